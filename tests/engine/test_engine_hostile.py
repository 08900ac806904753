"""Hostile input and misuse of the batching engine: each test is a defect found by a hostile
review (issue 23), fixed: a clear error instead of a hang, a raw exception or a lost output."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import olv_runtime
from olv_runtime import Engine, GenerationConfig, InferenceSession
from olv_runtime.engine.blocks import BlockManager
from olv_runtime.errors import InvalidArgument, StateError
from olv_runtime.kv import block_pool
from olv_runtime.kv.block_pool import KVBlockPool


@pytest.fixture(scope="module")
def sess(tiny_qwen2_dir, tmp_path_factory) -> InferenceSession:
    out = tmp_path_factory.mktemp("engine_hostile") / "model.onnx"
    olv_runtime.convert(tiny_qwen2_dir, out, weights="int4-block32")
    return InferenceSession(olv_runtime.load(out))


def _engine(sess, **kw) -> Engine:
    kw.setdefault("max_batch", 4)
    kw.setdefault("kv_cache_tokens", 512)
    return Engine(sess, **kw)


def _cfg(n=3) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, eos_token_id=None)


# -- input ------------------------------------------------------------------------------------
def test_ragged_prompt_ids_invalid_argument(sess):
    eng = _engine(sess)
    with pytest.raises(InvalidArgument, match="ragged"):
        eng.add_request([[1, 2], [3]])
    with pytest.raises(InvalidArgument, match="ragged"):
        olv_runtime.generate(sess, [[1, 2], [3]], 2)
    assert not eng.requests and not eng.has_unfinished()


@pytest.mark.parametrize("bad", [[1], {}, True, 1.0, np.float64(1), None, "1"])
def test_request_ids_must_be_integers(sess, bad):
    eng = _engine(sess)
    rid = eng.add_request([1, 2, 3], _cfg())
    assert rid == 1  # True == 1.0 == 1: neither may stand for request 1
    with pytest.raises(InvalidArgument, match="request_id must be an integer"):
        eng.cancel(bad)
    with pytest.raises(InvalidArgument, match="request_id must be an integer"):
        eng.result(bad)
    with pytest.raises(InvalidArgument, match="request_id must be an integer"):
        next(iter(eng.stream(bad)))
    assert not eng.requests[rid].cancel_asked
    assert eng.cancel(np.int64(rid)) is True


def test_generate_checks_every_prompt_before_queueing(sess):
    eng = _engine(sess)
    with pytest.raises(InvalidArgument, match=r"prompts\[2\]: prompt_ids"):
        eng.generate([[1, 2], [3], [10**6]], _cfg())
    assert not eng.requests and not eng.has_unfinished()
    eng.step()
    assert eng.stats().finished == 0


# -- streams ----------------------------------------------------------------------------------
def test_second_stream_of_a_read_request_raises_not_hangs(sess):
    eng = _engine(sess)
    rid = eng.add_request([1, 2, 3], _cfg())
    assert len(list(eng.stream(rid))) == 3
    with pytest.raises(StateError, match="already read"):
        next(iter(eng.stream(rid)))
    assert eng.result(rid).finish_reason == "length"


def test_second_stream_with_background_loop_raises_not_hangs(sess):
    eng = _engine(sess).start()
    try:
        rid = eng.add_request([1, 2, 3], _cfg())
        assert list(eng.stream(rid, timeout=30))[-1].finished
        with pytest.raises(StateError, match="already read"):
            next(iter(eng.stream(rid)))

        async def read():
            return [o async for o in eng.astream(rid)]
        with pytest.raises(StateError, match="already read"):
            asyncio.run(asyncio.wait_for(read(), 30))
    finally:
        eng.shutdown()


def test_astream_raises_when_the_loop_is_shut_down(sess):
    eng = _engine(sess).start()
    rid = eng.add_request([1, 2, 3], GenerationConfig(max_new_tokens=200, eos_token_id=None))

    async def read():
        n = 0
        async for _ in eng.astream(rid):
            n += 1
            if n == 2:
                await asyncio.to_thread(eng.shutdown)
        return n
    with pytest.raises(StateError, match="background loop stopped"):
        asyncio.run(asyncio.wait_for(read(), 60))
    assert not eng.requests[rid].sinks  # the stream's queue is no longer fed
    assert list(eng.stream(rid))[-1].finish_reason == "length"  # still there: steps itself


# -- callbacks --------------------------------------------------------------------------------
@pytest.mark.parametrize("drive", ["step", "generate", "stream"])
def test_callback_driving_the_engine_errors_not_deadlocks(sess, drive):
    eng = _engine(sess)
    other = eng.add_request([5, 6], _cfg(1))

    def cb(tok):
        if drive == "step":
            eng.step()
        elif drive == "generate":
            eng.generate([[7]], _cfg(1))
        else:
            list(eng.stream(other))
    rid = eng.add_request([1, 2, 3], _cfg(), callback=cb)
    done = threading.Event()
    t = threading.Thread(target=lambda: (eng.generate([[4]], _cfg(2)), done.set()), daemon=True)
    t.start()
    t.join(120)
    assert done.is_set(), "deadlock"
    res = eng.result(rid)
    assert res.finish_reason == "error" and isinstance(res.error, StateError)
    assert "inside a step" in str(res.error)
    assert eng.result(other).finish_reason == "length"
    assert not eng.requests  # generate(drive) queued nothing


def test_result_called_inside_a_step_does_not_lose_outputs(sess):
    eng = _engine(sess)
    a = eng.add_request([1, 2, 3], _cfg(1))       # finishes in the first step
    got = []

    def cb(tok):
        if not got:
            got.append(eng.result(a))              # forgets a before the step pushes its end
    b = eng.add_request([4, 5, 6], _cfg(3), callback=cb)
    outs = eng.step()                               # was: KeyError, b's output lost
    assert [o.request_id for o in outs] == [a, b]
    assert got[0].finish_reason == "length" and got[0].ids.size == 1
    while eng.has_unfinished():
        eng.step()
    assert len(list(eng.stream(b))) == 3


# -- memory -----------------------------------------------------------------------------------
def test_pool_over_physical_memory_refused_before_allocating(sess, monkeypatch):
    monkeypatch.setattr(block_pool, "physical_memory", lambda: 1 << 20)
    with pytest.raises(InvalidArgument, match="physical memory"):
        Engine(sess, kv_cache_tokens=1 << 16)


def test_pool_allocation_failure_is_invalid_argument(monkeypatch):
    def no_memory(*a, **k):
        raise MemoryError
    monkeypatch.setattr(block_pool.np, "zeros", no_memory)
    with pytest.raises(InvalidArgument, match="cannot be allocated"):
        KVBlockPool(2, 4, 2, 16, 8)


def test_block_manager_does_not_allocate_per_block():
    bm = BlockManager(10**15, 1)         # a huge kv_cache_tokens (the fallback makes no pool)
    assert bm.available() == 10**15 and bm.used() == 0
    t = [bm.allocate(), bm.allocate()]
    assert t == [0, 1] and bm.used() == 2
    bm.release(t)
    assert bm.used() == 0 and not bm.ref


# -- a model recording no vocabulary size; settings ---------------------------------------------
def test_ids_beyond_the_embedding_refused_without_vocab_metadata(tiny_qwen2_dir, tmp_path):
    out = tmp_path / "model.onnx"
    olv_runtime.convert(tiny_qwen2_dir, out, weights="int4-block32")
    model = olv_runtime.load(out)
    props = model.proto.metadata_props
    vocab = int(next(p.value for p in props if p.key == "olv.vocab_size"))
    keep = [p for p in props if p.key != "olv.vocab_size"]
    del props[:]
    props.extend(keep)
    eng = _engine(InferenceSession(model))
    assert eng.vocab is None
    good = eng.add_request([1, 2, 3], _cfg())
    with pytest.raises(InvalidArgument, match=rf"in \[0, {vocab}\), got {vocab}"):
        eng.add_request([1, vocab], _cfg())  # was queued: its step failed every request in it
    while eng.has_unfinished():
        eng.step()
    assert eng.result(good).finish_reason == "length"


@pytest.mark.parametrize("tok", ["tokenizer.json", 5])
def test_tokenizer_without_decode_refused(sess, tok):
    with pytest.raises(InvalidArgument, match="tokenizer must have a decode"):
        _engine(sess, tokenizer=tok)  # was: accepted, then every request ended "error"


def test_astream_outputs_are_not_kept_for_a_replay(sess):
    eng = _engine(sess).start()
    try:
        rid = eng.add_request([1, 2, 3], _cfg(5))

        async def read():
            return [o async for o in eng.astream(rid)]
        assert len(asyncio.run(asyncio.wait_for(read(), 60))) == 5
        assert not eng.requests[rid].queue  # was: every output kept (and replayed by stream)
        with pytest.raises(StateError, match="already read"):
            next(iter(eng.stream(rid)))
    finally:
        eng.shutdown()


@pytest.mark.parametrize("prompts, progress, match", [
    (None, None, "prompts must be a sequence"),
    (5, None, "prompts must be a sequence"),
    ("abc", None, "prompts must be a sequence"),
    ([[1, 2]], 5, "progress must be callable"),
])
def test_generate_arguments_checked_before_queueing(sess, prompts, progress, match):
    eng = _engine(sess)
    with pytest.raises(InvalidArgument, match=match):
        eng.generate(prompts, _cfg(), progress=progress)  # was TypeError (progress: after the run)
    assert not eng.requests and not eng.has_unfinished()


@pytest.mark.parametrize("timeout", ["x", -1, 0, float("nan"), True])
def test_stream_timeout_checked(sess, timeout):
    eng = _engine(sess)
    rid = eng.add_request([1, 2, 3], _cfg())
    with pytest.raises(InvalidArgument, match="timeout must be"):
        next(iter(eng.stream(rid, timeout=timeout)))
    assert len(list(eng.stream(rid, timeout=5))) == 3


@pytest.mark.parametrize("name", ["max_batch", "max_tokens_per_step"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, None])
def test_settings_set_between_steps_checked(sess, name, value):
    eng = _engine(sess)
    with pytest.raises(InvalidArgument, match=f"{name} must be an integer >= 1"):
        setattr(eng, name, value)  # was accepted: 0 ran nothing, generate looped for ever
    setattr(eng, name, 2)
    assert eng.generate([[1, 2, 3]], _cfg())[0].finish_reason == "length"


def test_outputs_for_a_closed_event_loop_reach_the_sync_stream(sess):
    eng = _engine(sess)
    rid = eng.add_request([1, 2, 3], _cfg())
    loop = asyncio.new_event_loop()
    loop.close()  # an async stream whose event loop is gone (its generator never closed)
    eng.requests[rid].sinks.append((loop, asyncio.Queue()))
    outs = list(eng.stream(rid))  # was: StateError, every output sent to the dead loop
    assert [len(o.token_ids) for o in outs] == [1, 1, 1] and outs[-1].finished
    assert not eng.requests[rid].sinks
