"""Fuse the converter's rotary position subgraph into one step (:class:`RotaryPositions`).

The olv converter (:func:`olv_runtime.models.qwen_graph._position_subgraph`) computes the RoPE
cos/sin of a call's positions with 18 small operators::

    past_len = Squeeze(Shape(past_key.0)[2:3], [0]); seq_len = Squeeze(Shape(input_ids)[1:2], [0])
    positions = Range(past_len, Add(past_len, seq_len), 1)
    freqs = Mul(Unsqueeze(Cast<float>(positions), [1]), Unsqueeze(inv_freq, [0]))        # [S, D/2]
    shape = Concat(Shape(input_ids)[0:1], [1, 1])
    cos = Expand(Unsqueeze(Cos(freqs), [0]), shape); sin = Expand(Unsqueeze(Sin(freqs), [0]), shape)

:func:`fuse_rotary_positions` recognises exactly this form in the plan (every intermediate read
only inside it, none a graph output) and replaces it with one step
``(past, input_ids) -> (cos, sin)`` that evaluates the same formula with the same numpy
operations in the same element types (int64 positions cast to float32, a float32 product,
numpy's float32 cos/sin), so the values are bitwise those of the operator chain (tested). Calls
whose inputs are not the checked form (a past of rank other than 4, ids of rank other than 2)
run the original steps one by one, which raise their own errors. A decode token then costs one
plan step instead of 18 (ONNX Range, Cast, Mul, Cos, Sin: https://onnx.ai/onnx/operators/).

Paged models (``olv convert --kv paged*``, :mod:`olv_runtime.models.paged_kv`) read the past length
from the first cache struct instead: ``past_len_1d = Unsqueeze(olv.StructGet(cache.0,
fields=["length"]), [0])`` (19 operators); the fused step then takes the cache struct and
reads its INT64 scalar ``length`` field (any other value: the original steps).
"""
from __future__ import annotations

import threading

import numpy as np

from olv_runtime.executor.decoder_step import run_leaks
from olv_runtime.executor.steps import Step
from olv_runtime.pool import empty
from olv_runtime.structs.runtime import RuntimeStruct

__all__ = ["RotaryPositions", "fuse_rotary_positions"]

_F32 = np.dtype(np.float32)
_I64 = np.dtype(np.int64)


def _const(constants, name, dtype=_I64):
    v = constants.get(name) if name else None
    if not isinstance(v, np.ndarray) or v.dtype != dtype:
        return None
    return v


def _axes_are(step, constants, want) -> bool:
    """``step`` is an opset-13 Squeeze/Unsqueeze whose constant axes are ``want``."""
    if len(step.inputs) != 2:
        return False
    ax = _const(constants, step.inputs[1])
    return ax is not None and ax.reshape(-1).tolist() == want


