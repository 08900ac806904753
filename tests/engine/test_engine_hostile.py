"""Hostile input and misuse of the batching engine: each test is a defect found by a hostile
review (issue 23), fixed: a clear error instead of a hang, a raw exception or a lost output."""
from __future__ import annotations


import pytest

import olv_runtime
from olv_runtime import Engine, GenerationConfig, InferenceSession
from olv_runtime.engine.blocks import BlockManager
from olv_runtime.errors import InvalidArgument
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
