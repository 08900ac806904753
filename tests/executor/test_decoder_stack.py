"""The compiled decode step (olv_runtime.executor.decoder_step + kernels.decode_stack).

Oracle: the same session with ``compiled_decode=False`` (the per-operator plan, itself checked
against transformers in test_qwen_parity). The compiled step must give the same greedy tokens,
logits within float32 rounding (exact mode 1e-4; int8 activations 5e-2, where a last-bit
difference can flip one activation's int8 rounding), the same state semantics (presents, KV
counters, branching) and allocate nothing per token after warm-up, with 1 and 2 threads. Qwen3
(per-head q/k RMSNorms) runs the compiled step too, contiguous and paged KV. Plans the pass does
not recognise stay per-operator.
"""
from __future__ import annotations

import numpy as np
import pytest

import olv_runtime
from olv_runtime.executor import decoder_step as decoder_stack
from olv_runtime.kernels import get_num_threads, set_num_threads, threading_layer

PROMPT = [5, 17, 99, 3, 42, 64, 7]


@pytest.fixture(scope="module")
def qwen2_int4(tmp_path_factory, tiny_qwen2_dir):
    path = tmp_path_factory.mktemp("stack") / "model.onnx"
    olv_runtime.convert(tiny_qwen2_dir, path, weights="int4-block32")
    return olv_runtime.load(path)


def _session(model, compiled, quant=False, threads=None):
    return olv_runtime.InferenceSession(model, olv_runtime.SessionOptions(
        compiled_decode=compiled, quantize_activations=quant, num_threads=threads))


def _greedy(sess, steps=12):
    st = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    feed = np.array([PROMPT], np.int64)
    ids, logits = [], []
    for _ in range(steps):
        lg = st.run({"input_ids": feed})["logits"][0, -1].copy()
        logits.append(lg)
        ids.append(int(np.argmax(lg)))
        feed = np.array([[ids[-1]]], np.int64)
    return ids, logits


def test_plan_is_fused(qwen2_int4):
    sess = _session(qwen2_int4, True)
    kinds = [k for k, _ in sess.plan()]
    assert kinds.count("DecoderStack") == 1
    assert "RopeAttention" not in kinds and "Linear" not in kinds and "SiluMul" not in kinds
    assert len(kinds) < len(_session(qwen2_int4, False).plan()) - 10


def _stack(sess):
    (stack,) = [s for s in sess.all_steps() if s.kind == "DecoderStack"]
    return stack.impl


@pytest.mark.parametrize("quant,tol", [(False, 1e-4), (True, 5e-2)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_per_operator_plan(qwen2_int4, quant, tol, threads, monkeypatch):
    # the tiny model's linears are all below the serial threshold: with 2 threads force the
    # parallel driver (2 tasks, barriers) so that it is the one checked here
    if threads == 2:
        monkeypatch.setattr(decoder_stack, "STACK_SERIAL_MAX_WORK", 0)
    nt = get_num_threads()
    try:
        ref_ids, ref = _greedy(_session(qwen2_int4, False, quant, threads))
        sess = _session(qwen2_int4, True, quant, threads)
        ids, got = _greedy(sess)
        tasks = _stack(sess).tasks
        # the signature a worker process compiles at the first (prefill) call, while this
        # process runs it (kernels.precompile), is exactly the one the one-token calls ran
        disp, sig = _stack(sess)._decode_entry()
        assert sig in disp.overloads
    finally:
        set_num_threads(nt)
    want_tasks = 2 if threads == 2 and threading_layer() == "omp" else 1
    assert tasks == want_tasks
    assert ids == ref_ids
    worst = max(float(np.abs(a - b).max()) for a, b in zip(got, ref))
    assert worst <= tol, worst


@pytest.mark.parametrize("isa", ["avx2", "avx512vnni"])
def test_exact_mode_on_each_instruction_path(qwen2_int4, isa, monkeypatch):
    """Exact mode runs the VNNI kernels (block fixed-point activation digits) where the CPU has
    them and the float kernels otherwise: force each path; the compiled step matches the
    per-operator plan of the same path, and the two paths agree within float32 rounding."""
    from olv_runtime.kernels import packed_i8

    if isa == "avx512vnni" and not packed_i8.HOST_VNNI:
        pytest.skip("the CPU has no AVX-512 VNNI")
    monkeypatch.setattr(decoder_stack, "STACK_SERIAL_MAX_WORK", 0)  # 2 tasks where possible
    nt = get_num_threads()
    try:
        packed_i8.set_isa(isa)
        ref_ids, ref = _greedy(_session(qwen2_int4, False, False, 2), 6)
        ids, got = _greedy(_session(qwen2_int4, True, False, 2), 6)
        packed_i8.set_isa("avx2")
        _, other = _greedy(_session(qwen2_int4, True, False, 2), 6)
    finally:
        packed_i8.set_isa(None)
        set_num_threads(nt)
    assert ids == ref_ids
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, ref)) <= 1e-4
    assert max(float(np.abs(a - b).max()) for a, b in zip(got, other)) <= 1e-4