def _match(steps, constants, cos_step, sin_step):
    """The region and its facts for the Expand steps producing cos and sin, or None."""
    prod = {}
    for st in steps:
        for o in st.outputs:
            if o:
                prod[o] = st

    def src(name, kind, n_in=None):
        st = prod.get(name)
        if st is None or st.kind != kind or (n_in is not None and len(st.inputs) != n_in):
            return None
        return st

    region = [cos_step, sin_step]
    if len(cos_step.inputs) != 2 or len(sin_step.inputs) != 2:
        return None
    if cos_step.inputs[1] != sin_step.inputs[1]:
        return None
    uc, us = src(cos_step.inputs[0], "Unsqueeze"), src(sin_step.inputs[0], "Unsqueeze")
    if uc is None or us is None or not _axes_are(uc, constants, [0]) or not _axes_are(us, constants, [0]):
        return None
    c, s = src(uc.inputs[0], "Cos", 1), src(us.inputs[0], "Sin", 1)
    if c is None or s is None or c.inputs[0] != s.inputs[0]:
        return None
    mul = src(c.inputs[0], "Mul", 2)
    if mul is None:
        return None
    up, ui = src(mul.inputs[0], "Unsqueeze"), src(mul.inputs[1], "Unsqueeze")
    if up is None or ui is None or not _axes_are(up, constants, [1]) or not _axes_are(ui, constants, [0]):
        return None
    inv = _const(constants, ui.inputs[0], _F32)
    if inv is None or inv.ndim != 1 or inv.size == 0:
        return None
    cast = src(up.inputs[0], "Cast", 1)
    if cast is None or cast.impl.dtype != _F32:
        return None
    rng = src(cast.inputs[0], "Range", 3)
    if rng is None:
        return None
    one = _const(constants, rng.inputs[2])
    if one is None or one.size != 1 or int(one.reshape(-1)[0]) != 1:
        return None
    add = src(rng.inputs[1], "Add", 2)
    if add is None or add.inputs[0] != rng.inputs[0]:
        return None
    sq_p, sq_s = src(rng.inputs[0], "Squeeze"), src(add.inputs[1], "Squeeze")
    if sq_p is None or sq_s is None or not _axes_are(sq_p, constants, [0]) \
            or not _axes_are(sq_s, constants, [0]):
        return None
    sh_p, sh_s = src(sq_p.inputs[0], "Shape", 1), src(sq_s.inputs[0], "Shape", 1)
    paged = []  # the paged form: Unsqueeze(olv.StructGet(cache.0, fields=["length"]), [0])
    if sh_p is None:
        un = src(sq_p.inputs[0], "Unsqueeze")
        if un is None or not _axes_are(un, constants, [0]):
            return None
        sg = src(un.inputs[0], "StructGet", 1)
        if sg is None or list(sg.impl.attrs["fields"]) != ["length"] or len(sg.outputs) != 1:
            return None
        sh_p, paged = sg, [un]
    elif (sh_p.impl.attrs["start"], sh_p.impl.attrs["end"]) != (2, 3):
        return None
    if sh_s is None:
        return None
    if (sh_s.impl.attrs["start"], sh_s.impl.attrs["end"]) != (1, 2):
        return None
    cat = src(cos_step.inputs[1], "Concat", 2)
    if cat is None or cat.impl.attrs["axis"] not in (0, -1):
        return None
    ones = _const(constants, cat.inputs[1])
    if ones is None or ones.reshape(-1).tolist() != [1, 1]:
        return None
    sh_b = src(cat.inputs[0], "Shape", 1)
    if sh_b is None or (sh_b.impl.attrs["start"], sh_b.impl.attrs["end"]) != (0, 1):
        return None
    if sh_b.inputs[0] != sh_s.inputs[0]:  # batch and sequence of the same ids
        return None
    past, ids = sh_p.inputs[0], sh_s.inputs[0]
    if past in constants or ids in constants or past in prod or ids in prod:
        return None  # graph inputs
    region += [uc, us, c, s, mul, up, ui, cast, rng, add, sq_p, sq_s, sh_p, sh_s, cat, sh_b] + paged
    if len({id(r) for r in region}) != len(region):
        return None
    return region, past, ids, np.ascontiguousarray(inv), bool(paged)


def fuse_rotary_positions(steps: list, constants: dict, graph_outputs: set) -> list:
    """Replace the rotary position subgraph (module docstring) by one
    :class:`RotaryPositions` step placed where its first step was; returns the (possibly
    unchanged) step list."""
    for cs in steps:
        if cs.kind != "Expand":
            continue
        for ss in steps:
            if ss is cs or ss.kind != "Expand":
                continue
            m = _match(steps, constants, cs, ss)
            if m is None:
                continue
            region, past, ids, inv, paged = m
            outs = [cs.outputs[0], ss.outputs[0]]
            if run_leaks(region, steps, outs, graph_outputs):
                continue
            inside = {id(r) for r in region}
            order = [st for st in steps if id(st) in inside]  # plan order (generic path)
            rp = RotaryPositions("RotaryPositions(" + order[0].name + " .. " + order[-1].name + ")",
                                 inv, order, (past, ids), tuple(outs), constants, paged)
            step = Step(rp.name, "RotaryPositions", rp, (past, ids), tuple(outs), rp)
            first = min(i for i, st in enumerate(steps) if id(st) in inside)
            out = []
            for i, st in enumerate(steps):
                if i == first:
                    out.append(step)
                if id(st) not in inside:
                    out.append(st)
            return out
    return steps


#: Positions whose RoPE rows :meth:`RotaryPositions.rows` makes at once.
ROWS_AHEAD = 64


