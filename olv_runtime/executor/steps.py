"""Execution steps of the session's plan (the fusion passes that make them are in
:mod:`olv_runtime.executor.passes`).

The session first turns each node into a :class:`Step` and fuses the encoded-weight patterns
(``olv.Decode -> Transpose -> MatMul`` → :class:`LinearStep`, ``olv.Decode -> Gather`` →
:class:`EncodedGather`). :func:`olv_runtime.executor.passes.optimize` then rewrites the step list (peephole passes over values
with a single consumer, never touching graph outputs):

* bias: ``Add(Linear(x), b)`` with a constant ``b[N]`` → the linear adds ``b``;
* residual: ``Add(h, Linear(x))`` → the linear adds ``h`` (``h`` computed earlier);
* siblings: linears reading the same ``x`` with INT4 block-32 weights of equal K → one kernel call
  over the weights concatenated along N at session creation;
* SiLU: ``Mul(Mul(g, Sigmoid(g)), u)`` → :func:`~olv_runtime.kernels.silu_mul`;
* RoPE + Attention: ``Attention(RotaryEmbedding(q), RotaryEmbedding(k), v, past...)`` → one step
  that rotates q and k in place (they are intermediates with no other reader);
* rotary positions: the converter's cos/sin subgraph (Shape, Range, Cast, Mul, Cos, Sin, ...)
  → one step (:mod:`olv_runtime.executor.positions`, bitwise the same values).

INT4 linear weights with block size 32 are repacked once into the 8-row group layout of
:mod:`olv_runtime.kernels.packed_i8` (``SessionOptions.prepack``), weights with zero points into
its zero-point form (:mod:`olv_runtime.kernels.packed_zp`); other block sizes use the row-major
kernel. The packed kernel is :func:`olv_runtime.kernels.dispatch.dispatch` ``(isa, mode,
format)``'s; :attr:`LinearStep.kernel` names it. Repacking changes only the memory layout, never
the values (seed 004: a prepacked form is a cache of the portable initializer).
"""
from __future__ import annotations

import contextvars
import math
import threading
from typing import Any, Sequence

import numpy as np

from olv_runtime import kernels
from olv_runtime.decoding.ggml_native import release_pages
from olv_runtime.errors import InvalidArgument
from olv_runtime.kernels import packed_i8
from olv_runtime.kernels.dispatch import LinearMode, WeightFormat, dispatch
from olv_runtime.kernels.packed_i8 import prepack_int4_i8
from olv_runtime.kv import contiguous as kv
from olv_runtime.lazy import lazy_module
from olv_runtime.ops.olv import EncodedGather  # noqa: F401  (re-exported: a fused step kind)
from olv_runtime.pool import empty
from olv_runtime.structs.compiled import packed_from_entries
from olv_runtime.structs.initializers import AffineValue

packed_zp = lazy_module("olv_runtime.kernels.packed_zp")  # zero-point weights only (warm start)
gp = lazy_module("olv_runtime.kernels.ggml_packed")  # GGUF block weights only (warm start)


#: Graph outputs the current run needs at the last position only (``State.run(last_only=)``),
#: seen by every step runner of the run (the executor and the DecoderStack's generic path).
LAST_ONLY: contextvars.ContextVar = contextvars.ContextVar("olv_last_only", default=frozenset())

#: Step kinds computing ``y[..., s, :]`` from ``x[..., s, :]`` alone (input 0, rank >= 2).
ROWWISE_KINDS = frozenset({"Linear"})


def last_position_args(step, args, last_only):
    """``args`` with input 0 cut to its last position (``x[..., -1:, :]``, C-contiguous; a view
    for batch 1) when ``step`` is row-wise and produces an output of ``last_only``."""
    if step.kind not in ROWWISE_KINDS or step.outputs[0] not in last_only:
        return args
    x = args[0]
    if not isinstance(x, np.ndarray) or x.ndim < 2 or x.shape[-2] <= 1:
        return args
    return [np.ascontiguousarray(x[..., -1:, :])] + list(args[1:])


class KVResults(tuple):
    """A step's outputs of which only the first (``pooled``) may be pool buffers or new
    allocations; the others are prefix views of KV capacity buffers, counted by
    :mod:`olv_runtime.kv.contiguous` when they are made or grown. The executor reference-counts and
    meters only the first (the compiled decode step's fast path returns its logits and presents
    so: 49 values of which 48 need no bookkeeping per token)."""

    __slots__ = ()
    pooled = 1


