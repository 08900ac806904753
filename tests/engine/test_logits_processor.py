"""Engine.add_request(..., logits_processor=...): a per-request hook on the logits row before each
selection (a grammar's token mask), told each chosen token through ``accept``."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from olv_runtime import Engine
from olv_runtime.errors import InvalidArgument


@pytest.fixture(scope="module")
def engine(tiny_chat_models):
    return Engine(tiny_chat_models["float32"], max_batch=4, kv_cache_tokens=1024)


class OnlyIds:
    """Allows ``ids`` only; records what it saw."""

    def __init__(self, ids):
        self.ids = list(ids)
        self.histories, self.accepted = [], []

    def __call__(self, history, row):
        assert row.dtype == np.float32 and row.ndim == 1
        self.histories.append(list(history))
        keep = row[self.ids].copy()
        row[:] = -np.inf
        row[self.ids] = keep

    def accept(self, tok):
        self.accepted.append(tok)


def test_mask_restricts_tokens_and_accept_sees_each(engine):
    prompt = [5, 6, 7, 8]
    proc = OnlyIds([40, 41, 42])
    rid = engine.add_request(prompt, {"max_new_tokens": 6, "eos_token_id": None},
                             logits_processor=proc)
    outs = list(engine.stream(rid))
    ids = [t for o in outs for t in o.token_ids]
    assert len(ids) == 6 and set(ids) <= {40, 41, 42}
    assert proc.accepted == ids
    # the history passed before token i is the prompt plus the i tokens chosen before it
    assert proc.histories == [prompt + ids[:i] for i in range(6)]
    engine.result(rid)


def test_mask_with_sampling_and_batched_neighbours_unchanged(engine):
    """A masked request among unmasked ones: the others' tokens are those of a solo run."""
    solo = engine.generate([[9, 10, 11]], {"max_new_tokens": 5, "eos_token_id": None})[0]
    proc = OnlyIds([50, 60])
    r1 = engine.add_request([1, 2, 3], {"max_new_tokens": 5, "temperature": 1.0, "seed": 3,
                                            "eos_token_id": None}, logits_processor=proc)
    r2 = engine.add_request([9, 10, 11], {"max_new_tokens": 5, "eos_token_id": None})
    while engine.has_unfinished():
        engine.step()
    a, b = engine.result(r1), engine.result(r2)
    assert set(a.ids.tolist()) <= {50, 60} and len(a.ids) == 5
    assert b.ids.tolist() == solo.ids.tolist()


def test_logprobs_are_of_the_raw_logits(engine):
    free = engine.generate([[3, 4, 5]], {"max_new_tokens": 1, "eos_token_id": None, "logprobs": True,
                                             "top_logprobs": 3})[0]
    forced = free.logprobs[0].top[2][0]  # the third most likely token, forced by the mask
    rid = engine.add_request([3, 4, 5], {"max_new_tokens": 1, "eos_token_id": None,
                                             "logprobs": True, "top_logprobs": 3},
                             logits_processor=OnlyIds([forced]))
    list(engine.stream(rid))
    res = engine.result(rid)
    assert res.ids.tolist() == [forced]
    assert res.logprobs[0].logprob == free.logprobs[0].top[2][1]
    assert res.logprobs[0].top == free.logprobs[0].top


def test_processor_error_ends_its_request_alone(engine):
    def boom(history, row):
        raise RuntimeError("mask failed")

    r1 = engine.add_request([1, 2], {"max_new_tokens": 3, "eos_token_id": None},
                            logits_processor=boom)
    r2 = engine.add_request([1, 2], {"max_new_tokens": 3, "eos_token_id": None})
    while engine.has_unfinished():
        engine.step()
    a, b = engine.result(r1), engine.result(r2)
    assert a.finish_reason == "error" and "mask failed" in str(a.error)
    assert b.finish_reason == "length" and len(b.ids) == 3


def test_every_id_masked_is_an_error_not_a_token(engine):
    def none_allowed(history, row):
        row[:] = -np.inf

    rid = engine.add_request([1, 2], {"max_new_tokens": 3, "eos_token_id": None},
                             logits_processor=none_allowed)
    list(engine.stream(rid))
    res = engine.result(rid)
    assert res.finish_reason == "error" and "every entry -inf" in str(res.error)
    assert res.ids.size == 0


def test_not_callable_is_refused(engine):
    before = engine.stats().waiting
    with pytest.raises(InvalidArgument, match="logits_processor must be callable"):
        engine.add_request([1, 2], None, logits_processor=42)
    assert engine.stats().waiting == before


def test_result_taken_during_the_step_that_finished_it(engine):
    """A request cancelled and collected by another thread (Engine.result as soon as it reads
    ``finished``) while the step that finished it still runs: the step goes on (a server's
    reaper does this; the engine's loop used to die with a KeyError)."""
    r2 = engine.add_request([4, 5], {"max_new_tokens": 5, "eos_token_id": None})
    engine.step()
    taken = []

    def collect_r2(tok):  # runs inside the next step, after r2 was finished by its cancel
        if not taken:
            taken.append(engine.result(r2))

    r1 = engine.add_request([1, 2], {"max_new_tokens": 2, "eos_token_id": None},
                            callback=collect_r2)
    engine.cancel(r2)
    while engine.has_unfinished():
        engine.step()
    assert taken and taken[0].finish_reason == "cancelled"
    assert engine.result(r1).finish_reason == "length"
    assert r2 not in engine.requests


class Prepared(OnlyIds):
    """OnlyIds whose mask is made by ``prepare()``: records the thread it ran on and whether
    each call found its prepared mask; ``fail`` makes prepare raise (the call then works
    alone)."""

    def __init__(self, ids, fail=False):
        super().__init__(ids)
        self.fail = fail
        self.threads, self.used = [], []
        self._ready = None

    def prepare(self):
        self.threads.append(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("prepare failed")
        self._ready = len(self.histories)

    def __call__(self, history, row):
        self.used.append(self._ready == len(self.histories))
        self._ready = None
        super().__call__(history, row)


@pytest.mark.parametrize("fail", [False, True])
def test_prepare_runs_on_the_mask_thread_before_each_call(engine, fail):
    """The engine starts each sampled request's ``prepare()`` on its mask thread before the
    forward and waits for it before the call (structured output's masks alongside the
    forward); a prepare that raises changes nothing but the work done in the call."""
    plain = OnlyIds([40, 41, 42])  # the same mask without prepare(): the reference
    proc = Prepared([40, 41, 42], fail=fail)
    rid = engine.add_request([5, 6, 7, 8], {"max_new_tokens": 5, "eos_token_id": None},
                             logits_processor=proc)
    rid2 = engine.add_request([5, 6, 7, 8], {"max_new_tokens": 5, "eos_token_id": None},
                              logits_processor=plain)
    while engine.has_unfinished():
        engine.step()
    a, b = engine.result(rid), engine.result(rid2)
    assert a.ids.tolist() == b.ids.tolist() and set(a.ids.tolist()) <= {40, 41, 42}
    assert len(proc.threads) == 5 and all(t.startswith("olv-mask") for t in proc.threads)
    assert proc.used == [not fail] * 5
