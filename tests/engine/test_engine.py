"""The continuous-batching engine (issue 23): batch invariance, agreement with generate, memory
bounds, bad input and faults, streams, the fallback for plans the rows program does not cover."""
from __future__ import annotations

import asyncio
import contextlib
import logging

import numpy as np
import pytest
from gguf_models import write_gguf

import olv_runtime
from olv_runtime import Engine, GenerationConfig, InferenceSession, SessionOptions
from olv_runtime.errors import ContextLengthError, InvalidArgument, StateError
from olv_runtime.executor.rows import rows_program
from olv_runtime.kernels import packed_i8


# -- models -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tiny_qwen2_dir, tiny_qwen3_dir, tiny_llama_dir, tmp_path_factory) -> dict:
    """Converted tiny models: qwen2, qwen3, llama (INT4 block 32), qwen2 with float32 weights
    (BLAS linears), a Q4_K GGUF and a Q4_1 GGUF (ggml block kernels, group records)."""
    out = {}
    root = tmp_path_factory.mktemp("engine_models")
    for name, src in (("qwen2", tiny_qwen2_dir), ("qwen3", tiny_qwen3_dir),
                      ("llama", tiny_llama_dir)):
        out[name] = root / name / "model.onnx"
        olv_runtime.convert(src, out[name], weights="int4-block32")
    out["qwen2-f32"] = root / "qwen2-f32" / "model.onnx"
    olv_runtime.convert(tiny_qwen2_dir, out["qwen2-f32"], weights="float32")
    g = write_gguf(root / "tiny.gguf", "qwen2", "Q4_K", hidden=256, inter=512, layers=2,
                   vocab=320)
    out["gguf"] = root / "gguf" / "model.onnx"
    olv_runtime.convert(g, out["gguf"])
    g = write_gguf(root / "tiny-q41.gguf", "llama", "Q4_1", hidden=128, inter=256, layers=2,
                   vocab=320)
    out["gguf-q41"] = root / "gguf-q41" / "model.onnx"
    olv_runtime.convert(g, out["gguf-q41"])
    return out


_SESSIONS: dict = {}


def _session(models, name, int8) -> InferenceSession:
    key = (name, int8)
    if key not in _SESSIONS:
        _SESSIONS[key] = InferenceSession(olv_runtime.load(models[name]),
                                          SessionOptions(quantize_activations=int8))
    return _SESSIONS[key]


def _vocab(sess) -> int:
    return int(sess.get_modelmeta()["olv.vocab_size"])


def _logprob_bits(res):
    return [(lp.token_id, np.float32(lp.logprob).view(np.uint32).item(),
             tuple(np.float32(v).view(np.uint32).item() for _, v in lp.top))
            for lp in res.logprobs]


def _solo(sess, prompt, cfg, kv_dtype="float32"):
    eng = Engine(sess, max_batch=1, kv_cache_tokens=1024, prefix_caching=False,
                 kv_dtype=kv_dtype, max_tokens_per_step=512)
    return eng.generate([prompt], cfg)[0]


# -- batch invariance -------------------------------------------------------------------------
def _workload(rng, vocab, n=32, shared=70):
    """n prompts of 1..300 tokens, a third starting with one shared 70-token header; configs
    greedy or seeded sampling, all with logprobs (no context limit: the tiny models declare 256
    positions, RoPE takes any)."""
    header = rng.integers(3, vocab, shared).tolist()
    prompts, cfgs = [], []
    for i in range(n):
        ln = int(rng.integers(1, 301))
        p = rng.integers(3, vocab, ln).tolist()
        if i % 3 == 0:
            p = header + p[:300 - shared]
        prompts.append(p)
        sample = i % 2 == 1
        cfgs.append(GenerationConfig(max_new_tokens=int(rng.integers(4, 14)), eos_token_id=None,
                                     temperature=0.8 if sample else 0.0, top_k=20 if sample else 0,
                                     seed=int(rng.integers(0, 2**31)), logprobs=True,
                                     top_logprobs=2, context_limit=None))
    return prompts, cfgs


