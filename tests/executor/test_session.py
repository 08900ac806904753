"""InferenceSession: plan, fusion, feed validation, errors; CLI commands."""
from __future__ import annotations

import numpy as np
import pytest

import olv_runtime
from olv_runtime import proto as pb
from olv_runtime.cli import main as cli_main
from olv_runtime.errors import (
    InvalidArgument,
    MissingDecoderError,
    UnsupportedOperatorError,
    ValidationError,
)
from olv_runtime.proto.helper import make_node, make_tensor, make_tensor_value_info
from olv_runtime.structs.quantize import quantize_int4_blockwise


def _model(nodes, inputs, outputs, inits=(), encoded=(), opsets=(("", 23), ("olv", 1))):
    m = pb.ModelProto(ir_version=10)
    for d, v in opsets:
        m.opset_import.add(domain=d, version=v)
    g = m.graph
    g.node.extend(nodes)
    g.input.extend(inputs)
    g.output.extend(outputs)
    g.initializer.extend(inits)
    g.encoded_initializer.extend(encoded)
    return m


def _encoded_weight(name, w):
    from olv_runtime.proto.helper import make_affine_encoded

    payload, scale = quantize_int4_blockwise(w)
    return make_affine_encoded(name, payload.tobytes(), pb.TensorProto.INT4, list(w.shape), scale,
                               None, axis=1, block_size=32)


def _linear_model(n=48, k=40, fused_consumers=True):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float32)
    ev = _encoded_weight("W", w)
    nodes = [
        make_node("Decode", ["W"], ["Wf"], name="dec", domain="olv"),
        make_node("Transpose", ["Wf"], ["Wt"], name="tr", perm=[1, 0]),
        make_node("MatMul", ["x", "Wt"], ["y"], name="mm"),
        make_node("Gather", ["Wf", "ids"], ["rows"], name="emb", axis=0),
    ]
    outputs = [make_tensor_value_info("y", pb.TensorProto.FLOAT, ["m", n]),
               make_tensor_value_info("rows", pb.TensorProto.FLOAT, ["r", k])]
    if not fused_consumers:
        nodes.append(make_node("Identity", ["Wf"], ["wcopy"], name="id"))
        outputs.append(make_tensor_value_info("wcopy", pb.TensorProto.FLOAT, [n, k]))
    inputs = [make_tensor_value_info("x", pb.TensorProto.FLOAT, ["m", k]),
              make_tensor_value_info("ids", pb.TensorProto.INT64, ["r"])]
    return _model(nodes, inputs, outputs, encoded=[ev]), ev


def test_fusion_never_materialises_the_weight():
    m, ev = _linear_model()
    sess = olv_runtime.InferenceSession(m)
    kinds = [k for k, _ in sess.plan()]
    assert kinds == ["Linear", "EncodedGather"], sess.plan()
    x = np.random.default_rng(1).standard_normal((3, 40)).astype(np.float32)
    ids = np.array([0, 47, -1, 5], np.int64)
    y, rows = sess.run(None, {"x": x, "ids": ids})
    assert sess.counters["bytes_dequantized"] == 0
    ref = olv_runtime.InferenceSession(m, olv_runtime.SessionOptions(enable_fusion=False))
    y2, rows2 = ref.run(None, {"x": x, "ids": ids})
    assert ref.counters["bytes_dequantized"] == 48 * 40 * 4
    np.testing.assert_array_equal(rows, rows2)
    np.testing.assert_allclose(y, y2, rtol=1e-5, atol=1e-5)


