"""The compiled decode step for models whose KV caches are paged (``olv convert --kv paged*``).

:func:`fuse_paged_decoder_stack` recognises, like :func:`olv_runtime.executor.decoder_step.
fuse_decoder_stack`, a run of pre-norm decoder layers + final norm + lm_head, in the paged
form of the layer (``RMSNormalization -> Linear(q|k|v merged) [-> per-head q and k RMSNorms
(Qwen3)] -> RotaryEmbedding(q) -> RotaryEmbedding(k) -> olv.PagedAttention(q, k, v, cache) ->
Linear(o, + residual) ->
RMSNormalization -> Linear(gate|up merged) -> SiluMul -> Linear(down, + residual)``), every linear
on the 8-row packed INT4 layout or ggml group records (merged linears possibly over several steps,
as there), every intermediate read only inside the run. The run becomes
one :class:`PagedDecoderStack` step whose inputs are the embedding output, cos/sin and each
layer's cache value, and whose outputs are the logits and each layer's next cache value -- the
executor, the state (retention, atomic publication) and the counters see the same values at the
call boundary as with the per-operator steps.

A one-token call (batch 1, float32) runs :func:`olv_runtime.kernels.decoder_layers.
decode_stack_paged`: per layer the cache manager (:class:`olv_runtime.kv.paged.PagedKV`)
claims the new token's slot and hands over the block table (``decode_begin``), the compiled step
writes the new key/value there and attends over the blocks, then the manager seals full blocks
by the policy and makes the next cache value (``decode_end``). Other calls (prefill) run the
original steps. The paged driver is compiled at the first one-token call of a paged model only.
"""
from __future__ import annotations

import numpy as np
from numba.typed import List

from olv_runtime.errors import InvalidArgument
from olv_runtime.executor.decoder_step import (
    DecoderStack,
    _match_mlp,
    _norm,
    _qk_norms,
    qk_norm_fields,
    qk_norms_consistent,
    run_leaks,
)
from olv_runtime.executor.stack_linears import (
    consistent,
    contiguous,
    linear,
    linear_run,
)
from olv_runtime.executor.steps import Step
from olv_runtime.kernels import paged_attention as pk
from olv_runtime.pool import empty
from olv_runtime.structs.runtime import RuntimeStruct

__all__ = ["PagedDecoderStack", "fuse_paged_decoder_stack"]



