"""Fuse the plan's decoder layers into one step that runs a decode token without per-operator
Python (the compiled driver of :mod:`olv_runtime.kernels.decoder_layers`).

:func:`fuse_decoder_stack` looks, after the other fusion passes, for a contiguous run of plan
steps of the pre-norm decoder form (per layer: ``RMSNormalization -> Linear(q|k|v merged) ->
RopeAttention -> Linear(o, + residual) -> RMSNormalization -> Linear(gate|up merged) -> SiluMul
-> Linear(down, + residual)``; then ``RMSNormalization -> Linear(lm_head)``), every linear on the
8-row packed INT4 layout or on ggml group records (GGUF Q8_0 / Q5_0 / Q4_1 / Q5_1 / Q4_K /
Q5_K / Q6_K, :mod:`olv_runtime.kernels.ggml_packed`), every intermediate value read only inside
the run and none a graph output. A merged linear may be several plan steps reading the same
input (q|k|v or gate|up whose weights the plan could not merge: a GGUF file mixes block types
per tensor, as llama.cpp's Q4_K_M writes q|k in Q5_0 and v in Q8_0):
:class:`~olv_runtime.executor.stack_linears.StackLinear` keeps them as the parts of one linear
of the step.

It replaces the run with one :class:`DecoderStack` step whose inputs are the run's
boundary values (the embedding output, cos/sin, each layer's past key/value) and whose outputs
are the logits and each layer's present key/value -- so the executor, the state and its
counters see the same values at the call boundary as before.

Qwen3 (olv's converted graphs and GGUF imports, contiguous and paged KV) normalises each query
and key head between the q|k|v linear and the attention: per projection ``Reshape(., [0, 0,
heads, D]) -> RMSNormalization(weight [D]) -> Reshape(., [0, 0, heads * D])``
(:func:`_head_norm`, the converter's ``qwen_graph._qk_norm``). The two weights go into the
layer's data (``q_norm`` / ``k_norm``, one epsilon with the layer's other norms; every layer or
none) and the step applies them with the plan's own row function
(:func:`olv_runtime.kernels.norm._rms_norm_row`) before RoPE. The onnxruntime-genai builder's
Qwen3 (norms on the unpacked q/k) is not matched and runs per operator.

The onnxruntime-genai builder's form (:func:`_genai_run`) is the same computation under other
operators: ``SimplifiedLayerNormalization``, one packed-QKV ``MatMulNBits`` (a single linear),
``com.microsoft::GroupQueryAttention`` (rotary from ``cos_cache``/``sin_cache`` at position
``T``, ``seqlens_k``/``total_sequence_length`` checked against ``T``), and
``SkipSimplifiedLayerNormalization`` doing each residual add and the next norm. Its boundary
inputs are (embedding, cos_cache, sin_cache, seqlens_k, total_sequence_length, pasts...); the
attention-mask arithmetic the builder interleaves with the first layer reads nothing the layers
make and is moved before the fused step.

:class:`DecoderStack` runs the compiled driver when the call is one token (batch 1, one new
position, float32 contiguous inputs) and otherwise -- prefill, other shapes -- the original steps
one by one (the generic path, unchanged). Plans of any other form are left alone: the pass only
ever replaces what it recognises, so graphs with other operators keep working.

KV: each layer's capacity buffer is reserved with :func:`olv_runtime.kv.contiguous.reserve` (in place
when the past is the previous present), the new key/value are written into slot ``T`` by the
driver, and the presents are the usual read-only prefix views (counted as
``bytes_copied_kv_append``, as the per-operator path does).
"""
from __future__ import annotations

import operator
import threading

import numpy as np

from olv_runtime.errors import InvalidArgument, ValidationError, node_failed
from olv_runtime.executor.stack_linears import (
    consistent,
    contiguous,
    linear,
    linear_run,
    narrow_scales,
)
from olv_runtime.executor.steps import (
    LAST_ONLY,
    KVAppended,
    KVResults,
    RopeAttention,
    SiluMul,
    Step,
    last_position_args,
)
from olv_runtime.kernels import config, packed_i8, precompile
from olv_runtime.kernels.packed_i8 import PackedInt4I8
from olv_runtime.kv import contiguous as kv
from olv_runtime.kv.contiguous import claim_all as kv_claim_all
from olv_runtime.lazy import import_now, lazy_module
from olv_runtime.ops.registry import canonical_domain
from olv_runtime.pool import current as current_pool
from olv_runtime.pool import empty

decoder_layers = lazy_module("olv_runtime.kernels.decoder_layers")  # the compiled step: first decode

__all__ = ["DecoderStack", "fuse_decoder_stack"]

_F32 = np.dtype(np.float32)
_ALL = slice(None)

#: The compiled step runs serially (no parallel region, no barriers) when every linear of the
#: stack has fewer than this many weight elements (N * Kp): the rule by which the per-operator
#: plan runs each of those linears on its serial driver (``packed_i8.SERIAL_MAX_WORK``). Small
#: models (``olv demo``: 128 hidden) decode several times faster serially than with two tasks
#: meeting at ~20 barriers per layer, and never compile the parallel driver. Tests set it to 0
#: to exercise the parallel driver on tiny models.
STACK_SERIAL_MAX_WORK = 1 << 18


def _norm(step, constants):
    """(weight array, eps float32) of an RMSNormalization (or com.microsoft
    SimplifiedLayerNormalization) step over the last axis with one output, or None."""
    if (step.kind not in ("RMSNormalization", "SimplifiedLayerNormalization")
            or len(step.inputs) != 2 or any(step.outputs[1:])):
        return None
    op = step.impl
    w = constants.get(step.inputs[1])
    if (not isinstance(w, np.ndarray) or w.dtype != _F32 or w.ndim != 1
            or op.attrs.get("axis", -1) != -1 or op.attrs.get("stash_type", 1) != 1):
        return None
    eps = getattr(op, "eps32", None)
    return np.ascontiguousarray(w), (eps if eps is not None else np.float32(op.attrs["epsilon"]))


