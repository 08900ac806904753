"""INT4 x int8 GEMV/GEMM (quantized activations) with explicit AVX2 integer dot products.

Symmetric INT4 weights, block 32: every 32-block of every activation row is quantized to int8
(``d = max|x| / 127``, ``xq = rint(x / d)``, :func:`~.packed.quantize_block`), and

    y[i, n] = sum_b float32(S[i, n, b]) * (scale[n, b] * d[i, b])      (b = 0, 1, ... in order)
    S[i, n, b] = sum_{j<32} q[n, 32b + j] * xq[i, 32b + j]             (exact int32)

The integer sums are exact and the float operations per (row, block) are fixed (one float32
multiply ``scale * d``, one multiply, one add, blocks in order from 0.0), so every variant (1, 2,
4 activation rows per pass, the prefill GEMM, either ISA) gives bitwise the same results, those
of ``tests/reference.py::linear_int4_int8``.

Instead of relying on LLVM's auto-vectoriser (which emits int16 ``vpmullw``/``vpaddw`` per nibble),
the inner loop is written with numba intrinsics (:func:`numba.core.extending.intrinsic`) that emit
LLVM IR on 256-bit vectors and call ``llvm.x86.avx2.pmadd.ub.sw`` (``vpmaddubsw``: u8 x s8 ->
saturating s16 pair sums) and ``llvm.x86.avx2.pmadd.wd`` (``vpmaddwd``: s16 x s16 -> s32 pair
sums), the way llama.cpp's Q4_0 x Q8_0 AVX2 dot product does.

Packed layout (:class:`PackedInt4I8`)
-------------------------------------
``G = 8`` consecutive output rows form a group (the 8 int32 / float32 lanes of a ymm);
``NG = ceil(N / 8)`` groups (padding rows: codes q = 0, scale 0); K is padded to ``Kp = 32 * KB``.

* ``codes``: uint8 ``[NG, KB, 128]`` (64-byte aligned). For group ``g``, block ``b``, chunk
  ``c = 0..3``, row ``r = 0..7`` and ``j = 0..3``::

      codes[g, b, 32c + 4r + j] = u[8g + r, 32b + 4c + j] | u[8g + r, 32b + 16 + 4c + j] << 4

  with ``u = q + 8`` in ``0..15`` (unsigned form of the signed code). One 32-byte load of chunk
  ``c`` gives, after ``& 0x0F`` (low nibbles) or ``>> 4 & 0x0F`` (high nibbles), 8 rows x 4 codes
  as unsigned bytes; the int32 lane ``r`` of ``vpmaddwd(vpmaddubsw(u, bcast32(xq[k..k+3])), 1)``
  is then ``sum_{j<4} u[r, k+j] * xq[k+j]`` for row ``r`` -- no horizontal sums anywhere.
* ``scale``: ``[NG, KB, 8]`` (64-byte aligned) = the stored ``scale[8g + r, b]`` bits (0 on
  padding rows): float32, or the uint16 bits of float16 scales (the converter default, 4.5 bits
  per weight like Q4_0), widened exactly with ``vcvtph2ps`` as they are loaded.

Two instruction paths, chosen at run time by :func:`isa` from the CPU's features (both compute the
exact integer block sums, so results are bitwise equal; a test forces the fallback):
``avx512vnni`` -- 8 ``vpdpbusd`` (u8 x s8 -> s32, 4 products per lane, accumulated) per (group,
block, activation row) on 256-bit registers; ``avx2`` -- as described next.

Inner loop per (group, block, activation row): 8 x (``vpbroadcastd`` of 4 int8 activations,
``vpmaddubsw``), 7 ``vpaddw``, 1 ``vpmaddwd`` (with ones), ``vpsubd`` of ``8 * sum(xq)``
(the symmetric offset: ``sum q*x = sum u*x - 8 sum x``), ``vcvtdq2ps``, 2 ``vmulps``, ``vaddps``;
the code vectors (4 loads, ``vpand``/``vpsrlw``) are decoded once per (group, block) and shared
by up to 4 activation rows whose accumulators stay in registers (rows in chunks of 4, 2, 1; a
later chunk re-reads the group's codes from L1/L2, not DRAM). On the VNNI path the 8
``vpdpbusd`` of a (group, block, row) run as two chains of 4 (chunks 0, 2 and 1, 3; about 10 %
faster from L2 than one chain of 8). M = 1 reads one group after the other: one sequential
stream per task. Two groups per pass (two interleaved streams, each activation broadcast
feeding both) ran 16 % faster from L2 but 0.58x as fast from DRAM on the 4864 x 896 weight (one
thread), and the decode step 0.67-0.76x: on this machine the memory side wants one sequential
stream per core. M >= 2 is bound by the ~8 vector ALU uops per (8 rows x 32 codes x
activation row), i.e. vpmaddubsw throughput plus the vpaddw reduction.

Memory: the codes and scales of a task are one contiguous stream each; the group loops issue
``prefetcht0`` :data:`PF_BYTES` ahead of the codes stream (and the matching scales) -- without
it the kernel reached only ~60 % of the streaming-read bandwidth at M = 1. 4 KiB ran 15 % faster
than 2 KiB from DRAM (one thread, 4864 x 896 and 896 x 4864); 8 KiB 11 % slower on 896 x 4864.
A second prefetch :data:`PF2_BYTES` (16 KiB) ahead goes to L2 (``prefetcht1``, codes only): in
the minutes when the 2-thread streaming read runs at 55-65 GB/s (this machine's vCPUs move
between hosts) the 896 x 4864 weight went from ~42 to ~47 GB/s with it (262 interleaved rounds,
median; no change when the stream runs at 30-38 GB/s), while a longer L1 distance, prefetcht1
alone or no software prefetch at all stayed at 40-42. The parallel driver
prefetches the head of each task's stream when the task starts (:func:`prefetch_task_head`).
Activation quantization of full 32-blocks is also vector IR (``vdivps``/``vroundps``, the same
IEEE operations as the scalar loop, so ``xq``/``d`` are bitwise those of ``quantize_block``).

Overflow: each ``vpmaddubsw`` lane is ``u0*x0 + u1*x1`` with ``|.| <= 2*15*127 = 3810`` (never
saturates); the 8 lanes summed with ``vpaddw`` per block give ``|.| <= 16*15*127 = 30480 < 32767``
(int16 exact); ``vpmaddwd`` with ones widens to int32 (``|sum u*x| <= 60960``).

Bytes read per call: ``packed.nbytes`` = ``16 * NG * Kp`` codes + ``32 * NG * KB`` float32 scales
(``16 * NG * KB`` float16 scales).

:data:`olv_runtime.kernels.layouts.PACKED_LAYOUT_VERSION` (the one layout-version constant) is
bumped whenever this layout changes, so a persisted prepacked copy (seed 004) of an older layout
is never read as this one.

Prefill (M >= 8) on the VNNI path: :mod:`.packed_i8_gemm` (16 output rows x 8 activation rows
per zmm register tile, the same bits).

Zero points are not supported here (:func:`prepack_int4_i8` raises
:class:`~olv_runtime.errors.InvalidArgument`): weights with zero points take :mod:`.packed_zp`.
"""
from __future__ import annotations