def _match_layer(steps, i, x, constants):
    """The paged layer starting at ``steps[i]`` reading residual ``x``: (layer dict, next x,
    next index) or None. The q|k|v linear may be several steps (:func:`~olv_runtime.executor.
    stack_linears.linear_run`)."""
    if i + 10 > len(steps):
        return None
    s0 = steps[i]
    n0 = _norm(s0, constants)
    if n0 is None or s0.inputs[0] != x:
        return None
    run = linear_run(steps, i + 1, s0.outputs[0], 3)
    if run is None:
        return None
    qkv, (q, k, v), j = run
    qk = _qk_norms(steps, j, q, k, constants)
    if qk is not None:  # Qwen3: RMSNorm of each q and k head before RoPE
        q, k, j = qk[2], qk[3], qk[4]
    if j + 4 > len(steps):
        return None
    s2, s3, s4, s5 = steps[j:j + 4]
    if s2.kind != "RotaryEmbedding" or s3.kind != "RotaryEmbedding":
        return None
    if s2.inputs[:1] == (k,) and s3.inputs[:1] == (q,):
        s2, s3 = s3, s2
    if (len(s2.inputs) != 3 or len(s3.inputs) != 3 or s2.inputs[0] != q or s3.inputs[0] != k
            or s2.inputs[1:] != s3.inputs[1:]):
        return None
    rq, rk = s2.impl, s3.impl
    if s4.kind != "PagedAttention" or s4.inputs[:3] != (s2.outputs[0], s3.outputs[0], v):
        return None
    pa = s4.impl
    nh, nkv = pa.h, pa.kvh
    if not pa.attrs["is_causal"] or nh % nkv:
        return None
    d = qkv.ns[0] // nh
    if qkv.ns != [nh * d, nkv * d, nkv * d]:
        return None
    if (rq.attrs["num_heads"] != nh or rk.attrs["num_heads"] != nkv
            or rq.attrs["interleaved"] != rk.attrs["interleaved"]
            or rq.attrs["rotary_embedding_dim"] != rk.attrs["rotary_embedding_dim"]):
        return None
    r = rq.attrs["rotary_embedding_dim"] or d
    if r > d or r % 2:
        return None
    if "int4" in pa.policy.key + pa.policy.value and d % 2:
        return None
    qkn = qk_norm_fields(qk, nh, nkv, d, n0[1])
    if qkn is None:
        return None
    attn, present = s4.outputs
    o = linear(s5, 1, residual=True)
    if o is None or s5.inputs != (attn, x) or o.k != nh * d:
        return None
    x1 = s5.outputs[0]
    mlp = _match_mlp(steps, j + 4, x1, constants, n0, qkv, o)
    if mlp is None:
        return None
    n1, gu, down, j = mlp
    layer = dict(steps=steps[i:j], norm_in=n0[0], norm_post=n1[0],
                 eps=n0[1], qkv=qkv, o=o, gu=gu, down=down, op=pa, heads=nh, **qkn,
                 kv_heads=nkv, head_dim=d, rotary_dim=r, interleaved=bool(rq.attrs["interleaved"]),
                 scale_attr=pa.attrs["scale"], kv_opts={}, cache=s4.inputs[3], cos=s2.inputs[1],
                 sin=s2.inputs[2], present=present)
    return layer, steps[j - 1].outputs[0], j


def fuse_paged_decoder_stack(steps: list, constants: dict, graph_outputs: set,
                             counters=None) -> list:
    """Replace the paged decoder-layer run of ``steps`` by one :class:`PagedDecoderStack` (see
    the module docstring); returns the (possibly unchanged) step list."""
    if not any(s.kind == "PagedAttention" for s in steps):
        return steps
    for i, s in enumerate(steps):
        if s.kind != "RMSNormalization":
            continue
        x0 = s.inputs[0]
        layers, j, x = [], i, x0
        while True:
            m = _match_layer(steps, j, x, constants)
            if m is None:
                break
            layers.append(m[0])
            x, j = m[1], m[2]
        if not layers or j + 2 > len(steps):
            continue
        nf = _norm(steps[j], constants)
        lm = linear(steps[j + 1], 1)
        if (nf is None or lm is None or steps[j].inputs[0] != x
                or steps[j + 1].inputs != (steps[j].outputs[0],) or lm.bias is not None
                or lm.k != layers[0]["o"].n or nf[1] != layers[0]["eps"]
                or len(lm.weights) != 1):
            continue
        if not consistent(layers, lm) or not qk_norms_consistent(layers):
            continue
        L0 = layers[0]
        if any(L["op"].policy != L0["op"].policy
               or L["op"].attrs["block_size"] != L0["op"].attrs["block_size"] for L in layers):
            continue
        run = [st for L in layers for st in L["steps"]] + steps[j:j + 2]
        if not contiguous(layers, lm):
            continue
        boundary_in = [x0, L0["cos"], L0["sin"]] + [L["cache"] for L in layers]
        boundary_out = [steps[j + 1].outputs[0]] + [L["present"] for L in layers]
        if any(L["cos"] != boundary_in[1] or L["sin"] != boundary_in[2] for L in layers):
            continue
        if len(set(boundary_in)) != len(boundary_in):
            continue
        if run_leaks(run, steps, boundary_out, graph_outputs):
            continue
        stack = PagedDecoderStack("PagedDecoderStack(" + run[0].name + " .. " + run[-1].name
                                  + ")", layers, nf[0], lm, run, boundary_in, boundary_out,
                                  constants, counters)
        step = Step(stack.name, "DecoderStack", stack, boundary_in, boundary_out, stack)
        return steps[:i] + [step] + steps[j + 2:]
    return steps


