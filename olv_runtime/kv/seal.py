"""Seal policies of the paged KV cache (:mod:`olv_runtime.kv.paged`): which format a sealed
block takes by its age, and the ``olv convert --kv`` presets.

A policy is a string per side, ``"fmt[:count],...,fmt"``, newest sealed block first: e.g.
``float32:2,int8:6,int4`` keeps the 2 newest sealed blocks float32, the next 6 INT8, the rest
INT4 (formats: :data:`~olv_runtime.kernels.paged_attention.FORMAT_CODES`).
"""
from __future__ import annotations

import dataclasses

from olv_runtime.errors import InvalidArgument
from olv_runtime.kernels import paged_attention as pk

__all__ = ["PRESETS", "SealPolicy"]

#: ``olv convert --kv`` presets -> seal policy spec (see :class:`SealPolicy`).
PRESETS = {
    "paged": "float32",
    "paged-int8": "int8",
    "paged-f16": "float16",
    "paged-int4": "int4",
    "paged-mixed": "float32:2,int8:6,int4",
}
#: Formats of the open (newest, not yet full) block.
_DENSE = ("float32", "float16")


def _parse_side(spec: str, what: str) -> tuple:
    """``"fmt[:count],...,fmt"`` -> ((format, count or None), ...), newest stage first.

    Raises
    ------
    InvalidArgument
        An empty spec, an unknown format, a negative count, a count missing before the last stage.
    """
    stages = []
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise InvalidArgument(f"{what}: empty seal policy")
    for k, part in enumerate(parts):
        name, _, count = part.partition(":")
        name = name.strip()
        if name not in pk.FORMAT_CODES:
            raise InvalidArgument(f"{what}: unknown block format {name!r}; formats: "
                                  f"{sorted(pk.FORMAT_CODES)}")
        last = k == len(parts) - 1
        if count:
            n = int(count)
            if n < 0:
                raise InvalidArgument(f"{what}: negative block count in {part!r}")
            stages.append((name, n))
        elif not last:
            raise InvalidArgument(f"{what}: only the last stage may omit its block count ({spec!r})")
        else:
            stages.append((name, None))
    if stages[-1][1] is not None:
        stages[-1] = (stages[-1][0], None)  # the last stage covers every older block
    return tuple(stages)


@dataclasses.dataclass(frozen=True)
class SealPolicy:
    """Which format a sealed block takes, by age (0 = the newest sealed block).

    Parameters
    ----------
    key, value : str
        ``"fmt[:count],fmt[:count],...,fmt"``, newest first; the last stage has no count (it
        covers all older blocks). Formats: float32, float16, int8, int4, codebook2.
    open_format : {"float32", "float16"}
        Format of the newest (open, not yet full) block.
    scales : {"token", "block"}
        INT8/INT4 scales per token and head, or per block and head.

    Raises
    ------
    InvalidArgument
        Unknown formats, a count on the last stage missing elsewhere, a quantized open format.
    """

    key: str = "float32"
    value: str = ""
    open_format: str = "float32"
    scales: str = "token"

    def __post_init__(self):
        object.__setattr__(self, "value", self.value or self.key)
        if self.open_format not in _DENSE:
            raise InvalidArgument(f"open_format: expected float32 or float16, got {self.open_format!r}")
        if self.scales not in ("token", "block"):
            raise InvalidArgument(f"scales: expected 'token' or 'block', got {self.scales!r}")
        object.__setattr__(self, "_k", _parse_side(self.key, "key policy"))
        object.__setattr__(self, "_v", _parse_side(self.value, "value policy"))

    @property
    def horizon(self) -> int:
        """Ages beyond which the format no longer changes."""
        return max(sum(n for _, n in s[:-1]) for s in (self._k, self._v))

    def format_for(self, age: int) -> tuple[str, str]:
        """(key format, value format) of a sealed block of this age."""
        return _stage(self._k, age), _stage(self._v, age)


def _stage(stages, age: int) -> str:
    """The format of a sealed block of ``age`` (0 = newest) under parsed ``stages``."""
    for name, n in stages:
        if n is None or age < n:
            return name
        age -= n
    return stages[-1][0]
