"""The compiled decode step on GGUF block weights (Q8_0, Q5_0, Q4_1, Q5_1, Q4_K, Q5_K, Q6_K; mixed
per tensor, with INT4 parts from Q4_0 tensors, as llama.cpp's Q4_K_M and Q5_K_M files are).

Oracles: the per-operator plan of the same session options (``compiled_decode=False``: one
:mod:`olv_runtime.kernels.ggml_packed` kernel call per linear, itself checked against gguf-py in
tests/kernels/test_ggml_packed.py) -- bitwise for one linear of mixed parts (the same serial group
functions), and for whole models the tolerance of tests/executor/test_decoder_stack.py (exact
mode 1e-4, int8 activations 5e-2) with the same greedy tokens; the step must really run (the plan
holds the DecoderStack, its compiled kernel runs every one-token call) and dequantize nothing.
A qwen3 file (per-head q/k norms) compiles and matches too, with contiguous and paged KV.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf_models import random_kquant, write_gguf

import olv_runtime
from olv_runtime import proto as pb
from olv_runtime.executor import decoder_step
from olv_runtime.kernels import decoder_layers as dl
from olv_runtime.kernels import (
    get_num_threads,
    packed_f32,
    packed_i8,
    set_num_threads,
    threading_layer,
)
from olv_runtime.kernels import ggml_packed as gp
from olv_runtime.kernels.packed_i8_gemm import linear_packed_i8
from olv_runtime.kernels.step_buffers import (
    GGMLState,
    StackWorkspace,
    StepWeights,
    WeightTable,
)
from olv_runtime.kernels.step_sync import barrier_slots
from olv_runtime.models.paged_kv import to_paged

PROMPT = [5, 17, 99, 3, 42, 64, 7]

#: llama.cpp's Q4_K_M choices in a tiny model (hidden 256, so K-quants fit every K), plus what
#: the step must take apart: q|k|v over three block types with an INT4 (Q4_0) part first, and
#: gate / up of two types (two Linear steps of the plan each)
MIX = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_0",
       "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "output": "Q6_K",
       "blk.1.attn_q.weight": "Q4_0", "blk.1.attn_v.weight": "Q6_K",
       "blk.1.ffn_up.weight": "Q6_K", "blk.1.ffn_down.weight": "Q4_K"}
#: a Q5_K_M-like mix (Q5_K, Q6_K for attn_v / ffn_down / output) with Q5_1 and Q4_1 tensors in
#: layer 1: q|k|v over Q5_K, Q5_1, Q4_1 (three ggml parts), gate / up Q5_K / Q4_1
MIX5 = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K",
        "blk.1.attn_k.weight": "Q5_1", "blk.1.attn_v.weight": "Q4_1",
        "blk.1.ffn_up.weight": "Q4_1", "blk.1.ffn_down.weight": "Q5_K"}
MODELS = ["Q8_0", "Q5_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "mix", "mix5"]
#: the ggml type ids (and 0: INT4) of the mixes' parts
MIX_KINDS = {"mix": {0, 6, 8, 12, 14}, "mix5": {3, 7, 13, 14}}
#: the file type of each model (a mix: the type of the tensors it does not name)
FILE_TYPE = {"mix": ("Q4_K", MIX), "mix5": ("Q5_K", MIX5)}


@pytest.fixture(scope="module")
def ggml_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("ggml_stack")
    out = {}
    for name in MODELS:
        sub = d / name
        sub.mkdir()
        ttype, types = FILE_TYPE.get(name, (name, None))
        path = write_gguf(sub / "m.gguf", "qwen2", ttype, seed=3, tied=False, tokenizer=False,
                          types=types)
        olv_runtime.convert(path, sub / "m.onnx")
        out[name] = olv_runtime.load(sub / "m.onnx")
    return out


def _session(model, compiled, quant, threads=None):
    return olv_runtime.InferenceSession(model, olv_runtime.SessionOptions(
        compiled_decode=compiled, quantize_activations=quant, num_threads=threads))


def _stack(sess):
    (stack,) = [s.impl for s in sess.all_steps() if s.kind == "DecoderStack"]
    return stack


def _greedy(sess, steps=8):
    st = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    feed = np.array([PROMPT], np.int64)
    ids, logits = [], []
    for _ in range(steps):
        lg = st.run({"input_ids": feed})["logits"][0, -1].copy()
        logits.append(lg)
        ids.append(int(np.argmax(lg)))
        feed = np.array([[ids[-1]]], np.int64)
    return ids, logits


def _counting(stack):
    """Count the compiled step's calls (a silent fallback to the sub-steps would not)."""
    calls = []
    real = stack.run_kernel

    def counting(*a):
        calls.append(1)
        return real(*a)
    stack.run_kernel = counting
    return calls


