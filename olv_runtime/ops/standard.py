"""Standard ONNX operators (domain ai.onnx) over numpy arrays: elementwise math, shape and
indexing operators. Semantics follow the ONNX operator specs (https://onnx.ai/onnx/operators/);
the neural-network operators with numba kernels live in :mod:`olv_runtime.ops.nn`.
"""
from __future__ import annotations

import numpy as np

from olv_runtime.errors import InvalidArgument, ValidationError
from olv_runtime.kernels.activations import erf
from olv_runtime.ops.registry import Op, register
from olv_runtime.pool import empty
from olv_runtime.structs.initializers import NP_DTYPE, dtype_name


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


@register("Add", 7)
class Add(_Binary):
    ufunc = np.add


@register("Sub", 7)
class Sub(_Binary):
    ufunc = np.subtract


@register("Mul", 7)
class Mul(_Binary):
    ufunc = np.multiply


@register("Div", 7)
class Div(_Binary):
    def run(self, a, b):
        _same_dtype(self, a, b)
        if a.dtype.kind in "iu":
            if np.any(b == 0):
                raise self.fail("integer division by zero")
            return (np.trunc(a / b).astype(a.dtype),)
        return (np.divide(a, b),)


@register("Pow", 7)
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


@register("Neg", 6)
class Neg(_Unary):
    ufunc = np.negative


@register("Sqrt", 6)
class Sqrt(_Unary):
    ufunc = np.sqrt


@register("Exp", 6)
class Exp(_Unary):
    ufunc = np.exp


@register("Tanh", 6)
class Tanh(_Unary):
    ufunc = np.tanh


@register("Reciprocal", 6)
class Reciprocal(_Unary):
    ufunc = np.reciprocal


@register("Sigmoid", 6)
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


class _Compare(Op):
    """Broadcasting comparison/logic: the output is bool."""

    ufunc = None
    bool_inputs = False

    def run(self, a, b):
        _same_dtype(self, a, b)
        if type(self).bool_inputs and a.dtype != np.bool_:
            raise self.fail(f"inputs must be bool, got {a.dtype}")
        try:
            shape = np.broadcast_shapes(a.shape, b.shape)
        except ValueError as exc:
            raise self.fail(f"shapes {list(a.shape)} and {list(b.shape)} do not broadcast ({exc})")
        return (type(self).ufunc(a, b, out=empty(shape, np.bool_)),)


@register("Equal", 7)
class Equal(_Compare):
    ufunc = np.equal


@register("Less", 7)
class Less(_Compare):
    ufunc = np.less


@register("Greater", 7)
class Greater(_Compare):
    ufunc = np.greater


@register("LessOrEqual", 12)
class LessOrEqual(_Compare):
    ufunc = np.less_equal


@register("GreaterOrEqual", 12)
class GreaterOrEqual(_Compare):
    ufunc = np.greater_equal


@register("And", 7)
class And(_Compare):
    ufunc = np.logical_and
    bool_inputs = True


@register("Or", 7)
class Or(_Compare):
    ufunc = np.logical_or
    bool_inputs = True


@register("Xor", 7)
class Xor(_Compare):
    ufunc = np.logical_xor
    bool_inputs = True


@register("IsNaN", 9)
class IsNaN(Op):
    def run(self, x):
        if x.dtype.kind != "f":
            raise self.fail(f"expected a floating-point input, got {x.dtype}")
        return (np.isnan(x),)


@register("IsInf", 10)
class IsInf(Op):
    attributes = {"detect_negative": 1, "detect_positive": 1}

    def run(self, x):
        if x.dtype.kind != "f":
            raise self.fail(f"expected a floating-point input, got {x.dtype}")
        y = np.zeros(x.shape, np.bool_)
        if self.attrs["detect_positive"]:
            y |= np.isposinf(x)
        if self.attrs["detect_negative"]:
            y |= np.isneginf(x)
        return (y,)


