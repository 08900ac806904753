"""generate() continuing a State: continuation cost (prefill counter), save/restore (prompt
cache) with the model digest check, stop strings, several eos ids, logprobs, Ctrl-C."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

import olv_runtime
from olv_runtime.errors import InvalidArgument, StateError, StateFileError

PROMPT = [5, 17, 99, 3, 42, 64, 7, 120]


@pytest.fixture(scope="module")
def sess(tiny_chat_models):
    return olv_runtime.InferenceSession(olv_runtime.load(tiny_chat_models["int4"]))


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_models):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_chat_models["int4"].parent / "tokenizer.json"))


def test_continuation_after_save_restore_equals_one_call(sess, tmp_path):
    full = olv_runtime.generate(sess, PROMPT, 12)
    first, state = olv_runtime.generate(sess, PROMPT, 5, return_state=True)
    assert state.tokens == PROMPT + first.tolist()
    assert state.cached_tokens == len(PROMPT) + 4  # the last generated token is pending
    path = state.save(tmp_path / "cache.npz")
    state.close()
    restored = olv_runtime.load_state(sess, path)
    assert restored.tokens == PROMPT + first.tolist()
    st = olv_runtime.GenerationStats()
    rest = olv_runtime.generate(sess, [], 7, state=restored, stats=st)
    assert first.tolist() + rest.tolist() == full.tolist()
    assert st.prefill_tokens == 1 and st.cached_tokens == len(PROMPT) + 4
    restored.close()


def test_sampled_continuation_carries_the_generator(sess, tmp_path):
    kw = dict(temperature=0.9, top_k=30, top_p=0.95, repetition_penalty=1.1)
    full = olv_runtime.generate(sess, PROMPT, 10, seed=11, **kw)
    a, state = olv_runtime.generate(sess, PROMPT, 4, seed=11, return_state=True, **kw)
    olv_runtime.save_state(state, tmp_path / "s.npz")
    restored = olv_runtime.load_state(sess, tmp_path / "s.npz")
    b = olv_runtime.generate(None, [], 6, state=restored, **kw)
    assert a.tolist() + b.tolist() == full.tolist()


def test_second_turn_costs_only_new_tokens(sess):
    turn2 = [9, 8, 7, 6]
    a, state = olv_runtime.generate(sess, PROMPT, 6, return_state=True)
    st = olv_runtime.GenerationStats()
    b = olv_runtime.generate(sess, turn2, 5, state=state, stats=st)
    assert st.prefill_tokens == 1 + len(turn2)            # pending token + the new turn
    assert st.cached_tokens == len(PROMPT) + len(a) - 1
    # the same ids as one fresh call on the whole sequence
    whole = olv_runtime.generate(sess, PROMPT + a.tolist() + turn2, 5)
    assert b.tolist() == whole.tolist()
    st_fresh = olv_runtime.GenerationStats()
    olv_runtime.generate(sess, PROMPT + a.tolist() + turn2, 1, stats=st_fresh)
    assert st_fresh.prefill_tokens == len(PROMPT) + len(a) + len(turn2)
    state.close()


def test_state_file_of_another_model_is_refused(sess, tiny_chat_models, tmp_path):
    _, state = olv_runtime.generate(sess, PROMPT, 3, return_state=True)
    state.save(tmp_path / "int4.npz")
    other = olv_runtime.InferenceSession(olv_runtime.load(tiny_chat_models["float32"]))
    assert olv_runtime.model_digest(other) != olv_runtime.model_digest(sess)
    with pytest.raises(StateFileError, match="saved for another model"):
        olv_runtime.load_state(other, tmp_path / "int4.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(StateFileError, match="not a readable state file"):
        olv_runtime.load_state(sess, tmp_path / "junk.npz")
    # a failed save leaves the existing file as it was
    before = (tmp_path / "int4.npz").read_bytes()
    state.close()
    with pytest.raises(StateError, match="closed"):
        olv_runtime.save_state(state, tmp_path / "int4.npz")
    assert (tmp_path / "int4.npz").read_bytes() == before


def test_digest_is_stable_across_copies(tiny_chat_models, tmp_path):
    import shutil

    src = tiny_chat_models["int4"]
    dst = tmp_path / "renamed.onnx"
    shutil.copyfile(src, dst)
    assert olv_runtime.model_digest(olv_runtime.load(dst)) == olv_runtime.model_digest(
        olv_runtime.load(src))


def test_state_run_outside_generate_is_detected(sess):
    _, state = olv_runtime.generate(sess, PROMPT, 2, return_state=True)
    state.run({"input_ids": np.array([[1, 2]], np.int64)})
    with pytest.raises(StateError, match="KV cache holds"):
        olv_runtime.generate(sess, [3], 2, state=state)
    state.close()
    with pytest.raises(StateError, match="closed"):
        olv_runtime.generate(sess, [3], 2, state=state)


@pytest.fixture(scope="module")
def paged_sess(tiny_chat_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("paged_state") / "model.onnx"
    olv_runtime.convert(tiny_chat_dir, path, kv="paged-int8")
    return olv_runtime.InferenceSession(olv_runtime.load(path))


def test_paged_state_run_outside_generate_is_detected(paged_sess):
    """A paged KV cache run outside generate: its ``length`` field disagrees with the token
    history, reported like the contiguous cache's sequence axis (no silent wrong logprobs)."""
    _, state = olv_runtime.generate(paged_sess, [5, 6, 7], 3, return_state=True)
    assert state.cached_tokens == 5 and len(state.tokens) == 6
    state.run({"input_ids": np.array([[4, 4, 4, 4]], np.int64)})
    with pytest.raises(StateError, match="KV cache holds 9 positions but its token history "
                                         "records 5"):
        olv_runtime.generate(paged_sess, [9], 3, state=state, return_result=True, logprobs=True)
    assert len(state.tokens) == 6  # refused before anything was fed
    # a consistent paged state continues as one call would have
    full = olv_runtime.generate(paged_sess, PROMPT, 6).tolist()
    first, st2 = olv_runtime.generate(paged_sess, PROMPT, 3, return_state=True)
    rest = olv_runtime.generate(paged_sess, [], 3, state=st2)
    assert first.tolist() + rest.tolist() == full
    state.close()
    st2.close()