def test_small_models_run_the_stack_serially(qwen2_int4):
    """Every linear of the tiny model is below STACK_SERIAL_MAX_WORK (N * Kp): one task, no
    parallel region, whatever the thread count (the parallel driver is not even compiled)."""
    nt = get_num_threads()
    try:
        sess = _session(qwen2_int4, True, False, 2)
        _greedy(sess, 3)
    finally:
        set_num_threads(nt)
    stack = _stack(sess)
    assert stack.max_work < decoder_stack.STACK_SERIAL_MAX_WORK
    assert stack.tasks == 1


def test_state_semantics_and_counters(qwen2_int4):
    """Presents are read-only prefix views of the capacity buffers, earlier presents stay valid,
    two states branched from one past never overwrite each other, KV append bytes are counted as
    in the per-operator plan, and decode steps after the first allocate nothing."""
    sessions = {c: _session(qwen2_int4, c) for c in (False, True)}
    outs = {}
    for c, sess in sessions.items():
        st = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
        st.run({"input_ids": np.array([PROMPT], np.int64)})
        before = sess.counters.snapshot()
        a = st.run({"input_ids": np.array([[3]], np.int64)})
        a_logits = a["logits"].copy()
        sess.recycle(a["logits"])  # as generate does: then a decode step allocates nothing
        mid = sess.counters.snapshot()
        b = st.run({"input_ids": np.array([[4]], np.int64)})
        after = sess.counters.snapshot()
        outs[c] = (a, b)
        assert not a["present_key.0"].flags.writeable
        assert a["present_key.0"].shape[2] == len(PROMPT) + 1
        assert b["present_key.0"].shape[2] == len(PROMPT) + 2
        # the first present is unchanged by the second call (same buffer, later slot)
        np.testing.assert_array_equal(a["present_key.0"], b["present_key.0"][:, :, :-1])
        kv_a = mid["bytes_copied_kv_append"] - before["bytes_copied_kv_append"]
        kv_b = after["bytes_copied_kv_append"] - mid["bytes_copied_kv_append"]
        assert kv_a == kv_b > 0
        assert after["arrays_allocated"] - mid["arrays_allocated"] == 0
        assert after["bytes_allocated"] - mid["bytes_allocated"] == 0
        assert np.isfinite(a_logits).all()
        outs[c] = (a, b, kv_a)
    assert outs[True][2] == outs[False][2]
    for name in ("logits", "present_key.1", "present_value.1"):
        np.testing.assert_allclose(outs[True][1][name], outs[False][1][name], atol=1e-4)


def test_branching_two_states_from_one_past(qwen2_int4):
    sess = _session(qwen2_int4, True)
    ref = _session(qwen2_int4, False)
    base = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    out = base.run({"input_ids": np.array([PROMPT], np.int64)})
    past = {f"past_{k}.{i}": out[f"present_{k}.{i}"] for i in range(2) for k in ("key", "value")}
    r1 = sess.run(None, {"input_ids": np.array([[11]], np.int64), **past})
    r2 = sess.run(None, {"input_ids": np.array([[12]], np.int64), **past})  # same past again
    e1 = ref.run(None, {"input_ids": np.array([[11]], np.int64), **past})
    e2 = ref.run(None, {"input_ids": np.array([[12]], np.int64), **past})
    for got, want in ((r1, e1), (r2, e2)):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-4)
    # the first call's presents still hold token 11's keys (the second copied the prefix)
    assert not np.array_equal(r1[1][:, :, -1], r2[1][:, :, -1])