@pytest.mark.parametrize("quant,tol", [(False, 1e-4), (True, 5e-2)])
@pytest.mark.parametrize("name", MODELS)
def test_matches_per_operator_plan(ggml_models, name, quant, tol, monkeypatch):
    # 2 threads with the parallel driver (claimed chunks, barriers) where the layer is omp
    monkeypatch.setattr(decoder_step, "STACK_SERIAL_MAX_WORK", 0)
    model = ggml_models[name]
    nt = get_num_threads()
    try:
        ref_ids, ref = _greedy(_session(model, False, quant, 2))
        sess = _session(model, True, quant, 2)
        kinds = [k for k, _ in sess.plan()]
        assert kinds.count("DecoderStack") == 1 and "Linear" not in kinds
        stack = _stack(sess)
        calls = _counting(stack)
        before = sess.counters["bytes_dequantized"]
        ids, got = _greedy(sess)
    finally:
        set_num_threads(nt)
    assert len(calls) == len(ids) - 1  # every one-token call ran the compiled step
    assert sess.counters["bytes_dequantized"] == before == 0
    assert stack.tasks == (2 if threading_layer() == "omp" else 1)
    w = stack.weights
    assert w.ggml0 is not None and not w.simple
    if name in MIX_KINDS:  # several parts in one linear (mix: INT4 and ggml parts)
        assert w.wl[:, 1].max() == 3
        assert (len(w.codes) > 0) == (0 in MIX_KINDS[name])
        kinds = set(w.wt[:, 4].tolist())
        assert kinds == MIX_KINDS[name]
    assert ids == ref_ids
    worst = max(float(np.abs(a - b).max()) for a, b in zip(got, ref))
    assert worst <= tol, worst


@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("name", ["mix", "mix5"])
def test_one_thread_serial_step(ggml_models, quant, name):
    model = ggml_models[name]
    nt = get_num_threads()
    try:
        ref_ids, ref = _greedy(_session(model, False, quant, 1), 5)
        sess = _session(model, True, quant, 1)
        ids, got = _greedy(sess, 5)
    finally:
        set_num_threads(nt)
    assert _stack(sess).tasks == 1
    assert ids == ref_ids
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, ref)) <= (5e-2 if quant else 1e-4)


@pytest.mark.parametrize("quant,kv", [(False, "paged-int8"), (True, "paged")])
def test_paged_kv(ggml_models, quant, kv, monkeypatch):
    """Paged KV (20 tokens: blocks of 16 sealed, INT8 ones in exact mode). In int8-activation
    mode the float32-block preset: over INT8 key blocks the compiled paged step's int8 queries
    and the per-operator plan differ already on INT4-only models (same numbers on main: greedy
    ids part after the first sealed block), which is not what this test is about."""
    monkeypatch.setattr(decoder_step, "STACK_SERIAL_MAX_WORK", 0)
    src = pathlib.Path(ggml_models["mix"].path)
    m = pb.ModelProto()
    m.ParseFromString(src.read_bytes())
    to_paged(m, kv)
    path = src.parent / f"{kv}.onnx"  # beside the .gguf its payloads point into
    path.write_bytes(m.SerializeToString())
    model = olv_runtime.load(path)
    ref_ids, ref = _greedy(_session(model, False, quant), 20)
    sess = _session(model, True, quant)
    stack = _stack(sess)
    assert type(stack).__name__ == "PagedDecoderStack"
    calls = _counting(stack)
    ids, got = _greedy(sess, 20)
    assert len(calls) == 19
    assert ids == ref_ids
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, ref)) <= (5e-2 if quant else 1e-4)