def _skip_norm(step, constants):
    """A com.microsoft SkipSimplifiedLayerNormalization ``RMSNorm(a + b) * gamma`` without bias:
    (gamma, eps float32, {a, b}, normed output, sum output or '') or None. The sum ``a + b`` is
    the residual stream (output 3); mean and inv_std_var (outputs 1, 2) must be unused."""
    if step.kind != "SkipSimplifiedLayerNormalization" or len(step.inputs) < 3:
        return None
    if any(step.inputs[3:]) or any(step.outputs[1:3]) or not step.outputs[0]:
        return None
    a, b = step.inputs[0], step.inputs[1]
    w = constants.get(step.inputs[2])
    if not a or not b or a == b or not isinstance(w, np.ndarray) or w.dtype != _F32 or w.ndim != 1:
        return None
    if a in constants or b in constants:
        return None
    total = step.outputs[3] if len(step.outputs) > 3 else ""
    return (np.ascontiguousarray(w), np.float32(step.impl.attrs["epsilon"]), {a, b},
            step.outputs[0], total)


def _match_mlp(steps, j, x1, constants, n0, qkv, o):
    """The second half of a pre-norm decoder layer from ``steps[j]``, after the attention
    residual ``x1``: RMSNorm, the gate|up linear (one merged step, or gate and up apart),
    SiLU*mul, the down linear adding ``x1``, with the sizes the compiled step needs (every
    linear's K the hidden size, no biases on o/gate|up/down, both norms of one eps). Returns
    ``(post norm, gate|up, down, next index)`` or None. Shared by the contiguous and the paged
    layer matchers."""
    if j >= len(steps):
        return None
    norm_step = steps[j]
    n1 = _norm(norm_step, constants)
    if n1 is None or norm_step.inputs[0] != x1:
        return None
    run = linear_run(steps, j + 1, norm_step.outputs[0], 2)
    if run is None:
        return None
    gu, gu_out, j = run
    if len(gu.ns) != 2 or gu.ns[0] != gu.ns[1] or j + 2 > len(steps):
        return None
    silu_step, down_step = steps[j], steps[j + 1]
    if (silu_step.kind != "SiluMul" or not isinstance(silu_step.impl, SiluMul)
            or silu_step.inputs != gu_out):
        return None
    down = linear(down_step, 1, residual=True)
    if down is None or down_step.inputs != (silu_step.outputs[0], x1):
        return None
    e = o.n
    if (qkv.k != e or gu.k != e or down.n != e or down.k != gu.ns[0]
            or n0[0].shape != (e,) or n1[0].shape != (e,) or n0[1] != n1[1]):
        return None
    if o.bias is not None or gu.bias is not None or down.bias is not None:
        return None
    return n1, gu, down, j + 2


def _reshape_to(step, src, constants):
    """The target shape (list of ints) of a ``Reshape(src, constant shape)`` step without
    allowzero, or None."""
    if (step.kind != "Reshape" or len(step.inputs) != 2 or step.inputs[0] != src
            or len(step.outputs) != 1 or step.impl.attrs.get("allowzero", 0)):
        return None
    shape = constants.get(step.inputs[1])
    if not isinstance(shape, np.ndarray) or shape.dtype.kind not in "iu" or shape.ndim != 1:
        return None
    return [int(v) for v in shape]


def _head_norm(steps, j, src, constants):
    """``steps[j:j + 3]`` the olv converter's per-head RMSNorm of a projection ``src`` [B, S,
    heads * D] (Qwen3's q_norm / k_norm, :func:`olv_runtime.models.qwen_graph._qk_norm`)::

        Reshape(src, [0, 0, heads, D]) -> RMSNormalization(weight [D]) -> Reshape(., [0, 0, heads * D])

    Returns (weight float32 [D], eps float32, heads, output name) or None."""
    if j + 3 > len(steps):
        return None
    s0, s1, s2 = steps[j:j + 3]
    split = _reshape_to(s0, src, constants)
    n = _norm(s1, constants)
    if split is None or n is None or len(split) != 4 or split[:2] != [0, 0]:
        return None
    heads, d = split[2], split[3]
    if s1.inputs[0] != s0.outputs[0] or n[0].shape != (d,) or heads <= 0 or d <= 0:
        return None
    if _reshape_to(s2, s1.outputs[0], constants) != [0, 0, heads * d]:
        return None
    return n[0], n[1], heads, s2.outputs[0]


def _qk_norms(steps, j, q, k, constants):
    """The per-head q and k norms (:func:`_head_norm`, q's then k's or k's then q's) from
    ``steps[j]``: (q norm, k norm, normed q name, normed k name, next index), or None when
    there are none there (Qwen2 / Llama) or they are not that form."""
    a = _head_norm(steps, j, q, constants)
    if a is not None:
        b = _head_norm(steps, j + 3, k, constants)
        qn, kn = a, b
    else:
        b = _head_norm(steps, j, k, constants)
        a = _head_norm(steps, j + 3, q, constants) if b is not None else None
        qn, kn = a, b
    if qn is None or kn is None:
        return None
    return qn, kn, qn[3], kn[3], j + 6


def qk_norm_fields(qk, nh, nkv, d, eps):
    """The layer-dict entries of the q/k norms ``qk`` (:func:`_qk_norms`' result or None) for a
    layer of ``nh`` query heads, ``nkv`` kv heads of size ``d`` whose other norms have epsilon
    ``eps``: ``{"q_norm": weight [D] or None, "k_norm": ...}``, or None when they do not fit
    the compiled step (other head counts or sizes, another epsilon)."""
    if qk is None:
        return {"q_norm": None, "k_norm": None}
    qn, kn = qk[0], qk[1]
    if (qn[2], kn[2]) != (nh, nkv) or qn[0].shape != (d,) or kn[0].shape != (d,):
        return None
    if qn[1] != eps or kn[1] != eps:
        return None
    return {"q_norm": qn[0], "k_norm": kn[0]}


def qk_norms_consistent(layers) -> bool:
    """Every layer has q/k norms, or none has."""
    return len({L["q_norm"] is None for L in layers}) == 1