@register("Not", 1)
class Not(Op):
    def run(self, x):
        if x.dtype != np.bool_:
            raise self.fail(f"input must be bool, got {x.dtype}")
        return (np.logical_not(x),)


class _Variadic(Op):
    """Max/Min/Sum/Mean over any number of broadcasting inputs of one type."""

    ufunc = None

    def run(self, *xs):
        if not xs:
            raise self.fail("needs at least one input")
        for x in xs[1:]:
            _same_dtype(self, xs[0], x)
        try:
            np.broadcast_shapes(*(x.shape for x in xs))
        except ValueError:
            raise self.fail(f"shapes {[list(x.shape) for x in xs]} do not broadcast") from None
        y = xs[0]
        for x in xs[1:]:
            y = type(self).ufunc(y, x)
        if len(xs) == 1:
            y = np.array(y, copy=True)
        return (self.finish(np.asarray(y, xs[0].dtype), len(xs)),)

    def finish(self, y, n):
        return y


@register("Max", 8)
class Max(_Variadic):
    ufunc = np.maximum


@register("Min", 8)
class Min(_Variadic):
    ufunc = np.minimum


@register("Sum", 8)
class Sum(_Variadic):
    ufunc = np.add


@register("Mean", 8)
class Mean(_Variadic):
    ufunc = np.add

    def finish(self, y, n):
        return (y / y.dtype.type(n)).astype(y.dtype)


@register("Log", 6)
class Log(_Unary):
    ufunc = np.log

    def run(self, x):
        with np.errstate(divide="ignore", invalid="ignore"):
            return super().run(x)


@register("Abs", 6)
class Abs(_Unary):
    ufunc = np.abs


@register("Floor", 6)
class Floor(_Unary):
    ufunc = np.floor


@register("Ceil", 6)
class Ceil(_Unary):
    ufunc = np.ceil


@register("Round", 11)
class Round(_Unary):
    ufunc = np.round  # numpy rounds half to even, as ONNX Round does


@register("Sign", 9)
class Sign(_Unary):
    ufunc = np.sign


@register("Relu", 6)
class Relu(Op):
    def run(self, x):
        return (np.maximum(x, x.dtype.type(0)),)


@register("Erf", 9)
class Erf(Op):
    """ONNX Erf (float16/float32/float64; float16 computed in float32)."""

    def run(self, x):
        if x.dtype.kind != "f":
            raise self.fail(f"expected a floating-point input, got {x.dtype}")
        return (erf(x),)


@register("Softplus", 1)
class Softplus(Op):
    def run(self, x):
        with np.errstate(over="ignore"):
            return (np.logaddexp(x.dtype.type(0), x).astype(x.dtype),)


@register("HardSigmoid", 6)
class HardSigmoid(Op):
    attributes = {"alpha": 0.2, "beta": 0.5}

    def run(self, x):
        a, b = x.dtype.type(self.attrs["alpha"]), x.dtype.type(self.attrs["beta"])
        return (np.clip(a * x + b, 0, 1).astype(x.dtype),)


@register("LeakyRelu", 6)
class LeakyRelu(Op):
    attributes = {"alpha": 0.01}

    def run(self, x):
        return (np.where(x < 0, x * x.dtype.type(self.attrs["alpha"]), x).astype(x.dtype),)


@register("Swish", 24)
class Swish(Op):
    """ONNX Swish-24: ``x * sigmoid(alpha * x)``."""

    attributes = {"alpha": 1.0}

    def run(self, x):
        a = x.dtype.type(self.attrs["alpha"])
        with np.errstate(over="ignore"):
            return ((x / (x.dtype.type(1) + np.exp(-a * x))).astype(x.dtype),)


@register("Clip", 11)
class Clip(Op):
    """ONNX Clip-11..13: ``min``/``max`` as optional scalar inputs."""

    def run(self, x, lo=None, hi=None):
        for nm, v in (("min", lo), ("max", hi)):
            if v is not None and (v.size != 1 or v.dtype != x.dtype):
                raise self.fail(f"{nm} must be a scalar of type {x.dtype}, got {v.dtype}{list(v.shape)}")
        y = x
        if lo is not None:
            y = np.maximum(y, lo.reshape(()))
        if hi is not None:
            y = np.minimum(y, hi.reshape(()))
        return (np.array(y, x.dtype, copy=True),)