def _run_mixed(sess, prompts, cfgs, rng, kv_dtype, kv_tokens):
    """All requests through one engine: random join steps, a random chunk budget per step, a
    pool small enough to force preemptions."""
    eng = Engine(sess, max_batch=8, kv_cache_tokens=kv_tokens, kv_dtype=kv_dtype)
    order = list(rng.permutation(len(prompts)))
    rids = {}
    steps = 0
    while order or eng.has_unfinished():
        for _ in range(int(rng.integers(0, 4))):
            if order:
                i = order.pop()
                rids[i] = eng.add_request(prompts[i], cfgs[i])
        eng.max_tokens_per_step = int(rng.choice([1, 7, 33, 64, 200]))
        eng.step()
        steps += 1
        assert steps < 5000
    return {i: eng.result(r) for i, r in rids.items()}, eng.stats()


#: models whose plan has one fused decoder stack: the engine runs them through the compiled rows
#: step (kernels/rows_layers.py); the others through the per-operator rows program
COMPILED = ("qwen2", "llama")


@contextlib.contextmanager
def _path(sess, compiled: bool):
    """Run the engine's steps through the compiled rows step or the per-operator rows program."""
    prog, why = sess.rows_program()
    assert prog is not None, why
    old = prog.use_compiled
    prog.use_compiled = compiled
    try:
        yield prog
    finally:
        prog.use_compiled = old


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama", "gguf", "qwen2-f32", "gguf-q41",
                                  "qwen2-plan"])
@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
def test_batch_invariance(models, name, int8):
    plan = name.endswith("-plan")
    name = name.removesuffix("-plan")
    sess = _session(models, name, int8)
    with _path(sess, not plan) as prog:
        assert (prog.compiled is not None) == (name in COMPILED), name
        if prog.compiled is not None:  # one row runs the embedding's one-token call
            assert prog.compiled.one_token is not None, name
        _check_invariance(sess)


def _check_invariance(sess):
    rng = np.random.default_rng(7)
    prompts, cfgs = _workload(rng, _vocab(sess))
    assert min(map(len, prompts)) < 20 and max(map(len, prompts)) > 256
    mixed, st = _run_mixed(sess, prompts, cfgs, rng, "float32", kv_tokens=12 * 64)
    assert st.preemptions > 0, st           # the small pool forced preemptions
    assert st.prefix_hit_tokens > 0, st     # the shared header came from the prefix cache
    assert st.max_rows_in_step > 8, st      # decode rows and prompt chunks rode together
    for i, (p, c) in enumerate(zip(prompts, cfgs)):
        solo = _solo(sess, p, c)
        got = mixed[i]
        assert got.ids.tolist() == solo.ids.tolist(), i
        assert _logprob_bits(got) == _logprob_bits(solo), i
        assert got.finish_reason == solo.finish_reason == "length"


@pytest.mark.parametrize("kv_dtype", ["float16", "int8", "int4"])
def test_batch_invariance_encoded_pool(models, kv_dtype):
    sess = _session(models, "qwen2", True)
    rng = np.random.default_rng(11)
    prompts, cfgs = _workload(rng, _vocab(sess), n=12)
    mixed, st = _run_mixed(sess, prompts, cfgs, rng, kv_dtype, kv_tokens=10 * 64)
    assert st.preemptions > 0
    for i, (p, c) in enumerate(zip(prompts, cfgs)):
        solo = _solo(sess, p, c, kv_dtype)
        assert mixed[i].ids.tolist() == solo.ids.tolist(), i
        assert _logprob_bits(mixed[i]) == _logprob_bits(solo), i


# -- agreement with generate ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gguf", "qwen2-plan"])
@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
def test_greedy_equals_generate(models, name, int8):
    plan = name.endswith("-plan")
    name = name.removesuffix("-plan")
    sess = _session(models, name, int8)
    rng = np.random.default_rng(3)
    vocab = _vocab(sess)
    prompts = [rng.integers(3, vocab, int(n)).tolist() for n in (1, 17, 64, 65, 150)]
    cfg = GenerationConfig(max_new_tokens=12, eos_token_id=None, logprobs=True)
    with _path(sess, not plan) as prog:
        eng = Engine(sess, max_batch=4, max_tokens_per_step=48)
        res = eng.generate(prompts, cfg)
        compiled = prog.compiled is not None and not plan
    for p, r in zip(prompts, res):
        g = olv_runtime.generate_result(sess, p, cfg)
        assert r.ids.tolist() == g.ids.tolist()
        a = np.array([lp.logprob for lp in r.logprobs])
        b = np.array([lp.logprob for lp in g.logprobs])
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        if not compiled:
            # the first token comes from the prompt's last row: the plan's prefill, bitwise
            # (the compiled rows step agrees with it to float32 rounding: the tolerance above)
            assert np.float32(a[0]).view(np.uint32) == np.float32(b[0]).view(np.uint32)