def _match_layer(steps, i, x, constants):
    """The layer starting at ``steps[i]`` reading residual ``x``; returns (layer dict, next x,
    next index) or None."""
    if i + 8 > len(steps):
        return None
    s0 = steps[i]
    n0 = _norm(s0, constants)
    if n0 is None or s0.inputs[0] != x:
        return None
    h = s0.outputs[0]
    run = linear_run(steps, i + 1, h, 3)
    if run is None:
        return None
    qkv, (q, k, v), j = run
    qk = _qk_norms(steps, j, q, k, constants)
    if qk is not None:  # Qwen3: RMSNorm of each q and k head before RoPE
        q, k, j = qk[2], qk[3], qk[4]
    if j + 2 > len(steps):
        return None
    s2, s3 = steps[j], steps[j + 1]
    if s2.kind != "RopeAttention" or not isinstance(s2.impl, RopeAttention) or not s2.impl.fast:
        return None
    ra = s2.impl
    at = ra.attention.attrs
    if at.get("softcap", 0.0) or at.get("qk_matmul_output_mode", 0):
        return None
    if (len(s2.inputs) != 9 or s2.inputs[:3] != (q, k, v) or s2.inputs[5] != s2.inputs[7]
            or s2.inputs[6] != s2.inputs[8] or len(s2.outputs) != 3):
        return None
    nh, nkv = ra.h, ra.kvh
    if nh % nkv:
        return None
    d = qkv.ns[0] // nh
    if qkv.ns != [nh * d, nkv * d, nkv * d] or nh * d != qkv.ns[0]:
        return None
    r = ra.rope_q.attrs["rotary_embedding_dim"] or d
    if r > d or r % 2:
        return None
    qkn = qk_norm_fields(qk, nh, nkv, d, n0[1])
    if qkn is None:
        return None
    attn = s2.outputs[0]
    o = linear(s3, 1, residual=True)
    if o is None or s3.inputs != (attn, x) or o.k != nh * d:
        return None
    x1 = s3.outputs[0]
    mlp = _match_mlp(steps, j + 2, x1, constants, n0, qkv, o)
    if mlp is None:
        return None
    n1, gu, down, j = mlp
    layer = dict(norm_in=n0[0], norm_post=n1[0], eps=n0[1], qkv=qkv, o=o, **qkn,
                 gu=gu, down=down, heads=nh, kv_heads=nkv, head_dim=d, rotary_dim=r,
                 interleaved=bool(ra.interleaved), scale_attr=ra.scale_attr,
                 kv_opts=ra.attention.kv_opts,
                 past_k=s2.inputs[3], past_v=s2.inputs[4], cos=s2.inputs[5], sin=s2.inputs[6],
                 present_k=s2.outputs[1], present_v=s2.outputs[2])
    return layer, steps[j - 1].outputs[0], j


#: Graph nodes (domain, op_type) of the decoders whose layers :func:`fuse_decoder_stack` fuses
#: (the olv converter's ONNX Attention, onnxruntime-genai's GroupQueryAttention).
_ATTENTION_OPS = {("", "Attention"), ("com.microsoft", "GroupQueryAttention")}


def prestart_precompile(graph=None) -> bool:
    """Session creation, before its plan is made: when ``graph`` has attention nodes (the
    plan may fuse a :class:`DecoderStack`) and numba's cache holds no compiled driver, start
    the compile worker now (:func:`olv_runtime.kernels.precompile.prestart`): it imports the
    kernels while this process prepacks the weights, and compiles the driver as soon as the
    stack gives its signature (:meth:`DecoderStack._start_precompile`). The session calls
    :func:`~olv_runtime.kernels.precompile.release_idle` after the plan (a worker no stack
    used exits). ``graph`` None: no check of the graph (``olv demo`` calls it before it
    builds its model: the worker's start-up then overlaps the conversion). Not when this
    process has asked a worker for a driver already (a later
    session most likely needs the same one: :func:`~olv_runtime.kernels.precompile.start`
    gives it that job). Returns whether a worker waits; only time depends on it, never
    results."""
    if not precompile.enabled() or precompile.asked("olv_runtime.kernels.decoder_layers"):
        return False
    if graph is not None and not any((canonical_domain(n.domain), n.op_type) in _ATTENTION_OPS
                                     for n in graph.node):
        return False
    if precompile.cache_index_exists("decoder_layers.py", ("_stack_thread", "_stack_par")):
        return False
    return precompile.prestart(("olv_runtime.kernels.decoder_layers",))


def fuse_decoder_stack(steps: list, constants: dict, graph_outputs: set, counters=None) -> list:
    """Replace the decoder-layer run of ``steps`` by one :class:`DecoderStack` (see the module
    docstring); returns the (possibly unchanged) step list."""
    for i, s in enumerate(steps):
        if s.kind not in ("RMSNormalization", "SimplifiedLayerNormalization"):
            continue
        res = _olv_run(steps, i, constants)
        if res is None:
            res = _genai_run(steps, i, constants)
        if res is None:
            continue
        layers, nf, lm, run, hoisted, rest, boundary_in, rope_table = res
        if (not consistent(layers, lm) or nf[1] != layers[0]["eps"]
                or not qk_norms_consistent(layers)):
            continue
        if (lm.bias is not None or lm.k != layers[0]["o"].n or len(lm.weights) != 1):
            continue
        if not contiguous(layers, lm):
            continue
        for L in layers:
            boundary_in += [L["past_k"], L["past_v"]]
        boundary_out = [run[-1].outputs[0]]
        for L in layers:
            boundary_out += [L["present_k"], L["present_v"]]
        if len(set(boundary_in)) != len(boundary_in):
            continue
        if run_leaks(run, steps, boundary_out, graph_outputs):
            continue
        narrow_scales(layers, lm, counters)
        stack = DecoderStack("DecoderStack(" + run[0].name + " .. " + run[-1].name + ")",
                             layers, nf[0], lm, run, boundary_in, boundary_out, constants,
                             counters, rope_table=rope_table)
        # cold numba cache: a worker process starts compiling the one-token driver now, while
        # this process finishes the session and runs (and compiles) the prefill
        stack._start_precompile()
        step = Step(stack.name, "DecoderStack", stack, boundary_in, boundary_out, stack)
        return steps[:i] + hoisted + [step] + rest
    return steps