def test_fused_residual_add_broadcasts_as_onnx_add():
    """MatMul + Add fused into one Linear step keeps Add's broadcasting, and shapes Add would
    reject raise InvalidArgument (not a numpy error from inside the step)."""
    from olv_runtime.errors import InvalidArgument

    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 40)).astype(np.float32)
    nodes = [make_node("Identity", ["r_in"], ["r"], name="id"),
             make_node("Decode", ["W"], ["Wf"], name="dec", domain="olv"),
             make_node("Transpose", ["Wf"], ["Wt"], name="tr", perm=[1, 0]),
             make_node("MatMul", ["x", "Wt"], ["y"], name="mm"),
             make_node("Add", ["y", "r"], ["out"], name="add")]
    m = _model(nodes, [make_tensor_value_info("x", pb.TensorProto.FLOAT, None),
                       make_tensor_value_info("r_in", pb.TensorProto.FLOAT, None)],
               [make_tensor_value_info("out", pb.TensorProto.FLOAT, None)],
               encoded=[_encoded_weight("W", w)])
    sess = olv_runtime.InferenceSession(m)
    assert [k for k, _ in sess.plan()] == ["Identity", "Linear"], sess.plan()
    ref = olv_runtime.InferenceSession(m, olv_runtime.SessionOptions(enable_fusion=False))
    for xs, rs in [((3, 40), (3, 48)), ((1, 3, 40), (48,)), ((2, 3, 40), (3, 1)),
                   ((1, 40), (4, 48)), ((3, 40), (2, 1, 48))]:
        x = rng.standard_normal(xs).astype(np.float32)
        r = rng.standard_normal(rs).astype(np.float32)
        (out,), (want,) = sess.run(None, {"x": x, "r_in": r}), ref.run(None, {"x": x, "r_in": r})
        assert out.shape == want.shape == np.broadcast_shapes(xs[:-1] + (48,), rs)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(InvalidArgument, match="not broadcastable") as e:
        sess.run(None, {"x": np.ones((96, 40), np.float32), "r_in": np.ones((1, 3, 48), np.float32)})
    assert e.value.__cause__ is None


def test_decode_with_another_consumer_is_materialised():
    m, _ = _linear_model(fused_consumers=False)
    sess = olv_runtime.InferenceSession(m)
    kinds = [k for k, _ in sess.plan()]
    assert "Decode" in kinds and "Linear" in kinds
    x = np.ones((1, 40), np.float32)
    y, rows, wcopy = sess.run(None, {"x": x, "ids": np.array([1], np.int64)})
    np.testing.assert_array_equal(rows[0], wcopy[1])
    np.testing.assert_allclose(y[0], wcopy.sum(axis=1), rtol=1e-5, atol=1e-4)


def test_tensor_only_op_given_encoded_value_fails_at_creation():
    _, ev = _linear_model()
    m = _model([make_node("Transpose", ["W"], ["y"], name="bad", perm=[1, 0])], [],
               [make_tensor_value_info("y", pb.TensorProto.FLOAT, [40, 48])], encoded=[ev])
    with pytest.raises(MissingDecoderError, match="olv.Decode"):
        olv_runtime.InferenceSession(m)


def test_unsupported_operator_names_op_and_domain():
    x = make_tensor_value_info("x", pb.TensorProto.FLOAT, [2])
    m = _model([make_node("Hardmax", ["x"], ["y"], name="h")], [x],
               [make_tensor_value_info("y", pb.TensorProto.FLOAT, [2])])
    with pytest.raises(UnsupportedOperatorError, match=r"ai\.onnx::Hardmax"):
        olv_runtime.InferenceSession(m)
    m2 = _model([make_node("Frobnicate", ["x"], ["y"], name="f", domain="acme")], [x],
                [make_tensor_value_info("y", pb.TensorProto.FLOAT, [2])],
                opsets=(("", 23), ("acme", 3)))
    with pytest.raises(UnsupportedOperatorError, match=r"acme::Frobnicate"):
        olv_runtime.InferenceSession(m2)


def test_graph_errors():
    x = make_tensor_value_info("x", pb.TensorProto.FLOAT, [2])
    y = make_tensor_value_info("y", pb.TensorProto.FLOAT, [2])
    with pytest.raises(ValidationError, match="'nope'"):
        olv_runtime.InferenceSession(_model([make_node("Add", ["x", "nope"], ["y"])], [x], [y]))
    cyc = [make_node("Neg", ["b"], ["a"], name="n1"), make_node("Neg", ["a"], ["b"], name="n2"),
           make_node("Neg", ["x"], ["y"], name="n3")]
    with pytest.raises(ValidationError, match="cycle"):
        olv_runtime.InferenceSession(_model(cyc, [x], [y]))
    dup = [make_tensor("x2", np.ones(2, np.float32))]
    m = _model([make_node("Add", ["x", "x2"], ["y"])], [x], [y], inits=dup)
    _, ev = _linear_model()
    ev2 = pb.EncodedValueProto()
    ev2.CopyFrom(ev)
    ev2.name = "x2"
    m.graph.encoded_initializer.append(ev2)
    with pytest.raises(ValidationError, match="unique across dense, sparse and encoded"):
        olv_runtime.InferenceSession(m)