def test_prefill_rows_bitwise_plan(models):
    """The rows program's logits of a prompt are the plan's, bitwise (block size 64 = the
    attention tile), in one chunk or many."""
    from olv_runtime import empty_cache, make_state
    from olv_runtime.kv.block_pool import KVBlockPool

    sess = _session(models, "qwen2", False)
    prog, _ = rows_program(sess)
    prog.use_compiled = False  # a program of its own (not the session's cached one)
    pool = KVBlockPool(prog.n_layers, 8, prog.n_kv_heads, 64, prog.head_dim)
    ids = np.random.default_rng(0).integers(3, _vocab(sess), 150).astype(np.int64)
    st = make_state(sess, empty_cache(sess))
    ref = st.run({"input_ids": ids.reshape(1, -1)}, outputs=["logits"])["logits"][0]
    assert np.array_equal(_forward_chunks(prog, ids, [150], pool), ref)
    assert np.array_equal(_forward_chunks(prog, ids, [1, 1, 30, 64, 54], pool), ref)


def _forward_chunks(prog, ids, chunks, pool):
    """One sequence's ``ids`` through ``prog.forward`` in chunks of the given sizes (its blocks
    5, 1, 6 of the pool, block size 64), every row's logits concatenated."""
    tab = np.array([[5, 1, 6]], np.int32)
    out, p0 = [], 0
    for c in chunks:
        pos = np.arange(p0, p0 + c, dtype=np.int64)
        out.append(prog.forward(ids[pos], pos, np.zeros(c, np.int32), tab,
                                tab[0, pos // 64].astype(np.int64), pos % 64,
                                np.arange(c, dtype=np.int64), pool))
        p0 += c
    return np.concatenate(out)


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8", "int4"])
@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
@pytest.mark.parametrize("tasks", [1, 2])
def test_compiled_rows_agree_with_plan(models, kv_dtype, int8, tasks, monkeypatch):
    """The compiled rows step (kernels/rows_layers.py): a prompt's logits in one chunk or many
    are bitwise the same, and agree with the per-operator rows program to float32 rounding; with
    2 tasks the parallel driver (barriers, claimed chunks) runs even on the tiny model."""
    from olv_runtime.executor import decoder_step
    from olv_runtime.kernels import config
    from olv_runtime.kv.block_pool import KVBlockPool

    if tasks == 2:
        if config.threading_layer() != "omp":
            pytest.fail("the parallel driver needs numba's omp threading layer")
        monkeypatch.setattr(decoder_step, "STACK_SERIAL_MAX_WORK", 0)
    sess = _session(models, "qwen2", int8)
    progs = {}
    for compiled in (False, True):
        prog, _ = rows_program(sess)  # programs of their own (not the session's cached one)
        prog.use_compiled = compiled
        progs[compiled] = prog
    assert progs[True].compiled is not None
    ids = np.random.default_rng(0).integers(3, _vocab(sess), 150).astype(np.int64)

    def run(prog, chunks):
        pool = KVBlockPool(prog.n_layers, 8, prog.n_kv_heads, 64, prog.head_dim, kv_dtype)
        return _forward_chunks(prog, ids, chunks, pool), pool

    nt0 = config.get_num_threads()
    config.set_num_threads(tasks)
    try:
        got, pool = run(progs[True], [150])
        assert progs[True].compiled.tasks == tasks
        again, pool2 = run(progs[True], [1, 1, 30, 64, 54])
        ref, ref_pool = run(progs[False], [150])
    finally:
        config.set_num_threads(nt0)
    assert np.array_equal(got, again)
    assert np.array_equal(pool.k, pool2.k) and np.array_equal(pool.v, pool2.v)
    assert pool.bytes_written == ref_pool.bytes_written == 150 * pool.bytes_per_token()
    tol = 1e-4 if kv_dtype in ("float32", "float16") or not int8 else 2e-2
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * float(np.abs(ref).max()))
    if kv_dtype == "float32":  # the keys and values as the plan stores them, to rounding
        np.testing.assert_allclose(pool.k, ref_pool.k, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(pool.v, ref_pool.v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("isa", ["avx2"] + (["avx512vnni"] if packed_i8.HOST_VNNI else []))
@pytest.mark.parametrize("tasks", [1, 2])
def test_compiled_rows_exact_on_each_path(models, isa, tasks, monkeypatch):
    """Exact mode's compiled rows step on each path: where the CPU has AVX-512 VNNI the
    one-token step's digit kernels (``groups_m1`` for one row, ``groups_rows`` for more), with
    AVX2 forced the float path. On both, a prompt's logits are bitwise the same in one chunk or
    in chunks of 1..64 rows, a sequence's rows give bitwise the same logits alone as beside
    another sequence's rows in the same forward, and they agree with the per-operator program to
    float32 rounding; the digits are made on the VNNI path only (cases: the paths the host
    has)."""
    from olv_runtime.executor import decoder_step
    from olv_runtime.kernels import config
    from olv_runtime.kv.block_pool import KVBlockPool

    if tasks == 2:
        if config.threading_layer() != "omp":
            pytest.fail("the parallel driver needs numba's omp threading layer")
        monkeypatch.setattr(decoder_step, "STACK_SERIAL_MAX_WORK", 0)
    sess = _session(models, "qwen2", False)
    prog, _ = rows_program(sess)
    ref_prog, _ = rows_program(sess)
    ref_prog.use_compiled = False
    rng = np.random.default_rng(3)
    ids = rng.integers(3, _vocab(sess), 150).astype(np.int64)
    other = rng.integers(3, _vocab(sess), 40).astype(np.int64)
    nt0 = config.get_num_threads()
    config.set_num_threads(tasks)
    packed_i8.set_isa(isa)
    try:
        digits = packed_i8.use_vnni()
        pool = KVBlockPool(prog.n_layers, 8, prog.n_kv_heads, 64, prog.head_dim)
        got = _forward_chunks(prog, ids, [150], pool)
        ws = prog.compiled._local.ws
        assert (ws._digits is not None) == digits
        pool = KVBlockPool(prog.n_layers, 8, prog.n_kv_heads, 64, prog.head_dim)
        again = _forward_chunks(prog, ids, [1, 1, 30, 64, 54], pool)
        # rows 0..39 of `ids` beside all 40 rows of another sequence (blocks 2, 3): one forward
        pool = KVBlockPool(prog.n_layers, 8, prog.n_kv_heads, 64, prog.head_dim)
        pos = np.concatenate([np.arange(40), np.arange(40)]).astype(np.int64)
        seq = np.repeat(np.arange(2, dtype=np.int32), 40)
        tab = np.array([[5, 1, 6], [2, 3, 4]], np.int32)
        mixed = prog.forward(np.concatenate([ids[:40], other]), pos, seq, tab,
                             tab[seq, pos // 64].astype(np.int64), pos % 64,
                             np.arange(40, dtype=np.int64), pool)
        ref = _forward_chunks(ref_prog, ids, [150],
                              KVBlockPool(prog.n_layers, 8, prog.n_kv_heads, 64, prog.head_dim))
    finally:
        packed_i8.set_isa(None)
        config.set_num_threads(nt0)
    assert prog.compiled.tasks == tasks
    assert np.array_equal(got, again)
    assert np.array_equal(got[:40], mixed)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))


def test_compiled_rows_refuse_bad_indices(models):
    """The compiled step indexes without bounds checks: forward refuses indices outside the pool
    or the tables before running anything."""
    from olv_runtime.kv.block_pool import KVBlockPool

    sess = _session(models, "qwen2", True)
    prog, _ = rows_program(sess)
    pool = KVBlockPool(prog.n_layers, 4, prog.n_kv_heads, 64, prog.head_dim)
    k0 = pool.k.copy()
    ids = np.array([5, 6], np.int64)
    pos = np.array([0, 1], np.int64)
    good = dict(row_seq=np.zeros(2, np.int32), tables=np.array([[1]], np.int32),
                blocks=np.array([1, 1], np.int64), offsets=pos.copy(),
                logit_rows=np.array([1], np.int64))
    bad = [("tables", np.array([[4]], np.int32), "table entry"),
           ("tables", np.array([[-1]], np.int32), "table entry"),
           ("blocks", np.array([1, 9], np.int64), "block outside"),
           ("offsets", np.array([0, 64], np.int64), "offset outside"),
           ("row_seq", np.array([0, 1], np.int32), "row_seq outside"),
           ("logit_rows", np.array([2], np.int64), "logit row outside"),
           ("row_seq", np.zeros(2, np.int64), "row_seq int32")]
    for name, value, match in bad:
        kw = dict(good, **{name: value})
        with pytest.raises(InvalidArgument, match=match):
            prog.forward(ids, pos, kw["row_seq"], kw["tables"], kw["blocks"], kw["offsets"],
                         kw["logit_rows"], pool)
    with pytest.raises(InvalidArgument, match="outside the block table"):
        prog.forward(ids, np.array([0, 64], np.int64), good["row_seq"], good["tables"],
                     good["blocks"], np.array([0, 0], np.int64), good["logit_rows"], pool)
    assert np.array_equal(pool.k, k0) and pool.bytes_written == 0
    out = prog.forward(ids, pos, **good, pool=pool)
    assert out.shape == (1, _vocab(sess)) and np.isfinite(out).all()


# -- memory -----------------------------------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_many_requests_small_pool_bounded_memory(models):
    sess = _session(models, "qwen2", True)
    vocab = _vocab(sess)
    rng = np.random.default_rng(5)
    eng = Engine(sess, max_batch=16, kv_cache_tokens=8 * 64, block_size=64)
    eng.generate([rng.integers(3, vocab, 100).tolist()], GenerationConfig(max_new_tokens=4))
    base = _rss()
    need = 0
    rids = []
    for _ in range(200):
        p = rng.integers(3, vocab, int(rng.integers(1, 120))).tolist()
        n = int(rng.integers(1, 12))
        need += len(p) + n
        rids.append(eng.add_request(p, GenerationConfig(max_new_tokens=n, eos_token_id=None)))
    assert need > 8 * 64 * 4  # the pool holds a small part of what the requests need
    peak = base
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        assert steps < 20000
        if steps % 10 == 0:
            peak = max(peak, _rss())
    results = [eng.result(r) for r in rids]
    assert all(r.finish_reason == "length" and r.error is None for r in results)
    st = eng.stats()
    assert st.blocks_used == 0 and st.blocks_total == 8
    assert st.preemptions > 0
    assert peak <= base * 1.10, (base, peak)
    # KV: every row's keys/values written once, where they stay (nothing moved between blocks)
    assert eng.pool.bytes_written == st.rows * eng.pool.bytes_per_token()


def test_prefix_hits_counted(models):
    sess = _session(models, "qwen2", False)
    rng = np.random.default_rng(9)
    header = rng.integers(3, _vocab(sess), 130).tolist()
    eng = Engine(sess, max_batch=4)
    cfg = GenerationConfig(max_new_tokens=3, eos_token_id=None)
    first = eng.generate([header + [5, 6]], cfg)[0]
    second = eng.generate([header + [7]], cfg)[0]
    assert first.cached_tokens == 0
    assert second.cached_tokens == 128   # two full blocks of 64 came from the cache
    assert eng.stats().prefix_hit_tokens == 128
    assert second.ids.tolist() == _solo(sess, header + [7], cfg).ids.tolist()


# -- bad input and faults ---------------------------------------------------------------------
@pytest.mark.parametrize("prompt, config, exc, match", [
    ([], None, InvalidArgument, "non-empty"),
    ([1, 2, 10**6], None, InvalidArgument, r"\[0, 128\), got 1000000"),
    ([-1], None, InvalidArgument, "got -1"),
    ([[1, 2]], None, InvalidArgument, "1-D"),
    ([1] * 250, {"max_new_tokens": 10}, ContextLengthError, "260 positions"),
    ([1], {"temperature": -1.0}, InvalidArgument, "temperature"),
    ([1], {"max_new_tokens": -2}, InvalidArgument, "max_new_tokens"),
    ([1], {"bogus": 1}, InvalidArgument, "bogus"),
    ([1], "greedy", InvalidArgument, "GenerationConfig"),
    ([1], {"stop": ["x"]}, InvalidArgument, "tokenizer"),
    ([1], {"eos_token_id": 10**6}, InvalidArgument, "1000000"),
    ([1], {"top_logprobs": 10**6, "logprobs": True}, InvalidArgument, "vocabulary"),
])
def test_add_request_bad_input_changes_nothing(models, prompt, config, exc, match):
    sess = _session(models, "qwen2", False)
    eng = Engine(sess, max_batch=2)
    before = eng.stats()
    with pytest.raises(exc, match=match):
        eng.add_request(prompt, config)
    assert not eng.has_unfinished()
    assert eng.stats() == before
    assert eng.requests == {}


def test_request_larger_than_pool_refused(models):
    sess = _session(models, "qwen2", False)
    eng = Engine(sess, max_batch=2, kv_cache_tokens=128)
    with pytest.raises(InvalidArgument, match="more than the whole pool"):
        eng.add_request([1] * 120, {"max_new_tokens": 20})
    assert not eng.has_unfinished()


def test_engine_settings_checked(models):
    sess = _session(models, "qwen2", False)
    for kw in ({"max_batch": 0}, {"block_size": -1}, {"kv_dtype": "int3"},
               {"kv_cache_tokens": 0}, {"max_tokens_per_step": True}):
        with pytest.raises(InvalidArgument):
            Engine(sess, **kw)


def test_failing_callback_ends_its_request_alone(models):
    sess = _session(models, "qwen2", False)
    cfg = GenerationConfig(max_new_tokens=6, eos_token_id=None)
    eng = Engine(sess, max_batch=4)
    seen = []

    def bad(tok):
        seen.append(tok)
        if len(seen) == 2:
            raise RuntimeError("callback failed")

    good = [eng.add_request([5, 6, 7], cfg), eng.add_request([9] * 40, cfg)]
    broken = eng.add_request([11, 12], cfg, callback=bad)
    while eng.has_unfinished():
        eng.step()
    b = eng.result(broken)
    assert b.finish_reason == "error" and isinstance(b.error, RuntimeError)
    assert len(b.ids) == 2
    for rid, p in zip(good, ([5, 6, 7], [9] * 40)):
        r = eng.result(rid)
        assert r.finish_reason == "length"
        assert r.ids.tolist() == _solo(sess, p, cfg).ids.tolist()
    assert eng.stats().blocks_used == 0


def test_cancel_frees_blocks_next_step(models):
    sess = _session(models, "qwen2", False)
    eng = Engine(sess, max_batch=4)
    rid = eng.add_request([5] * 197, {"max_new_tokens": 40, "eos_token_id": None})
    other = eng.add_request([4, 5], {"max_new_tokens": 3, "eos_token_id": None})
    eng.step()
    eng.step()
    used = eng.stats().blocks_used
    assert used >= 4
    assert eng.cancel(rid)
    outs = eng.step()
    assert any(o.request_id == rid and o.finished and o.finish_reason == "cancelled"
               for o in outs)
    assert eng.stats().blocks_used <= 1
    assert not eng.cancel(rid)            # already finished
    assert not eng.cancel(12345)          # unknown
    while eng.has_unfinished():
        eng.step()
    assert eng.result(other).finish_reason == "length"
    assert eng.result(rid).finish_reason == "cancelled"


def test_max_new_tokens_zero_and_results(models):
    sess = _session(models, "qwen2", False)
    eng = Engine(sess)
    rid = eng.add_request([3, 4], {"max_new_tokens": 0})
    with pytest.raises(InvalidArgument, match="not finished"):
        eng.result(rid)
    eng.step()
    r = eng.result(rid)
    assert r.finish_reason == "length" and r.ids.size == 0
    with pytest.raises(InvalidArgument, match="unknown request"):
        eng.result(rid)


# -- streams ----------------------------------------------------------------------------------
def test_sync_stream_drives_steps(models):
    sess = _session(models, "qwen2", False)
    eng = Engine(sess, max_batch=4)
    cfg = GenerationConfig(max_new_tokens=5, eos_token_id=None)
    rid = eng.add_request([3, 4, 5], cfg)
    outs = list(eng.stream(rid))
    toks = [t for o in outs for t in o.token_ids]
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert toks == eng.result(rid).ids.tolist() == _solo(sess, [3, 4, 5], cfg).ids.tolist()


def test_async_stream_with_background_loop(models):
    sess = _session(models, "qwen2", False)
    cfg = GenerationConfig(max_new_tokens=6, eos_token_id=None)
    eng = Engine(sess, max_batch=4)
    with pytest.raises(StateError, match="start"):
        asyncio.run(eng.astream(eng.add_request([3], cfg)).__anext__())

    async def collect(prompts):
        async def one(p):
            rid = eng.add_request(p, cfg)
            return [t async for o in eng.astream(rid) for t in o.token_ids]
        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 60)

    with eng.start():
        got = asyncio.run(collect([[3, 4], [5] * 30, [6, 7, 8]]))
    assert not eng.running_in_background()
    for p, toks in zip([[3, 4], [5] * 30, [6, 7, 8]], got):
        assert toks == _solo(sess, p, cfg).ids.tolist()


