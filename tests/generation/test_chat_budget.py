"""Issue 26 item 1: chat templates have a budget.

Every exception a template raises while rendering becomes a ChatTemplateError naming the
template's source; rendering is bounded in time (RENDER_SECONDS) and size (RENDER_MAX_CHARS,
RENDER_MAX_INT_BITS, checked before the string / integer is built). The hostile templates of
the issue run in a child process capped at 1 GiB of address space (tests/hostile.py): each must
end in a ChatTemplateError within a generous bound, never a hang, an abort or a MemoryError.
"""
from __future__ import annotations

import io
import json
import sys

import gguf
import jinja2.sandbox
import numpy as np
import pytest
from tokenizers import Tokenizer

import olv_runtime
from olv_runtime.generation.chat import (
    RENDER_SECONDS,
    ChatTemplateError,
    ChatTemplateText,
    Conversation,
    apply_chat_template,
    load_chat_template,
    read_template_file,
)
from olv_runtime.cli import main as cli_main
from olv_runtime.models.gguf_reader import GGUFFile
from olv_runtime.models.gguf_tokenizer import tokenizer_files

from hostile import run_cases

MSGS = [{"role": "user", "content": "hi"}]

# (name, template, a phrase the error names)
HOSTILE = [
    ("range_1e9", "{{ range(10**9)|list }}", "OverflowError"),
    ("recursive_macro", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
     "RecursionError"),
    ("zero_division", "{{ 1 / 0 }}", "ZeroDivisionError"),
    ("include", "{% include 'other.jinja' %}", "TypeError"),
    ("tojson_self", "{{ self|tojson }}", "TypeError"),
    ("wordwrap_0", "{{ 'abc def'|wordwrap(0) }}", "ValueError"),
    ("nested_range_loops",
     "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "took more than"),
    ("nested_loops_one_range",
     "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
     "took more than"),
    ("lipsum_1e7", "{{ lipsum(n=10**7) }}", "lipsum"),
    ("power_tower", "{{ 10 ** (10 ** 9) }}", "bits"),
    ("int_product", "{{ (10 ** 19000) * (10 ** 19000) }}", "bits"),
    ("str_times_1e10", "{{ 'a' * 10**10 }}", "characters"),
    ("str_times_5e8", "{{ 'a' * 5*10**8 }}", "characters"),
    ("center_filter", "{{ 'a'|center(10**10) }}", "characters"),
    ("center_method", "{{ 'a'.center(10**10) }}", "characters"),
    ("ljust_method", "{{ 'a'.ljust(10**10) }}", "characters"),
    ("tojson_indent", "{{ messages|tojson(indent=10**9) }}", "characters"),
    ("percent_width", "{{ '%01000000000d' % 1 }}", "format width"),
    ("percent_star", "{{ '%*d' % (10**9, 1) }}", "format width"),
    ("format_filter", "{{ '%01000000000d'|format(1) }}", "format width"),
    ("str_format", "{{ '{:>10000000000}'.format(1) }}", "format width"),
    ("doubling_tilde",
     "{% set ns = namespace(s='abcdefgh') %}{% for i in range(60) %}"
     "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}", "concatenation"),
    ("doubling_plus",
     "{% set ns = namespace(s='abcdefgh') %}{% for i in range(60) %}"
     "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}", "characters"),
    ("replace_blowup", "{% set s = 'a' * 100000 %}{{ s|replace('a', s) }}", "replace"),
    ("join_blowup", "{% set s = 'a' * 100000 %}{{ ([s] * 100000)|join }}", "join"),
    ("batch_1e9", "{{ [1]|batch(10**9, 'x')|list|length }}", "batch"),
    ("slice_1e8", "{{ [1]|slice(10**8)|list|length }}", "slice"),
    ("output_flood", "{% for i in range(100000) %}{{ 'x' * 4000 }}{% endfor %}",
     "rendered text exceeds"),
    ("lone_surrogate", "{{ '\\ud800' }}", "lone surrogate"),
]


def test_hostile_templates_end_in_chat_template_errors_in_a_capped_child():
    cases = [(name, f"apply_chat_template(MSGS, ChatTemplateText({tpl!r}, 'hostile/{name}.jinja'))")
             for name, tpl, _ in HOSTILE]
    got = run_cases("from olv_runtime.generation.chat import apply_chat_template, ChatTemplateText\n"
                    "MSGS = [{'role': 'user', 'content': 'hi'}]", cases,
                    timeout=300, mem_bytes=1 << 30)
    for name, _tpl, phrase in HOSTILE:
        rec = got.get(name)
        assert rec is not None, (name, got["__exit__"])
        assert rec["outcome"] == "ChatTemplateError", rec
        assert f"hostile/{name}.jinja" in rec["msg"], rec   # names the template's source
        assert phrase in rec["msg"], rec
        assert rec["seconds"] < RENDER_SECONDS + 12, rec


def test_budget_does_not_change_ordinary_rendering():
    tpl = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content|trim }}"
           "{{ '%5d|%-3s|' % (loop.index, 'x') }}{{ '{:>4}'.format(m.role[:2]) }}"
           "{{ m.content|center(9) ~ (m.content * 3) }}{{ [m.role, m.content]|join('/') }}"
           "{{ m|tojson(indent=2) }}{% endfor %}{{ (2 ** 64) * 3 }}"
           "{{ 'a\nb'|indent(2) }}{{ [1, 2, 3]|batch(2)|list }}{{ [1, 2, 3]|slice(2)|list }}")
    msgs = [{"role": "user", "content": " hello "}, {"role": "assistant", "content": "yes"}]
    got = apply_chat_template(msgs, tpl)
    # the same template in plain jinja2's sandbox (no budget) renders the same text
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent,
                                                              ensure_ascii=False)
    assert got == env.from_string(tpl).render(messages=msgs)