def test_steady_decode_then_branch_and_failure(qwen2_int4):
    """The per-token fast path (the pasts are the last call's presents: one registry claim for
    every buffer) keeps the KV rules: a state branched from a steady state's values appends in
    place first and the original then copies its prefix (neither sees the other's token); a
    call that fails inside the compiled step publishes nothing and the state decodes on with
    the same results as a per-operator reference; 0 allocations per steady token."""
    sess = _session(qwen2_int4, True)
    ref = _session(qwen2_int4, False)
    a = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    r = olv_runtime.make_state(ref, olv_runtime.empty_cache(ref))
    for st in (a, r):
        st.run({"input_ids": np.array([PROMPT], np.int64)})
    toks = [3, 8, 13, 21]
    for i, tok in enumerate(toks):
        before = sess.counters.snapshot()
        got = a.run({"input_ids": np.array([[tok]], np.int64)})
        want = r.run({"input_ids": np.array([[tok]], np.int64)})
        np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-4)
        sess.recycle(got["logits"])
        if i >= 2:
            after = sess.counters.snapshot()
            assert after["arrays_allocated"] == before["arrays_allocated"]
            assert after["kv_reallocations"] == before["kv_reallocations"]
    # branch: b starts from a's values (the same present arrays the fast path returned)
    b = olv_runtime.make_state(sess, dict(a.values))
    kept = {k: np.array(v) for k, v in a.values.items()}
    before = sess.counters.snapshot()
    gb = b.run({"input_ids": np.array([[5]], np.int64)})  # first append: in place
    assert sess.counters["kv_reallocations"] == before["kv_reallocations"]
    ga = a.run({"input_ids": np.array([[6]], np.int64)})  # a must copy: b owns slot T now
    assert sess.counters["kv_reallocations"] > before["kv_reallocations"]
    for k, v in kept.items():  # neither call changed what a held
        np.testing.assert_array_equal(ga[k.replace("past", "present")][:, :, :-1], v)
        np.testing.assert_array_equal(gb[k.replace("past", "present")][:, :, :-1], v)
    assert not np.array_equal(ga["present_key.0"][:, :, -1], gb["present_key.0"][:, :, -1])
    wb = ref.run(None, {"input_ids": np.array([[5]], np.int64), **kept})
    np.testing.assert_allclose(gb["logits"], wb[0], atol=1e-4)
    r.run({"input_ids": np.array([[6]], np.int64)})
    # a failure inside the compiled step: nothing published, the next call is right
    stack = _stack(sess)
    values = dict(a.values)
    real = stack.run_kernel

    def boom(*args):
        raise RuntimeError("injected")
    stack.run_kernel = boom
    try:
        with pytest.raises(olv_runtime.errors.OlvError, match="injected"):
            a.run({"input_ids": np.array([[9]], np.int64)})
    finally:
        stack.run_kernel = real
    assert all(a.values[k] is v for k, v in values.items())
    got = a.run({"input_ids": np.array([[9]], np.int64)})
    want = r.run({"input_ids": np.array([[9]], np.int64)})
    np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-4)
    for k in ("present_key.1", "present_value.0"):
        np.testing.assert_allclose(got[k], want[k], atol=1e-4)


def test_batch_and_prefill_use_the_per_operator_path(qwen2_int4):
    sess = _session(qwen2_int4, True)
    ref = _session(qwen2_int4, False)
    empty = olv_runtime.empty_cache(sess)
    ids = np.array([PROMPT, PROMPT[::-1]], np.int64)  # batch 2: generic path inside the step
    past = {k: np.zeros((2,) + v.shape[1:], np.float32) for k, v in empty.items()}
    got = sess.run(None, {"input_ids": ids, **past})
    want = ref.run(None, {"input_ids": ids, **past})
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.fixture(scope="module")
def qwen3_models(tmp_path_factory):
    """A tiny Qwen3 (q/k head norms, head_dim 32 != hidden 64 / 4 heads, intermediate 96: every
    linear's K a multiple of 32) with random q_norm / k_norm weights (transformers initialises
    them to ones), converted with contiguous and with paged KV caches."""
    import torch
    from safetensors.torch import load_file, save_file
    from tiny_checkpoints import _build

    ck = _build(tmp_path_factory, "tiny_qwen3_i96", "Qwen3ForCausalLM", intermediate_size=96,
                head_dim=32, tie_word_embeddings=True)
    st = ck / "model.safetensors"
    tensors = load_file(str(st))
    g = torch.Generator().manual_seed(5)
    for name, t in tensors.items():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            tensors[name] = 1.0 + 0.3 * torch.randn(t.shape, generator=g, dtype=t.dtype)
    save_file(tensors, str(st), metadata={"format": "pt"})
    d = tmp_path_factory.mktemp("stack_qwen3")
    out = {}
    for kv in ("contiguous", "paged"):
        path = d / f"{kv}.onnx"
        olv_runtime.convert(ck, path, weights="int4-block32", kv=kv)
        out[kv] = olv_runtime.load(path)
    return out


