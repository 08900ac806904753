"""The fusion passes the session applies to its plan (:func:`optimize`).

Peephole passes over values with a single consumer, never touching graph outputs (the step
classes they produce are in :mod:`olv_runtime.executor.steps`):

* bias: ``Add(Linear(x), b)`` with a constant ``b[N]`` → the linear adds ``b``;
* residual: ``Add(h, Linear(x))`` → the linear adds ``h`` (``h`` computed earlier);
* siblings: linears reading the same ``x`` with INT4 block-32 weights of equal K → one kernel call
  over the weights concatenated along N at session creation;
* SiLU: ``Mul(Mul(g, Sigmoid(g)), u)`` → :class:`~olv_runtime.executor.steps.SiluMul`;
* RoPE + Attention: ``Attention(RotaryEmbedding(q), RotaryEmbedding(k), v, past...)`` → one step
  that rotates q and k in place (they are intermediates with no other reader);
* rotary positions: the converter's cos/sin subgraph → one step
  (:mod:`olv_runtime.executor.positions`, bitwise the same values);
* the compiled decoder step: a run of decoder layers → one step
  (:mod:`olv_runtime.executor.decoder_step`, :mod:`olv_runtime.executor.paged_decoder_step`).
"""
from __future__ import annotations

import numpy as np

from olv_runtime.executor.decoder_step import fuse_decoder_stack
from olv_runtime.executor.paged_decoder_step import fuse_paged_decoder_stack
from olv_runtime.executor.positions import fuse_rotary_positions
from olv_runtime.executor.steps import (
    LinearStep,
    RopeAttention,
    SiluMul,
    Step,
    prepare_linears,
)


class _Graph:
    """Producer/consumer index over a step list."""

    def __init__(self, steps: list[Step]):
        self.steps = steps
        self.producer: dict[str, Step] = {}
        self.consumers: dict[str, list[Step]] = {}
        for s in steps:
            for o in s.outputs:
                if o:
                    self.producer[o] = s
            for i in s.inputs:
                if i:
                    self.consumers.setdefault(i, []).append(s)

    def sole_consumer(self, name: str, protected: set[str]):
        c = self.consumers.get(name, [])
        if len(c) != 1 or name in protected:
            return None
        return c[0]


def _position(steps: list[Step]) -> dict[int, int]:
    return {id(s): i for i, s in enumerate(steps)}


def optimize(steps: list[Step], constants: dict, graph_outputs: set[str], options,
             counters, compiled=None) -> list[Step]:
    """Apply the fusion passes (see the module docstring); returns the new step list."""
    steps = _fuse_bias_residual(steps, constants, graph_outputs)
    steps = _fuse_siblings(steps, graph_outputs)
    steps = _fuse_silu(steps, graph_outputs)
    steps = _fuse_rope_attention(steps, constants, graph_outputs)
    steps = fuse_rotary_positions(steps, constants, graph_outputs)
    prepare_linears(steps, counters, compiled)
    if getattr(options, "compiled_decode", True):
        steps = fuse_decoder_stack(steps, constants, graph_outputs, counters)
        if any(s.kind == "PagedAttention" for s in steps):
            steps = fuse_paged_decoder_stack(steps, constants, graph_outputs, counters)
    return steps


def _fuse_bias_residual(steps, constants, protected):
    # one pass (a step may absorb a bias Add and then a residual Add); the producer/consumer
    # index is updated in place instead of being rebuilt after every fusion (that was quadratic:
    # ~40 ms of session creation on a 24-layer model)
    g = _Graph(steps)
    pos = _position(steps)
    dead: set[int] = set()
    for s in steps:
        if id(s) in dead:
            continue
        while s.kind == "Linear" and len(s.outputs) == 1:
            lin: LinearStep = s.impl
            y = s.outputs[0]
            cons = [c for c in g.consumers.get(y, []) if id(c) not in dead]
            if len(cons) != 1 or y in protected:
                break
            add = cons[0]
            if add.kind != "Add" or len(add.inputs) != 2:
                break
            other = add.inputs[1] if add.inputs[0] == y else add.inputs[0]
            if other == y:
                break
            c = constants.get(other)
            if (isinstance(c, np.ndarray) and c.dtype == np.float32 and c.shape == (lin.n,)
                    and len(lin.weights) == 1 and lin.biases[0] is None and not lin.residual):
                lin.biases[0] = c
            elif (c is None and not lin.residual and other in g.producer
                  and pos[id(g.producer[other])] < pos[id(s)]):
                lin.residual = True
                s.inputs = s.inputs + (other,)
                g.consumers.setdefault(other, []).append(s)
            else:
                break
            s.outputs = add.outputs
            for o in add.outputs:
                if o:
                    g.producer[o] = s
            dead.add(id(add))
    return [t for t in steps if id(t) not in dead]


