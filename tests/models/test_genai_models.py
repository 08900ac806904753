"""onnxruntime-genai builder models run by olv (issue 12 item 3 and its acceptance).

Tiny random Qwen2 and Qwen3 checkpoints (Qwen3 with head_dim 32 != hidden 64 / 4 heads) are
written with transformers and converted once per session by
``python -m onnxruntime_genai.models.builder -p int4 -e cpu`` (the four builds one after the other
in one subprocess, each run as ``-m`` runs it), with float activations
(``--extra_options accuracy_level=0``; onnxruntime-genai 0.18 ignores the older alias
``int4_accuracy_level=0`` and writes accuracy_level 4) and with the builder's default
(accuracy_level 4, int8 activations allowed). olv runs the folder as written: greedy ids equal
onnxruntime-genai's for 32 new tokens, prompt logits within 1e-4 of onnxruntime on the same file,
``bytes_dequantized`` 0, every MatMulNBits fused into a packed linear step.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import onnxruntime_genai as og
import pytest
import torch
import transformers

from olv_runtime.executor.session import InferenceSession, SessionOptions
from olv_runtime.state import empty_cache, make_state

PROMPT = [3, 17, 42, 99, 5, 7]
N_NEW = 32


def _checkpoint(kind: str, out: pathlib.Path) -> pathlib.Path:
    from transformers import PreTrainedTokenizerFast

    from olv_runtime.models.random_checkpoint import build_tokenizer

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False)
    cfg = (transformers.Qwen2Config(**common) if kind == "qwen2"
           else transformers.Qwen3Config(head_dim=32, **common))
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.save_pretrained(out)
    PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(256),
                            eos_token="<|endoftext|>").save_pretrained(out)
    return out


#: Runs ``python -m onnxruntime_genai.models.builder ARGS`` (runpy, as ``-m`` does) for each
#: argument list in argv[1] (JSON), one after the other in this one process: the builder's
#: imports (torch, transformers, onnx; 7 of its 10 s per build) are paid once, not four times.
#: Each build's files are byte-identical to those of a build in a process of its own.
_BUILD_ALL = """
import json, runpy, sys
for args in json.loads(sys.argv[1]):
    print("building", args, file=sys.stderr, flush=True)
    sys.argv = ["builder", *args]
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
"""


def _build_args(ckpt: pathlib.Path, out: pathlib.Path, extra: list[str]) -> list[str]:
    args = ["-i", str(ckpt), "-o", str(out), "-p", "int4", "-e", "cpu",
            "-c", f"{out}.cache"]  # its own (empty, removed) cache directory, not ./cache_dir
    if extra:
        args += ["--extra_options", *extra]
    return args


@pytest.fixture(scope="session")
def genai_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("genai")
    for kind in ("qwen2", "qwen3"):
        _checkpoint(kind, root / f"{kind}_ckpt")
    # a bfloat16 checkpoint (as real ones are): the builder's scales absmax / -8 are then float16
    # values, which the compiled step reads as float16 (exactly)
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(root / "qwen2_ckpt",
                                                             dtype=torch.bfloat16)
    bf16.save_pretrained(root / "qwen2_bf16_ckpt")
    for f in (root / "qwen2_ckpt").glob("tokenizer*"):
        (root / "qwen2_bf16_ckpt" / f.name).write_bytes(f.read_bytes())
    built = {"qwen2": (root / "qwen2_ckpt", root / "qwen2_fp", ["accuracy_level=0"]),
             "qwen3": (root / "qwen3_ckpt", root / "qwen3_fp", ["accuracy_level=0"]),
             "qwen2_default": (root / "qwen2_ckpt", root / "qwen2_default", []),
             "qwen2_bf16": (root / "qwen2_bf16_ckpt", root / "qwen2_bf16", ["accuracy_level=0"])}
    res = subprocess.run([sys.executable, "-c", _BUILD_ALL,
                          json.dumps([_build_args(*b) for b in built.values()])],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    return {kind: out for kind, (_, out, _) in built.items()}


def _accuracy_levels(folder: pathlib.Path) -> set[int]:
    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    return {a.i for n in m.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
            if a.name == "accuracy_level"} or {0}


def _ort_feeds(folder: pathlib.Path, ids: np.ndarray) -> dict:
    dec = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in range(dec["num_hidden_layers"]):
        for side in ("key", "value"):
            feeds[dec["inputs"][f"past_{side}_names"] % i] = np.zeros(
                (1, dec["num_key_value_heads"], 0, dec["head_size"]), np.float32)
    return feeds


def _greedy_olv(folder: pathlib.Path, options: SessionOptions | None = None):
    from olv_runtime.state import StateOptions

    path = str(folder / "model.onnx")
    st = make_state(path, empty_cache(path),
                    StateOptions(session_options=options) if options else None)
    out = []
    logits = st.run({"input_ids": np.array([PROMPT], np.int64)})["logits"]
    for _ in range(N_NEW):
        t = int(np.argmax(logits[0, -1]))
        out.append(t)
        logits = st.run({"input_ids": np.array([[t]], np.int64)})["logits"]
    return out, st


def _greedy_genai(folder: pathlib.Path):
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    total = len(PROMPT) + N_NEW
    params.set_search_options(max_length=total, min_length=total, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([PROMPT], np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)][len(PROMPT):]


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_greedy_ids_equal_onnxruntime_genai(genai_models, kind):
    folder = genai_models[kind]
    assert _accuracy_levels(folder) == {0}
    ours, st = _greedy_olv(folder)
    assert ours == _greedy_genai(folder)
    assert st.session.counters.snapshot()["bytes_dequantized"] == 0
    # every step, those inside the compiled DecoderStack (qwen2) included
    kinds = [s.kind for s in st.session.all_steps()]
    assert "MatMulNBits" not in kinds and kinds.count("Linear") >= 7  # fused (merged siblings)
    assert "GroupQueryAttention" in kinds
    assert ("DecoderStack" in kinds) == (kind == "qwen2")  # qwen3: q/k norms, per operator


def _decode(sess, steps=10):
    st = make_state(sess, empty_cache(sess))
    feed = np.array([PROMPT], np.int64)
    ids, logits = [], []
    for _ in range(steps):
        lg = st.run({"input_ids": feed})["logits"][0, -1].copy()
        logits.append(lg)
        ids.append(int(np.argmax(lg)))
        feed = np.array([[ids[-1]]], np.int64)
    return ids, logits


@pytest.mark.parametrize("kind,quant,threads", [
    ("qwen2", False, 1), ("qwen2", False, 2), ("qwen2", True, 1), ("qwen2", True, 2),
    ("qwen2_bf16", False, 2), ("qwen2_bf16", True, 2)])
def test_decode_runs_in_the_compiled_step(genai_models, kind, quant, threads, monkeypatch):
    """The builder's layers (SimplifiedLayerNormalization, packed-QKV MatMulNBits,
    GroupQueryAttention, SkipSimplifiedLayerNormalization) run as one compiled DecoderStack step
    for each decode token. Against the per-operator plan: the same greedy ids, logits within
    float32 rounding as for olv's own models (test_decoder_stack: exact 1e-4, int8 activations
    5e-2; the step's SiLU uses libm's exp, the plan numpy's). From a bfloat16 checkpoint the
    step reads the float32 scales as float16 (all are float16 values): bitwise equal to the same
    step reading float32 scales."""
    from olv_runtime.executor import decoder_step as decoder_stack
    from olv_runtime.kernels import get_num_threads, set_num_threads

    path = str(genai_models[kind] / "model.onnx")
    nt = get_num_threads()
    runs = {}
    try:
        for compiled in (False, True, "wide"):
            if compiled == "wide":
                if kind != "qwen2_bf16":
                    continue
                monkeypatch.setattr(decoder_stack, "narrow_scales", lambda *a, **k: False)
            sess = InferenceSession(path, SessionOptions(
                compiled_decode=bool(compiled), quantize_activations=quant, num_threads=threads))
            kinds = [k for k, _ in sess.plan()]
            calls = [0]
            if compiled:
                assert kinds.count("DecoderStack") == 1
                assert "GroupQueryAttention" not in kinds and "Linear" not in kinds
                ds = next(s.impl for s in sess.all_steps() if s.kind == "DecoderStack")
                want = np.uint16 if kind == "qwen2_bf16" and compiled is True else np.float32
                assert all(sc.dtype == want for sc in ds.scales)
                inner = ds.run_kernel

                def counted(*a, _inner=inner):
                    calls[0] += 1
                    return _inner(*a)
                ds.run_kernel = counted
            ids, logits = _decode(sess)
            runs[compiled] = (ids, logits, calls[0])
    finally:
        set_num_threads(nt)
    assert runs[True][2] == 9  # every decode token (not the prompt) ran the compiled step
    assert runs[True][0] == runs[False][0]
    worst = max(float(np.abs(a - b).max()) for a, b in zip(runs[True][1], runs[False][1]))
    assert worst <= (5e-2 if quant else 1e-4), worst
    if "wide" in runs:
        assert runs["wide"][0] == runs[True][0]
        for a, b in zip(runs[True][1], runs["wide"][1]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_prompt_logits_match_onnxruntime(genai_models, kind):
    folder = genai_models[kind]
    path = str(folder / "model.onnx")
    ids = np.array([PROMPT], np.int64)
    feeds = _ort_feeds(folder, ids)
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    sess = InferenceSession(path)
    got = sess.run(None, {k: v for k, v in feeds.items() if k != "attention_mask"})
    np.testing.assert_allclose(got[0], ref[0], atol=1e-4, rtol=0)
    for g, r in zip(got[1:], ref[1:]):  # present KV
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=0)
    snap = sess.counters.snapshot()
    assert snap["bytes_dequantized"] == 0 and snap["bytes_repacked"] > 0


def test_builder_default_accuracy_level_4_runs(genai_models):
    """accuracy_level 4 permits int8 activations: olv runs it in its exact mode by default and
    with SessionOptions(quantize_activations=True) (what the attribute permits)."""
    folder = genai_models["qwen2_default"]
    assert _accuracy_levels(folder) == {4}
    path = str(folder / "model.onnx")
    ids = np.array([PROMPT], np.int64)
    feeds = _ort_feeds(folder, ids)
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    olv_feeds = {k: v for k, v in feeds.items() if k != "attention_mask"}
    exact = InferenceSession(path).run(None, olv_feeds)[0]
    fast = InferenceSession(path, SessionOptions(quantize_activations=True)).run(None, olv_feeds)[0]
    scale = float(np.max(np.abs(ref)))
    assert np.max(np.abs(exact - ref)) < 0.05 * scale  # int8 activation error of onnxruntime
    assert np.max(np.abs(fast - ref)) < 0.05 * scale
    ours, _ = _greedy_olv(folder, SessionOptions(quantize_activations=True))
    assert len(ours) == N_NEW


def test_olv_generate_cli_runs_the_folder(genai_models):
    folder = genai_models["qwen2"]
    res = subprocess.run(
        [sys.executable, "-m", "olv_runtime.cli", "generate", str(folder / "model.onnx"),
         "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "8", "--output", "ids"],
        capture_output=True, text=True)
    if res.returncode != 0 and "--output" in res.stderr:
        res = subprocess.run(
            [sys.executable, "-m", "olv_runtime.cli", "generate", str(folder / "model.onnx"),
             "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "8"],
            capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    res = subprocess.run(
        [sys.executable, "-m", "olv_runtime.cli", "bench", str(folder / "model.onnx"),
         "--prompt-len", "4", "--new-tokens", "4", "--runs", "1"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "bytes dequantized 0" in res.stdout


def test_folder_is_adapted_in_memory_only(genai_models):
    """The KV feedback comes from genai_config.json; the file on disk is unchanged."""
    from olv_runtime.io import load

    folder = genai_models["qwen2"]
    before = (folder / "model.onnx").read_bytes()
    m = load(folder / "model.onnx")
    bindings = {(b.input_name, b.output_name) for b in m.proto.graph.persistent_bindings}
    assert ("past_key_values.0.key", "present.0.key") in bindings and len(bindings) == 4
    assert "attention_mask" not in {vi.name for vi in m.proto.graph.input}
    assert (folder / "model.onnx").read_bytes() == before


def test_engine_runs_the_folder(genai_models):
    """Issue 23: an onnxruntime-genai folder works in the batching engine (its plan runs the
    requests one by one inside each step, said once) with generate's results; the ids equal
    onnxruntime-genai's greedy ones."""
    from olv_runtime import Engine, GenerationConfig, InferenceSession, generate_result, load

    folder = genai_models["qwen2"]
    sess = InferenceSession(load(folder / "model.onnx"))
    eng = Engine(sess, max_batch=3)
    assert not eng.batched and "past_key_values.0.key" in eng.fallback_reason
    cfg = GenerationConfig(max_new_tokens=N_NEW, eos_token_id=None)
    prompts = [PROMPT, PROMPT[:3], PROMPT + PROMPT[:2]]
    res = eng.generate(prompts, cfg)
    for p, r in zip(prompts, res):
        assert r.ids.tolist() == generate_result(sess, p, cfg).ids.tolist()
    assert res[0].ids.tolist() == _greedy_genai(folder)