@pytest.mark.parametrize("quant,tol", [(False, 1e-4), (True, 5e-2)])
@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_qwen3_runs_the_compiled_step(qwen3_models, kv, quant, tol, monkeypatch):
    """Qwen3's per-head q/k RMSNorms (Reshape -> RMSNormalization -> Reshape between the q|k|v
    linear and the attention) are fused: the plan is one DecoderStack carrying the norm weights,
    every one-token call runs its compiled kernel (2 tasks where the layer is omp), and the
    greedy ids and logits are the per-operator plan's (the tolerances of
    test_matches_per_operator_plan)."""
    monkeypatch.setattr(decoder_stack, "STACK_SERIAL_MAX_WORK", 0)
    model = qwen3_models[kv]
    nt = get_num_threads()
    try:
        ref_ids, ref = _greedy(_session(model, False, quant, 2))
        sess = _session(model, True, quant, 2)
        kinds = [k for k, _ in sess.plan()]
        assert kinds.count("DecoderStack") == 1
        assert not {"RMSNormalization", "Reshape", "Linear"} & set(kinds), kinds
        stack = _stack(sess)
        qk = stack.weights.qk_norms
        assert qk is not None and qk.shape == (2, 2, 32)
        q0 = sess._constants["model.layers.0.self_attn.q_norm.weight"]
        k1 = sess._constants["model.layers.1.self_attn.k_norm.weight"]
        np.testing.assert_array_equal(qk[0, 0], q0)
        np.testing.assert_array_equal(qk[1, 1], k1)
        calls = []
        real = stack.run_kernel

        def counting(*a):
            calls.append(1)
            return real(*a)
        stack.run_kernel = counting
        ids, got = _greedy(sess)
        if kv == "contiguous":  # the signature a compile worker builds is the one that ran
            disp, sig = stack._decode_entry()
            assert sig in disp.overloads
    finally:
        set_num_threads(nt)
    assert len(calls) == len(ids) - 1  # every one-token call ran the compiled step
    assert ids == ref_ids
    worst = max(float(np.abs(a - b).max()) for a, b in zip(got, ref))
    assert worst <= tol, worst


def test_qwen3_rows_run_per_operator(qwen3_models):
    """The batching engine's compiled rows step (kernels.rows_layers) has no q/k head norms: a
    fused Qwen3 plan gives the rows program no compiled step (its rows run the plan's steps)."""
    from olv_runtime.executor.rows import rows_program

    sess = _session(qwen3_models["contiguous"], True)
    assert "DecoderStack" in [k for k, _ in sess.plan()]
    prog, why = rows_program(sess)
    assert prog is not None, why
    assert prog.compiled is None


def test_unrecognised_plans_stay_per_operator(tmp_path, tiny_qwen3_dir):
    """The tiny Qwen3 of intermediate 80 (the down projection's K not a multiple of 32, which the
    compiled step's linears need) is not the fused form: the plan keeps its operators and runs
    as before."""
    path = tmp_path / "q3.onnx"
    olv_runtime.convert(tiny_qwen3_dir, path, weights="int4-block32")
    model = olv_runtime.load(path)
    sess = _session(model, True)
    kinds = [k for k, _ in sess.plan()]
    assert "DecoderStack" not in kinds and "RopeAttention" in kinds
    ids, _ = _greedy(sess, 4)
    ref_ids, _ = _greedy(_session(model, False), 4)
    assert ids == ref_ids