@register("Identity", 1)
class Identity(Op):
    accepts_structured = True  # pure transport: a struct value passes through as it is

    def run(self, x):
        return (x,)


@register("Cast", 6)
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


@register("Shape", 1)
class Shape(Op):
    attributes = {"start": 0, "end": None}

    def run(self, x):
        dims = x.shape[self.attrs["start"] : self.attrs["end"]]
        out = empty((len(dims),), np.int64)
        out[...] = dims
        return (out,)


@register("Size", 1)
class Size(Op):
    def run(self, x):
        return (np.array(x.size, dtype=np.int64),)


@register("Constant", 1)
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


@register("Unsqueeze", 13)
class Unsqueeze(Op):
    def run(self, x, axes):
        rank = x.ndim + np.asarray(axes).size
        shape = list(x.shape)
        for a in sorted(_axes_arg(self, axes, rank)):
            shape.insert(a, 1)
        return (x.reshape(shape),)


@register("Squeeze", 13)
class Squeeze(Op):
    def run(self, x, axes=None):
        if axes is None:
            return (x.reshape([d for d in x.shape if d != 1]),)
        ax = _axes_arg(self, axes, x.ndim)
        for a in ax:
            if x.shape[a] != 1:
                raise self.fail(f"cannot squeeze axis {a} of size {x.shape[a]}")
        return (x.reshape([d for i, d in enumerate(x.shape) if i not in ax]),)


class _AxesAttr(Op):
    """Squeeze/Unsqueeze opsets 1-12: ``axes`` is an attribute."""

    attributes = {"axes": None}

    def run(self, x):
        axes = self.attrs["axes"]
        base = Unsqueeze if self.node.op_type == "Unsqueeze" else Squeeze
        return base.run(self, x, None if axes is None else np.asarray(axes, np.int64))


@register("Unsqueeze", 1, 12)
class Unsqueeze1(_AxesAttr):
    pass


@register("Squeeze", 1, 12)
class Squeeze1(_AxesAttr):
    pass


@register("ConstantOfShape", 9)
class ConstantOfShape(Op):
    """ONNX ConstantOfShape: a tensor of shape ``input`` filled with ``value`` (default float 0)."""

    attributes = {"value": None}

    def setup(self, info):
        v = self.attrs["value"]
        self.fill = np.zeros((), np.float32) if v is None else np.asarray(v).reshape(-1)
        if self.fill.size != 1:
            raise ValidationError(
                f"node {self.name!r} (ConstantOfShape): value must have one element, got "
                f"{self.fill.size}"
            )

    def run(self, shape):
        dims = [int(d) for d in shape.reshape(-1)]
        if any(d < 0 for d in dims):
            raise self.fail(f"shape must be non-negative, got {dims}")
        return (np.full(dims, self.fill.reshape(()), self.fill.dtype),)


@register("CastLike", 15)
class CastLike(Op):
    attributes = {"saturate": 1, "round_mode": "up"}

    def run(self, x, like):
        out = empty(x.shape, like.dtype)
        np.copyto(out, x, casting="unsafe")
        return (out,)


@register("Tile", 6)
class Tile(Op):
    def run(self, x, repeats):
        reps = [int(r) for r in repeats.reshape(-1)]
        if len(reps) != x.ndim or any(r < 0 for r in reps):
            raise self.fail(f"repeats must be {x.ndim} non-negative ints, got {reps}")
        return (np.tile(x, reps),)


@register("Trilu", 14)
class Trilu(Op):
    attributes = {"upper": 1}

    def run(self, x, k=None):
        kk = 0 if k is None else int(np.asarray(k).reshape(()))
        if x.ndim < 2:
            raise self.fail(f"input must have rank >= 2, got {x.ndim}")
        return ((np.triu if self.attrs["upper"] else np.tril)(x, kk),)