@pytest.fixture(scope="module")
def qwen3_mix(tmp_path_factory):
    """A tiny qwen3 GGUF (random q/k head-norm weights) of the Q4_K_M-like mix, converted with
    contiguous and paged (paged-int8) KV caches."""
    d = tmp_path_factory.mktemp("ggml_qwen3")
    path = write_gguf(d / "m.gguf", "qwen3", "Q4_K", seed=4, tied=False, tokenizer=False,
                      types=MIX)
    olv_runtime.convert(path, d / "m.onnx")
    m = pb.ModelProto()
    m.ParseFromString((d / "m.onnx").read_bytes())
    to_paged(m, "paged-int8")
    (d / "paged.onnx").write_bytes(m.SerializeToString())
    return {"contiguous": olv_runtime.load(d / "m.onnx"),
            "paged": olv_runtime.load(d / "paged.onnx")}


@pytest.mark.parametrize("quant,tol", [(False, 1e-4), (True, 5e-2)])
@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_qwen3_gguf_runs_the_compiled_step(qwen3_mix, kv, quant, tol, monkeypatch):
    """A qwen3 GGUF (per-head q/k RMSNorms before RoPE) compiles into one DecoderStack holding
    the file's q/k norm weights, every one-token call runs it, and it gives the per-operator
    plan's greedy ids and logits (the tolerances above)."""
    monkeypatch.setattr(decoder_step, "STACK_SERIAL_MAX_WORK", 0)
    model = qwen3_mix[kv]
    nt = get_num_threads()
    try:
        ref_ids, ref = _greedy(_session(model, False, quant, 2), 12)
        sess = _session(model, True, quant, 2)
        kinds = [k for k, _ in sess.plan()]
        assert kinds.count("DecoderStack") == 1
        assert not {"Linear", "RMSNormalization", "Reshape"} & set(kinds), kinds
        stack = _stack(sess)
        qk = stack.weights.qk_norms
        assert qk is not None and qk.shape == (2, 2, 64)
        np.testing.assert_array_equal(
            qk[1, 0], sess._constants["model.layers.1.self_attn.q_norm.weight"])
        np.testing.assert_array_equal(
            qk[0, 1], sess._constants["model.layers.0.self_attn.k_norm.weight"])
        calls = _counting(stack)
        ids, got = _greedy(sess, 12)
    finally:
        set_num_threads(nt)
    assert len(calls) == len(ids) - 1
    assert ids == ref_ids
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, ref)) <= tol