class RotaryPositions:
    """``(past [B', KVH, T, D] -- or the paged cache struct, T its ``length`` --, input_ids [B, S])
    -> (cos, sin)``, float32 ``[B, S, D/2]``:
    ``cos[b, s, j] = cos(float32(T + s) * inv_freq[j])`` (and sin), numpy float32 arithmetic as
    the operator chain it replaces (see the module docstring)."""

    def __init__(self, name, inv_freq, sub_steps, inputs, outputs, constants, paged=False):
        self.name = name
        self.paged = bool(paged)
        self.inv_freq = inv_freq
        self.inv_row = inv_freq.reshape(1, -1)
        self.r2 = inv_freq.size
        self.sub_steps = list(sub_steps)
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.constants = constants
        self._local = threading.local()

    def rows(self, t: int):
        """``(cos, sin)`` float32 ``[1, 1, D/2]`` of position ``t`` alone: what a call with a past
        of length ``t`` and one id returns, by the same numpy operations on the same shapes
        (so bitwise the same). A decode token asks for ``t``, then ``t + 1``, ...: the rows of
        :data:`ROWS_AHEAD` positions from ``t`` are made at once (one position at a time, as
        a call would) and kept for this thread, so most tokens find theirs made (the decode
        program of :class:`~olv_runtime.InferenceSession` hands them to the compiled step;
        they must not be written)."""
        blk = getattr(self._local, "blk", None)
        if blk is not None:
            i = t - blk[0]
            if 0 <= i < ROWS_AHEAD:
                return blk[1][i]
        rows = []
        ti = np.empty((1, 1), _I64)
        pos = np.empty((1, 1), _F32)
        freqs = np.empty((1, self.r2), _F32)
        for u in range(t, t + ROWS_AHEAD):
            ti[0, 0] = u  # Range (int64) then Cast to float32, as __call__
            np.copyto(pos, ti, casting="unsafe")
            np.multiply(pos, self.inv_row, out=freqs)
            cos, sin = np.empty((1, 1, self.r2), _F32), np.empty((1, 1, self.r2), _F32)
            np.cos(freqs, out=cos.reshape(1, -1))
            np.sin(freqs, out=sin.reshape(1, -1))
            rows.append((cos, sin))
        self._local.blk = (t, rows)
        return rows[0]

    def __call__(self, past, ids):
        if type(ids) is not np.ndarray or ids.ndim != 2:
            return self._run_generic(past, ids)
        if self.paged:  # T = the cache struct's INT64 scalar length field
            if type(past) is not RuntimeStruct:
                return self._run_generic(past, ids)
            try:
                ln = past["length"]
            except KeyError:
                return self._run_generic(past, ids)
            if type(ln) is not np.ndarray or ln.dtype != _I64 or ln.ndim != 0:
                return self._run_generic(past, ids)
            t = int(ln)
        elif type(past) is np.ndarray and past.ndim == 4:
            t = past.shape[2]
        else:
            return self._run_generic(past, ids)
        b, s = ids.shape
        r2 = self.r2
        pos = empty((s, 1), _F32)  # Range (int64) then Cast to float32
        np.copyto(pos, np.arange(t, t + s, dtype=np.int64).reshape(s, 1), casting="unsafe")
        freqs = empty((s, r2), _F32)
        np.multiply(pos, self.inv_row, out=freqs)
        cos, sin = empty((b, s, r2), _F32), empty((b, s, r2), _F32)
        if b == 1:
            np.cos(freqs, out=cos.reshape(s, r2))
            np.sin(freqs, out=sin.reshape(s, r2))
        elif b:
            c, sn = empty((s, r2), _F32), empty((s, r2), _F32)
            np.cos(freqs, out=c)
            np.sin(freqs, out=sn)
            cos[...] = c
            sin[...] = sn
        return cos, sin

    def _run_generic(self, past, ids):
        """The original steps one by one (their own errors for other inputs)."""
        env = {self.inputs[0]: past, self.inputs[1]: ids}
        consts = self.constants
        for st in self.sub_steps:  # intermediates stay held by the pool until the run ends
            vals = [env[n] if n in env else consts[n] if n else None for n in st.inputs]
            for n, v in zip(st.outputs, st.fn(*vals)):
                if n:
                    env[n] = v
        return tuple(env[n] for n in self.outputs)
