"""Output-count ranges of the standard ONNX operators, as ``onnx.defs`` declares them.

A standard node may declare no more and no fewer outputs than its operator schema allows
(``OpSchema.min_output`` / ``max_output``); the session checks this for every node
(:func:`olv_runtime.executor.session._check_output_count`). Importing ``onnx.defs`` and initialising its
schema registry costs 30-90 ms, a third of a warm session creation: this table holds the same
figures for every operator of the standard domain, generated from onnx 1.23.2 (opset
28) by :func:`table_from_onnx` (``python -m olv_runtime.ops.schema_outputs``
prints it). tests/ops/test_ops_versions.py checks it against ``onnx.defs`` for every operator and
opset version, so it cannot drift from the onnx the tests run with. Operators not in the table
are looked up in ``onnx.defs`` (a newer onnx).

Source: the operator schemas of ``onnx.defs`` (``get_all_schemas_with_history``).
"""
from __future__ import annotations

__all__ = ["OUTPUTS", "output_range", "table_from_onnx"]

#: op_type -> ((since_version, min_output, max_output), ...), one entry per change of the range
OUTPUTS: dict[str, tuple[tuple[int, int, int], ...]] = {
    'Abs': ((1, 1, 1),),
    'Acos': ((7, 1, 1),),
    'Acosh': ((9, 1, 1),),
    'Add': ((1, 1, 1),),
    'AffineGrid': ((20, 1, 1),),
    'And': ((1, 1, 1),),
    'ArgMax': ((1, 1, 1),),
    'ArgMin': ((1, 1, 1),),
    'Asin': ((7, 1, 1),),
    'Asinh': ((9, 1, 1),),
    'Atan': ((7, 1, 1),),
    'Atanh': ((9, 1, 1),),
    'Attention': ((23, 1, 4),),
    'AveragePool': ((1, 1, 1),),
    'BatchNormalization': ((1, 1, 5), (14, 1, 3)),
    'Bernoulli': ((15, 1, 1),),
    'BitCast': ((26, 1, 1),),
    'BitShift': ((11, 1, 1),),
    'BitwiseAnd': ((18, 1, 1),),
    'BitwiseNot': ((18, 1, 1),),
    'BitwiseOr': ((18, 1, 1),),
    'BitwiseXor': ((18, 1, 1),),
    'BlackmanWindow': ((17, 1, 1),),
    'Cast': ((1, 1, 1),),
    'CastLike': ((15, 1, 1),),
    'CausalConvWithState': ((27, 2, 2),),
    'Ceil': ((1, 1, 1),),
    'Celu': ((12, 1, 1),),
    'CenterCropPad': ((18, 1, 1),),
    'Clip': ((1, 1, 1),),
    'Col2Im': ((18, 1, 1),),
    'Compress': ((9, 1, 1),),
    'Concat': ((1, 1, 1),),
    'ConcatFromSequence': ((11, 1, 1),),
    'Constant': ((1, 1, 1),),
    'ConstantOfShape': ((9, 1, 1),),
    'Conv': ((1, 1, 1),),
    'ConvInteger': ((10, 1, 1),),
    'ConvTranspose': ((1, 1, 1),),
    'Cos': ((7, 1, 1),),
    'Cosh': ((9, 1, 1),),
    'CumProd': ((26, 1, 1),),
    'CumSum': ((11, 1, 1),),
    'DFT': ((17, 1, 1),),
    'DeformConv': ((19, 1, 1),),
    'DepthToSpace': ((1, 1, 1),),
    'DequantizeLinear': ((10, 1, 1),),
    'Det': ((11, 1, 1),),
    'Div': ((1, 1, 1),),
    'Dropout': ((1, 1, 2),),
    'DynamicQuantizeLinear': ((11, 3, 3),),
    'Einsum': ((12, 1, 1),),
    'Elu': ((1, 1, 1),),
    'Equal': ((1, 1, 1),),
    'Erf': ((9, 1, 1),),
    'Exp': ((1, 1, 1),),
    'Expand': ((8, 1, 1),),
    'EyeLike': ((9, 1, 1),),
    'Flatten': ((1, 1, 1),),
    'Floor': ((1, 1, 1),),
    'GRU': ((1, 2, 2), (3, 0, 2)),
    'Gather': ((1, 1, 1),),
    'GatherElements': ((11, 1, 1),),
    'GatherND': ((11, 1, 1),),
    'Gelu': ((20, 1, 1),),
    'Gemm': ((1, 1, 1),),
    'GlobalAveragePool': ((1, 1, 1),),
    'GlobalLpPool': ((1, 1, 1),),
    'GlobalMaxPool': ((1, 1, 1),),
    'Greater': ((1, 1, 1),),
    'GreaterOrEqual': ((12, 1, 1),),
    'GridSample': ((16, 1, 1),),
    'GroupNormalization': ((18, 1, 1),),
    'HammingWindow': ((17, 1, 1),),
    'HannWindow': ((17, 1, 1),),
    'HardSigmoid': ((1, 1, 1),),
    'HardSwish': ((14, 1, 1),),
    'Hardmax': ((1, 1, 1),),
    'Identity': ((1, 1, 1),),
    'If': ((1, 1, 2147483647),),
    'ImageDecoder': ((20, 1, 1),),
    'InstanceNormalization': ((1, 1, 1),),
    'IsInf': ((10, 1, 1),),
    'IsNaN': ((9, 1, 1),),
    'LRN': ((1, 1, 1),),
    'LSTM': ((1, 0, 3),),
    'LayerNormalization': ((17, 1, 3),),
    'LeakyRelu': ((1, 1, 1),),
    'Less': ((1, 1, 1),),
    'LessOrEqual': ((12, 1, 1),),
    'LinearAttention': ((27, 2, 2),),
    'Log': ((1, 1, 1),),
    'LogSoftmax': ((1, 1, 1),),
    'Loop': ((1, 1, 2147483647),),
    'LpNormalization': ((1, 1, 1),),
    'LpPool': ((1, 1, 1),),
    'MatMul': ((1, 1, 1),),
    'MatMulInteger': ((10, 1, 1),),
    'Max': ((1, 1, 1),),
    'MaxPool': ((1, 1, 1), (8, 1, 2)),
    'MaxRoiPool': ((1, 1, 1),),
    'MaxUnpool': ((9, 1, 1),),
    'Mean': ((1, 1, 1),),
    'MeanVarianceNormalization': ((9, 1, 1),),
    'MelWeightMatrix': ((17, 1, 1),),
    'Min': ((1, 1, 1),),
    'Mish': ((18, 1, 1),),
    'Mod': ((10, 1, 1),),
    'Mul': ((1, 1, 1),),
    'Multinomial': ((7, 1, 1),),
    'Neg': ((1, 1, 1),),
    'NegativeLogLikelihoodLoss': ((12, 1, 1),),
    'NonMaxSuppression': ((10, 1, 1),),
    'NonZero': ((9, 1, 1),),
    'Not': ((1, 1, 1),),
    'OneHot': ((9, 1, 1),),
    'Optional': ((15, 1, 1),),
    'OptionalGetElement': ((15, 1, 1),),
    'OptionalHasElement': ((15, 1, 1),),
    'Or': ((1, 1, 1),),
    'PRelu': ((1, 1, 1),),
    'Pad': ((1, 1, 1),),
    'Pow': ((1, 1, 1),),
    'QLinearConv': ((10, 1, 1),),
    'QLinearMatMul': ((10, 1, 1),),
    'QuantizeLinear': ((10, 1, 1),),
    'RMSNormalization': ((23, 1, 1),),
    'RNN': ((1, 0, 2),),
    'RandomNormal': ((1, 1, 1),),
    'RandomNormalLike': ((1, 1, 1),),
    'RandomUniform': ((1, 1, 1),),
    'RandomUniformLike': ((1, 1, 1),),
    'Range': ((11, 1, 1),),
    'Reciprocal': ((1, 1, 1),),
    'ReduceL1': ((1, 1, 1),),
    'ReduceL2': ((1, 1, 1),),
    'ReduceLogSum': ((1, 1, 1),),
    'ReduceLogSumExp': ((1, 1, 1),),
    'ReduceMax': ((1, 1, 1),),
    'ReduceMean': ((1, 1, 1),),
    'ReduceMin': ((1, 1, 1),),
    'ReduceProd': ((1, 1, 1),),
    'ReduceSum': ((1, 1, 1),),
    'ReduceSumSquare': ((1, 1, 1),),
    'RegexFullMatch': ((20, 1, 1),),
    'Relu': ((1, 1, 1),),
    'Reshape': ((1, 1, 1),),
    'Resize': ((10, 1, 1),),
    'ReverseSequence': ((10, 1, 1),),
    'RoiAlign': ((10, 1, 1),),
    'RotaryEmbedding': ((23, 1, 1),),
    'Round': ((11, 1, 1),),
    'STFT': ((17, 1, 1),),
    'Scan': ((8, 1, 2147483647),),
    'Scatter': ((9, 1, 1),),
    'ScatterElements': ((11, 1, 1),),
    'ScatterND': ((11, 1, 1),),
    'Selu': ((1, 1, 1),),
    'SequenceAt': ((11, 1, 1),),
    'SequenceConstruct': ((11, 1, 1),),
    'SequenceEmpty': ((11, 1, 1),),
    'SequenceErase': ((11, 1, 1),),
    'SequenceInsert': ((11, 1, 1),),
    'SequenceLength': ((11, 1, 1),),
    'SequenceMap': ((17, 1, 2147483647),),
    'Shape': ((1, 1, 1),),
    'Shrink': ((9, 1, 1),),
    'Sigmoid': ((1, 1, 1),),
    'Sign': ((9, 1, 1),),
    'Sin': ((7, 1, 1),),
    'Sinh': ((9, 1, 1),),
    'Size': ((1, 1, 1),),
    'Slice': ((1, 1, 1),),
    'Softmax': ((1, 1, 1),),
    'SoftmaxCrossEntropyLoss': ((12, 1, 2),),
    'Softplus': ((1, 1, 1),),
    'Softsign': ((1, 1, 1),),
    'SpaceToDepth': ((1, 1, 1),),
    'Split': ((1, 1, 2147483647),),
    'SplitToSequence': ((11, 1, 1),),
    'Sqrt': ((1, 1, 1),),
    'Squeeze': ((1, 1, 1),),
    'StringConcat': ((20, 1, 1),),
    'StringNormalizer': ((10, 1, 1),),
    'StringSplit': ((20, 2, 2),),
    'Sub': ((1, 1, 1),),
    'Sum': ((1, 1, 1),),
    'SwiGLU': ((28, 1, 1),),
    'Swish': ((24, 1, 1),),
    'Tan': ((7, 1, 1),),
    'Tanh': ((1, 1, 1),),
    'TensorScatter': ((24, 1, 1),),
    'TfIdfVectorizer': ((9, 1, 1),),
    'ThresholdedRelu': ((10, 1, 1),),
    'Tile': ((1, 1, 1),),
    'TopK': ((1, 2, 2),),
    'Transpose': ((1, 1, 1),),
    'Trilu': ((14, 1, 1),),
    'Unique': ((11, 1, 4),),
    'Unsqueeze': ((1, 1, 1),),
    'Upsample': ((1, 1, 1),),
    'Where': ((9, 1, 1),),
    'Xor': ((1, 1, 1),),
}


def output_range(op_type: str, version: int) -> tuple[int, int] | None:
    """(min_output, max_output) of ``op_type`` at opset ``version`` of the standard domain, or
    None when the operator has no schema at that version (introduced later). Raises KeyError
    for an operator the table does not list."""
    best = None
    for since, lo, hi in OUTPUTS[op_type]:
        if since <= version:
            best = (lo, hi)
    return best


def table_from_onnx() -> dict:
    """The table, computed from the installed ``onnx.defs`` (the generator of :data:`OUTPUTS`)."""
    import onnx.defs

    hist: dict = {}
    for s in onnx.defs.get_all_schemas_with_history():
        if s.domain == "":
            hist.setdefault(s.name, []).append((s.since_version, s.min_output, s.max_output))
    out = {}
    for name, rows in hist.items():
        entries: list = []
        for since, lo, hi in sorted(rows):
            if not entries or entries[-1][1:] != (lo, hi):
                entries.append((since, lo, hi))
        out[name] = tuple(entries)
    return out


if __name__ == "__main__":
    for name, rows in sorted(table_from_onnx().items()):
        print(f"    {name!r}: {rows!r},")