def test_stop_strings(sess, tokenizer):
    ref = olv_runtime.generate(sess, PROMPT, 24, tokenizer=tokenizer, return_result=True)
    text = ref.text
    assert ref.finish_reason == "length" and len(text) > 12
    stop = text[8:11]
    first = text.find(stop)
    pieces = []
    res = olv_runtime.generate(sess, PROMPT, 24, tokenizer=tokenizer, stop=[stop, "\x00never"],
                               text_callback=pieces.append, return_result=True)
    assert res.finish_reason == "stop" and res.stop_string == stop
    assert res.text == text[:first]
    assert "".join(pieces) == text[:first]
    # the ids end with the token that completed the stop string
    assert stop in tokenizer.decode(res.ids.tolist())
    assert stop not in tokenizer.decode(res.ids[:-1].tolist())
    with pytest.raises(InvalidArgument, match="tokenizer"):
        olv_runtime.generate(sess, PROMPT, 4, stop="x")


def test_several_eos_ids_and_generation_config(sess, tiny_chat_models, tokenizer):
    eos = olv_runtime.eos_token_ids(sess)
    assert eos == [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    ref = olv_runtime.generate(sess, PROMPT, 10).tolist()
    absent = next(t for t in range(300) if t not in ref)  # eos ids must be in [0, vocab)
    res = olv_runtime.generate(sess, PROMPT, 10, eos_token_id=[absent, ref[3]], return_result=True)
    assert res.ids.tolist() == ref[:ref.index(ref[3]) + 1] and res.finish_reason == "eos"
    auto = olv_runtime.generate(sess, PROMPT, 10, eos_token_id="auto").tolist()
    cut = [i for i, t in enumerate(ref) if t in eos]
    assert auto == (ref[:cut[0] + 1] if cut else ref)


def test_logprobs_match_logits(sess):
    res = olv_runtime.generate(sess, PROMPT, 4, logprobs=True, top_logprobs=3, return_result=True)
    seq = PROMPT + res.ids.tolist()
    logits = sess.run(["logits"], {"input_ids": np.asarray([seq], np.int64), **_empty(sess)})[0][0]
    for k, lp in enumerate(res.logprobs):
        row = logits[len(PROMPT) - 1 + k].astype(np.float64)
        ref = row - np.log(np.exp(row - row.max()).sum()) - row.max()
        assert lp.token_id == res.ids[k]
        assert abs(lp.logprob - ref[lp.token_id]) < 1e-4
        assert [t for t, _ in lp.top] == np.argsort(-ref, kind="stable")[:3].tolist()
        assert lp.top[0][0] == lp.token_id  # greedy


def _empty(sess):
    return olv_runtime.empty_cache(sess)


def test_keyboard_interrupt_leaves_state_consistent(sess):
    full = olv_runtime.generate(sess, PROMPT, 9).tolist()
    state = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    seen = []

    def cb(tok):
        seen.append(tok)
        if len(seen) == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        olv_runtime.generate(sess, PROMPT, 9, state=state, callback=cb)
    assert state.tokens == PROMPT + seen
    rest = olv_runtime.generate(sess, [], 5, state=state)
    assert seen + rest.tolist() == full
    # with return_result the interruption is reported instead
    state2 = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
    seen.clear()
    res = olv_runtime.generate(sess, PROMPT, 9, state=state2, callback=cb, return_result=True)
    assert res.finish_reason == "interrupted" and res.ids.tolist() == full[:4]


def test_cli_prompt_cache(tiny_chat_models, tmp_path, capsys):
    from olv_runtime.cli import main as cli_main

    m = str(tiny_chat_models["int4"])
    cache = str(tmp_path / "p.npz")
    ids = ",".join(map(str, PROMPT))
    args = ["generate", m, "--prompt-ids", ids, "--max-new-tokens", "6", "--ignore-eos",
            "--prompt-cache", cache]
    assert cli_main(args) == 0
    first = capsys.readouterr()
    assert "(0 from the prompt cache)" in first.err
    assert cli_main(args) == 0  # the same prompt again: all but its last token reused
    second = capsys.readouterr()
    assert f"prefill 1 tokens ({len(PROMPT) - 1} from the prompt cache)" in second.err
    assert second.out == first.out
    longer = ",".join(map(str, PROMPT + [1, 2, 3]))
    assert cli_main(["generate", m, "--prompt-ids", longer, "--max-new-tokens", "2",
                     "--prompt-cache", cache]) == 0
    assert f"prefill 3 tokens ({len(PROMPT)} from the prompt cache)" in capsys.readouterr().err
    before = pathlib.Path(cache).read_bytes()
    assert cli_main(["generate", str(tiny_chat_models["float32"]), "--prompt-ids", ids,
                     "--prompt-cache", cache]) == 2
    assert "saved for another model" in capsys.readouterr().err
    assert pathlib.Path(cache).read_bytes() == before


def test_generate_refuses_a_model_without_persistent_bindings(tmp_path, tiny_qwen2_dir):
    """A plain export (past_*/present_* left to the caller) gets a StateError naming the inputs,
    not a missing-input error from inside the first run."""
    from olv_runtime.errors import StateError

    src = tmp_path / "m.onnx"
    olv_runtime.convert(tiny_qwen2_dir, src)
    m = olv_runtime.load(src)
    del m.proto.graph.persistent_bindings[:]
    with pytest.raises(StateError, match="no persistent_bindings.*past_key"):
        olv_runtime.generate(olv_runtime.InferenceSession(m), [1, 2, 3], 2)


@pytest.mark.parametrize("quantize", [False, True])
def test_last_only_logits_equal_the_last_row(tiny_chat_models, quantize):
    """State.run(last_only=("logits",)) computes the lm_head on the last position only: the
    row equals (bitwise: each row of the linear kernels depends only on its own input row) the
    last row of the full logits, and the retained KV cache is the same."""
    s = olv_runtime.InferenceSession(olv_runtime.load(tiny_chat_models["int4"]),
                                     olv_runtime.SessionOptions(quantize_activations=quantize))
    ids = np.array([PROMPT], np.int64)
    full_st = olv_runtime.make_state(s, olv_runtime.empty_cache(s))
    full = np.array(full_st.run({"input_ids": ids})["logits"])
    last_st = olv_runtime.make_state(s, olv_runtime.empty_cache(s))
    last = np.array(last_st.run({"input_ids": ids}, last_only=("logits",))["logits"])
    assert full.shape[1] == len(PROMPT) and last.shape == (1, 1, full.shape[2])
    np.testing.assert_array_equal(last[0, 0], full[0, -1])
    for name, v in full_st.values.items():
        np.testing.assert_array_equal(np.asarray(last_st.values[name]), np.asarray(v))
    # the next step continues identically
    nxt = np.array([[int(full[0, -1].argmax())]], np.int64)
    np.testing.assert_array_equal(last_st.run({"input_ids": nxt})["logits"],
                                  full_st.run({"input_ids": nxt})["logits"])
    with pytest.raises(InvalidArgument, match="last_only"):
        last_st.run({"input_ids": nxt}, last_only=("present.0.key",))
    with pytest.raises(InvalidArgument, match="last_only"):
        last_st.run({"input_ids": nxt}, last_only="logits")
    full_st.close()
    last_st.close()


def _rewrite_header(src, dst, edit):
    """Copy a state file with its JSON header edited by ``edit(header)``."""
    import json

    with np.load(src) as z:
        arrays = {k: z[k] for k in z.files}
    header = json.loads(arrays["__header__"].tobytes().decode())
    edit(header)
    arrays["__header__"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    np.savez(dst, **arrays)
    return dst


def test_state_file_whose_tokens_disagree_with_its_kv_is_refused(sess, tmp_path):
    """tokens / cached_tokens / KV length must agree: a file whose history lost its last two
    tokens (cached_tokens and the KV still 5 positions) would continue with a wrong logprob."""
    _, state = olv_runtime.generate(sess, [5, 6, 7], 3, return_state=True)
    good = state.save(tmp_path / "s.npz")
    state.close()
    assert olv_runtime.load_state(sess, good).tokens == [5, 6, 7] + state.tokens[3:]

    def short(h):
        h["tokens"] = h["tokens"][:-2]

    bad = _rewrite_header(good, tmp_path / "short.npz", short)
    with pytest.raises(StateFileError, match=r"cached_tokens' must be an integer in "
                                             r"\[0, len\(tokens\)\] = \[0, 4\], got 5"):
        olv_runtime.load_state(sess, bad)

    def fewer_cached(h):
        h["cached_tokens"] = 4

    bad = _rewrite_header(good, tmp_path / "cached.npz", fewer_cached)
    with pytest.raises(StateFileError, match="KV cache holds 5 positions but the header's "
                                             "cached_tokens is 4"):
        olv_runtime.load_state(sess, bad)


@pytest.mark.parametrize("edit, match", [
    (lambda h: h.pop("tokens"), r"lacks \['tokens'\]"),
    (lambda h: h.pop("cached_tokens"), r"lacks \['cached_tokens'\]"),
    (lambda h: h.pop("values"), r"lacks \['values'\]"),
    (lambda h: h.update(tokens="abcdef"), "'tokens' must be a list of integer token ids, got "
                                          "'abcdef'"),
    (lambda h: h.update(tokens=[5, 6, 7, 7, 7, 1.5]), "'tokens' must be a list of integer"),
    (lambda h: h.update(tokens=[5, 6, 7, 7, 7, 10**6]), r"token ids in \[0, \d+\), got 1000000"),
    (lambda h: h.update(cached_tokens="5"), "'cached_tokens' must be an integer"),
    (lambda h: h.update(values="cache"), "'values' must be a list of value names"),
    (lambda h: h.update(rng={"bit_generator": "MT19937"}), "'rng' is not a PCG64"),
])
def test_malformed_state_header_is_a_state_file_error(sess, tmp_path, edit, match):
    _, state = olv_runtime.generate(sess, [5, 6, 7], 3, return_state=True)
    good = state.save(tmp_path / "s.npz")
    state.close()
    with pytest.raises(StateFileError, match=match):
        olv_runtime.load_state(sess, _rewrite_header(good, tmp_path / "bad.npz", edit))


def test_unreadable_state_files_are_state_file_errors(sess, tmp_path):
    _, state = olv_runtime.generate(sess, [5, 6, 7], 3, return_state=True)
    good = state.save(tmp_path / "s.npz")
    data = good.read_bytes()
    (tmp_path / "half.npz").write_bytes(data[:len(data) // 2])
    (tmp_path / "tail.npz").write_bytes(data[:-30])
    corrupt = bytearray(data)
    mid = data.index(b"__header__.npy") + 200  # inside the first stored member's data
    corrupt[mid:mid + 8] = b"\xff" * 8
    (tmp_path / "crc.npz").write_bytes(bytes(corrupt))
    np.save(tmp_path / "bare.npy", np.zeros(3))
    for name in ("half.npz", "tail.npz", "crc.npz", "bare.npy", "missing.npz"):
        with pytest.raises(StateFileError, match=str(tmp_path / name).replace("\\", "\\\\")):
            olv_runtime.load_state(sess, tmp_path / name)
    with pytest.raises(StateFileError, match="not a readable state file"):
        olv_runtime.load_state(sess, tmp_path)  # a directory


def test_state_save_to_a_bad_path_names_the_path(sess, tmp_path):
    from olv_runtime.errors import OutputError

    _, state = olv_runtime.generate(sess, [5, 6, 7], 2, return_state=True)
    (tmp_path / "d").mkdir()
    with pytest.raises(OutputError, match=r"/d': it is an existing directory") as e:
        state.save(tmp_path / "d")
    assert ".tmp" not in str(e.value)
    with pytest.raises(OutputError, match=r"nope/s.npz'.*does not exist") as e:
        state.save(tmp_path / "nope" / "s.npz")
    assert ".tmp" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temporary file left
    state.close()


def test_cli_prompt_cache_refused_before_generating(tiny_chat_dir, tiny_chat_models, tmp_path,
                                                    capsys):
    """--prompt-cache that cannot be saved (paged KV model, a directory, a missing directory)
    is an error before anything is generated or printed, naming the path given."""
    from olv_runtime.cli import main as cli_main

    paged = tmp_path / "paged" / "model.onnx"
    olv_runtime.convert(tiny_chat_dir, paged, kv="paged-int8")
    ids = ",".join(map(str, PROMPT))
    base = ["generate", "--prompt-ids", ids, "--max-new-tokens", "4", "--output", "ids"]
    cache = tmp_path / "p.npz"
    assert cli_main([base[0], str(paged), *base[1:], "--prompt-cache", str(cache)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "paged KV cache" in out.err and not cache.exists()
    m = str(tiny_chat_models["int4"])
    (tmp_path / "dir").mkdir()
    for target, why in ((tmp_path / "dir", "is an existing directory"),
                        (tmp_path / "nope" / "p.npz", "does not exist")):
        assert cli_main([base[0], m, *base[1:], "--prompt-cache", str(target)]) == 2
        out = capsys.readouterr()
        assert out.out == "" and str(target) in out.err and why in out.err
        assert ".tmp" not in out.err


@pytest.mark.parametrize("kwargs, match", [
    (dict(callback=3), "callback must be callable or None, got int 3"),
    (dict(text_callback="x", tokenizer=None), "need a tokenizer"),
    (dict(tokenizer="x", stop=["a"]), "tokenizer must have a decode"),
    (dict(tokenizer=object()), "tokenizer must have a decode"),
    (dict(stats={}), "stats must be a GenerationStats or None, got dict"),
    (dict(eos_token_id=[2, "x"]), "eos_token_id entries must be integer token ids, got 'x'"),
    (dict(eos_token_id=[2, 1.0]), "eos_token_id entries must be integer token ids, got 1.0"),
    (dict(eos_token_id=True), "eos_token_id entries must be integer token ids, got True"),
    (dict(eos_token_id=-1), r"eos_token_id entries must be token ids in \[0, \d+\), got -1"),
    (dict(eos_token_id=[2, 10**6]), r"token ids in \[0, \d+\), got 1000000"),
    (dict(eos_token_id=object()), "eos_token_id must be an int, a list of ints"),
    (dict(top_logprobs=10**6, logprobs=True), "top_logprobs must be at most the vocabulary "
                                              "size"),
    (dict(top_logprobs=True), "top_logprobs must be an integer"),
])
def test_arguments_are_checked_before_the_state_is_touched(sess, kwargs, match):
    """Every argument is checked before the prefill: a bad one leaves a continued state as it
    was (tokens, cached tokens, KV, generator)."""
    _, state = olv_runtime.generate(sess, PROMPT, 3, return_state=True, seed=3)
    tokens, cached = list(state.tokens), state.cached_tokens
    kv = {k: v.copy() for k, v in state.values.items()}
    rng = state.rng.bit_generator.state
    with pytest.raises(InvalidArgument, match=match):
        olv_runtime.generate(sess, [9], 3, state=state, **kwargs)
    assert state.tokens == tokens and state.cached_tokens == cached
    assert state.rng.bit_generator.state == rng
    assert all(np.array_equal(state.values[k], v) for k, v in kv.items())
    state.close()


def test_state_argument_of_the_wrong_type(sess):
    with pytest.raises(InvalidArgument, match="state must be a State .* got dict"):
        olv_runtime.generate(sess, [9], 3, state={})


def test_a_raising_callback_keeps_the_tokens_so_far(sess, tokenizer):
    """The documented behaviour: the callback's exception propagates unchanged; the state keeps
    every token chosen so far, the one passed to the raising callback included (pending), and
    a continuation yields what one uninterrupted call would have."""
    full = olv_runtime.generate(sess, PROMPT, 9).tolist()
    for kind in ("callback", "text_callback"):
        state = olv_runtime.make_state(sess, olv_runtime.empty_cache(sess))
        seen = []

        def cb(tok):
            seen.append(tok)
            if len(seen) == 3:
                raise ValueError("stop here")

        def text_cb(piece):  # one piece per token at most: count tokens through callback
            if len(seen) >= 3:
                raise ValueError("stop here")

        kw = (dict(callback=cb) if kind == "callback"
              else dict(callback=seen.append, text_callback=text_cb, tokenizer=tokenizer))
        with pytest.raises(ValueError, match="stop here"):
            olv_runtime.generate(sess, PROMPT, 9, state=state, **kw)
        n = len(seen)
        assert n >= 3 and seen == full[:n]
        assert state.tokens == PROMPT + seen and state.cached_tokens == len(PROMPT) + n - 1
        rest = olv_runtime.generate(sess, [], 9 - n, state=state)
        assert seen + rest.tolist() == full
        state.close()


@pytest.mark.parametrize("batch", [-1, 0, 1.0, True, "2"])
def test_empty_cache_batch_size_is_checked(sess, paged_sess, batch):
    for s in (sess, paged_sess):
        with pytest.raises(InvalidArgument, match=f"batch_size must be an integer >= 1, got "
                                                  f"{batch!r}"):
            olv_runtime.empty_cache(s, batch)
    assert all(v.shape[0] == 2 for v in olv_runtime.empty_cache(sess, 2).values())
