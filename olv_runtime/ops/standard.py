"""Standard ONNX operators (domain ai.onnx) over numpy arrays: elementwise math, shape and
indexing operators. Semantics follow the ONNX operator specs (https://onnx.ai/onnx/operators/);
the neural-network operators with numba kernels live in :mod:`olv_runtime.ops.nn`.
"""
from __future__ import annotations

import numpy as np

from olv_runtime.errors import InvalidArgument, ValidationError
from olv_runtime.pool import empty
from olv_runtime.ops.registry import Op, register
from olv_runtime.values import NP_DTYPE, dtype_name


def _same_dtype(op: Op, a: np.ndarray, b: np.ndarray) -> None:
    if a.dtype != b.dtype:
        raise op.fail(f"inputs must have the same element type, got {a.dtype} and {b.dtype}")


class _Binary(Op):
    ufunc = None

    def run(self, a, b):
        _same_dtype(self, a, b)
        try:
            shape = np.broadcast_shapes(a.shape, b.shape)
        except ValueError as exc:
            raise self.fail(f"shapes {list(a.shape)} and {list(b.shape)} do not broadcast ({exc})")
        return (type(self).ufunc(a, b, out=empty(shape, a.dtype)),)


@register("Add", 14)
class Add(_Binary):
    ufunc = np.add


@register("Sub", 14)
class Sub(_Binary):
    ufunc = np.subtract


@register("Mul", 14)
class Mul(_Binary):
    ufunc = np.multiply


@register("Div", 14)
class Div(_Binary):
    def run(self, a, b):
        _same_dtype(self, a, b)
        if a.dtype.kind in "iu":
            if np.any(b == 0):
                raise self.fail("integer division by zero")
            return (np.trunc(a / b).astype(a.dtype),)
        return (np.divide(a, b),)


@register("Pow", 15)
class Pow(Op):
    def run(self, a, b):
        return (np.power(a, b.astype(a.dtype)),)


class _Unary(Op):
    ufunc = None

    def run(self, x):
        return (type(self).ufunc(x, out=empty(x.shape, x.dtype)),)


@register("Cos", 7)
class Cos(_Unary):
    ufunc = np.cos


@register("Sin", 7)
class Sin(_Unary):
    ufunc = np.sin


@register("Neg", 13)
class Neg(_Unary):
    ufunc = np.negative


@register("Sqrt", 13)
class Sqrt(_Unary):
    ufunc = np.sqrt


@register("Exp", 13)
class Exp(_Unary):
    ufunc = np.exp


@register("Tanh", 13)
class Tanh(_Unary):
    ufunc = np.tanh


@register("Reciprocal", 13)
class Reciprocal(_Unary):
    ufunc = np.reciprocal


@register("Sigmoid", 13)
class Sigmoid(Op):
    def run(self, x):
        # ONNX Sigmoid: 1 / (1 + exp(-x)), evaluated without overflow warnings.
        out = empty(x.shape, x.dtype)
        with np.errstate(over="ignore"):
            np.negative(x, out=out)
            np.exp(out, out=out)
            np.add(out, x.dtype.type(1.0), out=out)
            np.divide(x.dtype.type(1.0), out, out=out)
        return (out,)


@register("Identity", 16)
class Identity(Op):
    accepts_structured = True  # pure transport: a struct value passes through as it is

    def run(self, x):
        return (x,)


@register("Cast", 21)
class Cast(Op):
    attributes = {"to": Op.REQUIRED, "saturate": 1, "round_mode": "up"}

    def setup(self, info):
        to = self.attrs["to"]
        if to not in NP_DTYPE:
            raise ValidationError(
                f"node {self.name!r} (Cast): target type {dtype_name(to)} is not supported"
            )
        self.dtype = NP_DTYPE[to].newbyteorder("=")

    def run(self, x):
        out = empty(x.shape, self.dtype)
        np.copyto(out, x, casting="unsafe")
        return (out,)