import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic, models, register_model
from numba.np.ufunc import parallel

from olv_runtime.config import isa_override
from olv_runtime.errors import InvalidArgument, env_error

from .arena import weight_empty
from .config import JIT, PJIT, check_array, check_int
from .half import scale_bits
from .packed import quantize_block, workspace_args  # shared

__all__ = ["isa", "set_isa", "use_vnni", "fast_call_rows", "num_threads", "HOST_VNNI", "PackedInt4I8", "PackedI8Workspace", "prepack_int4_i8", "make_workspace_i8",
           "GROUP_ROWS", "BLOCK"]

def _host_vnni() -> bool:
    f = llvm.get_host_cpu_features()
    return bool(f.get("avx512vnni") and f.get("avx512vl"))


#: The host has AVX-512 VNNI with 256-bit forms (``vpdpbusd ymm``); numba compiles for the host,
#: so without it the VNNI instruction is never emitted.
HOST_VNNI = _host_vnni()


def _env_isa():
    return isa_override()


#: ``forced``: set by :func:`set_isa`; ``env``: the ``OLV_ISA`` environment variable, read once
#: when this module is imported (a per-call ``os.environ`` lookup costs ~1 us, as much as the
#: rest of a small call's Python)
_ISA = {"forced": None, "env": _env_isa()}


def isa() -> str:
    """The instruction path of the int8 dot products, chosen at run time from the CPU's
    features: ``"avx512vnni"`` (``vpdpbusd``) where the CPU has AVX-512 VNNI (+VL), else
    ``"avx2"`` (``vpmaddubsw`` + ``vpmaddwd``). :func:`set_isa` (or ``OLV_ISA=avx2`` in the
    environment when olv_runtime is imported) forces the fallback. Both paths compute the same
    exact integer sums: results are bitwise equal."""
    forced = _ISA["forced"]
    if forced is None:
        forced = _ISA["env"]
        if forced is not None and forced != "avx2":
            _check_env_isa(forced)
    if forced == "avx2" or not HOST_VNNI:
        return "avx2"
    return "avx512vnni"


def _check_env_isa(value: str) -> None:
    """``OLV_ISA`` (read at import) checked at first use, as :func:`set_isa` checks its
    argument: unset/empty, ``avx2`` or (where the CPU has it) ``avx512vnni``."""
    if value == "avx512vnni" and HOST_VNNI:
        return
    if value == "avx512vnni":
        raise env_error("OLV_ISA", value, "unset or empty (choose from the CPU), 'avx2'; "
                        "'avx512vnni' only where the CPU has AVX-512 VNNI (+VL), this one has not")
    raise env_error("OLV_ISA", value, "unset or empty (choose from the CPU), 'avx2', "
                    "'avx512vnni'")


def set_isa(name: str | None) -> None:
    """Force the int8 dot-product path: ``"avx2"`` (the fallback, any AVX2 CPU),
    ``"avx512vnni"`` (only where the CPU has it) or None (choose from the CPU's features)."""
    if name not in (None, "avx2", "avx512vnni"):
        raise InvalidArgument(f"isa: expected None, 'avx2' or 'avx512vnni', got {name!r}")
    if name == "avx512vnni" and not HOST_VNNI:
        raise InvalidArgument("isa: 'avx512vnni' requested but this CPU has no AVX-512 VNNI "
                              "(avx512vnni + avx512vl)")
    _ISA["forced"] = name


def use_vnni() -> bool:
    """True when the kernels should take the VNNI path (see :func:`isa`)."""
    return isa() == "avx512vnni"


_NT = {"get": None}


def num_threads() -> int:
    """``numba.get_num_threads()`` in ~0.2 us instead of ~0.7: once numba's threads are up, its
    C getter (the one ``numba.get_num_threads`` ends in, same thread-local count) is called
    directly; the public function where that getter is not found (another numba version)."""
    get = _NT["get"]
    if get is None:
        n = numba.get_num_threads()  # launches the threading layer
        get = getattr(parallel, "_get_num_threads", None)
        _NT["get"] = get if callable(get) else numba.get_num_threads
        return n
    return get()


_F32 = np.dtype(np.float32)