@register("GatherElements", 11)
class GatherElements(Op):
    attributes = {"axis": 0}

    def run(self, data, indices):
        axis = self.attrs["axis"]
        if not -data.ndim <= axis < data.ndim:
            raise self.fail(f"axis {axis} out of range for rank {data.ndim}")
        n = data.shape[axis]
        if indices.size and (indices.min() < -n or indices.max() >= n):
            raise self.fail(f"indices must lie in [{-n}, {n - 1}]")
        idx = np.where(indices < 0, indices + n, indices)
        return (np.take_along_axis(data, idx, axis=axis),)


@register("GatherND", 11)
class GatherND(Op):
    """ONNX GatherND-11/12/13 (https://onnx.ai/onnx/operators/onnx__GatherND.html): ``data``
    rank r >= 1, int64 ``indices`` rank q >= 1 whose last dimension k <= r - b indexes the
    first k dimensions after the ``batch_dims`` b leading ones (shared by both inputs);
    output shape ``indices.shape[:-1] + data.shape[b + k:]``. Negative indices count from the
    end. (``batch_dims`` is an attribute from GatherND-12; GatherND-11 nodes have none.)

    Raises InvalidArgument for ranks, a k too large, batch dimensions that differ or an index
    out of range (naming the dimension)."""

    attributes = {"batch_dims": 0}

    def run(self, data, indices):
        b = int(self.attrs["batch_dims"])
        if indices.dtype != np.int64:
            raise self.fail(f"indices: expected int64, got {indices.dtype}")
        if data.ndim < 1 or indices.ndim < 1:
            raise self.fail(f"data and indices must have rank >= 1, got {data.ndim} and "
                            f"{indices.ndim}")
        if not 0 <= b < min(data.ndim, indices.ndim):
            raise self.fail(f"batch_dims {b} must lie in [0, {min(data.ndim, indices.ndim) - 1}]")
        if data.shape[:b] != indices.shape[:b]:
            raise self.fail(f"the first {b} (batch) dimensions differ: data {list(data.shape)}, "
                            f"indices {list(indices.shape)}")
        k = indices.shape[-1]
        if not 1 <= k <= data.ndim - b:
            raise self.fail(f"indices.shape[-1] = {k} must lie in [1, {data.ndim - b}] "
                            f"(data rank {data.ndim}, batch_dims {b})")
        bsz = int(np.prod(data.shape[:b], dtype=np.int64))
        idx = indices.reshape(bsz, -1, k)
        dims = data.shape[b:b + k]
        fixed = []
        for j, n in enumerate(dims):
            col = idx[..., j]
            if col.size and (col.min() < -n or col.max() >= n):
                raise self.fail(f"indices[..., {j}] must lie in [{-n}, {n - 1}] (data dimension "
                                f"{b + j}), got values in [{col.min()}, {col.max()}]")
            fixed.append(np.where(col < 0, col + n, col))
        d = data.reshape((bsz,) + data.shape[b:])
        batch = np.arange(bsz).reshape(bsz, 1)
        out = d[(batch, *fixed)]
        return (np.ascontiguousarray(
            out.reshape(indices.shape[:-1] + data.shape[b + k:])),)