def test_the_callers_trace_function_is_restored():
    seen = []

    def tracer(frame, event, arg):
        seen.append(event)
        return None

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        apply_chat_template(MSGS, "{{ messages[0].content }}")
        with pytest.raises(ChatTemplateError):
            apply_chat_template(MSGS, "{{ 1 / 0 }}")
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(old)


def test_source_is_named_for_files(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{{ 1 / 0 }}")
    template, _ = load_chat_template(tmp_path)
    assert isinstance(template, ChatTemplateText)
    with pytest.raises(ChatTemplateError, match=r"chat_template\.jinja: the chat template "
                                                r"raised ZeroDivisionError"):
        apply_chat_template(MSGS, template)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ raise_exception('nope') }}"}))
    template, _ = load_chat_template(tmp_path)
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config\.json chat_template: the "
                                                r"chat template raised: nope"):
        apply_chat_template(MSGS, template)


@pytest.mark.parametrize("cfg, match", [
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, "not JSON"),
    (json.dumps({"eos_token": 7, "chat_template": "x"}), "eos_token must be a string"),
    (json.dumps({"eos_token": ["<e>"], "chat_template": "x"}), "eos_token must be a string"),
    (json.dumps({"eos_token": {"content": 3}}), "eos_token must be a string"),
    (json.dumps({"additional_special_tokens": [1]}), "additional_special_tokens holds int"),
    (json.dumps({"chat_template": 5}), "chat_template must be a string"),
    (json.dumps([1, 2]), "expected a JSON object"),
])
def test_hostile_tokenizer_config(tmp_path, cfg, match):
    (tmp_path / "tokenizer_config.json").write_text(cfg)
    with pytest.raises(ChatTemplateError, match=match):
        load_chat_template(tmp_path)


def test_token_settings_are_not_tokens(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": False, "eos_token": {"content": "</s>"}, "pad_token": None,
         "chat_template": "{{ eos_token }}"}))
    template, special = load_chat_template(tmp_path)
    assert special == {"eos_token": "</s>"}
    assert apply_chat_template(MSGS, template, special_tokens=special) == "</s>"


def test_deeply_nested_message_and_long_template(tmp_path):
    deep = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ChatTemplateError, match="nested too deep"):
        apply_chat_template([{"role": "user", "content": deep}], "{{ messages }}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        apply_chat_template(MSGS, "{{ " + "(" * 100_000 + "1" + ")" * 100_000 + " }}")
    (tmp_path / "big.jinja").write_text("x" * ((1 << 20) + 1))
    with pytest.raises(ChatTemplateError, match="more than 1048576 characters"):
        read_template_file(tmp_path / "big.jinja")
    (tmp_path / "bad.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ChatTemplateError, match="not UTF-8"):
        read_template_file(tmp_path / "bad.jinja")


def test_olv_chat_reports_a_hostile_template_and_goes_on(tiny_chat_models, tmp_path,
                                                         monkeypatch, capsys):
    bad = tmp_path / "bomb.jinja"
    bad.write_text("{{ 'a' * 10**10 }}")
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert cli_main(["chat", str(tiny_chat_models["int4"]), "--chat-template", str(bad),
                     "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert f"olv chat: error: {bad}: the chat template exceeded its budget" in err
    assert "Traceback" not in err


def test_conversation_keeps_its_messages_after_a_budget_error(tiny_chat_models):
    sess = olv_runtime.InferenceSession(olv_runtime.load(tiny_chat_models["int4"]))
    tok = Tokenizer.from_file(str(tiny_chat_models["int4"].parent / "tokenizer.json"))
    tpl = ChatTemplateText("{% for m in messages %}{{ m.content * (10**9 if m.content == "
                           "'boom' else 1) }}{% endfor %}", "api.jinja")
    conv = Conversation(sess, tok, tpl)
    with pytest.raises(ChatTemplateError, match="api.jinja: the chat template exceeded"):
        conv.send("boom", 2)
    assert conv.messages == [] and conv.state.tokens == []
    conv.close()


def test_gguf_embedded_template_is_budgeted(tmp_path):
    """A GGUF's tokenizer.chat_template reaches the model folder's tokenizer_config.json
    (the importer's tokenizer_files); rendering it is budgeted like any other template."""
    tokens = ["<|endoftext|>"] + [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["\u0120"]
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (len(tokens) - 1))
    w.add_token_merges(["! !"])
    w.add_eos_token_id(0)
    w.add_chat_template("{{ messages[0].content * 10**10 }}")
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFFile(tmp_path / "t.gguf") as g:
        files = tokenizer_files(g)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    template, special = load_chat_template(tmp_path)
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config\.json chat_template: the "
                                                r"chat template exceeded its budget"):
        apply_chat_template(MSGS, template, special_tokens=special)
