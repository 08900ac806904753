"""GenerationConfig (issue 22 item 5): its checks, the config form ``generate_result`` against
the keyword form ``generate``, and ``prefill`` + ``decode_step`` by hand as an independent
reference for generate's loop (greedy, seeded sampling with penalties, logprobs, continuation)."""
from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
from tokenizers import Tokenizer

import olv_runtime
from olv_runtime import GenerationConfig, GenerationResult, decode_step, generate_result, prefill
from olv_runtime.errors import InvalidArgument, StateError
from olv_runtime.generation.sampling import SamplingParams, select_token, token_logprob

PROMPT = [5, 17, 99, 3, 42, 64, 7, 120]

#: the module (``olv_runtime.generate`` is the function)
from olv_runtime.generation import generate as gen_mod  # noqa: E402

#: sampling with every control on (seeded)
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.2,
               presence_penalty=0.1, frequency_penalty=0.05, penalty_last_n=6, seed=11)


@pytest.fixture(scope="module")
def sess(tiny_chat_models):
    return olv_runtime.InferenceSession(olv_runtime.load(tiny_chat_models["int4"]))


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_models):
    return Tokenizer.from_file(str(tiny_chat_models["int4"].parent / "tokenizer.json"))


def _fresh(sess):
    return olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))


def _by_hand(state, prompt, n, params: SamplingParams | None = None, seed=None, top_n=0):
    """n tokens chosen from prefill / decode_step logits outside generate: the argmax (params
    None) or sampling.select_token with a generator seeded as generate seeds it; each token's
    TokenLogprob."""
    rng = np.random.default_rng(seed)
    history = list(state.tokens) + list(prompt)
    logits = prefill(state, prompt)
    toks, lps = [], []
    for k in range(n):
        row = logits[0, -1]
        tok = int(row.argmax()) if params is None else select_token(row, history, params, rng)
        lps.append(token_logprob(row, tok, top_n))
        toks.append(tok)
        history.append(tok)
        if k + 1 < n:
            logits = decode_step(state, tok)
    return toks, lps


# -- GenerationConfig: each field checked where the config is made ------------------------------

BAD = [
    ("max_new_tokens", -1, r"max_new_tokens must be an integer >= 0, got -1"),
    ("max_new_tokens", 2.0, r"max_new_tokens must be an integer >= 0, got 2.0"),
    ("max_new_tokens", True, r"max_new_tokens must be an integer >= 0, got True"),
    ("temperature", -0.5, r"temperature must be >= 0 \(0 = greedy\), got -0.5"),
    ("temperature", float("nan"), r"temperature must be a finite number, got nan"),
    ("temperature", "1", r"temperature must be a finite number, got '1'"),
    ("top_k", -1, r"top_k must be an integer >= 0, got -1"),
    ("top_k", 1.5, r"top_k must be an integer >= 0, got 1.5"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0.0"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\], got 1.5"),
    ("min_p", -0.1, r"min_p must be in \[0, 1\] \(0 = off\), got -0.1"),
    ("min_p", 1.1, r"min_p must be in \[0, 1\] \(0 = off\), got 1.1"),
    ("repetition_penalty", 0.0, r"repetition_penalty must be > 0 \(1 = off\), got 0.0"),
    ("presence_penalty", float("inf"), r"presence_penalty must be a finite number, got inf"),
    ("frequency_penalty", None, r"frequency_penalty must be a finite number, got None"),
    ("penalty_last_n", -2, r"penalty_last_n must be an integer >= 0, got -2"),
    ("seed", -1, r"seed must be an integer in \[0, 2\*\*128\), got -1"),
    ("seed", 2**128, r"seed must be an integer in \[0, 2\*\*128\), got 34028"),
    ("seed", 1.0, r"seed must be None or an integer >= 0, got 1.0"),
    ("seed", True, r"seed must be None or an integer >= 0, got True"),
    ("eos_token_id", "eos", r"eos_token_id must be an int, a list of ints, 'auto' or None, "
                            r"got 'eos'"),
    ("eos_token_id", object(), r"eos_token_id must be an int, a list of ints, 'auto' or None"),
    ("eos_token_id", [2, "x"], r"eos_token_id entries must be integer token ids, got 'x' in "
                               r"\[2, 'x'\]"),
    ("eos_token_id", [2, 1.0], r"eos_token_id entries must be integer token ids, got 1.0"),
    ("eos_token_id", True, r"eos_token_id entries must be integer token ids, got True"),
    ("stop", ["a", ""], r"stop strings must be non-empty strings, got \['a', ''\]"),
    ("stop", [3], r"stop strings must be non-empty strings, got \[3\]"),
    ("stop", "", r"stop strings must be non-empty strings, got \[''\]"),
    ("top_logprobs", -1, r"top_logprobs must be an integer >= 0, got -1"),
    ("top_logprobs", True, r"top_logprobs must be an integer >= 0, got True"),
]