class _SplitBase(Op):
    def _split(self, x, sizes):
        axis = self.attrs["axis"]
        if not -x.ndim <= axis < x.ndim:
            raise self.fail(f"axis {axis} out of range for rank {x.ndim}")
        axis %= x.ndim
        n_out = len(self.node.output)
        d = x.shape[axis]
        if sizes is None:
            n = self.attrs.get("num_outputs") or n_out
            step = -(-d // n)
            sizes = [min(step, d - i * step) for i in range(n)]
        sizes = [int(v) for v in sizes]
        if sum(sizes) != d or any(v < 0 for v in sizes):
            raise self.fail(f"split sizes {sizes} must be >= 0 and sum to {d}")
        out, start = [], 0
        for v in sizes:
            idx = [slice(None)] * x.ndim
            idx[axis] = slice(start, start + v)
            out.append(np.ascontiguousarray(x[tuple(idx)]))
            start += v
        return tuple(out)


@register("Split", 13, 17)
class Split13(_SplitBase):
    attributes = {"axis": 0}

    def run(self, x, split=None):
        return self._split(x, None if split is None else split.reshape(-1).tolist())


@register("Split", 18)
class Split(_SplitBase):
    """ONNX Split-18: ``split`` input or ``num_outputs`` (last chunk smaller)."""

    attributes = {"axis": 0, "num_outputs": None}

    def run(self, x, split=None):
        return self._split(x, None if split is None else split.reshape(-1).tolist())


@register("Reshape", 5)
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


@register("Flatten", 1)
class Flatten(Op):
    attributes = {"axis": 1}

    def run(self, x):
        axis = self.attrs["axis"]
        if not -x.ndim <= axis <= x.ndim:
            raise self.fail(f"axis {axis} out of range for rank {x.ndim} (expected [-r, r])")
        if axis < 0:  # ONNX Flatten: a negative axis counts from the back (axis + rank)
            axis += x.ndim
        lead = int(np.prod(x.shape[:axis], dtype=np.int64))
        return (x.reshape(lead, -1),)


@register("Transpose", 1)
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


@register("Concat", 4)
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


@register("Expand", 8)
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


@register("Gather", 1)
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


@register("Slice", 10)
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


@register("Where", 9)
class Where(Op):
    def run(self, cond, x, y):
        return (np.where(cond, x, y),)


@register("Softmax", 13)
class Softmax(Op):
    """ONNX Softmax-13 over ``axis`` (default -1); float16 inputs are computed in float32."""

    attributes = {"axis": -1}
    log = False

    def run(self, x):
        if x.dtype.kind != "f":
            raise self.fail(f"expected a floating-point input, got {x.dtype}")
        axis = self.attrs["axis"]
        if not -x.ndim <= axis < max(x.ndim, 1):
            raise self.fail(f"axis {axis} out of range for rank {x.ndim}")
        return (_softmax(x, axis, type(self).log),)


@register("LogSoftmax", 13)
class LogSoftmax(Softmax):
    """ONNX LogSoftmax-13: ``x - max - log(sum(exp(x - max)))`` over ``axis``."""

    log = True


def _softmax(x: np.ndarray, axis: int, log: bool) -> np.ndarray:
    xf = x.astype(np.float32) if x.dtype == np.float16 else x
    m = np.max(xf, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0).astype(xf.dtype)
    z = xf - m
    e = np.exp(z)
    s = np.sum(e, axis=axis, keepdims=True)
    y = z - np.log(s) if log else e / s
    return y.astype(x.dtype, copy=False)


class _Softmax2D(Op):
    """Softmax/LogSoftmax opsets 1-12: the input is coerced to 2-D ``[prod(dims[:axis]),
    prod(dims[axis:])]`` and normalised over the second dimension."""

    attributes = {"axis": 1}
    log = False

    def run(self, x):
        if x.dtype.kind != "f":
            raise self.fail(f"expected a floating-point input, got {x.dtype}")
        axis = self.attrs["axis"]
        if not -x.ndim <= axis <= x.ndim:
            raise self.fail(f"axis {axis} out of range for rank {x.ndim}")
        axis = axis + x.ndim if axis < 0 else axis
        lead = int(np.prod(x.shape[:axis], dtype=np.int64))
        y = _softmax(x.reshape(lead, -1), 1, type(self).log)
        return (y.reshape(x.shape),)


@register("Softmax", 1, 12)
class Softmax1(_Softmax2D):
    pass


@register("LogSoftmax", 1, 12)
class LogSoftmax1(_Softmax2D):
    log = True


__all__ = [name for name in dir() if not name.startswith("_")]
_ = InvalidArgument  # re-exported for op modules