@register("Shape", 21)
class Shape(Op):
    attributes = {"start": 0, "end": None}

    def run(self, x):
        dims = x.shape[self.attrs["start"] : self.attrs["end"]]
        out = empty((len(dims),), np.int64)
        out[...] = dims
        return (out,)


@register("Size", 21)
class Size(Op):
    def run(self, x):
        return (np.array(x.size, dtype=np.int64),)


@register("Constant", 21)
class Constant(Op):
    attributes = {
        "value": None, "value_float": None, "value_floats": None, "value_int": None,
        "value_ints": None, "sparse_value": None, "value_string": None, "value_strings": None,
    }

    def setup(self, info):
        given = {k: v for k, v in self.attrs.items() if v is not None}
        if len(given) != 1:
            raise ValidationError(
                f"node {self.name!r} (Constant): exactly one value attribute is required, got "
                f"{sorted(given)}"
            )
        key, value = next(iter(given.items()))
        if key == "value":
            self.value = value
        elif key == "value_float":
            self.value = np.array(value, np.float32)
        elif key == "value_floats":
            self.value = np.array(value, np.float32)
        elif key == "value_int":
            self.value = np.array(value, np.int64)
        elif key == "value_ints":
            self.value = np.array(value, np.int64)
        else:
            raise ValidationError(f"node {self.name!r} (Constant): {key} is not supported")

    def run(self):
        return (self.value,)


def _axes_arg(op: Op, axes, rank: int) -> list[int]:
    out = []
    for a in np.asarray(axes).reshape(-1).tolist():
        if not -rank <= a < rank:
            raise op.fail(f"axis {a} out of range for rank {rank}")
        out.append(a % rank)
    return out


@register("Unsqueeze", 21)
class Unsqueeze(Op):
    def run(self, x, axes):
        rank = x.ndim + np.asarray(axes).size
        shape = list(x.shape)
        for a in sorted(_axes_arg(self, axes, rank)):
            shape.insert(a, 1)
        return (x.reshape(shape),)


@register("Squeeze", 21)
class Squeeze(Op):
    def run(self, x, axes=None):
        if axes is None:
            return (x.reshape([d for d in x.shape if d != 1]),)
        ax = _axes_arg(self, axes, x.ndim)
        for a in ax:
            if x.shape[a] != 1:
                raise self.fail(f"cannot squeeze axis {a} of size {x.shape[a]}")
        return (x.reshape([d for i, d in enumerate(x.shape) if i not in ax]),)


@register("Reshape", 21)
class Reshape(Op):
    attributes = {"allowzero": 0}

    def run(self, x, shape):
        target = [int(v) for v in shape.reshape(-1)]
        if not self.attrs["allowzero"]:
            target = [x.shape[i] if v == 0 else v for i, v in enumerate(target)]
        try:
            return (x.reshape(target),)
        except ValueError:
            raise self.fail(
                f"cannot reshape {list(x.shape)} ({x.size} elements) to {target}"
            ) from None


@register("Flatten", 21)
class Flatten(Op):
    attributes = {"axis": 1}

    def run(self, x):
        axis = self.attrs["axis"] % (x.ndim + 1) if x.ndim else 0
        lead = int(np.prod(x.shape[:axis], dtype=np.int64))
        return (x.reshape(lead, -1),)


@register("Transpose", 21)
class Transpose(Op):
    attributes = {"perm": None}

    def run(self, x):
        perm = self.attrs["perm"]
        if perm is not None and sorted(perm) != list(range(x.ndim)):
            raise self.fail(f"perm {perm} is not a permutation of rank {x.ndim}")
        # A transpose materialises (ONNX outputs are fresh tensors; kernels need contiguity).
        t = np.transpose(x, perm)
        out = empty(t.shape, x.dtype)
        np.copyto(out, t)
        return (out,)


