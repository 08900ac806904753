"""Token selection (olv_runtime.sampling) against transformers' logits processors of the same
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
from olv_runtime.sampling import (
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