def _add_model():
    x = make_tensor_value_info("x", pb.TensorProto.FLOAT, ["n", 3])
    y = make_tensor_value_info("y", pb.TensorProto.FLOAT, ["n", 3])
    w = make_tensor("w", np.arange(3, dtype=np.float32))
    return olv_runtime.InferenceSession(_model([make_node("Add", ["x", "w"], ["y"])], [x], [y], [w]))


def test_feed_validation():
    sess = _add_model()
    assert [(a.name, a.type, a.shape) for a in sess.get_inputs()] == [("x", "tensor(float)", ["n", 3])]
    assert [a.name for a in sess.get_outputs()] == ["y"]
    good = np.zeros((2, 3), np.float32)
    with pytest.raises(InvalidArgument, match="unknown input 'z'"):
        sess.run(None, {"x": good, "z": good})
    with pytest.raises(InvalidArgument, match="missing input 'x'"):
        sess.run(None, {})
    with pytest.raises(InvalidArgument, match="expected element type FLOAT"):
        sess.run(None, {"x": good.astype(np.float64)})
    with pytest.raises(InvalidArgument, match="expected rank 2"):
        sess.run(None, {"x": np.zeros(3, np.float32)})
    with pytest.raises(InvalidArgument, match="dimension 1 must be 3"):
        sess.run(None, {"x": np.zeros((2, 4), np.float32)})
    with pytest.raises(InvalidArgument, match="not C-contiguous"):
        sess.run(None, {"x": np.zeros((3, 2), np.float32).T})
    with pytest.raises(InvalidArgument, match="byte-swapped"):
        sess.run(None, {"x": good.astype(">f4")})
    with pytest.raises(InvalidArgument, match="numpy array or a DLPack"):
        sess.run(None, {"x": [[0.0, 0.0, 0.0]]})
    with pytest.raises(InvalidArgument, match="unknown output"):
        sess.run(["nope"], {"x": good})


def test_torch_tensors_enter_without_copy():
    import torch

    sess = _add_model()
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    feeds = sess.prepare_feeds({"x": t})
    assert feeds["x"].ctypes.data == t.data_ptr()
    (y,) = sess.run(None, {"x": t})
    np.testing.assert_array_equal(y, t.numpy() + np.arange(3, dtype=np.float32))
    with pytest.raises(InvalidArgument, match="not C-contiguous"):
        sess.run(None, {"x": torch.zeros(3, 2).T})