def fast_call_rows(x, packed, out, workspace, packed_cls, ws_cls) -> int:
    """``M`` of a call whose arguments are all given and valid as they usually are in a decode
    loop (``x`` float32 ``[M, K]`` and ``out`` float32 ``[M, N]`` C-contiguous, ``out``
    writeable, ``M >= 1``, a workspace of ``ws_cls`` large enough, ``packed`` exactly a
    ``packed_cls``), else -1: the wrapper then runs the full checks of
    :func:`~.packed.prepare_call`, which name what is wrong. About 0.7 us instead of ~3."""
    if (type(packed) is not packed_cls or type(workspace) is not ws_cls
            or type(x) is not np.ndarray or type(out) is not np.ndarray
            or x.dtype is not _F32 or out.dtype is not _F32):
        return -1
    xs = x.shape
    if len(xs) != 2 or xs[1] != packed.k:
        return -1
    m = xs[0]
    if (m < 1 or out.shape != (m, packed.n) or workspace.m_max < m
            or workspace.k_max < packed.k_padded):
        return -1
    fo = out.flags
    if not (x.flags.c_contiguous and fo.c_contiguous and fo.writeable):
        return -1
    return m


GROUP_ROWS = 8      # rows per group: the 8 lanes of one ymm of int32 / float32
BLOCK = 32          # quantization block along K (the only block size supported)
GROUP_BLOCK_BYTES = 128  # codes bytes per (group, block): 8 rows x 32 codes x 4 bits
SERIAL_MAX_WORK = 1 << 18  # M*N*Kp below this: serial driver (a parallel region costs more)
ALIGN = 64
PF_BYTES = 4096    # software prefetch distance ahead of the codes stream (0: off)
PF2_BYTES = 16384  # second, longer prefetch distance into L2 (prefetcht1; 0: off)


# ------------------------------------------------------------------------------------------------
# 256-bit vector types and intrinsics
# ------------------------------------------------------------------------------------------------
class Vec(types.Type):
    """A 256-bit LLVM vector value (only created and consumed by the intrinsics below)."""

    def __init__(self, bits, count, is_float):
        self.bits, self.count, self.is_float = bits, count, is_float
        super().__init__(name=f"olv_vec{count}x{'f' if is_float else 'i'}{bits}")


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        et = ir.FloatType() if fe_type.is_float else ir.IntType(fe_type.bits)
        super().__init__(dmm, fe_type, ir.VectorType(et, fe_type.count))


V8F32 = Vec(32, 8, True)
V8I32 = Vec(32, 8, False)

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_LV32I8 = ir.VectorType(_I8, 32)
_LV16I16 = ir.VectorType(_I16, 16)
_LV8I32 = ir.VectorType(_I32, 8)
_LV8F32 = ir.VectorType(ir.FloatType(), 8)


def elem_ptr(context, builder, aty, aval, off, vty):
    """Pointer (as ``vty*``) to element ``off`` (linear, in elements) of a C-contiguous array."""
    ary = context.make_array(aty)(context, builder, aval)
    p = builder.gep(ary.data, [off])
    return builder.bitcast(p, vty.as_pointer())


def splat(builder, val, vty):
    undef = ir.Constant(vty, ir.Undefined)
    v = builder.insert_element(undef, val, ir.Constant(_I32, 0))
    mask = ir.Constant(ir.VectorType(_I32, vty.count), [0] * vty.count)
    return builder.shuffle_vector(v, undef, mask)


def check_array_arg(arr, dtype):
    return isinstance(arr, types.Array) and arr.dtype == dtype


def is_scale_array(arr):
    """float32 scales, or float16 scales as their uint16 bits (kernels/half.py)."""
    return isinstance(arr, types.Array) and arr.dtype in (types.float32, types.uint16)


_LV8I16 = ir.VectorType(ir.IntType(16), 8)
_LV8F16 = ir.VectorType(ir.HalfType(), 8)


def load_scales8(context, builder, aty, arr, off):
    """8 consecutive scales from linear element ``off`` as float32 lanes: a float32 load, or a
    uint16 (float16 bits) load widened exactly with ``fpext`` (``vcvtph2ps``)."""
    if aty.dtype == types.uint16:
        p = elem_ptr(context, builder, aty, arr, off, _LV8I16)
        h = builder.bitcast(builder.load(p, align=2), _LV8F16)
        return builder.fpext(h, _LV8F32)
    p = elem_ptr(context, builder, aty, arr, off, _LV8F32)
    return builder.load(p, align=4)


def emit_prefetch(context, builder, aty, arr, off, locality=3):
    """IR: ``llvm.prefetch`` (read) of the byte at linear element ``off`` of array ``arr``
    (type ``aty``; may lie past the end: prefetches never fault). ``locality`` 3 is
    ``prefetcht0``, 2 ``prefetcht1`` (into L2)."""
    ary = context.make_array(aty)(context, builder, arr)
    esz = context.get_abi_sizeof(context.get_data_type(aty.dtype))
    p = builder.bitcast(ary.data, _I8.as_pointer())
    p = builder.gep(p, [builder.mul(off, ir.Constant(off.type, esz))])
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]),
        "llvm.prefetch.p0i8")
    builder.call(fn, [p, ir.Constant(_I32, 0), ir.Constant(_I32, locality),
                      ir.Constant(_I32, 1)])


def _make_prefetch(locality, doc):
    @intrinsic
    def prefetch(typingctx, arr, off):
        if not isinstance(arr, types.Array):
            return None

        def codegen(context, builder, sig, args):
            emit_prefetch(context, builder, sig.args[0], args[0], args[1], locality)
            return context.get_dummy_value()
        return types.none(arr, types.intp), codegen
    prefetch.__doc__ = doc
    return prefetch


prefetch = _make_prefetch(3, "Software prefetch (prefetcht0) of the byte at linear element "
                              "``off`` of ``arr`` (may point past the end: never faults).")
_prefetch_l2 = _make_prefetch(2, "Software prefetch into L2 (prefetcht1) of the byte at linear "
                                 "element ``off`` of ``arr`` (may point past the end).")