@pytest.mark.parametrize("field, value, match", BAD)
def test_each_bad_field_raises_its_message(field, value, match):
    with pytest.raises(InvalidArgument, match=match) as made:
        GenerationConfig(**{field: value})
    # the keyword form raises the same exception with the same message, before any model work
    # (model None: a later check would say "generate needs a model")
    with pytest.raises(InvalidArgument) as kw:
        olv_runtime.generate(None, [1], **{field: value})
    assert str(kw.value) == str(made.value)
    # and a changed copy is checked again
    with pytest.raises(InvalidArgument, match=match):
        dataclasses.replace(GenerationConfig(), **{field: value})


def test_defaults_are_the_keyword_defaults():
    params = inspect.signature(olv_runtime.generate).parameters
    cfg = GenerationConfig()
    fields = [f.name for f in dataclasses.fields(GenerationConfig) if f.init]
    assert len(fields) == 16  # the 15 selection/stopping/output settings and context_limit
    for name in fields:
        assert params[name].default == getattr(cfg, name) or (
            name == "stop" and params[name].default is None and cfg.stop == ())
    assert cfg.sampling == SamplingParams()


def test_normalised_frozen_and_hashable():
    cfg = GenerationConfig(7, eos_token_id=np.int64(3), stop="x", seed=np.int64(5), logprobs=1,
                           skip_special_tokens=0, temperature=0.5)
    assert cfg.eos_token_id == (3,) and type(cfg.eos_token_id[0]) is int
    assert cfg.stop == ("x",) and cfg.seed == 5 and type(cfg.seed) is int
    assert cfg.logprobs is True and cfg.skip_special_tokens is False
    assert cfg.sampling == SamplingParams(temperature=0.5)
    assert GenerationConfig(eos_token_id=np.array([3, 4])).eos_token_id == (3, 4)
    assert GenerationConfig(eos_token_id="auto").eos_token_id == "auto"
    assert GenerationConfig(stop=None).stop == () and GenerationConfig(stop=["a", "b"]).stop == (
        "a", "b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.temperature = 1.0
    same = GenerationConfig(7, eos_token_id=[3], stop=("x",), seed=5, logprobs=True,
                            temperature=0.5, skip_special_tokens=False)
    assert same == cfg and hash(same) == hash(cfg) and len({cfg, same}) == 1
    assert dataclasses.replace(cfg, temperature=0.0) != cfg
    assert GenerationConfig(**dataclasses.asdict(cfg)) == cfg
    assert dataclasses.replace(cfg, temperature=0.0).sampling.greedy


def test_config_argument_must_be_a_config(sess):
    with pytest.raises(InvalidArgument, match="config must be a GenerationConfig or None, got "
                                              "dict"):
        generate_result(sess, PROMPT, {"max_new_tokens": 3})


def test_range_checks_that_need_the_model(sess):
    vocab = int(sess.get_modelmeta()["olv.vocab_size"])
    with pytest.raises(InvalidArgument, match=rf"token ids in \[0, {vocab}\), got -1"):
        generate_result(sess, PROMPT, GenerationConfig(3, eos_token_id=-1))
    with pytest.raises(InvalidArgument, match=rf"token ids in \[0, {vocab}\), got {vocab}"):
        generate_result(sess, PROMPT, GenerationConfig(3, eos_token_id=[2, vocab]))
    with pytest.raises(InvalidArgument, match=f"at most the vocabulary size {vocab}"):
        generate_result(sess, PROMPT, GenerationConfig(3, logprobs=True,
                                                       top_logprobs=vocab + 1))


# -- the config form and the keyword form give the same results -------------------------------

def _same(a: GenerationResult, b: GenerationResult) -> None:
    assert a.ids.dtype == b.ids.dtype == np.int64
    assert a.ids.tolist() == b.ids.tolist()
    assert a.finish_reason == b.finish_reason and a.stop_string == b.stop_string
    assert a.text == b.text
    assert a.logprobs == b.logprobs  # TokenLogprob equality: bitwise float values


@pytest.mark.parametrize("settings", [dict(), SAMPLED], ids=["greedy", "sampled"])
def test_config_form_equals_keyword_form_and_the_hand_loop(sess, settings):
    n = 10
    kw = olv_runtime.generate(sess, PROMPT, n, logprobs=True, top_logprobs=3,
                              return_result=True, **settings)
    cfg = generate_result(sess, PROMPT, GenerationConfig(n, logprobs=True, top_logprobs=3,
                                                         **settings))
    _same(kw, cfg)
    assert cfg.finish_reason == "length" and cfg.ids.size == n and cfg.state is None
    assert olv_runtime.generate(sess, PROMPT, n, **settings).tolist() == cfg.ids.tolist()
    # an independent reference: prefill, decode_step and the sampling functions by hand
    params = None if not settings else GenerationConfig(**settings).sampling
    state = _fresh(sess)
    toks, lps = _by_hand(state, PROMPT, n, params, settings.get("seed"), 3)
    state.close()
    assert toks == cfg.ids.tolist()
    assert lps == cfg.logprobs


def test_seeds_differ(sess):
    """The sampled case above is not greedy in disguise: two seeds give two sequences."""
    a = generate_result(sess, PROMPT, GenerationConfig(12, **SAMPLED))
    b = generate_result(sess, PROMPT, GenerationConfig(12, **{**SAMPLED, "seed": 12}))
    greedy = generate_result(sess, PROMPT, GenerationConfig(12))
    assert a.ids.tolist() != b.ids.tolist() and a.ids.tolist() != greedy.ids.tolist()


def test_stop_strings_and_eos_in_both_forms(sess, tokenizer):
    ref = generate_result(sess, PROMPT, GenerationConfig(24), tokenizer=tokenizer)
    assert ref.finish_reason == "length" and len(ref.text) > 12
    stop = ref.text[8:11]
    pieces_kw, pieces_cfg = [], []
    kw = olv_runtime.generate(sess, PROMPT, 24, tokenizer=tokenizer, stop=[stop, "\x00never"],
                              text_callback=pieces_kw.append, return_result=True)
    cfg = generate_result(sess, PROMPT, GenerationConfig(24, stop=(stop, "\x00never")),
                          tokenizer=tokenizer, text_callback=pieces_cfg.append)
    _same(kw, cfg)
    assert cfg.finish_reason == "stop" and cfg.stop_string == stop
    assert cfg.text == ref.text[:ref.text.find(stop)] and "".join(pieces_cfg) == cfg.text
    assert pieces_kw == pieces_cfg
    assert cfg.ids.tolist() == ref.ids.tolist()[:cfg.ids.size]
    # eos: the first occurrence of the 4th token ends generation, the eos id included
    ids = ref.ids.tolist()
    kw = olv_runtime.generate(sess, PROMPT, 24, eos_token_id=ids[3], return_result=True)
    cfg = generate_result(sess, PROMPT, GenerationConfig(24, eos_token_id=ids[3]))
    _same(kw, cfg)
    assert cfg.finish_reason == "eos" and cfg.ids.tolist() == ids[:ids.index(ids[3]) + 1]


def test_continuing_a_state_in_both_forms(sess):
    full = generate_result(sess, PROMPT, GenerationConfig(11, **SAMPLED)).ids.tolist()
    first, st_kw = olv_runtime.generate(sess, PROMPT, 4, return_state=True, **SAMPLED)
    res = generate_result(sess, PROMPT, GenerationConfig(4, **SAMPLED), keep_state=True)
    assert res.state is not None and not res.state.closed
    assert first.tolist() == res.ids.tolist() == full[:4]
    assert res.state.tokens == st_kw.tokens == PROMPT + full[:4]
    assert res.state.cached_tokens == len(PROMPT) + 3  # the last token is pending
    # the continued state keeps its generator (seed None): one uninterrupted call's draws
    rest_settings = {**SAMPLED, "seed": None}
    rest_kw = olv_runtime.generate(None, [], 7, state=st_kw, **rest_settings)
    rest = generate_result(None, [], GenerationConfig(7, **rest_settings), state=res.state)
    assert rest.state is res.state and not rest.state.closed
    assert rest_kw.tolist() == rest.ids.tolist() == full[4:]
    st_kw.close()
    res.state.close()


def test_a_state_made_by_the_call_is_closed_unless_kept(sess, monkeypatch):
    made = []
    real = gen_mod.make_state

    def spy(*a, **k):
        made.append(real(*a, **k))
        return made[-1]

    monkeypatch.setattr(gen_mod, "make_state", spy)
    res = generate_result(sess, PROMPT, GenerationConfig(3))
    kept = generate_result(sess, PROMPT, GenerationConfig(3), keep_state=True)
    assert res.state is None and made[0].closed
    assert kept.state is made[1] and not kept.state.closed
    kept.state.close()


def test_interrupt_is_reported_by_the_config_form(sess):
    full = generate_result(sess, PROMPT, GenerationConfig(9)).ids.tolist()
    state = _fresh(sess)
    seen = []

    def cb(tok):
        seen.append(tok)
        if len(seen) == 4:
            raise KeyboardInterrupt

    res = generate_result(sess, PROMPT, GenerationConfig(9), state=state, callback=cb)
    assert res.finish_reason == "interrupted" and res.ids.tolist() == full[:4]
    assert res.stats.new_tokens == 4 and state.tokens == PROMPT + full[:4]
    rest = generate_result(None, [], GenerationConfig(5), state=state)
    assert full[:4] + rest.ids.tolist() == full
    state.close()


def test_greedy_decode_skips_select_token(sess, monkeypatch):
    """The fast greedy path stays: unpenalised greedy decoding never calls select_token;
    penalised greedy does."""
    ref = generate_result(sess, PROMPT, GenerationConfig(6)).ids.tolist()

    def boom(*a, **k):
        raise AssertionError("select_token called")

    monkeypatch.setattr(gen_mod, "select_token", boom)
    assert generate_result(sess, PROMPT, GenerationConfig(6)).ids.tolist() == ref
    assert olv_runtime.generate(sess, PROMPT, 6).tolist() == ref
    with pytest.raises(AssertionError, match="select_token called"):
        generate_result(sess, PROMPT, GenerationConfig(6, repetition_penalty=1.3))


# -- prefill and decode_step by hand --------------------------------------------------------------

def test_prefill_decode_step_reproduce_greedy_generate(sess):
    n = 12
    ref = olv_runtime.generate(sess, PROMPT, n).tolist()
    state = _fresh(sess)
    toks, _ = _by_hand(state, PROMPT, n)
    assert toks == ref
    # the bookkeeping generate relies on: every token fed is recorded and cached
    assert state.tokens == PROMPT + ref[:-1] and state.cached_tokens == len(state.tokens)
    state.close()


def test_prefill_feeds_the_pending_token_of_a_generate(sess):
    full = olv_runtime.generate(sess, PROMPT, 10).tolist()
    first, state = olv_runtime.generate(sess, PROMPT, 4, return_state=True)
    assert state.cached_tokens == len(state.tokens) - 1
    with pytest.raises(StateError, match=r"decode_step: the state has 1 pending token"):
        decode_step(state, full[4])
    toks, _ = _by_hand(state, [], 6)
    assert first.tolist() + toks == full
    state.close()


def test_prefill_and_decode_step_checks(sess):
    vocab = int(sess.get_modelmeta()["olv.vocab_size"])
    state = _fresh(sess)
    with pytest.raises(InvalidArgument, match="prompt_ids must be a non-empty 1-D sequence"):
        prefill(state, [])
    with pytest.raises(InvalidArgument, match=rf"prompt_ids: token ids must be in \[0, {vocab}\), "
                                              rf"got {vocab}"):
        prefill(state, [1, vocab])
    assert state.tokens == [] and state.cached_tokens == 0  # nothing fed
    logits = prefill(state, PROMPT)
    assert logits.shape[0] == 1 and logits.shape[-1] == vocab and logits.dtype == np.float32
    for bad in (-1, vocab, 1.0, True):
        with pytest.raises(InvalidArgument, match=rf"decode_step: token must be an integer token "
                                                  rf"id in \[0, {vocab}\), got {bad!r}"):
            decode_step(state, bad)
    assert state.tokens == PROMPT and state.cached_tokens == len(PROMPT)
    out = decode_step(state, np.int64(7))
    assert out.shape == (1, 1, vocab) and state.tokens == PROMPT + [7]
    assert state.cached_tokens == len(PROMPT) + 1
    with pytest.raises(InvalidArgument, match="prefill: state must be a State"):
        prefill({}, PROMPT)
    with pytest.raises(InvalidArgument, match="decode_step: state must be a State"):
        decode_step(None, 3)
    state.close()
    with pytest.raises(StateError, match="prefill: the state is closed"):
        prefill(state, PROMPT)
    with pytest.raises(StateError, match="decode_step: the state is closed"):
        decode_step(state, 3)


@pytest.mark.parametrize("bad", ["auto", 0, -1, 1.5, True, "4096"])
def test_context_limit_is_checked(bad):
    with pytest.raises(InvalidArgument, match="context_limit must be 'model', an integer >= 1 or None"):
        GenerationConfig(context_limit=bad)


def test_context_limit_values_kept():
    assert GenerationConfig().context_limit == "model"
    assert GenerationConfig(context_limit=None).context_limit is None
    assert GenerationConfig(context_limit=np.int64(8)).context_limit == 8