class KVAppended(KVResults):
    """:class:`KVResults` of a step that appended one token in place: the values after the
    first are, in the order of the step's KV inputs, the read-only ``[:, :, :T + 1]`` prefix
    views of the very capacity buffers behind those inputs (``[:, :, :T]``, every one of the
    same length ``T``), so they have the inputs' dtype and every dimension but axis 2, and
    their buffers are the inputs' buffers. A state whose retained values went in as those
    inputs may retain the outputs without re-checking them (:meth:`State.run`'s steady call)."""

    __slots__ = ()


class Step:
    """One executable step: ``fn(*input values) -> tuple of outputs``.

    Attributes
    ----------
    name : str
        The node (or fused group) name, used in error messages.
    kind : str
        Op type, or the fused kind (Linear, EncodedGather, SiluMul, RopeAttention).
    inputs, outputs : tuple of str
        Value names ('' for an omitted optional input).
    release : tuple of str
        Values whose last use is this step (dropped after it runs).
    impl : object
        The op or fused-kernel object (``fn`` is its bound ``run``/``__call__``).
    """

    __slots__ = ("name", "kind", "fn", "inputs", "outputs", "release", "impl")

    def __init__(self, name: str, kind: str, fn, inputs: Sequence[str], outputs: Sequence[str],
                 impl: Any = None):
        self.name = name
        self.kind = kind
        self.fn = fn
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.release: tuple[str, ...] = ()
        self.impl = impl

    def __repr__(self) -> str:
        return f"Step({self.kind} {self.name!r}: {list(self.inputs)} -> {list(self.outputs)})"


def _ggml_kind(ws):
    """The ggml type id shared by every weight of ``ws`` (GGMLWeight), else None."""
    kinds = {getattr(w, "ggml_kind", None) for w in ws}
    return kinds.pop() if len(kinds) == 1 else None


def _packable(w) -> bool:
    return isinstance(w, AffineValue) and w.is_int4_rows_blocked() and w.block_size == 32


class SharedWorkspace:
    """One workspace (made by ``factory(m, k_max)``, the dispatch entry's ``make_workspace``) for
    every packed linear of one :class:`~olv_runtime.kernels.dispatch.LinearMode` in a session
    (steps run one after another), grown when a call has more rows than it serves. Its size is
    reported to the ``workspace_peak`` counter."""

    def __init__(self, k_max: int, counters, factory):
        self.k_max = k_max
        self._local = threading.local()  # one workspace per thread running the session
        self.counters = counters
        self.factory = factory

    def get(self, m: int):
        ws = getattr(self._local, "ws", None)
        if ws is None or ws.m_max < m:
            ws = self._local.ws = self.factory(max(m, 1), self.k_max)
            if self.counters is not None:
                self.counters.add("arrays_allocated", 9)
                self.counters.add("bytes_allocated", ws.nbytes)
                self.counters.set_max("workspace_peak", ws.nbytes)
        return ws


