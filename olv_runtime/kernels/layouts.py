"""The packed weight layouts the prepackers produce, described for persistence (seed 004).

A compiled entry (``CompiledTensorProto``) stores a prepacked weight as one struct-typed record
whose fields are the arrays of the packed object. This module is the one place that says, for
each packed class of :mod:`olv_runtime.kernels`, which attributes are arrays (stored as tensor
fields, in this order) and which are integers (stored as constant fields), how many output rows
make one step of the leading axis (so that per-weight parts can be concatenated along N into the
merged sibling weights the session builds), and which CPU architecture the kernels need.

:data:`PACKED_LAYOUT_VERSION` is the ``runtime_version`` of every device entry olv_runtime writes.
**Bump it on any change of a packed layout** (array order, element order inside an array,
padding, dtypes) or of the meaning of a packed field: an entry whose version differs is a cache
miss, so a stale layout can never be read as the new one.

Source: seed 004 "CompiledTensorProto" (DeviceProto, physical type identity).
"""
from __future__ import annotations

import dataclasses
import inspect
import platform

import llvmlite.binding as llvm
import numpy as np

from olv_runtime.kernels.packed_i8 import GROUP_BLOCK_BYTES, GROUP_ROWS, PackedInt4I8
from olv_runtime.lazy import lazy_module

packed_zp = lazy_module("olv_runtime.kernels.packed_zp")  # zero-point weights only (warm start)

__all__ = ["PACKED_LAYOUT_VERSION", "PackedLayout", "LAYOUTS", "layout_of", "layout_named",
           "cpu_architecture", "cpu_features"]

#: Version of every packed layout below (DeviceProto.runtime_version of compiled entries).
#: Bump on any layout change.
#: "2": the 8-row layout keeps float16 block scales as their uint16 bits (was float32 only).
PACKED_LAYOUT_VERSION = "2"


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """How one packed class is persisted.

    Attributes
    ----------
    name : str
        Physical type name (``StructTypeProto.name`` of compiled values), e.g.
        ``"olv.PackedInt4I8"``.
    cls : type
        The packed class (``PackedInt4I8``, ``PackedInt4I8Zp``).
    arrays : tuple of str
        Constructor parameters that are arrays, in stored order. Axis 0 of each is the
        row-group axis.
    ints : tuple of str
        Constructor parameters that are integers (``n``, ``k``).
    rows_per_group : int
        Output rows per step of axis 0: parts whose ``n`` is a multiple of it concatenate along
        axis 0 into the packed form of the rows concatenated (the sibling merge).
    shapes : callable
        ``shapes(n, k, has_zero_point, scale_dtype=float32) -> {array name: (dtype, shape)}``:
        what the prepacker produces for an ``[N, K]`` weight whose block scales have
        ``scale_dtype`` (a compiled entry must match it exactly).
    """

    name: str
    cls: type
    arrays: tuple
    ints: tuple
    rows_per_group: int
    shapes: object

    def parts(self, packed) -> tuple[dict, dict]:
        """(arrays by name, ints by name) of a packed object of this layout."""
        return ({a: getattr(packed, a) for a in self.arrays},
                {i: int(getattr(packed, i)) for i in self.ints})

    def build(self, arrays: dict, ints: dict):
        """The packed object from its arrays and ints (no copy)."""
        return self.cls(**arrays, **{k: int(v) for k, v in ints.items()})

    def concat_rows(self, parts: list, arrays: list[dict] | None = None):
        """Merge packed parts along N (each part's ``n`` a multiple of ``rows_per_group`` except
        possibly the last). ``arrays`` optionally gives the merged arrays already made (views)."""
        if arrays is None:
            arrays = {a: np.concatenate([getattr(p, a) for p in parts], axis=0)
                      for a in self.arrays}
        ints = {"n": sum(int(p.n) for p in parts), "k": int(parts[0].k)}
        return self.build(arrays, ints)


