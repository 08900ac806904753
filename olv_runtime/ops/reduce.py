"""Standard ONNX reductions (ReduceSum, ReduceMean, ReduceMax, ReduceMin, ReduceProd,
ReduceSumSquare, ReduceL1, ReduceL2, ReduceLogSumExp) and ArgMax/ArgMin over numpy arrays.

Versions (https://onnx.ai/onnx/operators/): ``axes`` is an attribute up to ReduceSum-11 and
the other reductions' opset 17, and an optional second input from ReduceSum-13 / opset 18 on.
``keepdims`` (default 1) keeps reduced axes as size 1; with no axes every axis is reduced
unless ``noop_with_empty_axes`` is 1, which returns the input unchanged. Reducing an empty axis
gives the operator's identity (0 for sums, -inf/+inf for max/min as numpy would fail, see
``_EMPTY``). float16 inputs are accumulated in float32 and the result cast back.
"""
from __future__ import annotations

import numpy as np

from olv_runtime.errors import ValidationError
from olv_runtime.ops.registry import Op, register


def _axes(op: Op, axes, rank: int) -> tuple[int, ...] | None:
    if axes is None:
        return None
    vals = [int(a) for a in np.asarray(axes).reshape(-1).tolist()]
    out = []
    for a in vals:
        if not -rank <= a < max(rank, 1):
            raise op.fail(f"axis {a} out of range for rank {rank}")
        a %= max(rank, 1)
        if a in out:
            raise op.fail(f"axis {a} is given twice in axes {vals}")
        out.append(a)
    return tuple(sorted(out))


def _sum_sq(x, axis, keepdims):
    return np.sum(x * x, axis=axis, keepdims=keepdims)


def _l1(x, axis, keepdims):
    return np.sum(np.abs(x), axis=axis, keepdims=keepdims)


def _l2(x, axis, keepdims):
    return np.sqrt(np.sum(x * x, axis=axis, keepdims=keepdims))


def _log_sum_exp(x, axis, keepdims):
    with np.errstate(divide="ignore"):
        return np.log(np.sum(np.exp(x), axis=axis, keepdims=keepdims))


def _max(x, axis, keepdims):
    if x.size == 0:  # ONNX: reducing an empty set gives the identity (-inf, or the type's min)
        return _identity_fill(x, axis, keepdims, -np.inf if x.dtype.kind == "f" else
                              np.iinfo(x.dtype).min if x.dtype.kind in "iu" else False)
    return np.max(x, axis=axis, keepdims=keepdims)


def _min(x, axis, keepdims):
    if x.size == 0:
        return _identity_fill(x, axis, keepdims, np.inf if x.dtype.kind == "f" else
                              np.iinfo(x.dtype).max if x.dtype.kind in "iu" else True)
    return np.min(x, axis=axis, keepdims=keepdims)


def _identity_fill(x, axis, keepdims, value):
    axes = range(x.ndim) if axis is None else axis
    shape = [1 if i in axes else d for i, d in enumerate(x.shape)]
    if not keepdims:
        shape = [d for i, d in enumerate(x.shape) if i not in axes]
    return np.full(shape, value, x.dtype)


class _Reduce(Op):
    """Shared body; subclasses set ``fn`` and whether axes come from the attribute."""

    attributes = {"keepdims": 1, "noop_with_empty_axes": 0}
    fn = staticmethod(np.sum)
    axes_attribute = False

    def run(self, x, axes=None):
        if self.axes_attribute:
            axes = self.attrs.get("axes")
        empty = axes is None or np.asarray(axes).size == 0
        if empty and self.attrs.get("noop_with_empty_axes", 0):
            return (x,)
        ax = None if empty else _axes(self, axes, x.ndim)
        keep = bool(self.attrs["keepdims"])
        xf = x.astype(np.float32) if x.dtype == np.float16 else x
        with np.errstate(invalid="ignore", over="ignore"):
            y = type(self).fn(xf, ax, keep)
        return (np.asarray(y).astype(x.dtype, copy=False),)


def _define(name: str, fn, attr_until: int, input_since: int) -> None:
    """Register ``name`` with axes as an attribute for opsets 1..attr_until and as an input
    from ``input_since`` on."""
    attr_cls = type(f"{name}{attr_until}", (_Reduce,), {
        "fn": staticmethod(fn), "axes_attribute": True,
        "attributes": {"keepdims": 1, "axes": None},
        "__doc__": f"ONNX {name} opsets 1-{attr_until} (axes attribute).",
    })
    register(name, 1, attr_until)(attr_cls)
    in_cls = type(name, (_Reduce,), {
        "fn": staticmethod(fn),
        "__doc__": f"ONNX {name} from opset {input_since} (axes input, noop_with_empty_axes).",
    })
    register(name, input_since)(in_cls)
    globals()[attr_cls.__name__] = attr_cls
    globals()[name] = in_cls


