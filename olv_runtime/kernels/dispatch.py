"""The linear-kernel modes of the packed INT4 / ggml family.

:class:`LinearMode` names what a linear step of the executor really distinguishes: whether its
weight is prepacked at all, and if so how the activations enter the dot products (int8-quantized
or float32) and on which packed family (8-row INT4 groups, ggml group records) -- the family
fixes the workspace class, so linears of one mode share one workspace.
"""
from __future__ import annotations

import enum

__all__ = ["LinearMode"]


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
        ggml blocks (Q8_0, Q5_0, Q4_K, Q6_K) in group records (:mod:`.ggml_packed`), int8
        activations.
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
