"""Token selection (olv_runtime.generation.sampling) against transformers' logits processors of the same
names on fixed logits: probabilities within 1e-6 before sampling; presence / frequency
penalties (no transformers processor) against the OpenAI / llama.cpp formula written out here."""
from __future__ import annotations

import numpy as np
import pytest

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from olv_runtime.errors import InvalidArgument
from olv_runtime.generation.sampling import (
    SamplingParams,
    apply_penalties,
    probabilities,
    select_token,
    token_logprob,
)

VOCAB = 96


def fixed_logits(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal(VOCAB) * 3.0).astype(np.float32)
    z[7] = z[11] = z.max() - 0.5  # a tie near the top (top-k keeps both)
    return z


HISTORY = [3, 7, 7, 20, 55, 3, 3, 90]


def hf_probs(logits: np.ndarray, history, processors) -> np.ndarray:
    ids = torch.tensor([history], dtype=torch.long)
    scores = torch.from_numpy(logits.copy()).reshape(1, -1)
    out = LogitsProcessorList(processors)(ids, scores)
    return torch.softmax(out.double(), dim=-1).numpy()[0]


CASES = [
    ("repetition_penalty=1.3", dict(repetition_penalty=1.3, temperature=1.0),
     [RepetitionPenaltyLogitsProcessor(1.3)]),
    ("repetition_penalty=0.8", dict(repetition_penalty=0.8, temperature=1.0),
     [RepetitionPenaltyLogitsProcessor(0.8)]),
    ("temperature=0.7", dict(temperature=0.7), [TemperatureLogitsWarper(0.7)]),
    ("temperature=1.6", dict(temperature=1.6), [TemperatureLogitsWarper(1.6)]),
    ("top_k=5", dict(temperature=1.0, top_k=5), [TopKLogitsWarper(5)]),
    ("top_k=1", dict(temperature=1.0, top_k=1), [TopKLogitsWarper(1)]),
    ("top_p=0.9", dict(temperature=1.0, top_p=0.9), [TopPLogitsWarper(0.9)]),
    ("top_p=0.35", dict(temperature=1.0, top_p=0.35), [TopPLogitsWarper(0.35)]),
    ("min_p=0.05", dict(temperature=1.0, min_p=0.05), [MinPLogitsWarper(0.05)]),
    ("min_p=0.3", dict(temperature=1.0, min_p=0.3), [MinPLogitsWarper(0.3)]),
    ("chain", dict(repetition_penalty=1.2, temperature=0.8, top_k=40, top_p=0.92, min_p=0.02),
     [RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(0.8), TopKLogitsWarper(40),
      TopPLogitsWarper(0.92), MinPLogitsWarper(0.02)]),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name,kwargs,processors", CASES, ids=[c[0] for c in CASES])
def test_probabilities_match_transformers(name, kwargs, processors, seed):
    z = fixed_logits(seed)
    got = probabilities(z, HISTORY, SamplingParams(**kwargs))
    want = hf_probs(z, HISTORY, processors)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert np.array_equal(got == 0, want == 0)  # the same tokens removed


def test_top_k_keeps_ties():
    z = fixed_logits(0)
    p = probabilities(z, None, SamplingParams(temperature=1.0, top_k=1))
    # 7 and 11 tie below the maximum; top_k=1 keeps only the maximum
    assert np.count_nonzero(p) == 1
    z2 = z.copy()
    z2[7] = z2[11] = z.max() + 1
    p2 = probabilities(z2, None, SamplingParams(temperature=1.0, top_k=1))
    assert sorted(np.flatnonzero(p2).tolist()) == [7, 11]


def openai_penalties(z, history, presence, frequency):
    out = z.astype(np.float64).copy()
    for t in set(history):
        c = history.count(t)
        out[t] = out[t] - c * frequency - (presence if c > 0 else 0.0)
    return out


@pytest.mark.parametrize("presence,frequency", [(0.5, 0.0), (0.0, 0.3), (0.7, -0.2)])
def test_presence_frequency_penalties(presence, frequency):
    z = fixed_logits(3)
    got = apply_penalties(z, HISTORY, SamplingParams(presence_penalty=presence,
                                                     frequency_penalty=frequency))
    np.testing.assert_allclose(got, openai_penalties(z, HISTORY, presence, frequency), atol=1e-12)
    # penalty_last_n: only the last 3 tokens count
    got3 = apply_penalties(z, HISTORY, SamplingParams(presence_penalty=presence,
                                                      frequency_penalty=frequency,
                                                      penalty_last_n=3))
    np.testing.assert_allclose(got3, openai_penalties(z, HISTORY[-3:], presence, frequency),
                               atol=1e-12)


def test_greedy_with_repetition_penalty_is_argmax_of_penalised():
    z = np.zeros(10, np.float32)
    z[4], z[6] = 2.0, 1.9
    assert select_token(z, [], SamplingParams()) == 4
    assert select_token(z, [4], SamplingParams(repetition_penalty=1.2)) == 6  # 2/1.2 < 1.9


def test_sampling_follows_probabilities_and_seed():
    z = fixed_logits(4)
    params = SamplingParams(temperature=0.9, top_k=8, top_p=0.95)
    p = probabilities(z, None, params)
    rng = np.random.default_rng(123)
    n = 20000
    draws = np.array([select_token(z, None, params, rng) for _ in range(n)])
    counts = np.bincount(draws, minlength=VOCAB)
    assert counts[p == 0].sum() == 0  # removed tokens are never drawn
    sd = np.sqrt(n * p * (1 - p))
    assert np.all(np.abs(counts - n * p) <= 5 * sd + 1)
    a = [select_token(z, None, params, np.random.default_rng(7)) for _ in range(5)]
    b = [select_token(z, None, params, np.random.default_rng(7)) for _ in range(5)]
    assert a == b


def test_token_logprob_top_n():
    z = fixed_logits(5)
    lp = token_logprob(z, 3, top_n=4)
    ref = z.astype(np.float64) - np.log(np.exp(z.astype(np.float64)).sum())
    assert abs(lp.logprob - ref[3]) < 1e-9
    order = np.argsort(-ref, kind="stable")[:4]
    assert [t for t, _ in lp.top] == order.tolist()
    np.testing.assert_allclose([v for _, v in lp.top], ref[order], atol=1e-9)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), "temperature"), (dict(top_k=-2), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(penalty_last_n=-1), "penalty_last_n"),
])
def test_bad_params(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        SamplingParams(**kwargs)


def test_sampling_needs_rng():
    with pytest.raises(InvalidArgument, match="rng"):
        select_token(fixed_logits(0), None, SamplingParams(temperature=1.0))


def test_token_logprob_refuses_ids_outside_the_vocabulary():
    z = fixed_logits(5)
    ref = z.astype(np.float64) - np.log(np.exp(z.astype(np.float64)).sum())
    assert abs(token_logprob(z, VOCAB - 1).logprob - ref[-1]) < 1e-9
    for bad in (-1, VOCAB, 500, True, 2.0):
        with pytest.raises(InvalidArgument, match=rf"token_id must be an integer in \[0, {VOCAB}\)"):
            token_logprob(z, bad)
    with pytest.raises(InvalidArgument, match="top_n must be an integer >= 0"):
        token_logprob(z, 3, top_n=-1)


@pytest.mark.parametrize("call", [
    lambda z: select_token(z, None, SamplingParams()),
    lambda z: select_token(z, [1], SamplingParams(repetition_penalty=1.2)),
    lambda z: select_token(z, None, SamplingParams(temperature=0.8), np.random.default_rng(0)),
    lambda z: probabilities(z, None, SamplingParams(temperature=1.0)),
    lambda z: token_logprob(z, 3),
])
def test_logits_must_be_one_row(call):
    z = fixed_logits(0)
    with pytest.raises(InvalidArgument, match=r"one row \[vocab\] .*got shape \[2, 48\]"):
        call(z.reshape(2, 48))
    with pytest.raises(InvalidArgument, match=r"got shape \[0\]"):
        call(z[:0])
    with pytest.raises(InvalidArgument, match="real numbers"):
        call(z.astype(np.complex64))


@pytest.mark.parametrize("poison, what", [
    ({17: np.nan}, r"1 NaN \(first at index 17\)"),
    ({5: np.nan, 60: np.nan}, r"2 NaN \(first at index 5\)"),
    ({9: np.inf}, r"1 \+inf \(first at index 9\)"),
    ("all -inf", "every entry -inf"),
])
@pytest.mark.parametrize("call", [
    lambda z: select_token(z, None, SamplingParams()),
    lambda z: select_token(z, [1], SamplingParams(repetition_penalty=1.2)),
    lambda z: select_token(z, None, SamplingParams(temperature=0.8), np.random.default_rng(0)),
    lambda z: probabilities(z, None, SamplingParams(temperature=1.0, top_p=0.9)),
    lambda z: token_logprob(z, 3),
])
def test_non_finite_logits_are_refused(poison, what, call):
    z = fixed_logits(1)
    if poison == "all -inf":
        z[:] = -np.inf
    else:
        for i, v in poison.items():
            z[i] = v
    with pytest.raises(InvalidArgument, match="non-finite logits: " + what):
        call(z)


def test_some_minus_inf_logits_are_fine():
    z = fixed_logits(2)
    z[:10] = -np.inf  # masked tokens: never chosen, logprob -inf
    assert select_token(z, None, SamplingParams()) == int(np.argmax(z))
    p = probabilities(z, None, SamplingParams(temperature=1.0))
    assert np.all(p[:10] == 0) and abs(p.sum() - 1) < 1e-12
    assert token_logprob(z, 3).logprob == -np.inf


@pytest.mark.parametrize("history", [[3, 7, VOCAB], [-1, 3], [3, 500]])
def test_penalty_history_outside_the_vocabulary_is_refused(history):
    z = fixed_logits(3)
    params = SamplingParams(repetition_penalty=1.3)
    with pytest.raises(InvalidArgument, match=rf"history: token ids must be in \[0, {VOCAB}\)"):
        apply_penalties(z, history, params)
    with pytest.raises(InvalidArgument, match="history"):
        select_token(z, history, params)
    # only the window the penalties look at is checked
    ok = apply_penalties(z, history + [3, 4], SamplingParams(repetition_penalty=1.3,
                                                             penalty_last_n=2))
    assert ok.shape == (VOCAB,)
    with pytest.raises(InvalidArgument, match="integer token ids"):
        apply_penalties(z, [1.5, 2.0], params)


def test_generate_refuses_nan_logits(tiny_chat_models, monkeypatch):
    """The greedy fast path of generate (argmax without select_token) checks the chosen
    logit too: a NaN row is an error, not the NaN's index."""
    import olv_runtime

    sess = olv_runtime.InferenceSession(olv_runtime.load(tiny_chat_models["int4"]))
    real = olv_runtime.State.run

    def poisoned(self, feeds, **kw):
        out = real(self, feeds, **kw)
        if feeds["input_ids"].shape[1] == 1:  # decode steps: one NaN in the row
            out["logits"][0, -1, 42] = np.nan
        return out

    monkeypatch.setattr(olv_runtime.State, "run", poisoned)
    for kw in (dict(), dict(temperature=0.7, seed=1), dict(repetition_penalty=1.1)):
        with pytest.raises(InvalidArgument, match=r"non-finite logits: 1 NaN \(first at index "
                                                  r"42\)"):
            olv_runtime.generate(sess, [5, 6, 7], 4, **kw)