def _fuse_siblings(steps, protected):
    g = _Graph(steps)
    out = []
    merged: set[int] = set()
    for s in steps:
        if id(s) in merged:
            continue
        if s.kind == "Linear" and not s.impl.residual:
            group = [t for t in g.consumers.get(s.inputs[0], [])
                     if t is not s and t.kind == "Linear" and id(t) not in merged
                     and s.impl.can_merge(t.impl)]
            if group:
                lin: LinearStep = s.impl
                outputs = list(s.outputs)
                for t in group:
                    lin.weights += t.impl.weights
                    lin.biases += t.impl.biases
                    lin.ns += t.impl.ns
                    outputs += list(t.outputs)
                    merged.add(id(t))
                lin.n = sum(lin.ns)
                s.outputs = tuple(outputs)
                s.name = s.name + "+" + "+".join(t.name for t in group)
        out.append(s)
    return out


def _fuse_silu(steps, protected):
    g = _Graph(steps)
    drop: set[int] = set()
    for s in steps:
        if s.kind != "Sigmoid":
            continue
        gate = s.inputs[0]
        sig = s.outputs[0]
        m1 = g.sole_consumer(sig, protected)
        if m1 is None or m1.kind != "Mul" or set(m1.inputs) != {gate, sig}:
            continue
        act = m1.outputs[0]
        m2 = g.sole_consumer(act, protected)
        if m2 is None or m2.kind != "Mul" or act not in m2.inputs:
            continue
        up = m2.inputs[1] if m2.inputs[0] == act else m2.inputs[0]
        if up == act:
            continue
        fused = SiluMul(m2.name)
        m2.kind, m2.fn, m2.impl, m2.inputs = "SiluMul", fused, fused, (gate, up)
        drop.update((id(s), id(m1)))
    return [s for s in steps if id(s) not in drop]


def _fuse_rope_attention(steps, constants, protected):
    g = _Graph(steps)
    drop: set[int] = set()
    for s in steps:
        if s.kind != "Attention" or len(s.inputs) < 6 or not s.inputs[4]:
            continue
        if len(s.inputs) > 3 and s.inputs[3]:
            continue
        if not getattr(s.impl, "simple", True):  # softcap, window, nonpad, qk output
            continue
        rq = g.producer.get(s.inputs[0])
        rk = g.producer.get(s.inputs[1])
        if rq is None or rk is None or rq.kind != "RotaryEmbedding" or rk.kind != "RotaryEmbedding":
            continue
        if any(len(r.inputs) > 3 and r.inputs[3] for r in (rq, rk)):
            continue  # position_ids form: keep unfused
        if any(g.sole_consumer(r.outputs[0], protected) is not s for r in (rq, rk)):
            continue
        # the rotated inputs must be intermediates this step may overwrite
        if any(r.inputs[0] in constants or r.inputs[0] not in g.producer or
               len(g.consumers.get(r.inputs[0], [])) != 1 or r.inputs[0] in protected
               for r in (rq, rk)):
            continue
        if any(r.impl.attrs["num_heads"] <= 0 for r in (rq, rk)):
            continue
        fused = RopeAttention(s.name, rq.impl, rk.impl, s.impl)
        s.kind, s.fn, s.impl = "RopeAttention", fused, fused
        s.inputs = (rq.inputs[0], rk.inputs[0], s.inputs[2], s.inputs[4], s.inputs[5],
                    rq.inputs[1], rq.inputs[2], rk.inputs[1], rk.inputs[2])
        drop.update((id(rq), id(rk)))
    return [s for s in steps if id(s) not in drop]