@intrinsic
def fzero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_LV8F32, [0.0] * 8)
    return V8F32(), codegen


@intrinsic
def fstore(typingctx, arr, off, v):
    """Store the 8 (or 16) float32 lanes of ``v`` to ``arr`` at linear element ``off``."""
    if not (check_array_arg(arr, types.float32) and isinstance(v, Vec) and v.is_float
            and v.bits == 32):
        return None

    def codegen(context, builder, sig, args):
        p = elem_ptr(context, builder, sig.args[0], args[0], args[1],
                     context.get_value_type(sig.args[2]))
        builder.store(args[2], p, align=4)
        return context.get_dummy_value()
    return types.none(arr, types.intp, v), codegen


def _hreduce(builder, v, op):
    """Horizontal reduction of an 8-lane vector with ``op(builder, a, b)`` (log2 shuffles)."""
    n = v.type.count
    undef = ir.Constant(v.type, ir.Undefined)
    while n > 1:
        n //= 2
        mask = ir.Constant(ir.VectorType(_I32, v.type.count),
                           [i + n if i < n else i for i in range(v.type.count)])
        v = op(builder, v, builder.shuffle_vector(v, undef, mask))
    return builder.extract_element(v, ir.Constant(_I32, 0))


@intrinsic
def _quant_block(typingctx, x, xoff, xq, qoff, xd, xs8, boff):
    """int8 quantization of one full 32-block ``x[xoff:xoff+32]`` (float32, linear offsets):
    ``d = max|x| / 127``, ``xq = clamp(rint(x / d), -127, 127)`` (0 if max|x| == 0) written to
    ``xq[qoff:qoff+32]``, ``xd[boff] = d``, ``xs8[boff] = 8 * sum(xq)``. Same float operations as
    the scalar loop (IEEE division, rint = round half to even), on 4 ymm vectors."""
    if not (check_array_arg(x, types.float32) and check_array_arg(xq, types.int8)
            and check_array_arg(xd, types.float32) and check_array_arg(xs8, types.int32)):
        return None

    def codegen(context, builder, sig, args):
        xa, xo, qa, qo, da, sa, bo = args
        ft = ir.FloatType()
        vs = []
        for j in range(4):
            off = builder.add(xo, ir.Constant(xo.type, 8 * j))
            p = elem_ptr(context, builder, sig.args[0], xa, off, _LV8F32)
            vs.append(builder.load(p, align=4))
        absmask = ir.Constant(_LV8I32, [0x7FFFFFFF] * 8)
        av = [builder.bitcast(builder.and_(builder.bitcast(v, _LV8I32), absmask), _LV8F32)
              for v in vs]

        def fmax(b, p, q):
            return b.select(b.fcmp_ordered(">", p, q), p, q)
        m = fmax(builder, fmax(builder, av[0], av[1]), fmax(builder, av[2], av[3]))
        amax = _hreduce(builder, m, fmax)
        d = builder.fdiv(amax, ir.Constant(ft, 127.0))
        pos = builder.fcmp_ordered(">", amax, ir.Constant(ft, 0.0))
        dv = splat(builder, d, _LV8F32)
        rint = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_LV8F32, [_LV8F32]), "llvm.rint.v8f32")
        hi = ir.Constant(_LV8F32, [127.0] * 8)
        lo = ir.Constant(_LV8F32, [-127.0] * 8)
        tot = None
        for j in range(4):
            v = builder.call(rint, [builder.fdiv(vs[j], dv)])
            v = builder.select(builder.fcmp_ordered(">", v, hi), hi, v)
            v = builder.select(builder.fcmp_ordered("<", v, lo), lo, v)
            iv = builder.fptosi(v, _LV8I32)
            iv = builder.select(pos, iv, ir.Constant(_LV8I32, [0] * 8))
            off = builder.add(qo, ir.Constant(qo.type, 8 * j))
            p = elem_ptr(context, builder, sig.args[2], qa, off, ir.VectorType(_I8, 8))
            builder.store(builder.trunc(iv, ir.VectorType(_I8, 8)), p, align=1)
            tot = iv if tot is None else builder.add(tot, iv)
        total = _hreduce(builder, tot, lambda b, p, q: b.add(p, q))
        builder.store(d, elem_ptr(context, builder, sig.args[4], da, bo, ft))
        builder.store(builder.mul(total, ir.Constant(_I32, 8)),
                      elem_ptr(context, builder, sig.args[5], sa, bo, _I32))
        return context.get_dummy_value()
    return types.none(x, types.intp, xq, types.intp, xd, xs8, types.intp), codegen


# ------------------------------------------------------------------------------------------------
# container and workspace
# ------------------------------------------------------------------------------------------------
def aligned_empty(shape, dtype, align=ALIGN):
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes].view(dtype).reshape(shape)