@register("Concat", 13)
class Concat(Op):
    attributes = {"axis": Op.REQUIRED}

    def run(self, *xs):
        axis = self.attrs["axis"]
        try:
            ax = axis % xs[0].ndim
            shape = list(xs[0].shape)
            shape[ax] = sum(x.shape[ax] for x in xs)
            return (np.concatenate(xs, axis=ax, out=empty(shape, xs[0].dtype)),)
        except (ValueError, ZeroDivisionError, IndexError) as exc:
            raise self.fail(str(exc)) from None


@register("Expand", 13)
class Expand(Op):
    def run(self, x, shape):
        target = [int(v) for v in shape.reshape(-1)]
        try:
            out_shape = np.broadcast_shapes(x.shape, tuple(target))
        except ValueError:
            raise self.fail(f"cannot expand {list(x.shape)} to {target}") from None
        out = empty(out_shape, x.dtype)
        np.copyto(out, np.broadcast_to(x, out_shape))
        return (out,)


@register("Range", 11)
class Range(Op):
    def run(self, start, limit, delta):
        s, l, d = (np.asarray(v).reshape(()) for v in (start, limit, delta))
        if d == 0:
            raise self.fail("delta must be nonzero")
        n = max(int(np.ceil((l - s) / d)), 0)
        out = empty((n,), s.dtype)
        if n <= 64:  # ONNX Range: output[i] = start + i * delta
            for i in range(n):
                out[i] = s + i * d
        else:
            out[...] = s + d * np.arange(n, dtype=s.dtype)
        return (out,)


@register("Gather", 13)
class Gather(Op):
    attributes = {"axis": 0}

    def run(self, data, indices):
        axis = self.attrs["axis"]
        if not -data.ndim <= axis < data.ndim:
            raise self.fail(f"axis {axis} out of range for rank {data.ndim}")
        n = data.shape[axis]
        if indices.size and (indices.min() < -n or indices.max() >= n):
            raise self.fail(
                f"indices must lie in [{-n}, {n - 1}] (axis {axis} has {n}), got "
                f"[{indices.min()}, {indices.max()}]"
            )
        ax = axis % data.ndim
        shape = data.shape[:ax] + indices.shape + data.shape[ax + 1:]
        return (np.take(data, indices, axis=axis, out=empty(shape, data.dtype)),)


@register("Slice", 13)
class Slice(Op):
    def run(self, data, starts, ends, axes=None, steps=None):
        starts = starts.reshape(-1).tolist()
        ends = ends.reshape(-1).tolist()
        axes = list(range(len(starts))) if axes is None else _axes_arg(self, axes, data.ndim)
        steps = [1] * len(starts) if steps is None else steps.reshape(-1).tolist()
        index = [slice(None)] * data.ndim
        for s, e, a, st in zip(starts, ends, axes, steps):
            if st == 0:
                raise self.fail("slice step must be nonzero")
            index[a] = slice(s, e, st)
        return (data[tuple(index)],)


@register("Where", 16)
class Where(Op):
    def run(self, cond, x, y):
        return (np.where(cond, x, y),)


@register("ReduceMean", 18)
class ReduceMean(Op):
    attributes = {"keepdims": 1, "noop_with_empty_axes": 0}

    def run(self, x, axes=None):
        ax = None if axes is None or axes.size == 0 else tuple(_axes_arg(self, axes, x.ndim))
        return (np.mean(x, axis=ax, keepdims=bool(self.attrs["keepdims"])).astype(x.dtype),)


@register("Softmax", 13)
class Softmax(Op):
    attributes = {"axis": -1}

    def run(self, x):
        axis = self.attrs["axis"]
        m = np.max(x, axis=axis, keepdims=True)
        e = np.exp(x - m)
        return ((e / np.sum(e, axis=axis, keepdims=True)).astype(x.dtype, copy=False),)


__all__ = [name for name in dir() if not name.startswith("_")]
_ = InvalidArgument  # re-exported for op modules
