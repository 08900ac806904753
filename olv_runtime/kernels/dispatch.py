"""One dispatch for the packed INT4 / ggml linear kernels: ``dispatch(isa, mode, format)``.

:class:`LinearMode` names what a linear step of the executor really distinguishes: whether its
weight is prepacked at all, and if so how the activations enter the dot products (int8-quantized
or float32) and on which packed family (8-row INT4 groups, ggml group records) -- the family
fixes the workspace class, so linears of one mode share one workspace. :class:`WeightFormat`
names the prepacked weight's class; :func:`dispatch` returns the kernel serving an
(ISA, mode, format) and its workspace factory, or raises for a combination nothing serves.
"""
from __future__ import annotations

import enum
from typing import Callable, NamedTuple

from olv_runtime.errors import InvalidArgument
from olv_runtime.lazy import lazy_module

from . import packed_f32, packed_i8, packed_i8_gemm

packed_zp = lazy_module("olv_runtime.kernels.packed_zp")  # zero-point weights only (warm start)
ggml_packed = lazy_module("olv_runtime.kernels.ggml_packed")  # GGUF block weights only

__all__ = ["LinearMode", "WeightFormat", "LinearKernel", "ISAS", "dispatch", "supported"]


class LinearMode(enum.Enum):
    """How a linear step runs ``y = x @ W.T``.

    Members
    -------
    FLOAT
        No prepacked weight: a dense float32 weight (BLAS) or the row-major INT4 kernel
        (:func:`~olv_runtime.kernels.linear.linear_int4`, any block size).
    INT8
        INT4 block-32 weights in 8-row groups (:mod:`.packed_i8`; with zero points
        :mod:`.packed_zp`), activations quantized to int8 per 32-block, exact integer block sums.
    EXACT
        The same INT4 8-row groups with float32 activations (:mod:`.packed_f32`; on AVX-512 VNNI
        the exact int8-digit path of :mod:`.packed_f32_vnni`).
    GGML_INT8
        ggml blocks (Q8_0, Q5_0, Q4_1, Q5_1, Q4_K, Q5_K, Q6_K) in group records
        (:mod:`.ggml_packed`), int8 activations.
    GGML_EXACT
        The ggml group records with float32 activations.
    """

    FLOAT = "float"
    INT8 = "int8"
    EXACT = "exact"
    GGML_INT8 = "ggml-int8"
    GGML_EXACT = "ggml-exact"

    @property
    def packed(self) -> bool:
        """True for the modes that run a prepacked weight (all but :attr:`FLOAT`)."""
        return self is not LinearMode.FLOAT

    @property
    def quantized(self) -> bool:
        """True for the modes that quantize the activations to int8."""
        return self in (LinearMode.INT8, LinearMode.GGML_INT8)


class WeightFormat(enum.Enum):
    """The prepacked weight format a linear kernel reads (the packed class of the weight).

    Members
    -------
    INT4
        Symmetric blocked INT4 in 8-row groups (:class:`~.packed_i8.PackedInt4I8`).
    INT4_ZP
        The same layout with one zero point per (row, block) (:class:`~.packed_zp.PackedInt4I8Zp`).
    GGML
        ggml blocks in group records (:class:`~.ggml_packed.GGMLPacked`; every kind).
    """

    INT4 = "olv.PackedInt4I8"
    INT4_ZP = "olv.PackedInt4I8Zp"
    GGML = "ggml"


#: Instruction-set paths of :func:`~.packed_i8.isa`. Every kernel below serves both: it computes
#: the same exact integer sums on either path and takes ``vpdpbusd`` where the CPU has AVX-512
#: VNNI (chosen per call), so an entry does not depend on the ISA beyond its being supported.
ISAS = ("avx2", "avx512vnni")


