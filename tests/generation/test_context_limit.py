"""Issue 26 item 2: prompt length is checked against the context before any prefill.

The tiny chat model records max_position_embeddings = 256 (conftest TINY). A prompt that does
not fit is a ContextLengthError with the numbers, before the state is touched; generation that
would pass the context stops there with finish reason "length" (as llama.cpp); ``context_limit``
(``--context-limit``) allows more or turns the check off.
"""
from __future__ import annotations

import io
import sys
import time

import numpy as np
import pytest
from tokenizers import Tokenizer

import olv_runtime
from olv_runtime.generation.chat import Conversation, load_chat_template
from olv_runtime.cli import main as cli_main
from olv_runtime.errors import ContextLengthError, InvalidArgument
from olv_runtime.generation.generate import context_limit_of

CTX = 256


@pytest.fixture(scope="module")
def sess(tiny_chat_models):
    s = olv_runtime.InferenceSession(olv_runtime.load(tiny_chat_models["int4"]))
    assert context_limit_of(s) == CTX
    return s


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(3, 200, size=n).tolist()


def test_prompt_beyond_the_context_is_refused_with_the_numbers(sess):
    with pytest.raises(ContextLengthError, match=r"prompt of 256 tokens does not fit the "
                                                 r"context of 256 positions \(the model's "
                                                 r"max_position_embeddings\) with room for a "
                                                 r"new token \(at most 255 prompt tokens\)"):
        olv_runtime.generate(sess, _prompt(256), 4)
    # with max_new_tokens 0 the whole context may be filled
    assert olv_runtime.generate(sess, _prompt(256), 0).size == 0
    with pytest.raises(ContextLengthError, match="prompt of 257 tokens"):
        olv_runtime.generate(sess, _prompt(257), 0)


def test_huge_prompt_is_refused_before_any_prefill(sess):
    before = sess.counters.snapshot()
    t0 = time.perf_counter()
    with pytest.raises(ContextLengthError, match="prompt of 10000000 tokens"):
        olv_runtime.generate(sess, np.ones(10_000_000, np.int64), 8)
    assert time.perf_counter() - t0 < 10
    after = sess.counters.snapshot()
    assert after["bytes_allocated"] == before["bytes_allocated"]


def test_max_new_tokens_stops_at_the_context_with_length(sess):
    prompt = _prompt(250, seed=1)
    res = olv_runtime.generate(sess, prompt, 100, return_result=True)
    assert res.finish_reason == "length"
    assert len(res.ids) == CTX - len(prompt)
    same = olv_runtime.generate(sess, prompt, CTX - len(prompt))
    assert res.ids.tolist() == same.tolist()


def test_continued_state_counts_what_it_holds(sess):
    first, state = olv_runtime.generate(sess, _prompt(200, seed=2), 10, return_state=True)
    tokens = list(state.tokens)
    with pytest.raises(ContextLengthError, match=r"prompt of 50 tokens after the 210 tokens "
                                                 r"the state holds .*at most 45 prompt"):
        olv_runtime.generate(None, _prompt(50), 4, state=state)
    assert state.tokens == tokens  # untouched
    res = olv_runtime.generate(None, _prompt(40), 100, state=state, return_result=True)
    assert res.finish_reason == "length" and len(state.tokens) == CTX
    state.close()


def test_explicit_limits_and_opt_out(sess):
    with pytest.raises(ContextLengthError, match=r"context of 8 positions \(context_limit\)"):
        olv_runtime.generate(sess, _prompt(8), 1, context_limit=8)
    res = olv_runtime.generate(sess, _prompt(5), 10, context_limit=8, return_result=True)
    assert len(res.ids) == 3 and res.finish_reason == "length"
    got = olv_runtime.generate(sess, _prompt(258, seed=3), 2, context_limit=300)
    assert len(got) == 2
    got_none = olv_runtime.generate(sess, _prompt(258, seed=3), 2, context_limit=None)
    assert got_none.tolist() == got.tolist()
    for bad in (0, -1, True, 2.5, "big"):
        with pytest.raises(InvalidArgument, match="context_limit must be"):
            olv_runtime.generate(sess, [1, 2], 1, context_limit=bad)


def test_conversation_refuses_a_huge_line_and_goes_on(sess, tiny_chat_models):
    tok = Tokenizer.from_file(str(tiny_chat_models["int4"].parent / "tokenizer.json"))
    template, special = load_chat_template(tiny_chat_models["int4"])
    conv = Conversation(sess, tok, template, special)
    with pytest.raises(ContextLengthError, match="does not fit the context of 256"):
        conv.send("the lazy dog " * 20_000, 4)
    assert conv.messages == [] and conv.state.tokens == []
    rep = conv.send("hello", 3)
    assert rep.ids.size > 0
    conv.close()


def test_cli_refuses_before_work(tiny_chat_models, capsys):
    model = str(tiny_chat_models["int4"])
    ids = ",".join(str(t) for t in _prompt(300))
    assert cli_main(["generate", model, "--prompt-ids", ids, "--max-new-tokens", "2"]) == 2
    assert "the prompt of 300 tokens does not fit the context of 256" in capsys.readouterr().err
    t0 = time.perf_counter()
    assert cli_main(["bench", model, "--prompt-len", "100000"]) == 2
    assert time.perf_counter() - t0 < 20
    assert "the prompt of 100000 tokens does not fit" in capsys.readouterr().err
    assert cli_main(["generate", model, "--prompt-ids", ids, "--max-new-tokens", "2",
                     "--context-limit", "none", "--output", "ids"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:  # argparse's usage error
        cli_main(["generate", model, "--prompt-ids", "5,6,7", "--context-limit", "0"])
    assert exc.value.code == 2
    assert "--context-limit: expected 'model', 'none' or an integer >= 1, got '0'" in \
        capsys.readouterr().err


def test_cli_generation_stops_at_the_context(tiny_chat_models, capsys):
    model = str(tiny_chat_models["int4"])
    ids = ",".join(str(t) for t in _prompt(250, seed=4))
    assert cli_main(["generate", model, "--prompt-ids", ids, "--max-new-tokens", "1000",
                     "--ignore-eos", "--output", "ids"]) == 0
    out, err = capsys.readouterr()
    assert "generation stops at 6 new tokens (finish reason length)" in err
    assert "generated 6 tokens" in err


def test_olv_chat_reports_a_too_long_line_and_goes_on(tiny_chat_models, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("the lazy dog " * 20_000 + "\nhello\n"))
    assert cli_main(["chat", str(tiny_chat_models["int4"]), "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "olv chat: error: the prompt of" in err and "does not fit the context" in err
    assert "[turn 1:" in err