class LinearStep:
    """Fused ``y_i = x @ W_i.T (+ b_i) (+ residual)`` over stored ``[N_i, K]`` weights.

    One weight: one output. Several (sibling merge): one kernel call over the weights
    concatenated along N, outputs returned as column blocks (views when ``x`` has one row).
    """

    def __init__(self, name: str, weights: list, options, counters):
        self.name = name
        self.weights = list(weights)
        self.biases: list = [None] * len(self.weights)
        self.residual = False
        self.options = options
        self.counters = counters
        self.k = self.weights[0].shape[1]
        self.ns = [w.shape[0] for w in self.weights]
        self.n = sum(self.ns)
        self.packed = None
        self.dense = None
        self.workspace: SharedWorkspace | None = None
        self.make_workspace = None  # the packed kernel's workspace factory (set by prepare)
        #: how the step runs (set by prepare): FLOAT (no prepacked weight) or a packed mode
        self.mode = LinearMode.FLOAT
        self.quantize = bool(getattr(options, "quantize_activations", False))
        self.compiled = None  # CompiledEntries of the session (seed 004), set before prepare()
        self._prepared = False
        #: the kernel serving the step (set by prepare): the dispatch entry's name --
        #: "packed_i8" / "packed_i8_exact" (8-row groups, symmetric), "packed_i8_zp" /
        #: "packed_i8_exact_zp" (8-row groups with zero points), "ggml_<type>_i8" /
        #: "ggml_<type>_exact" -- or "dense" (float32) or "row_major" (linear_int4)
        self.kernel = None

    # -- preparation (once, at session creation) ---------------------------------------------
    def prepare(self) -> None:
        ws = self.weights
        prepack = getattr(self.options, "prepack", True)
        if all(_packable(w) for w in ws) and prepack:
            symmetric = all(w.zero_point is None for w in ws)
            # seed 004: a valid compiled entry replaces the repacking (the source pages are never
            # read); otherwise (no entry, or a cache miss) repack from the source
            fmt = WeightFormat.INT4 if symmetric else WeightFormat.INT4_ZP
            self.packed = packed_from_entries(self.compiled, ws, fmt.value, self.counters)
            if self.packed is None:
                self.packed = self._repack(symmetric)
            # the 8-row group layout of kernels/packed_i8.py (zero points: plus one byte per
            # (row, block), kernels/packed_zp.py, compiled only for such models) serves both
            # modes: int8 activations (vpmaddubsw / vpdpbusd, exact integer block sums) or
            # float32 activations (kernels/packed_f32.py, exact-mode tolerance)
            self._use(LinearMode.INT8 if self.quantize else LinearMode.EXACT, fmt)
        elif _ggml_kind(ws) is not None and prepack:
            self._prepare_ggml()
        elif len(ws) == 1 and isinstance(ws[0], np.ndarray):
            self.dense = np.ascontiguousarray(ws[0])
            self.kernel = "dense"
        else:
            self.kernel = "row_major"
        biases = [b if b is not None else np.zeros(n, np.float32) for b, n in zip(self.biases, self.ns)]
        self.bias = (np.ascontiguousarray(np.concatenate(biases))
                     if any(b is not None for b in self.biases) else None)
        self._prepared = True

    def _use(self, mode: LinearMode, fmt: WeightFormat) -> None:
        """Take the packed kernel of ``(isa, mode, fmt)`` (:func:`~olv_runtime.kernels.dispatch.
        dispatch`) for the prepacked weight in ``self.packed``."""
        entry = dispatch(packed_i8.isa(), mode, fmt)
        self.mode = mode
        self._linear_packed = entry.fn
        self.make_workspace = entry.make_workspace
        self.kernel = entry.name.format(kind=getattr(self.packed, "type_name", ""))

    def _prepare_ggml(self) -> None:
        """ggml blocks (GGUF Q8_0 / Q5_0 / Q4_1 / Q5_1 / Q4_K / Q5_K / Q6_K, verified by
        decoding/ggml_native.py): repacked into the group records of kernels/ggml_packed.py, at
        the file's bits per weight (compiled only for models that have such weights)."""
        ws = self.weights
        parts = [gp.prepack_ggml(w.kind, w.blocks, w.shape[0], w.shape[1]) for w in ws]
        if len(parts) == 1:
            self.packed = parts[0]
        else:  # merged siblings (every N a multiple of 8): groups concatenated
            data = packed_i8.aligned_empty(
                (sum(p.n_groups for p in parts),) + parts[0].data.shape[1:], np.uint8)
            np.concatenate([p.data for p in parts], axis=0, out=data)
            self.packed = gp.GGMLPacked(parts[0].kind, data, self.n, self.k)
        if self.counters is not None:
            self.counters.add("bytes_repacked", self.packed.nbytes)
        for w in ws:  # the records are what runs: the mapped pages need not stay resident
            release_pages(w.blocks)
        self._use(LinearMode.GGML_INT8 if self.quantize else LinearMode.GGML_EXACT,
                  WeightFormat.GGML)

    def _repack(self, symmetric: bool):
        """Prepack the weights (concatenated along N when merged) from their source payloads."""
        ws = self.weights
        if len(ws) == 1:
            w = ws[0]
            payload, scale, zp = w.codes, w.scale, w.zero_point
        else:
            payload = _concat_rows([w.codes for w in ws], [w.shape for w in ws])
            scale = np.ascontiguousarray(np.concatenate([w.scale for w in ws], axis=0))
            zps = [w.zero_point for w in ws]
            if any(z is not None for z in zps):
                zp = np.concatenate([
                    z if z is not None else np.zeros(w.scale.shape, np.int8)
                    for z, w in zip(zps, ws)], axis=0)
            else:
                zp = None
            # read-only like the single-weight views of the model's payload: one compiled
            # specialisation of the prepack kernels instead of two (cold start)
            payload.flags.writeable = False
            scale.flags.writeable = False
        if symmetric:
            packed = prepack_int4_i8(payload, scale, None, self.n, self.k, 32)
        else:
            packed = packed_zp.prepack_int4_i8_zp(payload, scale, zp, self.n, self.k, 32)
        # read-only, like the memory-mapped arrays of compiled entries and the DecoderStack's
        # views: the kernels shared by the plan and the compiled step are compiled for one
        # array type, not two (cold start)
        for name in ("codes", "scale", "zp"):
            a = getattr(packed, name, None)
            if isinstance(a, np.ndarray):
                a.flags.writeable = False
        if self.counters is not None:
            self.counters.add("bytes_repacked", packed.nbytes)  # 0 when compiled entries hit
        return packed

    def can_merge(self, other: "LinearStep") -> bool:
        ws = self.weights + other.weights
        if _ggml_kind(ws) is not None:  # ggml records: whole 8-row groups of one block type
            return (self.k == other.k and not self.residual and not other.residual
                    and all(w.shape[0] % 8 == 0 for w in ws)
                    and getattr(self.options, "prepack", True))
        return (self.k == other.k and not self.residual and not other.residual
                and all(_packable(w) for w in ws)
                and getattr(self.options, "prepack", True))

    # -- execution ------------------------------------------------------------------------------
    def __call__(self, x, residual=None):
        if x.dtype != np.float32:
            raise InvalidArgument(f"node {self.name!r} (MatMul): expected float32 input, got {x.dtype}")
        if x.shape[-1] != self.k:
            raise InvalidArgument(
                f"node {self.name!r} (MatMul): input has {x.shape[-1]} features, the weight "
                f"expects {self.k} (shape {list(x.shape)})"
            )
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k) if x.flags.c_contiguous else np.ascontiguousarray(x).reshape(-1, self.k)
        m = x2.shape[0]
        y = empty((m, self.n), np.float32)
        if self.packed is not None:
            ws = self.workspace.get(m) if self.workspace is not None else None
            self._linear_packed(x2, self.packed, y, workspace=ws)
        elif self.dense is not None:
            kernels.linear_f32(x2, self.dense, out=y)
        else:
            start = 0
            for w in self.weights:
                n, k = w.shape
                part = y if len(self.weights) == 1 else np.empty((m, n), np.float32)
                kernels.linear_int4(x2, w.codes, w.scale, w.zero_point, n, k, w.block_size,
                                    out=part)
                if part is not y:
                    y[:, start:start + n] = part
                start += n
        if self.bias is not None:
            np.add(y, self.bias, out=y)
        if self.residual:  # the fused Add, with ONNX (numpy) broadcasting
            out_shape = (*lead, self.n)
            if residual.shape == out_shape:
                np.add(y, residual.reshape(y.shape), out=y)
            else:
                try:
                    shape = np.broadcast_shapes(out_shape, residual.shape)
                except ValueError:
                    raise InvalidArgument(
                        f"node {self.name!r} (MatMul + Add): the MatMul output {list(out_shape)} "
                        f"and the added input {list(residual.shape)} are not broadcastable"
                    ) from None
                if shape == out_shape:
                    np.add(y.reshape(out_shape), residual, out=y.reshape(out_shape))
                else:  # the added input widens the result: a new array of that shape
                    return (np.add(y.reshape(out_shape), residual),)
        if len(self.weights) == 1:
            return (y.reshape(*lead, self.n),)
        outs = []
        start = 0
        for n in self.ns:
            # column block of the merged output: a view (strided when x has several rows;
            # consumers that need contiguous rows copy into their own buffers)
            outs.append(y[:, start:start + n].reshape(*lead, n))
            start += n
        return tuple(outs)