class LinearKernel(NamedTuple):
    """A packed linear kernel and the factory of its workspace.

    Attributes
    ----------
    name : str
        What :attr:`LinearStep.kernel <olv_runtime.executor.steps.LinearStep>` reports; for ggml
        weights it holds ``{kind}``, the ggml type name (``name.format(kind="Q8_0")``).
    fn : callable
        ``fn(x, packed, out=None, workspace=None) -> out``: ``x`` float32 [M, K], ``out``
        float32 [M, N]; raises :class:`~olv_runtime.errors.InvalidArgument` on a wrong argument.
    make_workspace : callable
        ``make_workspace(m_max, k_max, n_tasks=None)``: the buffers ``fn`` takes as
        ``workspace`` (one workspace serves every weight of the mode with ``K <= k_max``).
    """

    name: str
    fn: Callable
    make_workspace: Callable


def _table() -> dict:
    """(mode, format) -> LinearKernel; the zero-point and ggml modules are imported only when
    their entry is asked for (warm start)."""
    return {
        (LinearMode.INT8, WeightFormat.INT4): lambda: LinearKernel(
            "packed_i8", packed_i8_gemm.linear_packed_i8, packed_i8.make_workspace_i8),
        (LinearMode.EXACT, WeightFormat.INT4): lambda: LinearKernel(
            "packed_i8_exact", packed_f32.linear_packed_i8_exact, packed_f32.make_workspace_f32),
        (LinearMode.INT8, WeightFormat.INT4_ZP): lambda: LinearKernel(
            "packed_i8_zp", packed_zp.linear_packed_i8_zp, packed_i8.make_workspace_i8),
        (LinearMode.EXACT, WeightFormat.INT4_ZP): lambda: LinearKernel(
            "packed_i8_exact_zp", packed_zp.linear_packed_i8_exact_zp,
            packed_f32.make_workspace_f32),
        (LinearMode.GGML_INT8, WeightFormat.GGML): lambda: LinearKernel(
            "ggml_{kind}_i8", ggml_packed.linear_ggml_i8, ggml_packed.make_workspace_ggml),
        (LinearMode.GGML_EXACT, WeightFormat.GGML): lambda: LinearKernel(
            "ggml_{kind}_exact", ggml_packed.linear_ggml_exact, ggml_packed.make_workspace_ggml),
    }


_TABLE = _table()


def supported() -> list[tuple[str, LinearMode, WeightFormat]]:
    """Every (isa, mode, format) combination :func:`dispatch` serves."""
    return [(isa, mode, fmt) for isa in ISAS for (mode, fmt) in _TABLE]


def dispatch(isa: str, mode: LinearMode, fmt: WeightFormat) -> LinearKernel:
    """The linear kernel (and its workspace factory) for an ISA, a mode and a weight format.

    Parameters
    ----------
    isa : str
        An instruction-set path of :func:`~.packed_i8.isa` (``"avx2"``, ``"avx512vnni"``).
    mode : LinearMode
        A packed mode (not :attr:`LinearMode.FLOAT`, which runs no packed kernel).
    fmt : WeightFormat
        The prepacked weight's format.

    Returns
    -------
    LinearKernel
        ``(name, fn, make_workspace)``.

    Raises
    ------
    InvalidArgument
        An unknown ISA, mode or format, or a combination no kernel serves (the message lists the
        supported ones).
    """
    if isa not in ISAS:
        raise InvalidArgument(f"isa: expected one of {list(ISAS)}, got {isa!r}")
    if not isinstance(mode, LinearMode):
        raise InvalidArgument(f"mode: expected a LinearMode, got {mode!r}")
    if not isinstance(fmt, WeightFormat):
        raise InvalidArgument(f"fmt: expected a WeightFormat, got {fmt!r}")
    make = _TABLE.get((mode, fmt))
    if make is None:
        have = ", ".join(f"({m.name}, {f.name})" for m, f in _TABLE)
        raise InvalidArgument(f"no linear kernel for mode {mode.name} on {fmt.name} weights "
                              f"(isa {isa}); supported (mode, format): {have}")
    return make()
