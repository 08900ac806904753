"""Options of an :class:`~olv_runtime.executor.session.InferenceSession` (:class:`SessionOptions`),
each field checked when the options are made."""
from __future__ import annotations

import dataclasses
import math

import numba
import numpy as np

from olv_runtime.errors import InvalidArgument


@dataclasses.dataclass
class SessionOptions:
    """Options of :class:`InferenceSession`.

    Attributes
    ----------
    num_threads : int or None
        numba threads for parallel kernels (None: numba's default, the core count).
    enable_fusion : bool
        Fuse Decode/Transpose/MatMul and Decode/Gather (default True). With False every
        ``olv.Decode`` materialises its tensor (counted in ``bytes_dequantized``): a reference
        mode for tests.
    prepack : bool
        Repack INT4 block-32 linear weights once into the 8-row group layout of
        :mod:`olv_runtime.kernels.packed_i8` (default True; a layout change only, the values are
        those of the encoded initializer).
    quantize_activations : bool
        Quantize activations per 32-block to int8 for integer dot products in the INT4 linear
        layers (as llama.cpp and onnxruntime accuracy level 4 do). Faster, approximate: off by
        default; see :mod:`olv_runtime.kernels.packed` for the tolerance.
    compiled_decode : bool
        Run the decoder layers of a one-token call as one compiled step (default True; see
        :mod:`olv_runtime.executor.decoder_step`): no Python per operator, one parallel region per token.
        Plans of another form, and calls of several tokens, run operator by operator.
    kv_initial_capacity : int
        Tokens of a newly allocated contiguous KV capacity buffer (at least what the call needs).
    kv_growth : float
        Capacity multiplier when a KV buffer is outgrown (the prefix is copied once then);
        finite, > 1 and <= 16.
    use_compiled : bool
        Use the model's seed 004 compiled entries (persisted prepacked weights) where every
        loading rule holds (default True); False repacks every weight from its source.

    Raises
    ------
    InvalidArgument
        A flag that is not a bool; num_threads not an int in numba's pool; kv_initial_capacity
        not an int in [0, :data:`MAX_KV_CAPACITY`]; kv_growth not a number in
        (1, :data:`MAX_KV_GROWTH`].
    """

    num_threads: int | None = None
    enable_fusion: bool = True
    prepack: bool = True
    quantize_activations: bool = False
    compiled_decode: bool = True
    kv_initial_capacity: int = 256
    kv_growth: float = 2.0
    use_compiled: bool = True

    def __post_init__(self):
        for name in ("enable_fusion", "prepack", "quantize_activations", "compiled_decode",
                     "use_compiled"):
            v = getattr(self, name)
            if not isinstance(v, (bool, np.bool_)):
                raise InvalidArgument(
                    f"SessionOptions.{name} must be a bool (True or False), got "
                    f"{type(v).__name__} {v!r}")
        if self.num_threads is not None:
            most = int(numba.config.NUMBA_NUM_THREADS)
            _check_int("num_threads", self.num_threads, 1, most,
                       "numba's thread pool on this machine")
        _check_int("kv_initial_capacity", self.kv_initial_capacity, 0, MAX_KV_CAPACITY,
                   "tokens of a new contiguous KV buffer")
        v = self.kv_growth
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer,
                                                                 np.floating)):
            raise InvalidArgument(
                f"SessionOptions.kv_growth must be a finite number in (1, {MAX_KV_GROWTH:g}], "
                f"got {type(v).__name__} {v!r}")
        growth = float(v)
        if not (math.isfinite(growth) and 1.0 < growth <= MAX_KV_GROWTH):
            raise InvalidArgument(
                f"SessionOptions.kv_growth must be a finite number in (1, {MAX_KV_GROWTH:g}] "
                f"(the capacity multiplier when a KV buffer is outgrown), got {v!r}")


#: Upper bounds of :class:`SessionOptions` fields: a KV buffer of more tokens, or a growth
#: factor beyond this, only fails later (allocation, "maximum allowed dimension exceeded").
MAX_KV_CAPACITY = 1 << 24
MAX_KV_GROWTH = 16.0


def _check_int(name: str, v, lo: int, hi: int, what: str) -> None:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise InvalidArgument(
            f"SessionOptions.{name} must be an int in [{lo}, {hi}] ({what}), got "
            f"{type(v).__name__} {v!r}")
    if not lo <= int(v) <= hi:
        raise InvalidArgument(
            f"SessionOptions.{name} must be in [{lo}, {hi}] ({what}), got {v}")