def _olv_run(steps, i, constants):
    """The olv converter's form from ``steps[i]``: contiguous layers of
    :func:`_match_layer`, then ``RMSNormalization -> Linear(lm_head)``. Returns (layers, final
    norm, lm_head linear, run steps, hoisted steps, steps after the run, boundary inputs so far,
    rope_table) or None."""
    x0 = steps[i].inputs[0]
    layers, j, x = [], i, x0
    while True:
        m = _match_layer(steps, j, x, constants)
        if m is None:
            break
        layers.append(m[0])
        x, j = m[1], m[2]
    if not layers or j + 2 > len(steps):
        return None
    nf = _norm(steps[j], constants)
    lm = linear(steps[j + 1], 1)
    if (nf is None or lm is None or steps[j].inputs[0] != x
            or steps[j + 1].inputs != (steps[j].outputs[0],)):
        return None
    if any(L["cos"] != layers[0]["cos"] or L["sin"] != layers[0]["sin"] for L in layers):
        return None
    return (layers, nf, lm, steps[i:j + 2], [], steps[j + 2:],
            [x0, layers[0]["cos"], layers[0]["sin"]], False)


def _gqa(step, constants, qkv, h_in):
    """The attention parameters of a com.microsoft GroupQueryAttention step the compiled step
    computes (packed QKV from ``qkv``, past/present, rotary from cos/sin caches, no softcap, no
    local window, no position_ids), or None."""
    if step.kind != "GroupQueryAttention" or len(step.outputs) != 3 or len(step.inputs) < 9:
        return None
    ins = step.inputs
    if ins[0] != qkv or ins[1] or ins[2] or not (ins[3] and ins[4] and ins[5] and ins[6]):
        return None
    if any(ins[9:]):  # position_ids, attention_bias, head_sink
        return None
    op = step.impl
    a = op.attrs
    if (not getattr(op, "packed", False) or not a["do_rotary"] or a["softcap"]
            or a["local_window_size"] >= 0 or a["smooth_softmax"] or a["qk_output"]):
        return None
    cos, sin = constants.get(ins[7]), constants.get(ins[8])
    nh, nkv = a["num_heads"], a["kv_num_heads"]
    if nh <= 0 or nkv <= 0 or nh % nkv or h_in % (nh + 2 * nkv):
        return None
    d = h_in // (nh + 2 * nkv)
    for c in (cos, sin):
        if (not isinstance(c, np.ndarray) or c.dtype != _F32 or c.ndim != 2
                or not c.flags.c_contiguous or c.shape != cos.shape):
            return None
    r = 2 * cos.shape[1]
    if r == 0 or r > d:
        return None
    return dict(heads=nh, kv_heads=nkv, head_dim=d, rotary_dim=r,
                interleaved=bool(a["rotary_interleaved"]), scale_attr=a["scale"] or None,
                kv_opts=op.kv_opts, past_k=ins[3], past_v=ins[4], seqlens=ins[5], total=ins[6],
                cos=ins[7], sin=ins[8], present_k=step.outputs[1], present_v=step.outputs[2])


def _genai_run(steps, i, constants):
    """The onnxruntime-genai builder's form from ``steps[i]`` (a SimplifiedLayerNormalization
    of the embedding), in the order of the steps that depend on it (steps that do not -- the
    attention-mask arithmetic the builder places between the first projection and the first
    attention -- are hoisted before the run; they read nothing the run makes). Per layer::

        h = norm(x); qkv = Linear(h); attn, present_k, present_v = GroupQueryAttention(qkv, ...)
        h2, x1 = SkipSimplifiedLayerNormalization(x, Linear_o(attn))
        a = SiluMul(Linear_gate|up(h2)); h', x' = SkipSimplifiedLayerNormalization(x1, Linear_down(a))

    where the last SkipSimplifiedLayerNormalization is the final norm, read by the lm_head
    linear. The residual adds are the Skip... sums (``x + y``; IEEE addition is commutative, so
    the compiled step's ``y + x`` is the same float). Returns as :func:`_olv_run` or None."""
    first = steps[i]
    n0 = _norm(first, constants)
    if n0 is None:
        return None
    made = {o for o in first.outputs if o}
    core, hoist_at = [first], []
    for p in range(i + 1, len(steps)):
        st = steps[p]
        if any(n in made for n in st.inputs if n):
            core.append(st)
            made.update(o for o in st.outputs if o)
        else:
            hoist_at.append(p)
    x = first.inputs[0]
    norm_w, eps, h = n0[0], n0[1], first.outputs[0]
    layers, c = [], 1
    while c + 8 <= len(core):
        c1, c2, c3, c4, c5, c6, c7, c8 = core[c:c + 8]
        qkv = linear(c1, 1)
        if qkv is None or c1.inputs != (h,):
            break
        att = _gqa(c2, constants, c1.outputs[0], qkv.n)
        if att is None:
            break
        o = linear(c3, 1)
        if o is None or c3.inputs != (c2.outputs[0],) or o.k != att["heads"] * att["head_dim"]:
            break
        post = _skip_norm(c4, constants)
        if post is None or post[2] != {x, c3.outputs[0]} or not post[4]:
            break
        gu = linear(c5, 2)
        if gu is None or c5.inputs != (post[3],) or len(gu.ns) != 2 or gu.ns[0] != gu.ns[1]:
            break
        if c6.kind != "SiluMul" or not isinstance(c6.impl, SiluMul) or c6.inputs != c5.outputs:
            break
        down = linear(c7, 1)
        if down is None or c7.inputs != (c6.outputs[0],):
            break
        nxt = _skip_norm(c8, constants)
        if nxt is None or nxt[2] != {post[4], c7.outputs[0]}:
            break
        e = o.n
        if (qkv.k != e or gu.k != e or down.n != e or down.k != gu.ns[0] or eps != post[1]
                or norm_w.shape != (e,) or post[0].shape != (e,) or nxt[0].shape != (e,)):
            break
        if o.bias is not None or gu.bias is not None or down.bias is not None:
            break
        layers.append(dict(norm_in=norm_w, norm_post=post[0], eps=eps, qkv=qkv, o=o, gu=gu,
                           down=down, q_norm=None, k_norm=None, **att))
        norm_w, eps, h = nxt[0], nxt[1], nxt[3]
        x = nxt[4]
        c += 8
        if not x:  # a norm without its sum output: the final norm
            break
    if not layers or c >= len(core):
        return None
    lm = linear(core[c], 1)
    if lm is None or core[c].inputs != (h,):
        return None
    L0 = layers[0]
    keys = ("seqlens", "total", "cos", "sin")
    if any(L[k] != L0[k] for L in layers for k in keys):
        return None
    last = steps.index(core[c])
    hoisted = [steps[p] for p in hoist_at if p < last]
    return (layers, (norm_w, eps), lm, core[:c + 1], hoisted, steps[last + 1:],
            [first.inputs[0], L0["cos"], L0["sin"], L0["seqlens"], L0["total"]], True)


