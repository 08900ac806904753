"""End to end: converted tiny Qwen2/Qwen3 models against transformers (torch, fp32).

(a) ``--weights float32``: logits within 1e-4 of transformers, identical greedy ids.
(b) ``--weights int4-block32``: transformers run with weights dequantized independently here
    (numpy, from the saved EncodedValueProto payloads): logits within 1e-4, identical greedy ids;
    with the default float16 block scales and with ``scale_dtype="float32"``.
Plus: prefill split across two calls, and the state loop against the manual past/present loop.
"""
from __future__ import annotations

import numpy as np
import pytest

import olv_runtime
from olv_runtime import proto as pb

import torch  # the test extra installs torch==2.13.0 (CPU) and transformers
import transformers

N_DECODE = 16
PROMPT = [5, 17, 99, 3, 42, 64, 7]


def independent_int4_dequant(ev: pb.EncodedValueProto, payload: np.ndarray) -> np.ndarray:
    """Slow obvious decode of an INT4 [N, K] blocked-axis-1 affine value (no runtime code)."""
    a = ev.affine
    assert a.storage_type == pb.TensorProto.INT4 and a.axis == 1
    n, k = (d.dim_value for d in ev.logical_type.tensor_type.shape.dim)
    b = np.asarray(payload, np.uint8)
    nib = np.empty(b.size * 2, np.int16)
    nib[0::2] = b & 0x0F
    nib[1::2] = b >> 4
    q = nib[: n * k].astype(np.int16)
    q[q >= 8] -= 16
    q = q.reshape(n, k).astype(np.float32)
    kb = -(-k // a.block_size)
    sdt = {pb.TensorProto.FLOAT: np.float32, pb.TensorProto.FLOAT16: np.float16}[a.scale.data_type]
    scale = np.frombuffer(a.scale.raw_data, sdt).reshape(n, kb).astype(np.float32)  # exact
    s = np.repeat(scale, a.block_size, axis=1)[:, :k]
    return q * s


def reference_model(ckpt_dir, onnx_path=None):
    """transformers model in float32; with ``onnx_path`` its weights are replaced by the
    independent dequantization of the model's encoded initializers."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt_dir), dtype=torch.float32)
    model.eval()
    if onnx_path is not None:
        m = olv_runtime.load(onnx_path)
        params = dict(model.named_parameters())
        n = 0
        for ev in m.graph.encoded_initializer:
            w = independent_int4_dequant(ev, m.payload(ev))
            assert ev.name in params, ev.name
            with torch.no_grad():
                params[ev.name].copy_(torch.from_numpy(w))
            n += 1
        assert n >= 7  # every linear weight (+ embedding) is encoded
    return model


def hf_greedy(model, prompt, steps):
    """Greedy decode with full-sequence forwards (no cache): an independent reference."""
    ids = list(prompt)
    all_logits = []
    with torch.no_grad():
        for _ in range(steps + 1):
            out = model(torch.tensor([ids])).logits[0].numpy()
            if not all_logits:
                all_logits.append(out)  # prefill: every position
            else:
                all_logits.append(out[-1:])
            ids.append(int(np.argmax(out[-1])))
    return ids[len(prompt):], all_logits


def olv_greedy(path, prompt, steps):
    model = olv_runtime.load(path)
    state = olv_runtime.make_state(model, olv_runtime.empty_cache(model))
    ids = list(prompt)
    logits_seq = []
    feed = np.array([prompt], np.int64)
    for _ in range(steps + 1):
        logits = state.run({"input_ids": feed})["logits"][0]
        logits_seq.append(logits)
        nxt = int(np.argmax(logits[-1]))
        ids.append(nxt)
        feed = np.array([[nxt]], np.int64)
    return ids[len(prompt):], logits_seq


CHECKPOINTS = ["tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_qwen2_untied_dir"]


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
@pytest.mark.parametrize("weights", ["float32", "int4-block32", "int4-block32/float32-scales"])
def test_matches_transformers(request, tmp_path, ckpt, weights):
    ckpt_dir = request.getfixturevalue(ckpt)
    path = tmp_path / "model.onnx"
    kw = {"scale_dtype": "float32"} if weights.endswith("/float32-scales") else {}
    weights = weights.split("/")[0]
    olv_runtime.convert(ckpt_dir, path, weights=weights, **kw)
    if weights == "int4-block32":  # the default stores float16 scales (4.5 bits per weight)
        want = pb.TensorProto.FLOAT if kw else pb.TensorProto.FLOAT16
        encoded = olv_runtime.load(path).graph.encoded_initializer
        assert encoded and all(ev.affine.scale.data_type == want for ev in encoded)
    ref = reference_model(ckpt_dir, path if weights == "int4-block32" else None)
    ref_ids, ref_logits = hf_greedy(ref, PROMPT, N_DECODE)
    ids, logits = olv_greedy(path, PROMPT, N_DECODE)
    assert len(logits) == len(ref_logits) == N_DECODE + 1
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(logits, ref_logits))
    assert worst <= 1e-4, f"max |logit difference| {worst:.3g}"
    assert ids == ref_ids


@pytest.fixture(scope="module")
def int4_model(tmp_path_factory, tiny_qwen2_dir):
    path = tmp_path_factory.mktemp("int4") / "model.onnx"
    olv_runtime.convert(tiny_qwen2_dir, path, weights="int4-block32")
    return path


def test_prefill_split_equals_single_call(int4_model):
    model = olv_runtime.load(int4_model)
    ids = np.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]], np.int64)
    one = olv_runtime.make_state(model, olv_runtime.empty_cache(model))
    full = one.run({"input_ids": ids})["logits"][0, -1]
    two = olv_runtime.make_state(model, olv_runtime.empty_cache(model))
    two.run({"input_ids": ids[:, :4]})
    split = two.run({"input_ids": ids[:, 4:]})["logits"][0, -1]
    assert float(np.max(np.abs(full - split))) <= 1e-5


def test_state_loop_equals_manual_loop(int4_model):
    model = olv_runtime.load(int4_model)
    sess = olv_runtime.InferenceSession(model)
    state = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    bindings = [(b.input_name, b.output_name) for b in model.graph.persistent_bindings]
    past = olv_runtime.empty_cache(sess)
    out_names = [o.name for o in sess.get_outputs()]
    feed = np.array([[7, 8, 9]], np.int64)
    for _ in range(6):
        s_out = state.run({"input_ids": feed})
        m_out = dict(zip(out_names, sess.run(None, {"input_ids": feed, **past})))
        for name in out_names:
            np.testing.assert_array_equal(s_out[name], m_out[name])
        past = {i: m_out[o] for i, o in bindings}
        feed = np.array([[int(np.argmax(m_out["logits"][0, -1]))]], np.int64)
    # the retained values are the output arrays themselves (no copy)
    for i, o in bindings:
        assert np.shares_memory(state.values[i], s_out[o])


def test_generate_greedy_matches_state_loop(int4_model):
    ids, _ = olv_greedy(int4_model, PROMPT, 9)
    got = olv_runtime.generate(olv_runtime.load(int4_model), PROMPT, max_new_tokens=10)
    assert got.tolist() == ids


def test_generate_sampling_is_seeded(int4_model):
    m = olv_runtime.load(int4_model)
    a = olv_runtime.generate(m, PROMPT, 12, temperature=0.8, top_k=20, top_p=0.9, seed=123)
    b = olv_runtime.generate(m, PROMPT, 12, temperature=0.8, top_k=20, top_p=0.9, seed=123)
    assert a.tolist() == b.tolist() and len(a) == 12
    seen = []
    olv_runtime.generate(m, PROMPT, 5, callback=seen.append)
    assert len(seen) == 5