@pytest.fixture(scope="module")
def qwen2_bf16_f32_scales(tmp_path_factory):
    """A bfloat16 checkpoint converted with float32 scales: every scale m / -8 of a bfloat16
    value is a float16 value too."""
    from tiny_checkpoints import _build

    ck = _build(tmp_path_factory, "tiny_qwen2_bf16", "Qwen2ForCausalLM", dtype="bfloat16",
                intermediate_size=96, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("stack_bf16") / "model.onnx"
    olv_runtime.convert(ck, path, weights="int4-block32", scale_dtype="float32")
    return path


def _stack(sess):
    return next(s.impl for s in sess.all_steps() if s.kind == "DecoderStack")


@pytest.mark.parametrize("quant", [False, True])
def test_float32_scales_exact_in_float16_are_read_as_float16(qwen2_bf16_f32_scales, quant,
                                                             monkeypatch):
    """The compiled step stores float32 block scales that are all float16 values as float16
    (4.5 bits per weight instead of 5): every logit is bitwise that of the same compiled step
    reading the float32 scales (narrowing switched off)."""
    from olv_runtime.executor import decoder_step as decoder_stack

    model = olv_runtime.load(qwen2_bf16_f32_scales)
    sess = _session(model, True, quant)
    assert all(s.dtype == np.uint16 for s in _stack(sess).scales)
    ids, got = _greedy(sess, 8)
    monkeypatch.setattr(decoder_stack, "narrow_scales", lambda *a, **k: False)
    wide = _session(model, True, quant)
    assert all(s.dtype == np.float32 for s in _stack(wide).scales)
    ref_ids, want = _greedy(wide, 8)
    assert ids == ref_ids
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_narrowed_scales_persist_as_float32(qwen2_bf16_f32_scales, tmp_path):
    """olv compile of such a model stores the source's float32 scales (its entries hit again)."""
    import shutil

    from olv_runtime.models.compile import compile_model

    for f in qwen2_bf16_f32_scales.parent.iterdir():
        shutil.copy(f, tmp_path / f.name)
    path = tmp_path / qwen2_bf16_f32_scales.name
    rep = compile_model(olv_runtime.load(path), path)
    assert rep.entries > 0
    sess = _session(olv_runtime.load(path), True)
    report = sess.compiled_report()
    assert report and {e.status for e in report} == {"hit"}
    assert all(s.dtype == np.uint16 for s in _stack(sess).scales)


def test_float32_scales_not_float16_values_stay_float32(tmp_path, tiny_qwen2_dir):
    path = tmp_path / "f32.onnx"
    olv_runtime.convert(tiny_qwen2_dir, path, weights="int4-block32", scale_dtype="float32")
    sess = _session(olv_runtime.load(path), True)
    assert all(s.dtype == np.float32 for s in _stack(sess).scales)


def test_cold_cache_session_hands_the_driver_to_a_worker(qwen2_int4, monkeypatch):
    """On a cold numba cache the session prestarts a compile worker before its plan (the
    model has attention nodes) and its stack gives it the one-token driver's signature while
    the session is made (not at the first call); the worker is released after the plan."""
    from olv_runtime.kernels import precompile

    calls = []
    monkeypatch.setattr(precompile, "_JOBS", {})  # no job asked for in this process yet
    monkeypatch.setattr(precompile, "enabled", lambda: True)
    monkeypatch.setattr(precompile, "cache_index_exists", lambda *a: False)
    monkeypatch.setattr(precompile, "prestart", lambda mods=(): calls.append(("prestart", mods))
                        or True)
    monkeypatch.setattr(precompile, "start", lambda entries: calls.append(("start", entries))
                        or None)
    monkeypatch.setattr(precompile, "release_idle", lambda: calls.append(("release",)))
    sess = _session(qwen2_int4, True)
    assert [c[0] for c in calls] == ["prestart", "start", "release"]
    assert calls[0][1] == ("olv_runtime.kernels.decoder_layers",)
    # prefill kernels and the attention rows the prefill shares with the step first, then the
    # step (kernels.decode_stack.precompile_entries)
    from olv_runtime.kernels.decoder_layers import precompile_entries

    entry = _stack(sess)._decode_entry()
    assert calls[1][1] == precompile_entries(entry) and calls[1][1][-1] == entry
    calls.clear()
    _session(qwen2_int4, False)  # no compiled step: no worker
    assert calls == []

def _claim_weight(rng, n, k):
    from olv_runtime.kernels.packed_i8 import prepack_int4_i8

    u = (rng.integers(-8, 8, size=n * k) & 15).astype(np.uint8)
    payload = (u[0::2] | (u[1::2] << 4)).astype(np.uint8)
    scale = (rng.random((n, k // 32), dtype=np.float32) * 0.05 + 1e-3).astype(np.float16)
    return prepack_int4_i8(payload, scale, None, n, k, 32)


def test_claims_partition_the_groups():
    """kernels.decode_stack._claim: whatever order the tasks claim in, the chunks cover every
    unit exactly once, each task starts in its own range, and every chunk starts at its
    range's start plus a multiple of CHUNK_MULTIPLE (where the static split's multi-group
    passes fall)."""
    from olv_runtime.kernels import decoder_layers as ds

    rng = np.random.default_rng(3)
    for nt, n, step in [(2, 37, 4), (3, 1000, 8), (2, 5, 4), (4, 3, 4), (3, 608, 4)]:
        bar = np.zeros(ds.barrier_slots(nt), np.int64)
        r = list(range(nt))
        active = list(range(nt))
        seen = np.zeros(n, np.int64)
        first = {}
        while active:
            t = active[int(rng.integers(len(active)))]
            u0, u1, r[t] = ds._claim(bar, nt, n, step, r[t])
            if u0 < 0:
                active.remove(t)
                continue
            first.setdefault(t, r[t])
            assert u1 > u0
            seen[u0:u1] += 1
            s = r[t] * n // nt
            assert s <= u0 and u1 <= (r[t] + 1) * n // nt
            assert (u0 - s) % ds.CHUNK_MULTIPLE == 0
        assert (seen == 1).all()
        assert all(first[t] == t for t in first if (t + 1) * n // nt > t * n // nt)


@pytest.mark.parametrize("mode", ["int8", "exact", "digits"])
@pytest.mark.parametrize("order", [(1, 0), (0, 1)])
def test_claimed_chunks_give_the_static_split_bits(mode, order):
    """Dynamic work distribution changes no row: the two tasks' _linear_part run one after the
    other (the first drains its own range, then takes every chunk of the other's; the second
    finds nothing left), and the output (+ residual) is bitwise the static split's (each task
    its own range in one group-kernel call), in every activation mode."""
    from olv_runtime.kernels import decoder_layers as ds
    from olv_runtime.kernels import packed_f32, packed_f32_vnni, packed_i8

    if mode == "digits" and not packed_i8.HOST_VNNI:
        pytest.skip("the CPU has no AVX-512 VNNI (exact-mode digit kernels)")
    rng = np.random.default_rng(11)
    n, k = 8 * 37, 4096  # 37 groups: ranges of 18 and 19, several chunks each
    pk = _claim_weight(rng, n, k)
    codes, sc = pk.codes, pk.scale
    ng, kb = codes.shape[0], codes.shape[1]
    x = rng.standard_normal((1, k)).astype(np.float32)
    res = rng.standard_normal((1, n)).astype(np.float32)
    facc32 = np.zeros(packed_f32.ROWS_MAX * 8, np.float32)
    ref = np.zeros((1, n), np.float32)
    halves = [(0, ng // 2), (ng // 2, ng)]  # the static split of 2 tasks
    vnni = packed_i8.use_vnni()
    if mode == "int8":
        xq = packed_i8._aligned_empty((1, 32 * kb), np.int8)
        xd = np.zeros((1, kb), np.float32)
        xs8 = np.zeros((1, kb), np.int32)
        facc8 = np.zeros((1, 8), np.float32)
        packed_i8._quantize_rows_i8(x, 1, k, kb, xq, xd, xs8)
        i8 = (xq, xd, xs8, facc8)
        for g0, g1 in halves:
            packed_i8._groups(codes, sc, g0, g1, xq, xd, xs8, 1, n, ref, facc8, vnni)
    elif mode == "exact":
        i8 = None
        for g0, g1 in halves:
            packed_f32._groups_m1(codes, sc, g0, g1, x, n, ref, facc32)
    else:
        dg, bz, xsc = packed_f32_vnni.digit_buffers(1, kb)
        packed_f32_vnni._digits_rows(x, 1, k, dg, bz, xsc)
        i8 = (dg, bz, xsc)
        for g0, g1 in halves:
            packed_f32_vnni._groups_m1(codes, sc, g0, g1, dg, bz, xsc, n, ref, facc32)
    ref = ref + res
    out = np.full((1, n), np.nan, np.float32)
    bar = np.zeros(ds.barrier_slots(2), np.int64)
    wt = ds.WeightTable([pk])  # one linear, one INT4 part
    w = ds.StepWeights(wt.wt, wt.codes0, wt.scale0, None, None, None, None, wt.wl, None)
    done = [ds._linear_part(t, 2, i8, None, w, 0, x, out, facc32, vnni, bar, True, res)
            for t in order]
    assert done[0] >= 2 and done[1] == 0
    assert np.array_equal(out, ref)