def test_text_and_stop_strings(tiny_chat_models):
    from tokenizers import Tokenizer

    path = tiny_chat_models["int4"]
    tok = Tokenizer.from_file(str(path.parent / "tokenizer.json"))
    sess = InferenceSession(olv_runtime.load(path))
    ids = tok.encode("hello there").ids
    cfg = GenerationConfig(max_new_tokens=8, eos_token_id=None)
    g = olv_runtime.generate_result(sess, ids, cfg, tokenizer=tok)
    eng = Engine(sess, tokenizer=tok)
    r = eng.generate([ids], cfg)[0]
    assert r.text == g.text and r.ids.tolist() == g.ids.tolist()
    if len(g.text) > 3:
        stop = g.text[1:3]
        cfg2 = GenerationConfig(max_new_tokens=8, eos_token_id=None, stop=[stop])
        g2 = olv_runtime.generate_result(sess, ids, cfg2, tokenizer=tok)
        r2 = eng.generate([ids], cfg2)[0]
        assert r2.finish_reason == "stop" and r2.text == g2.text


# -- fallback ---------------------------------------------------------------------------------
def test_fallback_runs_rows_one_by_one(tiny_chat_dir, tmp_path, caplog):
    paged = tmp_path / "paged.onnx"
    olv_runtime.convert(tiny_chat_dir, paged, kv="paged-int8")
    sess = InferenceSession(olv_runtime.load(paged))
    with caplog.at_level(logging.WARNING, logger="olv_runtime.engine"):
        eng = Engine(sess, max_batch=3)
    assert not eng.batched and eng.fallback_reason
    assert sum("one by one" in r.message for r in caplog.records) == 1
    cfg = GenerationConfig(max_new_tokens=5, eos_token_id=None)
    prompts = [[5, 6, 7], [8] * 20, [9, 10]]
    res = eng.generate(prompts, cfg)
    for p, r in zip(prompts, res):
        assert r.ids.tolist() == olv_runtime.generate_result(sess, p, cfg).ids.tolist()


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8", "int4"])
def test_pool_formats_attend_as_the_dequantized_keys(kv_dtype):
    """Row attention over an encoded pool = attention over what the pool stores, dequantized
    (float64 reference): the storage error is the only error."""
    from olv_runtime.kernels import row_attention as ra
    from olv_runtime.kv.block_pool import KVBlockPool

    rng = np.random.default_rng(0)
    pool = KVBlockPool(1, 6, 2, 16, 8, kv_dtype)
    n = 40
    k = rng.standard_normal((n, 2, 8)).astype(np.float32)
    v = rng.standard_normal((n, 2, 8)).astype(np.float32)
    tab = np.array([[4, 0, 2]], np.int32)
    pos = np.arange(n, dtype=np.int64)
    pool.write(0, tab[0, pos // 16].astype(np.int64), pos % 16, k, v)
    assert pool.bytes_written == n * pool.bytes_per_token()
    q = rng.standard_normal((n, 4, 8)).astype(np.float32)
    out = np.empty_like(q)
    pool.attend(0, q, tab, np.zeros(n, np.int32), pos, 0.35, out)
    if kv_dtype in ("int8", "int4"):
        qmax = 127 if kv_dtype == "int8" else 7
        qk, sk = ra.quantize_rows(k, qmax)
        qv, sv = ra.quantize_rows(v, qmax)
        k, v = qk * sk[:, :, None], qv * sv[:, :, None]
    elif kv_dtype == "float16":
        k, v = k.astype(np.float16), v.astype(np.float16)
    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    for r in range(n):
        for hh in range(4):
            s = k64[:r + 1, hh // 2] @ q[r, hh].astype(np.float64) * 0.35
            p = np.exp(s - s.max())
            ref = (p / p.sum()) @ v64[:r + 1, hh // 2]
            np.testing.assert_allclose(out[r, hh], ref, rtol=1e-5, atol=1e-5)