class DecoderStack:
    """The fused decoder layers + final norm + lm_head (see the module docstring).

    ``fn(x0, cos, sin, past_key_0, past_value_0, ...) -> (logits, present_key_0,
    present_value_0, ...)``. ``run_kernel`` is the compiled driver call (benchmarks replace it
    to measure the Python around it).
    """

    def __init__(self, name, layers, norm_final, lm, sub_steps, inputs, outputs, constants,
                 counters, rope_table=False):
        self.name = name
        self.sub_steps = list(sub_steps)
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.constants = constants
        self.counters = counters
        L0 = layers[0]
        self.n_layers = len(layers)
        self.heads, self.kv_heads, self.head_dim = L0["heads"], L0["kv_heads"], L0["head_dim"]
        self.rotary_dim = L0["rotary_dim"]
        self.interleaved = bool(L0["interleaved"])
        d = self.head_dim
        sc = L0["scale_attr"]
        self.att_scale = np.float32(sc if sc is not None else 1.0 / np.sqrt(d))
        self.eps = np.float32(L0["eps"])
        self.quant = L0["qkv"].quantized
        self.e = L0["o"].n
        self.inter = L0["gu"].ns[0]
        self.vocab = lm.n
        self.kv_opts = L0["kv_opts"]
        # True: the inputs are (x0, cos_cache, sin_cache, seqlens_k, total_sequence_length,
        # pasts...) of GroupQueryAttention (the token's cos/sin row is picked by its position)
        self.rope_table = bool(rope_table)
        # views, not copies: an address table of the packed weights (the plan's LinearSteps own
        # them); the norms and biases (E or N_qkv floats per layer) stacked into 2-D arrays
        # per linear its packed parts (INT4 and / or ggml), for the weight table
        packed = [L[name].packs for L in layers for name in ("qkv", "o", "gu", "down")]
        self._packed_all = packed + [lm.packs]  # -> self.weights, see _load_kernels
        #: every linear one INT4 weight (no ggml records, no parts): what the batching
        #: engine's compiled rows step (kernels.rows_layers) takes
        self.int4_only = all(len(ps) == 1 and type(ps[0]) is PackedInt4I8
                             for ps in self._packed_all)
        #: q/k head norms (Qwen3): the rows step (kernels.rows_layers) has none
        self.qk_norm = layers[0].get("q_norm") is not None
        self.biases = np.zeros((self.n_layers, L0["qkv"].n), np.float32)
        self.has_bias = np.zeros(self.n_layers, np.bool_)
        self.norms = np.empty((2 * self.n_layers + 1, self.e), np.float32)
        for li, L in enumerate(layers):
            b = L["qkv"].bias
            if b is not None:
                self.has_bias[li] = True
                self.biases[li] = b
            self.norms[2 * li] = L["norm_in"]
            self.norms[2 * li + 1] = L["norm_post"]
        self.norms[2 * self.n_layers] = norm_final
        # read-only like the graph's norm weights, so that the step's RMSNorm rows have the type
        # of the per-operator plan's (one compiled specialisation of _rms_norm_row, not two)
        self.norms.flags.writeable = False
        #: float32 [L, 2, D] read-only: per layer the q and the k head norm weights (Qwen3), or
        #: None (the step then compiles no head norm)
        self.qk_norms = None
        if L0.get("q_norm") is not None:
            self.qk_norms = np.empty((self.n_layers, 2, d), np.float32)
            for li, L in enumerate(layers):
                self.qk_norms[li, 0] = L["q_norm"]
                self.qk_norms[li, 1] = L["k_norm"]
            self.qk_norms.flags.writeable = False
        self.k_max = max(self.e, self.heads * d, self.inter)
        self.max_work = max(lin.n * (32 * -(-lin.k // 32))
                            for lin in [L[n] for L in layers for n in ("qkv", "o", "gu", "down")]
                            + [lm])
        self._local = threading.local()
        # bytes one token appends to the KV cache (keys and values of every layer, float32)
        self._append_bytes = 2 * 4 * self.kv_heads * self.head_dim * self.n_layers
        self.tasks = 0  # tasks of the last compiled call (1: serial driver)
        # the compiled step's compilation in a worker process, started at the first generic
        # (prefill) call on a cold numba cache (kernels.precompile); None: not started, False:
        # nothing to wait for
        self._precompile = None
        # lifetimes of the values made inside the run (generic path)
        keep = set(self.outputs) | set(self.inputs)
        last = {}
        for idx, st in enumerate(self.sub_steps):
            for n in st.inputs:
                if n:
                    last[n] = idx
            for n in st.outputs:
                if n:
                    last.setdefault(n, idx)
        self._release = [[] for _ in self.sub_steps]
        for n, idx in last.items():
            if n not in keep and n not in constants:
                self._release[idx].append(n)

    def __getattr__(self, name):
        # the compiled step's module, weight table and driver (``_ds``, ``weights``,
        # ``run_kernel``) are made on first use: a prefill does not need them, so creating a
        # session does not import kernels.decoder_layers (warm start)
        if name in ("_ds", "weights", "run_kernel"):
            self._load_kernels()
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _load_kernels(self) -> None:
        with precompile.preparing():  # a first import: on the caller's kernel clock
            ds = import_now(decoder_layers)
        d = self.__dict__
        d.setdefault("_ds", ds)
        if "weights" not in d:
            d["weights"] = ds.WeightTable(d["_packed_all"], qk_norms=self.qk_norms)
        d.setdefault("run_kernel", ds.decode_stack)

    @property
    def codes(self) -> list:
        """The packed codes arrays of the step (4 per layer, then the lm_head)."""
        return self.weights.codes

    @property
    def scales(self) -> list:
        """The packed scale arrays of the step (float32, or uint16 float16 bits)."""
        return self.weights.scales

    # -- per-thread state ----------------------------------------------------------------------
    def _thread_state(self, nt):
        st = getattr(self._local, "st", None)
        if st is None or st["nt"] != nt:
            ws, kv0, kvt, tpos = self._new_workspace(nt)
            st = {"nt": nt, "ws": ws, "kvt": kvt, "kv0": kv0,
                  "kb_py": [None] * self.n_layers, "vb_py": [None] * self.n_layers,
                  "tpos": tpos,
                  # steady decode (_reserve_kv): the presents of the last call, the buffers'
                  # registry entries and read-only whole-buffer views, the smallest capacity;
                  # whether this call claimed in place (the pasts' own buffers, one length)
                  "last": None, "entries": [], "ro": [], "cap": 0, "steady": False,
                  # the compiled function and its argument list (kernels.decoder_layers
                  # .prepared_call), with the ISA choice it was built for
                  "call": None}
            self._local.st = st
            if self.counters is not None:
                nbytes = ws.nbytes + kv0.nbytes + kvt.nbytes + st["tpos"].nbytes
                self.counters.add("arrays_allocated", 24)
                self.counters.add("bytes_allocated", nbytes)
                self.counters.set_max("workspace_peak", nbytes)
        return st

    def _new_workspace(self, nt):
        """(StackWorkspace, kv0, kvt, tpos) for ``nt`` tasks (see :func:`decode_stack`)."""
        ws = self._ds.StackWorkspace(nt, self.e, self.biases.shape[1], self.heads * self.head_dim,
                                     2 * self.inter, self.inter, self.vocab, self.k_max)
        ws.attention(self.heads, self.kv_heads, self.head_dim)
        kv0 = np.zeros((1, self.kv_heads, 1, self.head_dim), np.float32)
        # per layer: key buffer address, value buffer address, capacity (see decode_stack)
        kvt = np.zeros((self.n_layers, 3), np.int64)
        return ws, kv0, kvt, np.zeros(self.n_layers, np.int64)

    # -- execution ------------------------------------------------------------------------------
    def _task_count(self) -> int:
        nt = 1
        if self.max_work >= STACK_SERIAL_MAX_WORK and config.threading_layer() == "omp":
            nt = config.thread_count_fns()[1]()
        return nt

    def _tasks_for(self, threads: int) -> int:
        """:meth:`_tasks` when numba's thread count of this thread is ``threads``."""
        nt = 1
        if self.max_work >= STACK_SERIAL_MAX_WORK and config.threading_layer() == "omp":
            nt = threads
        self.tasks = nt
        return nt

    def _tasks(self) -> int:
        """Tasks of this call: numba's thread count with the ``omp`` layer, 1 (the serial driver)
        otherwise or when every linear is below :data:`STACK_SERIAL_MAX_WORK`."""
        nt = self.tasks = self._task_count()
        return nt

    def _decode_entry(self):
        """(numba dispatcher, argument types) of the driver the next one-token call runs."""
        nt = self._task_count()
        ws, kv0, kvt, tpos = self._new_workspace(nt)  # throwaway: only their types are used
        r2 = self.rotary_dim // 2
        return self._ds.decode_stack_entry(
            nt, self.quant, np.zeros((1, self.e), np.float32), self.weights, self.biases,
            self.has_bias, self.norms, self.eps, kvt, kv0, tpos, np.zeros(r2, np.float32),
            np.zeros(r2, np.float32), self.heads, self.kv_heads, self.head_dim, self.rotary_dim,
            self.interleaved, self.att_scale, self.inter, ws, np.zeros((1, self.vocab), np.float32))

    def _start_precompile(self) -> None:
        """When the session makes this step (and again at the first generic call, if it did
        not) on a cold numba cache: have a worker process compile the driver the one-token
        calls will run, while this process finishes the session and runs the prefill
        (:mod:`olv_runtime.kernels.precompile`; sessions asking for the same driver share one
        worker). With any cache entry of the driver on disk nothing happens (warm start:
        kernels.decoder_layers is not even imported here)."""
        if self._precompile is not None:
            return
        self._precompile = False
        if not precompile.enabled() or precompile.cache_index_exists(
                "decoder_layers.py", ("_stack_thread", "_stack_par")):
            return
        rk = self.__dict__.get("run_kernel")
        if rk is not None and rk is not self._ds.decode_stack:
            return  # replaced (benchmarks)
        entry = self._decode_entry()
        self._precompile = precompile.start(self._ds.precompile_entries(entry)) or False

    def _token_ok(self, x0, cos, sin) -> bool:
        """One token's hidden state [1, 1, E] and RoPE cos/sin [1, 1, rotary_dim/2]: contiguous
        float32 arrays (what the compiled driver reads)."""
        e, r2 = self.e, self.rotary_dim // 2
        if not (type(x0) is np.ndarray and x0.dtype == _F32 and x0.shape == (1, 1, e)
                and x0.flags.c_contiguous):
            return False
        for c in (cos, sin):
            if not (type(c) is np.ndarray and c.dtype == _F32 and c.shape == (1, 1, r2)
                    and c.flags.c_contiguous):
                return False
        return True

    def _fast_ok(self, x0, cos, sin, pasts) -> bool:
        if not self._token_ok(x0, cos, sin):
            return False
        st = getattr(self._local, "st", None)
        last = st["last"] if st is not None else None
        if last is not None and _is_span(last, pasts):
            return True  # the presents of this thread's last call (float32 [1, KVH, T, D])
        shp = (1, self.kv_heads)
        for p in pasts:
            if not (type(p) is np.ndarray and p.dtype == _F32 and p.ndim == 4
                    and p.shape[:2] == shp and p.shape[3] == self.head_dim):
                return False
        return True

    def _table_rows(self, cos, sin, seqlens_k, total, pasts):
        """GroupQueryAttention form: the cos/sin rows of the token's position ``T`` (every
        layer's past length), or None when the call is not the checked one-token form (the
        generic path then runs and raises GroupQueryAttention's own errors)."""
        t = pasts[0].shape[2] if pasts and type(pasts[0]) is np.ndarray else -1
        if t < 0 or t >= cos.shape[0]:
            return None
        for p in pasts:
            if type(p) is not np.ndarray or p.ndim != 4 or p.shape[2] != t:
                return None
        for v, want in ((seqlens_k, t), (total, t + 1)):
            if (type(v) is not np.ndarray or v.size != 1 or v.dtype.kind not in "iu"
                    or int(v.reshape(-1)[0]) != want):
                return None
        if seqlens_k.ndim != 1:
            return None
        return cos[t], sin[t]

    def __call__(self, x0, cos, sin, *rest):
        if self.rope_table:
            seqlens_k, total, pasts = rest[0], rest[1], rest[2:]
            rows = self._table_rows(cos, sin, seqlens_k, total, pasts)
            if rows is None or not self._fast_ok(x0, rows[0].reshape(1, 1, -1),
                                                  rows[1].reshape(1, 1, -1), pasts):
                self._start_precompile()
                return self._run_generic((x0, cos, sin) + rest)
            cos, sin = rows
        else:
            pasts = rest
            if not self._fast_ok(x0, cos, sin, pasts):
                self._start_precompile()
                return self._run_generic((x0, cos, sin) + pasts)
        nt = self._tasks()
        st = self._thread_state(nt)
        t = self._reserve_kv(st, pasts)
        logits = empty((1, 1, self.vocab), np.float32)
        if self._precompile:  # the worker compiling this driver: its result, not a 2nd compile
            self._precompile.wait()
            self._precompile = False
        self._kernel(st, nt, x0, cos, sin, logits)
        c = self.kv_opts.get("counters")
        if c is not None:
            c.add("bytes_copied_kv_append", self._append_bytes)
        if t is not None:
            span = st["last"] = KVSpan(st["ro"], t + 1)
            presents = span.views()  # read-only prefix views
            if st["steady"]:  # the pasts' own buffers, one token longer
                return KVAppended([logits, *presents])
            return KVResults([logits, *presents])
        out = [logits]  # layers of different lengths
        out += [kv.present(b, int(st["tpos"][li]) + 1)
                for li in range(self.n_layers) for b in (st["kb_py"][li], st["vb_py"][li])]
        return KVResults(out)  # the executor books only the logits (the presents: kv registry)

    def _kernel(self, st, nt, x0, cos, sin, logits) -> None:
        """One token through the compiled driver (``run_kernel``; the default one through the
        argument list prepared for this thread's workspace, :func:`.kernels.decoder_layers
        .prepared_call`)."""
        x2, c1, s1, l2 = (x0.reshape(1, self.e), cos.reshape(-1), sin.reshape(-1),
                          logits.reshape(1, self.vocab))
        rk = self.run_kernel
        if rk is self._ds.decode_stack:  # the prepared argument list (same arguments)
            vnni = packed_i8.use_vnni()
            call = st["call"]
            if call is None or call[3] != vnni:
                call = st["call"] = self._ds.prepared_call(
                    nt, self.quant, x2, self.weights, self.biases, self.has_bias, self.norms,
                    self.eps, st["kvt"], st["kv0"], st["tpos"], c1, s1, self.heads,
                    self.kv_heads, self.head_dim, self.rotary_dim, self.interleaved,
                    self.att_scale, self.inter, st["ws"], l2) + (vnni,)
            fn, args, (i0, i1, i2, i3) = call[0], call[1], call[2]
            args[i0], args[i1], args[i2], args[i3] = x2, c1, s1, l2
            fn(*args)
        else:  # replaced (tests, benchmarks)
            rk(nt, self.quant, x2, self.weights, self.biases, self.has_bias, self.norms, self.eps,
               st["kvt"], st["kv0"], st["tpos"], c1, s1, self.heads, self.kv_heads,
               self.head_dim, self.rotary_dim, self.interleaved, self.att_scale, self.inter,
               st["ws"], l2)

    # -- the steady decode of a state (InferenceSession's decode program) -----------------------
    def steady_begin(self, kv, threads: int | None = None) -> int | None:
        """Claim slot ``T`` of every KV buffer when ``kv`` -- a :class:`KVSpan`, or the list of
        the step's KV input arrays in order -- is this thread's last call's result and every
        buffer has room; returns ``T`` (None: nothing claimed, run the step generically). The
        caller then runs :meth:`steady_run` (one-token hidden state and RoPE rows) or, if that
        cannot happen, leaves the claim: a later call sees the claimed slot and copies.
        ``threads``: numba's thread count of this thread when the caller has just set it
        (spares reading it back)."""
        st = getattr(self._local, "st", None)
        if st is None:
            return None
        last = st["last"]
        if last is None or not (kv is last or (type(kv) is list and _is_span(last, kv))):
            return None
        t = last.n
        nt = self._tasks() if threads is None else self._tasks_for(threads)
        if t >= st["cap"] or st["nt"] != nt or not kv_claim_all(st["entries"], t, 1):
            return None
        st["last"] = None
        st["tpos"].fill(t)
        st["steady"] = True
        return t

    def steady_run(self, x0, cos, sin, t: int):
        """The token after :meth:`steady_begin` returned ``t``: ``x0`` float32 [1, 1, E], ``cos``,
        ``sin`` float32 [1, 1, rotary_dim / 2] (C-contiguous; the caller made them). Returns
        (logits float32 [1, 1, V] from the buffer pool, the :class:`KVSpan` of length ``t + 1``
        over the same buffers), counting the appended bytes as the step does."""
        st = self._local.st
        logits = empty((1, 1, self.vocab), np.float32)
        if self._precompile:
            self._precompile.wait()
            self._precompile = False
        self._kernel(st, st["nt"], x0, cos, sin, logits)
        c = self.kv_opts.get("counters")
        if c is not None:
            c.add("bytes_copied_kv_append", self._append_bytes)
        span = st["last"] = KVSpan(st["ro"], t + 1)
        return logits, span

    def _reserve_kv(self, st, pasts):
        """Claim slot ``T`` of every layer's key and value capacity buffer; returns ``T`` (None
        when the layers' lengths differ; ``st["tpos"]`` holds each layer's).

        Steady decode: the pasts are the presents this thread's last call returned (retained by
        the state) and no one appended to their buffers since, so one registry claim covers all
        of them (:func:`olv_runtime.kv.contiguous.claim_all`). Otherwise each past goes through
        :func:`olv_runtime.kv.contiguous.reserve` (in place, or a copy into a new buffer when the
        past is shared or full) and the address table is updated."""
        last = st["last"]
        if last is not None and _is_span(last, pasts):
            t = last.n
            if t < st["cap"] and kv.claim_all(st["entries"], t, 1):
                st["last"] = None
                st["tpos"].fill(t)
                st["steady"] = True
                return t
        st["last"] = None
        st["steady"] = False
        kvt, kb_py, vb_py, tpos = st["kvt"], st["kb_py"], st["vb_py"], st["tpos"]
        opts = self.kv_opts
        t = 0
        for li in range(self.n_layers):
            kbuf, t = kv.reserve(pasts[2 * li], 1, **opts)
            vbuf, t2 = kv.reserve(pasts[2 * li + 1], 1, **opts)
            if t2 != t:
                raise InvalidArgument(
                    f"node {self.name!r}: layer {li} past key has {t} tokens, past value {t2}")
            if kbuf is not kb_py[li] or vbuf is not vb_py[li]:
                # a new capacity buffer (first call, growth, another state): its address into
                # the table; kb_py / vb_py keep the buffers alive while the table points there
                if (kbuf.shape != vbuf.shape or not kbuf.flags.c_contiguous
                        or not vbuf.flags.c_contiguous):
                    raise InvalidArgument(
                        f"node {self.name!r}: layer {li} KV capacity buffers {kbuf.shape} / "
                        f"{vbuf.shape} are not C-contiguous buffers of one shape")
                kvt[li, 0] = self._ds.address(kbuf)
                kvt[li, 1] = self._ds.address(vbuf)
                kvt[li, 2] = kbuf.shape[2]
                kb_py[li] = kbuf
                vb_py[li] = vbuf
            tpos[li] = t
        if not (tpos == t).all():
            return None  # layers of different lengths: no steady-state fast path
        # the state of the fast path: every buffer's registry entry and read-only whole view
        bufs = [b for pair in zip(kb_py, vb_py) for b in pair]
        st["entries"] = [kv.entry_of(b) for b in bufs]
        st["ro"] = [_readonly_view(b) for b in bufs]
        st["cap"] = int(kvt[:, 2].min())
        return t

    def _run_generic(self, args):
        """The original steps one by one (prefill and other shapes)."""
        pool = current_pool()
        env = dict(zip(self.inputs, args))
        consts = self.constants
        last_only = LAST_ONLY.get()
        for st, rel in zip(self.sub_steps, self._release):
            vals = [env[n] if n in env else consts[n] if n else None for n in st.inputs]
            if last_only:
                vals = last_position_args(st, vals, last_only)
            try:
                res = st.fn(*vals)
            except (InvalidArgument, ValidationError):
                raise
            except Exception as exc:
                raise node_failed(st, exc) from exc
            for n, v in zip(st.outputs, res):
                if n:
                    env[n] = v
                    if pool is not None:
                        pool.ref(v)
            for n in rel:
                v = env.pop(n, None)
                if pool is not None:
                    pool.unref(v)
        # the outputs keep this reference until the run ends (BufferPool.end_run); the executor
        # adds and drops its own
        return tuple(env[n] for n in self.outputs)


class KVSpan:
    """The KV values a compiled step's call produced, as its thread state keeps them: the
    read-only whole-buffer views ``ros`` (one per KV value, in the step's KV order) and the
    length ``n``; :meth:`views` makes the ``[:, :, :n]`` prefix views once (what the step returns
    and a state retains; a state on the decode program's path makes them only when they are
    read)."""

    __slots__ = ("ros", "n", "_views")

    def __init__(self, ros: list, n: int):
        self.ros = ros
        self.n = n
        self._views = None

    def views(self) -> list:
        """The read-only ``[1, KVH, n, D]`` prefix views, in the step's KV order (made once)."""
        v = self._views
        if v is None:
            key = (_ALL, _ALL, slice(0, self.n))
            v = self._views = [ro[key] for ro in self.ros]
        return v


def _is_span(span: KVSpan, pasts) -> bool:
    """``pasts`` are the views ``span`` handed out (the same objects, in order)."""
    v = span._views
    return v is not None and len(pasts) == len(v) and all(map(operator.is_, pasts, v))


def _readonly_view(buf: np.ndarray) -> np.ndarray:
    """A read-only view of a whole capacity buffer: its slices are read-only views whose
    ``base`` is the buffer itself (numpy collapses view chains), as
    :func:`olv_runtime.kv.contiguous.present` makes them."""
    v = buf.view()
    v.flags.writeable = False
    return v


def run_leaks(run, steps, boundary_out, graph_outputs) -> set:
    """Values made inside ``run`` (a span of plan steps about to become one fused step) that
    leave it other than through ``boundary_out``: read by a step outside the run or a graph
    output. A run can be fused only when this is empty."""
    made = {o for st in run for o in st.outputs if o} - set(boundary_out)
    inside = {id(st) for st in run}
    leaks = made & set(graph_outputs)
    for st in steps:
        if id(st) not in inside:
            leaks |= made & set(st.inputs)
    return leaks