def _concat_rows(payloads, shapes) -> np.ndarray:
    """Concatenate INT4 row-major payloads of ``[N_i, K]`` matrices along N."""
    if all((n * k) % 2 == 0 for n, k in shapes):
        return np.concatenate([np.asarray(p) for p in payloads])
    # odd element counts: re-pack nibble by nibble (session creation only)
    codes = []
    for p, (n, k) in zip(payloads, shapes):
        b = np.asarray(p, np.uint8)
        nib = np.empty(b.size * 2, np.uint8)
        nib[0::2] = b & 0x0F
        nib[1::2] = b >> 4
        codes.append(nib[: n * k])
    allc = np.concatenate(codes)
    if allc.size % 2:
        allc = np.concatenate([allc, np.zeros(1, np.uint8)])
    return (allc[0::2] | (allc[1::2] << 4)).astype(np.uint8)


_F32 = np.dtype(np.float32)
_SILU_CHUNK = 32768  # elements per pass of the SiLU step (128 KiB of float32)


class SiluMul:
    """``Mul(Mul(g, Sigmoid(g)), u)`` in one step (SiLU-gated MLP), into one pooled buffer."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, g, u):
        if g.dtype is not _F32 or u.dtype is not _F32 or g.shape != u.shape:
            raise InvalidArgument(
                f"node {self.name!r} (SiluMul): expected float32 g and u of one shape, got "
                f"{g.dtype}{list(g.shape)} and {u.dtype}{list(u.shape)}"
            )
        # numpy's SIMD exp is several times faster than a scalar libm exp in a numba loop; the
        # operations are exactly those of the unfused Sigmoid (1 / (1 + exp(-g))) and two Muls.
        # Cost (512 x 4864, one thread, thread_time): ~7.5 ms = 3 ns per element: negative 3.0
        # ms (reads g from DRAM: the gate|up output is not in cache), exp 3.9 (numpy 2.4's
        # float32 exp, 1.5-2.4 ns per element here), the last four passes 2.8 together. Tried
        # and dropped (session 13): the last four passes as one numba loop (scalar on the
        # strided gate/up halves, 33 us against numpy's 18 per chunk), the rows split over two
        # Python threads (no gain: after a GEMM the omp workers still spin; 128 rows 2.2 ms
        # against 2.0 best of 60).
        out = empty(g.shape, np.float32)
        n = g.shape[-1] if g.ndim else 1
        g2, u2, o2 = g.reshape(-1, n), u.reshape(-1, n), out.reshape(-1, n)
        rows = max(1, _SILU_CHUNK // max(n, 1))  # row chunks that stay in L2 across the passes
        with np.errstate(over="ignore"):
            for r0 in range(0, g2.shape[0], rows):
                gc, uc, oc = g2[r0:r0 + rows], u2[r0:r0 + rows], o2[r0:r0 + rows]
                np.negative(gc, out=oc)
                np.exp(oc, out=oc)
                np.add(oc, np.float32(1.0), out=oc)
                np.divide(np.float32(1.0), oc, out=oc)
                np.multiply(gc, oc, out=oc)
                np.multiply(oc, uc, out=oc)
        return (out,)


def _contiguous_copy(x: np.ndarray) -> np.ndarray:
    out = empty(x.shape, x.dtype)
    np.copyto(out, x)
    return out


class RopeAttention:
    """``Attention(RotaryEmbedding(q), RotaryEmbedding(k), v, past...)`` in two kernel calls.

    q and k are intermediates no other step reads, so they are rotated in place; the new keys and
    values go straight into the KV capacity buffers (:func:`olv_runtime.kv.contiguous.reserve`).
    Falls back to the unfused ops for layouts the fused kernel does not take (4-D inputs,
    different cos/sin for q and k).
    """

    def __init__(self, name: str, rope_q, rope_k, attention):
        self.name = name
        self.rope_q = rope_q
        self.rope_k = rope_k
        self.attention = attention
        at = attention.attrs
        self.h, self.kvh = at["q_num_heads"], at["kv_num_heads"]
        self.causal = bool(at["is_causal"])
        self.scale_attr = at["scale"]
        self.interleaved = bool(rope_q.attrs["interleaved"])
        self.fast = (rope_q.attrs["num_heads"] == self.h and rope_k.attrs["num_heads"] == self.kvh
                     and self.h > 0 and self.kvh > 0
                     and rope_q.attrs["interleaved"] == rope_k.attrs["interleaved"]
                     and rope_q.attrs["rotary_embedding_dim"] == rope_k.attrs["rotary_embedding_dim"])

    def __call__(self, q, k, v, past_key, past_value, cos_q, sin_q, cos_k, sin_k):
        if (self.fast and q.ndim == 3 and cos_q is cos_k and sin_q is sin_k
                and q.dtype == k.dtype == v.dtype == np.float32):
            res = self._fused(q, k, v, past_key, past_value, cos_q, sin_q)
            if res is not None:
                return res
        q = self._rotate(self.rope_q, q, cos_q, sin_q)
        k = self._rotate(self.rope_k, k, cos_k, sin_k)
        return self.attention.run(q, k, v, None, past_key, past_value)

    def _fused(self, q, k, v, past_key, past_value, cos, sin):
        if q.dtype is not _F32 or k.dtype is not _F32 or v.dtype is not _F32:
            return None
        # strided column blocks of a merged q/k/v projection (prefill): q and k are rotated in
        # place, so give them (and v) contiguous pooled copies first
        if not q.flags.c_contiguous:
            q = _contiguous_copy(q)
        if not k.flags.c_contiguous:
            k = _contiguous_copy(k)
        if not v.flags.c_contiguous:
            v = _contiguous_copy(v)
        b, s, hq = q.shape
        h, kvh = self.h, self.kvh
        if hq % h or h % kvh:
            return None
        d = hq // h
        r = self.rope_q.attrs["rotary_embedding_dim"] or d
        if (k.shape != (b, s, kvh * d) or v.shape != (b, s, kvh * d) or r > d or r % 2
                or past_key.ndim != 4 or past_key.shape[:2] != (b, kvh) or past_key.shape[3] != d
                or past_value.shape != past_key.shape or past_key.dtype != np.float32
                or past_value.dtype != np.float32
                or cos.shape != (b, s, r // 2) or sin.shape != cos.shape
                or cos.dtype != np.float32 or sin.dtype != np.float32
                or not (q.flags.c_contiguous and k.flags.c_contiguous and v.flags.c_contiguous
                        and cos.flags.c_contiguous and sin.flags.c_contiguous)
                or not (q.flags.writeable and k.flags.writeable)):
            return None
        att = self.attention
        kbuf, t = kv.reserve(past_key, s, **att.kv_opts)
        vbuf, _ = kv.reserve(past_value, s, **att.kv_opts)
        scale = self.scale_attr if self.scale_attr is not None else 1.0 / math.sqrt(d)
        out = empty((b, s, h, d), np.float32)
        kernels.rope_attention(q.reshape(b, s, h, d), k.reshape(b, s, kvh, d),
                               v.reshape(b, s, kvh, d), cos, sin, self.interleaved, r, kbuf, vbuf,
                               t, float(np.float32(scale)), self.causal, out)
        counters = att.kv_opts.get("counters")
        if counters is not None:
            counters.add("bytes_copied_kv_append", k.nbytes + v.nbytes)
        return out.reshape(b, s, h * d), kv.present(kbuf, t + s), kv.present(vbuf, t + s)

    @staticmethod
    def _rotate(op, x, cos, sin):
        return op.run(x, cos, sin)[0]


# ------------------------------------------------------------------------------------------------
# passes
# ------------------------------------------------------------------------------------------------
def prepare_linears(steps: list[Step], counters=None, compiled=None) -> None:
    """Prepack every linear step's weights (from valid seed 004 compiled entries when
    ``compiled`` has them) and give the packed ones one shared workspace."""
    linears = [s.impl for s in steps if isinstance(s.impl, LinearStep)]
    for lin in linears:
        if not lin._prepared:
            lin.compiled = compiled
            lin.prepare()
    for mode in LinearMode:
        packed = [lin for lin in linears if lin.packed is not None and lin.mode is mode]
        if packed:  # one mode, one workspace class (the dispatch entries of a mode share it)
            shared = SharedWorkspace(max(lin.packed.k_padded for lin in packed), counters,
                                     packed[0].make_workspace)
            for lin in packed:
                lin.workspace = shared


# -- after planning: the row-major forms the prepacked copies replace ---------------------------
class _Released:
    """Stands in for a repacked plane once its prepacked copy exists (name and shape only)."""

    def __init__(self, w):
        self.name, self.shape, self.nbytes = w.name, w.shape, 0


class _ReleasedInt4(_Released):
    """Stands in for the row-major INT4 form of a Q4_0 weight once its prepacked copy exists:
    name, shape and scales (``olv compile`` reads the scales' dtype), no codes."""

    def __init__(self, w):
        super().__init__(w)
        self.scale = w.scale


def release_repacks(values, steps) -> None:
    """After planning: drop the row-major INT4 codes of Q4_0 weights in linear steps (their
    prepacked copies are what runs; the steps inside a DecoderStack included), and clear the
    per-value repack cache. A form a gather still reads stays alive through the gather's own
    reference."""
    for v in values:
        if hasattr(v, "__dict__"):
            v.__dict__.pop("_ggml_repack", None)
    every = []
    for st in steps:
        every.append(st)
        every.extend(getattr(st.impl, "sub_steps", ()))
    for st in every:
        impl = st.impl
        if isinstance(impl, LinearStep) and impl.packed is not None and impl.weights and all(
                getattr(w, "_ggml_q4_0", False) for w in impl.weights):
            impl.weights = [_ReleasedInt4(w) for w in impl.weights]
            continue