def _mean(x, axis, keepdims):
    return np.mean(x, axis=axis, keepdims=keepdims)


def _prod(x, axis, keepdims):
    return np.prod(x, axis=axis, keepdims=keepdims)


_define("ReduceSum", lambda x, a, k: np.sum(x, axis=a, keepdims=k), 12, 13)
_define("ReduceMean", _mean, 17, 18)
_define("ReduceMax", _max, 17, 18)
_define("ReduceMin", _min, 17, 18)
_define("ReduceProd", _prod, 17, 18)
_define("ReduceSumSquare", _sum_sq, 17, 18)
_define("ReduceL1", _l1, 17, 18)
_define("ReduceL2", _l2, 17, 18)
_define("ReduceLogSumExp", _log_sum_exp, 17, 18)


class _ArgReduce(Op):
    attributes = {"axis": 0, "keepdims": 1, "select_last_index": 0}
    fn = staticmethod(np.argmax)

    def run(self, x):
        axis = self.attrs["axis"]
        if not -x.ndim <= axis < max(x.ndim, 1):
            raise self.fail(f"axis {axis} out of range for rank {x.ndim}")
        axis %= max(x.ndim, 1)
        if x.shape[axis] == 0:
            raise self.fail(f"cannot take {self.node.op_type} over the empty axis {axis}")
        if self.attrs["select_last_index"]:
            flipped = np.flip(x, axis=axis)
            y = x.shape[axis] - 1 - type(self).fn(flipped, axis=axis)
        else:
            y = type(self).fn(x, axis=axis)
        if self.attrs["keepdims"]:
            y = np.expand_dims(y, axis)
        return (np.asarray(y, np.int64),)


@register("ArgMax", 11)
class ArgMax(_ArgReduce):
    """ONNX ArgMax-11..13 (negative axis, select_last_index)."""


@register("ArgMin", 11)
class ArgMin(_ArgReduce):
    """ONNX ArgMin-11..13."""

    fn = staticmethod(np.argmin)


_CUMSUM_TYPES = (np.float32, np.float64, np.float16, np.int32, np.int64, np.uint32, np.uint64)


@register("CumSum", 11)
class CumSum(Op):
    """ONNX CumSum-11/14 (https://onnx.ai/onnx/operators/onnx__CumSum.html): running sums of
    ``x`` along the rank-0 ``axis`` input (int32 / int64, negative counts from the back);
    ``exclusive=1`` starts each sum at 0 (element i sums the elements before it),
    ``reverse=1`` sums from the end. Accumulates in ``x``'s own type, element by element in
    order (integers wrap), as the ONNX reference does. ``x`` of any rank >= 1; float16,
    float32, float64, int32, int64, uint32, uint64 (CumSum-14 adds bfloat16: not supported).

    Raises InvalidArgument for an axis that is not a rank-0 integer tensor or is out of
    range, a rank-0 ``x`` or another dtype."""

    attributes = {"exclusive": 0, "reverse": 0}

    def setup(self, session_info) -> None:
        for key in ("exclusive", "reverse"):
            if self.attrs[key] not in (0, 1):
                raise ValidationError(f"node {self.name!r} (CumSum): attribute {key!r} must be "
                                      f"0 or 1, got {self.attrs[key]!r}")

    def run(self, x, axis):
        if x.dtype.type not in _CUMSUM_TYPES:
            raise self.fail(f"x: unsupported dtype {x.dtype} (expected one of "
                            f"{[np.dtype(t).name for t in _CUMSUM_TYPES]})")
        a = np.asarray(axis)
        if a.ndim != 0 or a.dtype not in (np.int32, np.int64):
            raise self.fail(f"axis: expected a rank-0 int32/int64 tensor, got "
                            f"{a.dtype}{list(a.shape)}")
        if x.ndim == 0:
            raise self.fail("x: expected rank >= 1, got a scalar")
        ax = int(a)
        if not -x.ndim <= ax < x.ndim:
            raise self.fail(f"axis {ax} out of range for rank {x.ndim}")
        ax %= x.ndim
        src = np.flip(x, ax) if self.attrs["reverse"] else x
        res = np.empty(x.shape, x.dtype)
        dst = np.flip(res, ax) if self.attrs["reverse"] else res
        if self.attrs["exclusive"]:
            n = x.shape[ax]
            head = [slice(None)] * x.ndim
            head[ax] = slice(0, min(1, n))
            dst[tuple(head)] = 0
            if n > 1:
                lo = [slice(None)] * x.ndim
                hi = [slice(None)] * x.ndim
                lo[ax] = slice(0, n - 1)
                hi[ax] = slice(1, n)
                np.cumsum(src[tuple(lo)], axis=ax, dtype=x.dtype, out=dst[tuple(hi)])
        else:
            np.cumsum(src, axis=ax, dtype=x.dtype, out=dst)
        return (res,)