def _i8_layout(name: str, zp: bool) -> PackedLayout:
    cls = packed_zp.PackedInt4I8Zp if zp else PackedInt4I8

    def shapes(n, k, has_zp, scale_dtype=np.float32):
        ng, kb = -(-n // GROUP_ROWS), -(-k // 32)
        sdt = np.uint16 if np.dtype(scale_dtype) == np.float16 else np.float32  # float16 bits
        out = {"codes": (np.uint8, (ng, kb, GROUP_BLOCK_BYTES)),
               "scale": (sdt, (ng, kb, GROUP_ROWS))}
        if zp:
            out["zp"] = (np.uint8, out["scale"][1])
        return out

    return _layout_of_class(name, cls, GROUP_ROWS, shapes)


def _layout_of_class(name, cls, rows, shapes) -> PackedLayout:
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    ints = tuple(p for p in params if p in ("n", "k"))
    arrays = tuple(p for p in params if p not in ints)
    return PackedLayout(name, cls, arrays, ints, rows, shapes)


#: physical type name -> (module of the packed class, class name, layout factory); a layout is
#: built (and its kernel module imported) only when a session or ``olv compile`` asks for it
_SPECS = {
    "olv.PackedInt4I8": ("olv_runtime.kernels.packed_i8", "PackedInt4I8",
                         lambda name: _i8_layout(name, False)),
    "olv.PackedInt4I8Zp": ("olv_runtime.kernels.packed_zp", "PackedInt4I8Zp",
                           lambda name: _i8_layout(name, True)),
}
_BUILT: dict = {}


def _layout(name: str) -> PackedLayout | None:
    got = _BUILT.get(name)
    if got is None and name in _SPECS:
        got = _BUILT[name] = _SPECS[name][2](name)
    return got


def _layouts() -> dict:
    return {name: _layout(name) for name in _SPECS}


class _LayoutsView:
    def __getitem__(self, name):
        got = _layout(name)
        if got is None:
            raise KeyError(name)
        return got

    def get(self, name, default=None):
        got = _layout(name)
        return default if got is None else got

    def __contains__(self, name):
        return name in _SPECS

    def __iter__(self):
        return iter(_SPECS)

    def values(self):
        return _layouts().values()


#: Physical type name -> :class:`PackedLayout` (built on first use).
LAYOUTS = _LayoutsView()


def layout_of(packed) -> PackedLayout | None:
    """The layout of a packed object (None for an unknown class)."""
    cls = type(packed)
    for name, (module, cname, _) in _SPECS.items():
        if cls.__name__ == cname and cls.__module__ == module:
            lay = _layout(name)
            return lay if lay.cls is cls else None
    return None


def layout_named(name: str) -> PackedLayout | None:
    """The layout with physical type name ``name`` (None when this runtime does not know it)."""
    return _layout(name)


_FEATURES: frozenset | None = None


def cpu_features() -> frozenset:
    """This CPU's features as LLVM reports them (``avx2``, ``avx512vnni``, ...)."""
    global _FEATURES
    if _FEATURES is None:
        feats = llvm.get_host_cpu_features()
        _FEATURES = frozenset(k for k, on in feats.items() if on)
    return _FEATURES


def cpu_architecture() -> str:
    """``DeviceProto.architecture`` of this CPU for the packed INT4 kernels.

    The machine name followed by the best instruction-set level the packed kernels use here:
    ``x86_64-avx512vnni`` (AVX-512 VNNI), ``x86_64-avx2`` (AVX2 + FMA, the integer dot-product
    kernels), else ``<machine>-generic``. An entry compiled for another string is a cache miss.
    """
    machine = platform.machine().lower() or "unknown"
    if machine in ("amd64", "x64"):
        machine = "x86_64"
    f = cpu_features()
    if {"avx512f", "avx512bw", "avx512vl", "avx512vnni"} <= f:
        level = "avx512vnni"
    elif {"avx2", "fma"} <= f:
        level = "avx2"
    else:
        level = "generic"
    return f"{machine}-{level}"
