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
#: "3": an entry's ``olv.payload_digest`` also covers its source name, source digest and name
#: (olv_runtime.structs.compiled.payload_parts); version-2 entries are misses by version, not digest.
PACKED_LAYOUT_VERSION = "3"


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """How one packed layout is persisted, zero points an optional field of the description.

    One description serves a layout family: its arrays, integers, row grouping and array shapes.
    A family whose weights may carry zero points names the optional array (``zero_point``); its
    zero-point *form* (:meth:`with_zero_point`) is the same description with that array stored
    after the others, under its own physical type name and packed class (the kernels differ).

    Attributes
    ----------
    name : str
        Physical type name of this form (``StructTypeProto.name`` of compiled values), e.g.
        ``"olv.PackedInt4I8"`` or, with zero points, ``"olv.PackedInt4I8Zp"``.
    cls : type
        The packed class of this form (``PackedInt4I8``, ``PackedInt4I8Zp``); its constructor
        takes ``*arrays, *ints`` by name.
    arrays : tuple of str
        The arrays of this form, in stored order. Axis 0 of each is the row-group axis.
    ints : tuple of str
        Constructor parameters that are integers (``n``, ``k``).
    rows_per_group : int
        Output rows per step of axis 0: parts whose ``n`` is a multiple of it concatenate along
        axis 0 into the packed form of the rows concatenated (the sibling merge).
    array_shapes : callable
        ``array_shapes(n, k, scale_dtype) -> {array name: (dtype, shape)}`` of the arrays every
        form has (see :meth:`shapes`).
    zero_point : str or None
        Name of the optional zero-point array of the family (uint8, one per (row, block): the
        shape of ``zero_point_like``), or None when the family has no zero-point form.
    zero_point_like : str
        The array whose shape the zero-point array has (``"scale"``).
    """

    name: str
    cls: type
    arrays: tuple
    ints: tuple
    rows_per_group: int
    array_shapes: object
    zero_point: str | None = None
    zero_point_like: str = "scale"

    @property
    def has_zero_point(self) -> bool:
        """True for the zero-point form (its arrays include :attr:`zero_point`)."""
        return self.zero_point is not None and self.zero_point in self.arrays

    def with_zero_point(self, name: str, cls: type) -> "PackedLayout":
        """The zero-point form of this description: the same arrays plus :attr:`zero_point`
        (stored last), physical type ``name``, packed class ``cls``.

        Raises
        ------
        ValueError
            The family has no optional zero-point array, or this is already the zero-point form.
        """
        if self.zero_point is None or self.has_zero_point:
            raise ValueError(f"{self.name}: no zero-point form to add (zero_point="
                             f"{self.zero_point!r}, arrays={self.arrays})")
        return dataclasses.replace(self, name=name, cls=cls,
                                   arrays=self.arrays + (self.zero_point,))

    def shapes(self, n: int, k: int, has_zero_point: bool = False,
               scale_dtype=np.float32) -> dict:
        """``{array name: (dtype, shape)}`` the prepacker produces for an ``[N, K]`` weight whose
        block scales have ``scale_dtype`` (a compiled entry must match it exactly): the
        family's arrays, plus the zero-point array in the zero-point form. ``has_zero_point``
        (whether the source weight has zero points) is accepted for the callers' sake; the
        form decides."""
        out = dict(self.array_shapes(n, k, scale_dtype))
        if self.has_zero_point:
            out[self.zero_point] = (np.uint8, out[self.zero_point_like][1])
        return out

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


def _group8_shapes(n, k, scale_dtype=np.float32):
    """Arrays of the 8-row group layout (kernels/packed_i8.py) for an ``[N, K]`` weight."""
    ng, kb = -(-n // GROUP_ROWS), -(-k // 32)
    sdt = np.uint16 if np.dtype(scale_dtype) == np.float16 else np.float32  # float16 bits
    return {"codes": (np.uint8, (ng, kb, GROUP_BLOCK_BYTES)),
            "scale": (sdt, (ng, kb, GROUP_ROWS))}


def _constructor_arrays(cls) -> tuple:
    """The array parameters of ``cls``'s constructor, in order (all but self, n, k)."""
    return tuple(p for p in inspect.signature(cls.__init__).parameters
                 if p not in ("self", "n", "k"))


def _group8(name: str) -> PackedLayout:
    """The 8-row group layout of symmetric INT4 weights; zero points optional (``zp``)."""
    lay = PackedLayout(name, PackedInt4I8, ("codes", "scale"), ("n", "k"), GROUP_ROWS,
                       _group8_shapes, zero_point="zp")
    assert _constructor_arrays(lay.cls) == lay.arrays
    return lay


def _group8_zp(name: str) -> PackedLayout:
    """The zero-point form of :func:`_group8` (kernels/packed_zp.py)."""
    lay = _group8("olv.PackedInt4I8").with_zero_point(name, packed_zp.PackedInt4I8Zp)
    assert _constructor_arrays(lay.cls) == lay.arrays
    return lay


#: physical type name -> (module of the packed class, class name, layout factory); a layout is
#: built (and its kernel module imported) only when a session or ``olv compile`` asks for it
_SPECS = {
    "olv.PackedInt4I8": ("olv_runtime.kernels.packed_i8", "PackedInt4I8", _group8),
    "olv.PackedInt4I8Zp": ("olv_runtime.kernels.packed_zp", "PackedInt4I8Zp", _group8_zp),
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