class PagedDecoderStack(DecoderStack):
    """The fused paged decoder layers + final norm + lm_head (see the module docstring).

    ``fn(x0, cos, sin, cache_0, cache_1, ...) -> (logits, present_cache_0, ...)``.
    ``run_kernel`` is the compiled driver call (benchmarks replace it).
    """

    paged = True

    def __init__(self, name, layers, norm_final, lm, sub_steps, inputs, outputs, constants,
                 counters):
        super().__init__(name, layers, norm_final, lm, sub_steps, inputs, outputs, constants,
                         counters)
        self.ops = [L["op"] for L in layers]
        self.block_size = int(layers[0]["op"].attrs["block_size"])
        self.managers = [op._manager(self.head_dim) for op in self.ops]
        self.run_kernel = self._ds.decode_stack_paged

    def _paged_state(self, nt):
        st = self._thread_state(nt)
        if "tabs" not in st:
            tabs = List()
            dummy = np.zeros((1, 10), np.int64)
            for _ in range(self.n_layers):
                tabs.append(dummy)
            st["tabs"] = tabs
            st["tabs_py"] = [dummy] * self.n_layers
            st["nblk"] = np.zeros(self.n_layers, np.int64)
            st["tin"] = np.zeros(self.n_layers, np.int64)
        return st

    def _fast_ok(self, x0, cos, sin, caches) -> bool:
        if not self._token_ok(x0, cos, sin):
            return False
        return all(type(c) is RuntimeStruct for c in caches)

    def __call__(self, x0, cos, sin, *caches):
        if not self._fast_ok(x0, cos, sin, caches):
            return self._run_generic((x0, cos, sin) + caches)
        nt = self._tasks()
        st = self._paged_state(nt)
        tabs, tabs_py, nblk, tin = st["tabs"], st["tabs_py"], st["nblk"], st["tin"]
        calls = []
        for li, (mgr, cache) in enumerate(zip(self.managers, caches)):
            try:
                call = mgr.decode_begin(cache)
            except InvalidArgument as exc:
                raise InvalidArgument(f"node {self.name!r}: layer {li} cache: {exc}") from None
            calls.append(call)
            pt = call.ptab
            if pt.rows is not tabs_py[li]:
                tabs[li] = pt.rows
                tabs_py[li] = pt.rows
            nblk[li] = pt.n
            tin[li] = call.t_in
        logits = empty((1, 1, self.vocab), np.float32)
        self.run_kernel(nt, self.quant, x0.reshape(1, self.e), self.weights,
                        self.biases, self.has_bias, self.norms, self.eps, tabs, nblk, tin,
                        self.block_size, cos.reshape(-1), sin.reshape(-1), self.heads,
                        self.kv_heads, self.head_dim, self.rotary_dim, self.interleaved,
                        self.att_scale, self.inter, st["ws"], logits.reshape(1, self.vocab))
        out = [logits]
        c = self.managers[0].counters
        # KV bytes read / committed: summed over the layers and counted once (when every layer
        # counts into the same counters, as a session's do)
        tally = [0, 0] if all(m.counters is c for m in self.managers) else None
        for mgr, call in zip(self.managers, calls):
            out.append(mgr.decode_end(call, tally))
        if c is not None:
            if tally is not None:
                c.add("bytes_read_kv_attention", tally[0])
                c.add("kv_committed_bytes", tally[1])
            nb = 2 * 4 * self.kv_heads * self.head_dim * self.n_layers
            c.add("bytes_copied_kv_append", nb)
            g = self.managers[0].geom
            c.set_max("attention_workspace_peak",
                      pk.workspace_bytes(1, self.heads, self.kv_heads, self.head_dim,
                                         g.block_size))
        return tuple(out)