def test_cli_convert_generate_inspect(tmp_path, tiny_qwen2_dir, capsys):
    out = tmp_path / "m.onnx"
    assert cli_main(["convert", str(tiny_qwen2_dir), str(out)]) == 0
    assert (tmp_path / "tokenizer.json").exists()
    assert "wrote" in capsys.readouterr().out
    assert cli_main(["generate", str(out), "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert "decode" in captured.err and "tok/s" in captured.err
    expected = olv_runtime.generate(olv_runtime.load(out), [1, 2, 3], 4).tolist()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert captured.out == tok.decode(expected) + "\n"  # streamed pieces add up to the text
    assert cli_main(["generate", str(out), "--prompt", "a b c", "--max-new-tokens", "3"]) == 0
    assert cli_main(["inspect", str(out), "-v"]) == 0
    text = capsys.readouterr().out
    assert "binding past_key.0 <- present_key.0" in text and "affine INT4" in text
    assert cli_main(["bench", str(out), "--prompt-len", "4", "--new-tokens", "3", "--runs", "1"]) == 0


def test_cli_argument_errors(tmp_path, tiny_qwen2_dir, capsys):
    out = tmp_path / "m.onnx"
    olv_runtime.convert(tiny_qwen2_dir, out)
    capsys.readouterr()
    cases = [
        (["--prompt-ids", "1 2 3"], "comma-separated integers"),
        (["--prompt-ids", "1,,2"], "got item ''"),
        (["--prompt-ids=-1,2"], "token ids must be in [0, 128)"),
        (["--prompt-ids", "1", "--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--prompt-ids", "1", "--temperature", "nan"], "temperature must be a finite"),
        (["--prompt-ids", "1", "--threads", "999"], "num_threads must be in [1,"),
    ]
    for extra, msg in cases:
        assert cli_main(["generate", str(out), *extra]) == 2, extra
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, (extra, err)
    with pytest.raises(SystemExit):
        cli_main(["bench", str(out), "--runs", "0"])
    assert "expected an integer >= 1" in capsys.readouterr().err


def test_generate_streams_multibyte_text(tmp_path, capsys):
    from olv_runtime.models.random_checkpoint import write_random_qwen2

    ckpt = write_random_qwen2(tmp_path / "ck", hidden_size=32, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    olv_runtime.convert(ckpt, tmp_path / "m.onnx")
    capsys.readouterr()
    assert cli_main(["generate", str(tmp_path / "m.onnx"), "--prompt", "café ü",
                     "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = olv_runtime.generate(olv_runtime.load(tmp_path / "m.onnx"), tok.encode("café ü").ids, 12)
    # the streamed pieces add up to the decoded text: no character split across tokens is lost
    assert out == "café ü" + tok.decode(ids.tolist()) + "\n"


def test_cli_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(["generate", str(tmp_path / "x.onnx")])  # no prompt source
    assert cli_main(["generate", str(tmp_path / "x.onnx"), "--prompt-ids", "1"]) == 2
    assert "model file not found" in capsys.readouterr().err
    assert cli_main(["convert", str(tmp_path / "nodir"), str(tmp_path / "o.onnx")]) == 2


def test_demo_runs(tmp_path, capsys):
    assert cli_main(["demo", "--workdir", str(tmp_path), "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr()
    assert "generated 5 tokens" in out.err


def test_generate_leaves_special_tokens_out_of_the_text(tmp_path, capsys, monkeypatch):
    """``olv generate`` prints the text without special tokens (``--special`` keeps them);
    ``generate(skip_special_tokens=...)`` is passed to the tokenizer's decode."""
    from tokenizers import Tokenizer

    import olv_runtime.cli as cli
    from olv_runtime.models.random_checkpoint import write_random_qwen2

    ckpt = write_random_qwen2(tmp_path / "ck", hidden_size=32, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    olv_runtime.convert(ckpt, tmp_path / "m.onnx")
    real = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    prompt = real.encode("hello world").ids
    ids = olv_runtime.generate(olv_runtime.load(tmp_path / "m.onnx"), prompt, 8,
                               eos_token_id=None).tolist()
    special = ids[3]

    class Marked:  # the real tokenizer, with the 4th generated id treated as a special token
        def encode(self, *a, **k):
            return real.encode(*a, **k)

        def get_vocab_size(self, *a, **k):
            return real.get_vocab_size(*a, **k)

        def decode(self, seq, skip_special_tokens=False):
            return "".join("<SPECIAL>" if i == special and not skip_special_tokens
                           else real.decode([i]) for i in seq)

        def __getattr__(self, name):
            return getattr(real, name)

    res = olv_runtime.generate(olv_runtime.load(tmp_path / "m.onnx"), prompt, 8,
                               eos_token_id=None, tokenizer=Marked(), return_result=True,
                               skip_special_tokens=True)
    assert res.ids.tolist() == ids and "<SPECIAL>" not in res.text
    res = olv_runtime.generate(olv_runtime.load(tmp_path / "m.onnx"), prompt, 8,
                               eos_token_id=None, tokenizer=Marked(), return_result=True,
                               skip_special_tokens=False)  # (the default is True since issue 26)
    assert "<SPECIAL>" in res.text

    monkeypatch.setattr(cli, "_tokenizer_for", lambda path: Marked())
    capsys.readouterr()
    base = ["generate", str(tmp_path / "m.onnx"), "--prompt-ids", ",".join(map(str, prompt)),
            "--max-new-tokens", "8", "--ignore-eos", "--output", "text"]
    assert cli.main(base) == 0
    assert "<SPECIAL>" not in capsys.readouterr().out
    assert cli.main(base + ["--special"]) == 0
    assert "<SPECIAL>" in capsys.readouterr().out
