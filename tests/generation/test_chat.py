"""Chat templates rendered like transformers' apply_chat_template (string equality), and
``olv chat`` through a subprocess with piped stdin and in a pseudo-terminal (Ctrl-C, /reset)."""
from __future__ import annotations

import json
import os
import pathlib
import select
import subprocess
import sys
import time

import pytest

import olv_runtime
from olv_runtime.generation.chat import ChatTemplateError, apply_chat_template, load_chat_template

import transformers

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.fixture(scope="module")
def hf_tok(tiny_chat_dir):
    return transformers.AutoTokenizer.from_pretrained(str(tiny_chat_dir))


@pytest.fixture(scope="module")
def tok(tiny_chat_models):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_chat_models["int4"].parent / "tokenizer.json"))


CONVERSATIONS = [
    [{"role": "user", "content": "hello world"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
     {"role": "assistant", "content": " the quick fox\n"}, {"role": "user", "content": "again?"}],
    [{"role": "user", "content": "héllo ✓ <b>&</b>"}],
]

# exercises tojson (no HTML escaping, non-ASCII kept), loop controls, namespace, special tokens
# as variables, whitespace control and raise_exception
EXTRA_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{% for m in messages %}
  {% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}
  {% if loop.index > 3 %}{% break %}{% endif %}
  {% set ns.n = ns.n + 1 %}
[{{ m['role'] | upper }}] {{ m | tojson }}
  {%- if not loop.last %} | {% endif %}
{% endfor %}
{% generation %}n={{ ns.n }}{% endgeneration %}{{ eos_token }}
{%- if add_generation_prompt %}>>{% endif %}"""


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("k", range(len(CONVERSATIONS)))
def test_template_matches_transformers(tiny_chat_models, hf_tok, k, gen):
    template, special = load_chat_template(tiny_chat_models["int4"])
    assert template == hf_tok.chat_template
    msgs = CONVERSATIONS[k]
    want = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert apply_chat_template(msgs, template, add_generation_prompt=gen,
                               special_tokens=special) == want
    want2 = hf_tok.apply_chat_template(msgs, chat_template=EXTRA_TEMPLATE, tokenize=False,
                                       add_generation_prompt=gen)
    got2 = apply_chat_template(msgs, EXTRA_TEMPLATE, add_generation_prompt=gen,
                               special_tokens=special)
    assert got2 == want2


def test_template_errors(tiny_chat_models):
    template, special = load_chat_template(tiny_chat_models["int4"])
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        apply_chat_template([{"role": "tool", "content": "x"}], template)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        apply_chat_template([], "{% for %}")


def run_chat(model, stdin: str, *extra, transcript=None):
    args = [sys.executable, "-m", "olv_runtime.cli", "chat", str(model), *extra]
    if transcript is not None:
        args += ["--transcript", str(transcript)]
    r = subprocess.run(args, input=stdin, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr
    turns = [json.loads(l) for l in transcript.read_text().splitlines()] if transcript else []
    return r, turns


def test_two_turns_piped(tiny_chat_models, hf_tok, tok, tmp_path):
    model = tiny_chat_models["int4"]
    r, turns = run_chat(model, "hello there\nthe lazy dog?\n", "--max-new-tokens", "10",
                        transcript=tmp_path / "t.jsonl")
    assert len(turns) == 2
    t1, t2 = turns
    m1 = [{"role": "user", "content": "hello there"}]
    assert t1["rendered"] == hf_tok.apply_chat_template(m1, tokenize=False, add_generation_prompt=True)
    m2 = m1 + [{"role": "assistant", "content": t1["answer"]},
               {"role": "user", "content": "the lazy dog?"}]
    assert t2["rendered"] == hf_tok.apply_chat_template(m2, tokenize=False, add_generation_prompt=True)
    # turn 1 prefills the whole rendered prompt; turn 2 only its new tokens
    ids1 = hf_tok.apply_chat_template(m1, tokenize=True, add_generation_prompt=True)
    ids1 = ids1["input_ids"] if isinstance(ids1, dict) or hasattr(ids1, "keys") else ids1
    assert t1["prefill_tokens"] == len(ids1) and t1["cached_tokens"] == 0
    cached_text = t1["rendered"] + tok.decode(t1["ids"], skip_special_tokens=False)
    assert t2["rendered"].startswith(cached_text) and t2["reused_prefix"]
    suffix = tok.encode(t2["rendered"][len(cached_text):], add_special_tokens=False).ids
    assert t2["cached_tokens"] == len(ids1) + len(t1["ids"]) - 1
    assert t2["prefill_tokens"] == 1 + len(suffix)  # the pending last answer token + new turn
    full2 = tok.encode(t2["rendered"], add_special_tokens=False).ids
    assert t2["prefill_tokens"] < len(full2) // 2
    # the carried KV cache gives what one fresh call on the whole sequence gives
    seq = list(ids1) + t1["ids"] + suffix
    fresh = olv_runtime.generate(olv_runtime.load(model), seq, 10, eos_token_id="auto")
    assert fresh.tolist() == t2["ids"]
    # the answers were streamed to stdout (special tokens skipped), a newline after each
    assert r.stdout == "".join(tok.decode(t["ids"], skip_special_tokens=True) + "\n"
                               for t in turns)
    assert "[turn 2: prefill" in r.stderr


def test_system_and_reset_piped(tiny_chat_models, hf_tok, tmp_path):
    model = tiny_chat_models["int4"]
    _, turns = run_chat(model, "hello\n/reset\nhello\n", "--max-new-tokens", "6",
                        "--system", "you are terse", transcript=tmp_path / "t.jsonl")
    assert len(turns) == 2
    m = [{"role": "system", "content": "you are terse"}, {"role": "user", "content": "hello"}]
    want = hf_tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
    assert turns[0]["rendered"] == want == turns[1]["rendered"]
    assert turns[1]["cached_tokens"] == 0 and turns[1]["ids"] == turns[0]["ids"]


def _read_more(fd, buf: bytearray, n: int, timeout: float = 120.0) -> None:
    start = len(buf)
    end = time.monotonic() + timeout
    while len(buf) - start < n:
        assert time.monotonic() < end, f"no output; got {bytes(buf[-400:])!r}"
        r, _, _ = select.select([fd], [], [], 1.0)
        if r:
            buf += os.read(fd, 4096)


def _read_until(fd, needle: bytes, buf: bytearray, timeout: float = 120.0, start: int = 0) -> None:
    end = time.monotonic() + timeout
    while needle not in buf[start:]:
        left = end - time.monotonic()
        assert left > 0, f"timed out waiting for {needle!r}; got {bytes(buf[-400:])!r}"
        r, _, _ = select.select([fd], [], [], min(left, 1.0))
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                chunk = b""
            assert chunk, f"EOF waiting for {needle!r}; got {bytes(buf[-400:])!r}"
            buf += chunk


def test_ctrl_c_in_a_terminal(tiny_chat_models, tmp_path):
    import pty

    transcript = tmp_path / "t.jsonl"
    argv = [sys.executable, "-m", "olv_runtime.cli", "chat", str(tiny_chat_models["int4"]),
            "--max-new-tokens", "100000", "--ignore-eos", "--transcript", str(transcript)]
    pid, fd = pty.fork()
    if pid == 0:  # child: the pty is its controlling terminal
        os.execve(sys.executable, argv, ENV)
    buf = bytearray()
    try:
        _read_until(fd, b"> ", buf)
        os.write(fd, b"hello\n")
        _read_until(fd, b"hello\r\n", buf)
        _read_more(fd, buf, 40)  # the answer is streaming
        os.write(fd, b"\x03")  # Ctrl-C: the terminal sends SIGINT
        _read_until(fd, b"interrupted]", buf)
        _read_until(fd, b"> ", buf, start=buf.rindex(b"interrupted]"))
        # the session goes on: a second message is answered, interrupted again
        os.write(fd, b"/reset\n")
        _read_until(fd, b"[conversation reset]", buf)
        os.write(fd, b"again\n")
        _read_until(fd, b"again\r\n", buf)
        _read_more(fd, buf, 40)
        os.write(fd, b"\x03")
        _read_until(fd, b"interrupted]", buf, start=len(buf))
        os.write(fd, b"/exit\n")
        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.monotonic() < deadline, bytes(buf[-400:])
            r, _, _ = select.select([fd], [], [], 0.5)
            if r:
                try:
                    buf += os.read(fd, 4096)
                except OSError:
                    pass
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, bytes(buf[-400:])
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
    turns = [json.loads(l) for l in transcript.read_text().splitlines()]
    assert [t["finish_reason"] for t in turns] == ["interrupted", "interrupted"]
    assert turns[1]["cached_tokens"] == 0  # after /reset
    assert all(0 < len(t["ids"]) < 100000 for t in turns)
    assert b"Traceback" not in buf


def test_template_that_rewrites_the_answer_cuts_the_cache_back(tiny_chat_models, tok):
    """A template that changes the recorded answer (here: wraps it) breaks the text prefix;
    the cache is cut back to the longest common token prefix and the turn stays exact."""
    from olv_runtime.generation.chat import Conversation

    template, special = load_chat_template(tiny_chat_models["int4"])
    rewriting = template.replace("{{ message['content'] }}",
                                 "{{ '[' + message['content'] + ']' if message['role'] == "
                                 "'assistant' else message['content'] }}")
    sess = olv_runtime.InferenceSession(olv_runtime.load(tiny_chat_models["int4"]))
    conv = Conversation(sess, tok, rewriting, special)
    r1 = conv.send("hello", 6)
    r2 = conv.send("again", 6)
    assert r1.reused_prefix and not r2.reused_prefix
    full = tok.encode(r2.rendered, add_special_tokens=False).ids
    assert 0 < r2.cached_tokens < len(full) and r2.prefill_tokens == len(full) - r2.cached_tokens
    fresh = olv_runtime.generate(sess, full, 6, eos_token_id="auto")
    assert fresh.tolist() == r2.ids.tolist()
    conv.reset()
    r3 = conv.send("hello", 6)
    assert r3.cached_tokens == 0 and r3.ids.tolist() == r1.ids.tolist()
    conv.close()


def test_chat_errors(tiny_qwen2_dir, tiny_chat_models, tmp_path, capsys):
    from olv_runtime.cli import main as cli_main

    olv_runtime.convert(tiny_qwen2_dir, tmp_path / "m.onnx")  # its tokenizer_config has no template
    capsys.readouterr()
    assert cli_main(["chat", str(tmp_path / "m.onnx")]) == 2
    assert "no chat template" in capsys.readouterr().err
    assert cli_main(["chat", str(tiny_chat_models["int4"]), "--chat-template", "/nonexistent"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli_main(["chat", str(tiny_chat_models["int4"]), "--min-p", "2"]) == 2
    assert "min_p must be in [0, 1]" in capsys.readouterr().err


def test_end_of_turn_token_stops_without_generation_config(tiny_chat_models, tok, tmp_path):
    import shutil

    from olv_runtime.generation.chat import Conversation

    src = tiny_chat_models["int4"].parent
    for name in ("model.onnx", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, tmp_path / name)  # no generation_config.json
    template, special = load_chat_template(tmp_path / "model.onnx")
    sess = olv_runtime.InferenceSession(olv_runtime.load(tmp_path / "model.onnx"))
    assert olv_runtime.eos_token_ids(sess) == [tok.token_to_id("<|im_end|>")]  # metadata
    conv = Conversation(sess, tok, template, {**special, "eos_token": "<|endoftext|>"})
    assert conv.generate_kwargs["eos_token_id"] == [tok.token_to_id("<|im_end|>"),
                                                    tok.token_to_id("<|endoftext|>")]
    conv.close()


def test_template_added_after_conversion_is_named_not_read(tiny_chat_dir, tmp_path, capsys):
    """A chat_template.jinja put beside a converted model later is not read (no digest was
    recorded for it); the error names it instead of claiming the folder has no template."""
    import shutil

    from olv_runtime.cli import main as cli_main
    from olv_runtime.models.hf import convert

    ck = tmp_path / "ck"
    shutil.copytree(tiny_chat_dir, ck)
    cfg = json.loads((ck / "tokenizer_config.json").read_text())
    template = cfg.pop("chat_template")
    (ck / "tokenizer_config.json").write_text(json.dumps(cfg))
    convert(ck, tmp_path / "m" / "model.onnx", weights="float32")
    model = tmp_path / "m" / "model.onnx"
    assert load_chat_template(model)[0] is None
    (model.parent / "chat_template.jinja").write_text(template)
    assert load_chat_template(model)[0] is None  # not recorded at conversion: not read
    assert cli_main(["chat", str(model)]) == 2
    err = capsys.readouterr().err
    assert "chat_template.jinja in" in err and "not a file recorded for this model" in err