def task_scratch(nt, tail, dtype, pad=True):
    """Zeros ``[nt, *tail']``: each task's private scratch on cache lines of its own.

    The array starts on a 64-byte line and, with ``pad``, the first dimension of ``tail`` is
    rounded up so that one task's block is a whole number of lines (``tail'[0] >= tail[0]``; the
    kernels index their scratch explicitly and never read its shape); without ``pad`` (a caller
    that checks the shape) the block is whole lines when its byte size is a multiple of 64.
    Why: ``np.zeros`` starts small arrays 16 bytes into a line, so the last line of task 0's
    block was also the first of task 1's, and the two cores took turns owning it on every write
    (false sharing): the engine's exact-mode accumulators (4 rows x 16 floats per task,
    rewritten every 32-block) made its 8-row step 64 ms instead of 51 ms (bench/rows_phases.py
    --batch 8 --exact, 2 tasks)."""
    dtype = np.dtype(dtype)
    tail = tuple(int(t) for t in tail)
    if pad and tail:
        rest = int(np.prod(tail[1:], dtype=np.int64)) * dtype.itemsize
        unit = ALIGN // np.gcd(ALIGN, rest) if rest else 1
        tail = (-(-tail[0] // unit) * unit,) + tail[1:]
    a = aligned_empty((nt,) + tail, dtype)
    a[...] = 0
    return a


class PackedInt4I8:
    """A symmetric INT4 ``[N, K]`` weight (block 32) repacked by :func:`prepack_int4_i8`.

    Attributes
    ----------
    codes : ndarray of uint8, shape [NG, KB, 128]
        See the module docstring (8-row groups, 4 chunks of 8 rows x 4 codes per byte nibble).
    scale : ndarray of float32 or uint16, shape [NG, KB, 8]
        ``scale[g, b, r]`` = original ``scale[8g + r, b]`` (0 on padding rows); uint16 holds
        the bits of float16 scales (widened exactly in the kernels).
    n, k, k_padded, k_blocks, n_groups : int
    """

    __slots__ = ("codes", "scale", "n", "k", "k_padded", "k_blocks", "n_groups")

    def __init__(self, codes, scale, n, k):
        self.codes = codes
        self.scale = scale
        self.n = int(n)
        self.k = int(k)
        self.k_blocks = int(codes.shape[1])
        self.k_padded = BLOCK * self.k_blocks
        self.n_groups = int(codes.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of the packed arrays (what one call streams from memory)."""
        return int(self.codes.nbytes + self.scale.nbytes)

    def copy(self) -> "PackedInt4I8":
        codes = aligned_empty(self.codes.shape, np.uint8)
        codes[...] = self.codes
        scale = aligned_empty(self.scale.shape, self.scale.dtype)
        scale[...] = self.scale
        return PackedInt4I8(codes, scale, self.n, self.k)

    def __repr__(self) -> str:
        return (f"PackedInt4I8(n={self.n}, k={self.k}, k_padded={self.k_padded}, "
                f"n_groups={self.n_groups}, nbytes={self.nbytes})")


class PackedI8Workspace:
    """Preallocated buffers for :func:`linear_packed_i8` (made by :func:`make_workspace_i8`).

    Valid for any packed weight with ``k_padded <= k_max`` and any ``M <= m_max``, with at most
    ``n_tasks`` parallel tasks.
    """

    __slots__ = ("m_max", "k_max", "n_tasks", "xq", "xd", "xs8", "facc")

    def __init__(self, m_max, k_max, n_tasks):
        kp = BLOCK * (-(-k_max // BLOCK))
        kb = kp // BLOCK
        self.m_max, self.k_max, self.n_tasks = m_max, kp, n_tasks
        self.xq = aligned_empty((m_max, kp), np.int8)
        self.xq[...] = 0
        self.xd = np.zeros((m_max, kb), dtype=np.float32)
        self.xs8 = np.zeros((m_max, kb), dtype=np.int32)
        self.facc = task_scratch(n_tasks, (1, GROUP_ROWS), np.float32)

    @property
    def nbytes(self) -> int:
        return int(sum(getattr(self, a).nbytes for a in ("xq", "xd", "xs8", "facc")))


def make_workspace_i8(m_max: int, k_max: int, n_tasks: int | None = None) -> PackedI8Workspace:
    """Preallocate the buffers of :func:`linear_packed_i8`.

    Sizes: ``xq`` int8 ``[m_max, Kp]``, ``xd`` float32 / ``xs8`` int32 ``[m_max, KB]``, ``facc``
    float32 ``[n_tasks, 1, 8]`` (``Kp = 32 * ceil(k_max / 32)``). ``n_tasks`` defaults to
    ``numba.config.NUMBA_NUM_THREADS``.
    """
    m_max, k_max, n_tasks = workspace_args(m_max, k_max, n_tasks)
    return PackedI8Workspace(m_max, k_max, n_tasks)


# ------------------------------------------------------------------------------------------------
# prepacking
# ------------------------------------------------------------------------------------------------
@njit(**JIT)
def _code_u(payload, row, kk, n, k):
    if row < n and kk < k:
        e = row * k + kk
        return np.uint8(((payload[e >> 1] >> ((e & 1) * 4)) & 15) ^ 8)
    return np.uint8(8)


@njit(inline="always", **JIT)  # one library per driver, not two levels
def _prepack_group(payload, scale, n, k, codes, pscale, g):
    kb = codes.shape[1]
    for b in range(kb):
        for r in range(GROUP_ROWS):
            row = g * GROUP_ROWS + r
            if row < n:
                pscale[g, b, r] = scale[row, b]  # same dtype: float32, or float16 bits
            else:
                pscale[g, b, r] = 0
            for c in range(4):
                for j in range(4):
                    kk = b * BLOCK + 4 * c + j
                    lo = _code_u(payload, row, kk, n, k)
                    hi = _code_u(payload, row, kk + 16, n, k)
                    codes[g, b, 32 * c + 4 * r + j] = np.uint8(lo | (hi << 4))


@njit(**PJIT)
def _prepack_par(payload, scale, n, k, codes, pscale):
    for g in prange(codes.shape[0]):
        _prepack_group(payload, scale, n, k, codes, pscale, g)


@njit(**JIT)
def _prepack_ser(payload, scale, n, k, codes, pscale):
    for g in range(codes.shape[0]):
        _prepack_group(payload, scale, n, k, codes, pscale, g)


#: Weights with fewer elements (N * K) are repacked by the serial driver: a parallel region does
#: not pay for ~1 ms of work, and models whose weights are all small (``olv demo``) never
#: compile the parallel driver (cold start).
PREPACK_SERIAL_MAX = 1 << 20


def prepack(payload, scale, n, k, codes, pscale):
    """Fill ``codes`` / ``pscale`` (the serial driver for small weights, else the parallel)."""
    driver = _prepack_ser if n * k < PREPACK_SERIAL_MAX else _prepack_par
    driver(payload, scale, n, k, codes, pscale)


def prepack_int4_i8(payload: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None,
                    n: int, k: int, block_size: int) -> PackedInt4I8:
    """Repack a blocked symmetric INT4 ``[N, K]`` weight (block 32) for :func:`linear_packed_i8`.

    Parameters
    ----------
    payload : ndarray of uint8, shape [>= ceil(N*K/2)]
        Signed INT4 codes in ``[-8, 7]`` of ``W`` row-major, two per byte, low nibble first.
    scale : ndarray of float32 or float16, shape [N, ceil(K/32)]
        float16 scales are kept as float16 in the packed layout (no float32 copy).
    zero_point : None
        Must be None (symmetric); anything else raises
        :class:`~olv_runtime.errors.InvalidArgument` (zero points: :mod:`.packed_zp`).
    n, k : int
    block_size : int
        Must be 32 (:class:`~olv_runtime.errors.InvalidArgument` otherwise).
    """
    n = check_int(n, "n", lo=1)
    k = check_int(k, "k", lo=1)
    block_size = check_int(block_size, "block_size")
    if block_size != BLOCK:
        raise InvalidArgument(f"block_size: expected {BLOCK} for the int8-dot packed INT4 "
                              f"layout, got {block_size}")
    if zero_point is not None:
        raise InvalidArgument("zero_point: the int8-dot packed INT4 layout supports symmetric "
                              "weights only (zero_point None), got an array")
    check_array(payload, "payload", dtype=np.uint8, ndim=1)
    need = (n * k + 1) // 2
    if payload.shape[0] < need:
        raise InvalidArgument(f"payload: expected at least {need} bytes for [{n}, {k}] INT4 "
                              f"codes, got {payload.shape[0]}")
    kb = -(-k // BLOCK)
    check_array(scale, "scale", dtype=(np.float32, np.float16), shape=(n, kb))
    ng = -(-n // GROUP_ROWS)
    codes = weight_empty((ng, kb, GROUP_BLOCK_BYTES), np.uint8)
    # float16 scales stay float16 (as uint16 bits): 4.5 bits per weight, like Q4_0
    sdt = np.uint16 if scale.dtype == np.float16 else np.float32
    pscale = weight_empty((ng, kb, GROUP_ROWS), sdt)
    prepack(payload, scale_bits(scale), n, k, codes, pscale)
    return PackedInt4I8(codes, pscale, n, k)


# ------------------------------------------------------------------------------------------------
# activation quantization (packed.quantize_block's operations, int8 output)
# ------------------------------------------------------------------------------------------------
@njit(**JIT)
def quantize_rows_i8(x, m, k, kb, xq, xd, xs8):
    kx = xq.shape[1]
    kbx = xd.shape[1]
    for i in range(m):
        for b in range(kb):
            k0 = b * BLOCK
            ln = min(BLOCK, k - k0)
            if ln == BLOCK:  # full block: vector code (same operations)
                _quant_block(x, i * k + k0, xq, i * kx + k0, xd, xs8, i * kbx + b)
                continue
            d, tot = quantize_block(x, i, k0, ln, xq)
            xd[i, b] = d
            xs8[i, b] = np.int32(8 * tot)


# ------------------------------------------------------------------------------------------------
# serial group kernel
# ------------------------------------------------------------------------------------------------
def _emit_block_dot(context, builder, sig, args, nrows):
    """IR: per activation row r, the int32 lanes (8 output rows) of sum_{j<32} u * xq over one
    (group, block). Both instruction paths give the exact integer sums (bitwise equal)."""
    codes, cb, xq = args[0], args[1], args[2]
    xos = args[3:3 + nrows]
    vnni = args[3 + nrows]
    aty = sig.args
    lo, hi = [], []
    m0f = ir.Constant(_LV32I8, [0x0F] * 32)
    for c in range(4):
        off = builder.add(cb, ir.Constant(cb.type, 32 * c))
        v = builder.load(elem_ptr(context, builder, aty[0], codes, off, _LV32I8), align=1)
        lo.append(builder.and_(v, m0f))
        vh = builder.bitcast(builder.lshr(builder.bitcast(v, _LV16I16),
                                          ir.Constant(_LV16I16, [4] * 16)), _LV32I8)
        hi.append(builder.and_(vh, m0f))
    xs = []
    for r in range(nrows):
        row = []
        for c in range(4):
            for half in (0, 16):
                off = builder.add(xos[r], ir.Constant(xos[r].type, half + 4 * c))
                p = elem_ptr(context, builder, aty[2], xq, off, _I32)
                row.append(builder.bitcast(splat(builder, builder.load(p, align=1), _LV8I32),
                                           _LV32I8))
        xs.append(row)

    def avx2():
        mub = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_LV16I16, [_LV32I8, _LV32I8]),
            "llvm.x86.avx2.pmadd.ub.sw")
        mwd = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_LV8I32, [_LV16I16, _LV16I16]),
            "llvm.x86.avx2.pmadd.wd")
        ones = ir.Constant(_LV16I16, [1] * 16)
        out = []
        for r in range(nrows):
            s16 = None
            for c in range(4):
                for h, u in enumerate((lo[c], hi[c])):
                    t = builder.call(mub, [u, xs[r][2 * c + h]])
                    s16 = t if s16 is None else builder.add(s16, t)
            out.append(builder.call(mwd, [s16, ones]))
        return out

    def avx512vnni():
        dp = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_LV8I32, [_LV8I32, _LV32I8, _LV32I8]),
            "llvm.x86.avx512.vpdpbusd.256")
        out = []
        for r in range(nrows):
            # two independent chains of 4 (chunks 0, 2 and 1, 3), summed: the same integers
            acc = [ir.Constant(_LV8I32, [0] * 8), ir.Constant(_LV8I32, [0] * 8)]
            for c in range(4):
                for h, u in enumerate((lo[c], hi[c])):
                    acc[c & 1] = builder.call(dp, [acc[c & 1], u, xs[r][2 * c + h]])
            out.append(builder.add(acc[0], acc[1]))
        return out

    if HOST_VNNI:
        pred = builder.icmp_unsigned("!=", vnni, ir.Constant(vnni.type, 0))
        with builder.if_else(pred) as (then, otherwise):
            with then:
                r_v = avx512vnni()
                b_v = builder.block
            with otherwise:
                r_a = avx2()
                b_a = builder.block
        res = []
        for x1, x2 in zip(r_v, r_a):
            phi = builder.phi(_LV8I32)
            phi.add_incoming(x1, b_v)
            phi.add_incoming(x2, b_a)
            res.append(phi)
    else:  # the VNNI instruction cannot even be compiled here
        res = avx2()
    return context.make_tuple(builder, sig.return_type, res)


def _block_dot_typer(nrows, codes, xq, rest):
    """Signature of the block-dot intrinsics: (codes, cb, xq, xo_0..xo_{n-1}, vnni) ->
    UniTuple(int32 x 8, n)."""
    if not (check_array_arg(codes, types.uint8) and check_array_arg(xq, types.int8)
            and len(rest) == nrows + 1):
        return None
    return types.UniTuple(V8I32, nrows)(codes, types.intp, xq, *([types.intp] * nrows),
                                        types.boolean)


@intrinsic
def dot_r1(typingctx, codes, cb, xq, xo0, vnni):
    """Exact int32 block sums of one activation row (see :func:`_emit_block_dot`); ``vnni``
    selects vpdpbusd (if the host has it) or vpmaddubsw + vpaddw + vpmaddwd."""
    sig = _block_dot_typer(1, codes, xq, (xo0, vnni))
    return sig, (lambda context, builder, sig, args:
                 _emit_block_dot(context, builder, sig, args, 1))


@intrinsic
def dot_r2(typingctx, codes, cb, xq, xo0, xo1, vnni):
    """As :func:`dot_r1` for two activation rows sharing the decoded codes."""
    sig = _block_dot_typer(2, codes, xq, (xo0, xo1, vnni))
    return sig, (lambda context, builder, sig, args:
                 _emit_block_dot(context, builder, sig, args, 2))


@intrinsic
def dot_r4(typingctx, codes, cb, xq, xo0, xo1, xo2, xo3, vnni):
    """As :func:`dot_r1` for four activation rows sharing the decoded codes."""
    sig = _block_dot_typer(4, codes, xq, (xo0, xo1, xo2, xo3, vnni))
    return sig, (lambda context, builder, sig, args:
                 _emit_block_dot(context, builder, sig, args, 4))


@intrinsic
def _block_acc32(typingctx, acc, s32, s8, scale, soff, d):
    """``acc + float32(s32 - s8) * (scale[soff:soff+8] * d)`` (lane = row): the float operations
    of the int8 block accumulation on exact int32 block sums."""
    if acc != V8F32 or s32 != V8I32 or not is_scale_array(scale):
        return None

    def codegen(context, builder, sig, args):
        a, i32, sx, sc, so, dd = args
        sx = context.cast(builder, sx, sig.args[2], types.int32)
        i32 = builder.sub(i32, splat(builder, sx, _LV8I32))
        f = builder.sitofp(i32, _LV8F32)
        ws = load_scales8(context, builder, sig.args[3], sc, so)
        dd = context.cast(builder, dd, sig.args[5], types.float32)
        v = builder.fmul(ws, splat(builder, dd, _LV8F32))
        return builder.fadd(a, builder.fmul(f, v))
    return V8F32(V8F32, V8I32, types.int32, scale, types.intp, types.float32), codegen


@njit(**JIT)
def store_group(acc, facc, g, i, n, out):
    """Write the 8 rows of group g of activation row i (partial last group through facc)."""
    r0 = g * GROUP_ROWS
    if r0 + GROUP_ROWS <= n:
        fstore(out, i * n + r0, acc)
    else:
        fstore(facc, 0, acc)
        for r in range(n - r0):
            out[i, r0 + r] = facc[0, r]


@njit(**JIT)
def prefetch_block(codes, scale, base, b):
    if PF_BYTES > 0:
        cb = (base + b) * GROUP_BLOCK_BYTES
        prefetch(codes, cb + PF_BYTES)
        prefetch(codes, cb + PF_BYTES + 64)
        prefetch(scale, (base + b) * GROUP_ROWS + PF_BYTES // 4)
    if PF2_BYTES > 0:
        cb = (base + b) * GROUP_BLOCK_BYTES
        _prefetch_l2(codes, cb + PF2_BYTES)
        _prefetch_l2(codes, cb + PF2_BYTES + 64)


@njit(**JIT)
def group_r1(codes, scale, g, xq, xd, xs8, i0, n, out, facc, vnni):
    """Group g (8 output rows) of activation row i0; accumulator in a register."""
    kb = codes.shape[1]
    xr = i0 * xq.shape[1]
    base = g * kb
    acc = fzero()
    for b in range(kb):
        prefetch_block(codes, scale, base, b)
        s = dot_r1(codes, (base + b) * GROUP_BLOCK_BYTES, xq, xr + b * BLOCK, vnni)
        acc = _block_acc32(acc, s[0], xs8[i0, b], scale, (base + b) * GROUP_ROWS, xd[i0, b])
    store_group(acc, facc, g, i0, n, out)


@njit(**JIT)
def group_r2(codes, scale, g, xq, xd, xs8, i0, n, out, facc, vnni):
    """Group g of activation rows i0, i0+1: each code chunk decoded once, accumulators in
    registers."""
    kb = codes.shape[1]
    kx = xq.shape[1]
    x0 = i0 * kx
    x1 = x0 + kx
    base = g * kb
    a0 = fzero()
    a1 = fzero()
    for b in range(kb):
        prefetch_block(codes, scale, base, b)
        xo = b * BLOCK
        s = dot_r2(codes, (base + b) * GROUP_BLOCK_BYTES, xq, x0 + xo, x1 + xo, vnni)
        so = (base + b) * GROUP_ROWS
        a0 = _block_acc32(a0, s[0], xs8[i0, b], scale, so, xd[i0, b])
        a1 = _block_acc32(a1, s[1], xs8[i0 + 1, b], scale, so, xd[i0 + 1, b])
    store_group(a0, facc, g, i0, n, out)
    store_group(a1, facc, g, i0 + 1, n, out)


@njit(**JIT)
def group_r4(codes, scale, g, xq, xd, xs8, i0, n, out, facc, vnni):
    """Group g of activation rows i0..i0+3: each code chunk decoded once, accumulators in
    registers."""
    kb = codes.shape[1]
    kx = xq.shape[1]
    x0 = i0 * kx
    x1 = x0 + kx
    x2 = x1 + kx
    x3 = x2 + kx
    base = g * kb
    a0 = fzero()
    a1 = fzero()
    a2 = fzero()
    a3 = fzero()
    for b in range(kb):
        prefetch_block(codes, scale, base, b)
        xo = b * BLOCK
        s = dot_r4(codes, (base + b) * GROUP_BLOCK_BYTES, xq, x0 + xo, x1 + xo, x2 + xo,
                   x3 + xo, vnni)
        so = (base + b) * GROUP_ROWS
        a0 = _block_acc32(a0, s[0], xs8[i0, b], scale, so, xd[i0, b])
        a1 = _block_acc32(a1, s[1], xs8[i0 + 1, b], scale, so, xd[i0 + 1, b])
        a2 = _block_acc32(a2, s[2], xs8[i0 + 2, b], scale, so, xd[i0 + 2, b])
        a3 = _block_acc32(a3, s[3], xs8[i0 + 3, b], scale, so, xd[i0 + 3, b])
    store_group(a0, facc, g, i0, n, out)
    store_group(a1, facc, g, i0 + 1, n, out)
    store_group(a2, facc, g, i0 + 2, n, out)
    store_group(a3, facc, g, i0 + 3, n, out)


@njit(**JIT)
def groups(codes, scale, g0, g1, xq, xd, xs8, m, n, out, facc, vnni):
    """Groups g0..g1-1 of ``out[:m]``: activation rows in chunks of 4, 2, 1 per group (the
    group's codes, <= 128 * KB bytes, are re-read from L1/L2 by later chunks, not from DRAM).
    ``facc``: float32 [>= 1, 8] scratch of this task (partial last group)."""
    for g in range(g0, g1):
        i0 = np.int64(0)  # not Literal[int](0): one specialisation of the callees
        while m - i0 >= 4:
            group_r4(codes, scale, g, xq, xd, xs8, i0, n, out, facc, vnni)
            i0 += 4
        if m - i0 >= 2:
            group_r2(codes, scale, g, xq, xd, xs8, i0, n, out, facc, vnni)
            i0 += 2
        if m - i0 >= 1:
            group_r1(codes, scale, g, xq, xd, xs8, i0, n, out, facc, vnni)


# ------------------------------------------------------------------------------------------------
# drivers
# ------------------------------------------------------------------------------------------------
@njit(**JIT)
def prefetch_task_head(codes, scale, g0, g1, nstreams, pf):
    """Prefetch the first ``pf`` codes bytes (and the matching scales) of each of the first
    ``nstreams`` groups of ``[g0, g1)``: the part of a task's streams that the group loops'
    own prefetch (``pf`` ahead) never covers. Issued when a task starts, so the DRAM latency
    of its first blocks overlaps instead of stalling each stream in turn."""
    kb = codes.shape[1]
    gsc = kb * GROUP_BLOCK_BYTES
    gss = kb * GROUP_ROWS
    nb = min(pf, gsc)
    for g in range(g0, min(g1, g0 + nstreams)):
        for off in range(0, nb, 64):
            prefetch(codes, g * gsc + off)
        for off in range(0, nb // GROUP_BLOCK_BYTES * GROUP_ROWS, 64 // scale.itemsize):
            prefetch(scale, g * gss + off)

@njit(**PJIT)
def linear_par(x, m, k, codes, scale, n, out, ntmax, xq, xd, xs8, facc, vnni):
    """``min(ntmax, groups)`` tasks."""
    kb = codes.shape[1]
    quantize_rows_i8(x, m, k, kb, xq, xd, xs8)
    ng = codes.shape[0]
    ntasks = min(ntmax, ng)
    for task in prange(ntasks):
        g0 = task * ng // ntasks
        g1 = (task + 1) * ng // ntasks
        prefetch_task_head(codes, scale, g0, g1, 1, PF_BYTES)
        groups(codes, scale, g0, g1, xq, xd, xs8, m, n, out, facc[task], vnni)


@njit(**JIT)
def linear_ser(x, m, k, codes, scale, n, out, xq, xd, xs8, facc, vnni):
    kb = codes.shape[1]
    quantize_rows_i8(x, m, k, kb, xq, xd, xs8)
    groups(codes, scale, np.int64(0), codes.shape[0], xq, xd, xs8, m, n, out, facc,
           vnni)  # not literal


#: Old names of the shared helpers above, still used outside the packed kernel modules
#: (kernels/decoder_layers.py, executor/decoder_step.py, tests/test_decoder_stack.py).
_aligned_empty = aligned_empty
_groups = groups
_prefetch = prefetch
_quantize_rows_i8 = quantize_rows_i8