# -- one linear of mixed parts, bitwise ------------------------------------------------------------
def _parts(rng, k):
    """An INT4 part (24 rows), Q5_0 (16), Q8_0 (8), Q4_1 (8), Q5_1 (16), Q4_K (32), Q5_K (24),
    Q6_K (13 rows: a partial last group) with the plan's kernels for each."""
    parts = []
    n = 24
    payload = rng.integers(0, 256, n * k // 2, dtype=np.uint8)
    scale = (rng.uniform(0.5, 1.0, (n, k // 32)) * 0.01).astype(np.float16).astype(np.float32)
    parts.append(packed_i8.prepack_int4_i8(payload, scale, None, n, k, 32))
    for kind, n in (("Q5_0", 16), ("Q8_0", 8), ("Q4_1", 8), ("Q5_1", 16), ("Q4_K", 32),
                    ("Q5_K", 24), ("Q6_K", 13)):
        if kind in ("Q4_K", "Q5_K", "Q6_K"):
            blocks = random_kquant(kind, (n, k), rng)
        else:
            w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
            blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
        parts.append(gp.prepack_ggml(kind, np.ascontiguousarray(blocks).reshape(-1), n, k))
    return parts


def _plan_rows(parts, x, quant):
    outs = []
    for p in parts:
        if isinstance(p, gp.GGMLPacked):
            outs.append((gp.linear_ggml_i8 if quant else gp.linear_ggml_exact)(x, p))
        elif quant:
            outs.append(linear_packed_i8(x, p))
        else:
            outs.append(packed_f32.linear_packed_i8_exact(x, p))
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("nt", [1, 2])
def test_mixed_linear_bitwise_equals_the_plans_kernels(quant, nt):
    """One linear of INT4 + Q5_0 + Q8_0 + Q4_1 + Q5_1 + Q4_K + Q5_K + Q6_K parts through the
    step's group dispatch (claimed chunks with 2 tasks, run one after the other here) = the
    plan's kernel per part, bit for bit (exact mode on the float path: the non-VNNI INT4
    kernels)."""
    if not quant and packed_i8.HOST_VNNI:
        packed_i8.set_isa("avx2")
    try:
        rng = np.random.default_rng(7)
        k = 512
        parts = _parts(rng, k)
        wtab = WeightTable([parts])
        n = sum(p.n for p in parts)
        x = rng.standard_normal((1, k)).astype(np.float32)
        w = StepWeights(wtab.wt, wtab.codes0, wtab.scale0, np.zeros((1, n), np.float32),
                        np.zeros(1, np.bool_), np.ones((1, k), np.float32), np.float32(1e-6),
                        wtab.wl, wtab.ggml0)
        ws = StackWorkspace(nt, k, n, k, n, k, n, k)
        gxs = ws.ggml_buffers(True)
        out = np.zeros((1, n), np.float32)
        bar = np.zeros(barrier_slots(nt), np.int64)
        vnni = packed_i8.use_vnni()
        for tid in range(nt):
            i8 = (ws.xq[tid], ws.xd[tid], ws.xs8[tid], ws.facc8[tid]) if quant else None
            gx = GGMLState(*(a[tid] for a in gxs))
            dl._activations(i8, gx, w, 0, x, k)
            dl._linear_part(tid, nt, i8, gx, w, 0, x, out, ws.facc32[tid], vnni, bar,
                            np.bool_(False), out)
        ref = _plan_rows(parts, x, quant)
    finally:
        packed_i8.set_isa(None)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))


def test_int4_stack_compiles_no_ggml_kernel(tmp_path, tiny_qwen2_dir):
    """A model with INT4 weights only: its step's types carry no ggml buffers, and a decode in
    a fresh process never imports kernels/ggml_packed.py (so compiles none of its kernels)."""
    path = tmp_path / "int4.onnx"
    olv_runtime.convert(tiny_qwen2_dir, path, weights="int4-block32")
    sess = _session(olv_runtime.load(path), True, True)
    stack = _stack(sess)
    assert stack.int4_only and stack.weights.ggml0 is None
    _, sig = stack._decode_entry()
    assert "GGMLState" not in str(sig) and "array(int32, 3d" not in str(sig[-2:])
    code = ("import sys, numpy as np, olv_runtime\n"
            f"m = olv_runtime.load({str(path)!r})\n"
            "s = olv_runtime.InferenceSession(m, olv_runtime.SessionOptions("
            "quantize_activations=True))\n"
            "st = olv_runtime.make_state(s, olv_runtime.empty_cache(s))\n"
            "st.run({'input_ids': np.array([[5, 17, 99]], np.int64)})\n"
            "st.run({'input_ids': np.array([[3]], np.int64)})\n"
            "assert 'olv_runtime.kernels.decoder_layers' in sys.modules\n"
            "print('ggml' , 'olv_runtime.kernels.ggml_packed' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "ggml False" in res.stdout
