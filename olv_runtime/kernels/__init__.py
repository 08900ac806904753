"""Numba CPU kernels of olv_runtime.

Three tiers per kernel: serial ``@njit`` inner kernels, ``@njit(parallel=True)`` drivers, and
the public wrappers re-exported here, which validate their arguments (raising
:class:`olv_runtime.errors.InvalidArgument`), allocate the output when ``out`` is None, and call
the jitted code. Compilation flags and the threading layer live in :mod:`.config`.
"""
from .activations import silu_mul
from .affine import dequantize_affine, gather_rows_int4, unpack_codes
from .attention import append_kv, attention, kv_write, rope_attention
from .config import JIT, PJIT, get_num_threads, set_num_threads, threading_layer
from .dispatch import LinearMode
from .linear import linear_f32, linear_int4
from .norm import rms_norm
from .rope import rotary_embedding

__all__ = [
    "JIT", "PJIT", "set_num_threads", "get_num_threads", "threading_layer",
    "unpack_codes", "dequantize_affine", "gather_rows_int4",
    "linear_int4", "linear_f32", "LinearMode",
    "rms_norm", "rotary_embedding",
    "attention", "append_kv", "kv_write", "rope_attention", "silu_mul",
]
