"""Chat templates and multi-turn conversations with the KV cache carried across turns.

:func:`apply_chat_template` renders a list of messages with a model's Jinja ``chat_template``
the way Hugging Face transformers' ``PreTrainedTokenizerBase.apply_chat_template(...,
tokenize=False)`` does: a sandboxed jinja2 environment (``ImmutableSandboxedEnvironment``) with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and the ``{% generation
%}`` block tag, a ``tojson`` filter that does not HTML-escape (``json.dumps``, non-ASCII kept,
``indent`` / ``separators`` / ``sort_keys`` accepted), the globals ``raise_exception(message)``
and ``strftime_now(format)``, and the tokenizer's special tokens (``bos_token``,
``eos_token``, ...) as variables next to ``messages``, ``add_generation_prompt``, ``tools`` and
``documents``. Source: transformers' chat templating documentation ("Templates for chat
models", "Writing a chat template").

:func:`load_chat_template` finds a model's template: ``chat_template.jinja`` or the
``chat_template`` of ``tokenizer_config.json`` beside the model (a GGUF importer can pass the
``tokenizer.chat_template`` metadata string to :class:`Conversation` / apply_chat_template
directly).

:class:`Conversation` runs turns on one :class:`~olv_runtime.State`: each turn renders the
whole conversation, and when the text already in the KV cache is a prefix of it (the usual
case), tokenizes and feeds only the new suffix — the way llama.cpp's ``llama-cli``
conversation mode does — so a turn's prefill covers its new tokens only.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import pathlib
import re
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from olv_runtime.errors import InvalidArgument, OlvError
from olv_runtime.generation.generate import (
    GenerationStats,
    TextStream,
    eos_token_ids,
    generate,
)
from olv_runtime.io.sidecars import sidecar_path
from olv_runtime.state import empty_cache, make_state
from olv_runtime.state.restore import trim_state


class ChatTemplateError(OlvError, ValueError):
    """A chat template is missing, does not compile, or raised while rendering (any exception
    of the template, or a render budget exceeded); the message names the template's source."""


class ChatTemplateText(str):
    """A chat template's Jinja source that remembers where it came from (``source``: a file
    path, ``tokenizer_config.json chat_template``, ...): error messages name it."""

    source: str

    def __new__(cls, text: str, source: str):
        obj = super().__new__(cls, text)
        obj.source = source
        return obj


#: Render budget of :func:`apply_chat_template` (issue 26): wall-clock seconds per render,
#: characters of rendered text (and of any one string or list a template builds), and bits of
#: any integer it computes. Real chat templates render in milliseconds into far less text than
#: any model's context holds (2**22 characters is about a million tokens).
RENDER_SECONDS = 3.0
RENDER_MAX_CHARS = 1 << 22
RENDER_MAX_INT_BITS = 1 << 16
#: Largest template source and tokenizer_config.json read (characters / bytes).
TEMPLATE_MAX_CHARS = 1 << 20
CONFIG_MAX_BYTES = 64 << 20

# a %-format conversion: flags, width, precision (each possibly '*')
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|[0-9]+)?(?:\.(\*|[0-9]+))?")
# a str.format replacement field's spec: every number in it
_BRACE_SPEC = re.compile(r"\{[^{}]*:([^{}]*)\}")


class _RenderLimit(Exception):
    """A render budget was exceeded (wrapped into ChatTemplateError naming the source)."""


def _limit(n: int, what: str) -> None:
    if n > RENDER_MAX_CHARS:
        raise _RenderLimit(f"{what} would be {n} characters or items; the render budget is "
                           f"{RENDER_MAX_CHARS}")


def _size(v) -> int:
    return len(v) if isinstance(v, (str, list, tuple, dict)) else 0


def _check_int(v, what: str) -> None:
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > RENDER_MAX_INT_BITS:
        raise _RenderLimit(f"{what}: an integer of {v.bit_length()} bits; the render budget is "
                           f"{RENDER_MAX_INT_BITS} bits")


def _check_format(fmt: str, args) -> None:
    """Widths and precisions of a %-format or str.format string (and '*' arguments) within
    the character budget."""
    nums = []
    for m in _PERCENT_SPEC.finditer(fmt):
        nums += [g for g in m.groups() if g]
    for m in _BRACE_SPEC.finditer(fmt):
        nums += re.findall(r"[0-9]+", m.group(1))
    if "*" in nums or re.search(r"\{[^{}]*:[^{}]*\{", fmt):  # widths taken from arguments
        vals = args if isinstance(args, (tuple, list)) else (args,)
        nums += [str(a) for a in vals if isinstance(a, int) and not isinstance(a, bool)
                 and a > 0] + [s for a in vals if isinstance(a, str) for s in re.findall(
                     r"[0-9]+", a)]
    for n in nums:
        if n != "*" and (len(n) > 12 or int(n) > RENDER_MAX_CHARS):
            raise _RenderLimit(f"format width or precision {n[:20]} exceeds the render budget "
                               f"of {RENDER_MAX_CHARS} characters")


def _check_binop(op: str, left, right) -> None:
    what = f"{type(left).__name__} {op} {type(right).__name__}"
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (left, right))
    if op == "*":
        if ints:
            if left and right and left.bit_length() + right.bit_length() > RENDER_MAX_INT_BITS:
                raise _RenderLimit(f"{what}: the product has more than {RENDER_MAX_INT_BITS} "
                                   "bits")
        elif isinstance(right, int) and _size(left):
            _limit(_size(left) * max(right, 0), what)
        elif isinstance(left, int) and _size(right):
            _limit(_size(right) * max(left, 0), what)
    elif op == "**" and ints:
        if right > 0 and abs(left) > 1 and \
                right * math.log2(abs(left)) > RENDER_MAX_INT_BITS:
            raise _RenderLimit(f"{what}: {left} ** {right} has more than "
                               f"{RENDER_MAX_INT_BITS} bits")
    elif op == "**" and isinstance(left, float) and isinstance(right, int):
        _check_int(right, what)
    elif op == "+":
        if _size(left) or _size(right):
            _limit(_size(left) + _size(right), what)
    elif op == "%" and isinstance(left, str):
        _check_format(left, right)


# str methods whose result size a template chooses: name -> checker(obj, args, kwargs)
def _width_arg(obj, args, kwargs, key="width"):
    w = args[0] if args else kwargs.get(key, 0)
    if isinstance(w, int) and not isinstance(w, bool):
        _limit(max(w, 0), f"str width {w}")


def _str_method_check(name: str, obj: str, args, kwargs) -> None:
    if name in ("center", "ljust", "rjust", "zfill"):
        _width_arg(obj, args, kwargs)
    elif name == "expandtabs":
        t = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(t, int):
            _limit(obj.count("\t") * max(t, 0) + len(obj), "str.expandtabs")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) \
            and isinstance(args[1], str):
        count = obj.count(args[0]) if args[0] else len(obj) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            count = min(count, args[2])
        _limit(len(obj) + count * max(len(args[1]) - len(args[0]), 0), "str.replace")
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        _limit(sum(_size(x) for x in args[0]) + len(obj) * len(args[0]), "str.join")
    elif name in ("format", "format_map"):
        _check_format(obj, list(args) + list(kwargs.values()))


def _concat(parts) -> str:
    """The template ``~`` operator (jinja's str_join) within the character budget."""
    out = [str(x) for x in parts]
    _limit(sum(len(x) for x in out), "the '~' concatenation")
    return "".join(out)


_ENV = None


# -- budget checks of the filters and globals a template can call (used by _environment) ----
def _f_center(value, width=80):
    _limit(max(width, 0) if isinstance(width, int) else 0, f"center({width})")

def _f_indent(s, width=4, first=False, blank=False):
    w = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    _limit(len(str(s)) + (str(s).count("\n") + 1) * max(w, 0), f"indent({str(width)[:20]})")

def _f_wordwrap(s, width=79, *args, **kwargs):
    _limit(len(str(s)) * 2, "wordwrap")

def _f_format(value, *args, **kwargs):
    if isinstance(value, str):
        _check_format(value, list(args) + list(kwargs.values()))

def _f_replace(s, old, new, count=None):
    _str_method_check("replace", str(s), (str(old), str(new)) +
                      ((count,) if isinstance(count, int) else ()), {})

def _f_join(value, d="", attribute=None):
    if isinstance(value, (list, tuple)):
        _limit(sum(_size(x) for x in value) + len(str(d)) * len(value), "join")

def _f_batch(value, linecount, fill_with=None):
    _limit(linecount if isinstance(linecount, int) else 0, f"batch({linecount})")

def _f_slice(value, slices, fill_with=None):
    _limit(slices if isinstance(slices, int) else 0, f"slice({slices})")


def _checked_filter(base, check):
    """``base`` (a jinja filter) after ``check`` saw its arguments (the context jinja passes first
    skipped)."""
    skip = 1 if hasattr(base, "jinja_pass_arg") else 0  # the context jinja passes first

    def run(*args, **kwargs):
        check(*args[skip:], **kwargs)
        return base(*args, **kwargs)

    for attr in ("jinja_pass_arg",):
        if hasattr(base, attr):
            setattr(run, attr, getattr(base, attr))
    return run


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    if isinstance(indent, int) and not isinstance(indent, bool):
        _limit(max(indent, 0), f"tojson(indent={indent})")
    elif isinstance(indent, str):
        _limit(len(indent), "tojson(indent=...)")
    text = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)
    _limit(len(text), "tojson")
    return text

def _strftime_now(fmt):
    _limit(len(str(fmt)) * 16, "strftime_now")
    return datetime.datetime.now().strftime(fmt)


def _environment():
    global _ENV
    if _ENV is not None:
        return _ENV
    import jinja2
    import jinja2.ext
    from jinja2.compiler import CodeGenerator
    from jinja2.filters import FILTERS
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import generate_lorem_ipsum

    class BudgetCodeGenerator(CodeGenerator):
        """Compiles ``a ~ b`` to the budgeted :func:`_concat` (jinja: ``str_join``)."""

        def visit_Concat(self, node, frame):
            self.write("environment.olv_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BudgetEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox with size checks before the operations whose result size a template
        chooses (binary operators, str methods); the time budget is :func:`_render`'s."""

        intercepted_binops = frozenset(["+", "*", "**", "%"])
        code_generator_class = BudgetCodeGenerator

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str):
                _str_method_check(getattr(__obj, "__name__", ""), owner, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)  # str.format / format_map, sandboxed
            if wrapped is None:
                return None
            fmt = value.__self__

            def checked(*args, **kwargs):
                _check_format(fmt, list(args) + list(kwargs.values()))
                return wrapped(*args, **kwargs)

            return checked

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body unchanged (transformers
        uses the tag to mark assistant tokens)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def lipsum(n=5, html=True, min=20, max=100):  # noqa: A002 - jinja's parameter names
        ints = [v for v in (n, min, max) if isinstance(v, int)]
        if len(ints) != 3 or n < 0 or n * max > RENDER_MAX_CHARS // 8:
            raise _RenderLimit(f"lipsum(n={n}, max={max}) exceeds the render budget")
        return generate_lorem_ipsum(n=n, html=html, min=min, max=max)

    env = BudgetEnvironment(trim_blocks=True, lstrip_blocks=True,
                            extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.olv_concat = _concat
    env.filters["tojson"] = _tojson
    for name, check in (("center", _f_center), ("indent", _f_indent), ("wordwrap", _f_wordwrap),
                        ("format", _f_format), ("replace", _f_replace), ("join", _f_join),
                        ("batch", _f_batch), ("slice", _f_slice)):
        env.filters[name] = _checked_filter(FILTERS[name], check)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["lipsum"] = lipsum
    _ENV = env
    return env


def _render(compiled, where: str, variables: dict) -> str:
    """Render with the budget: a trace function stops any Python-level loop (in the template
    or in jinja's helpers) after :data:`RENDER_SECONDS`, the output stops at
    :data:`RENDER_MAX_CHARS` characters, and every exception becomes a ChatTemplateError
    naming ``where``. The caller's trace function (a debugger, coverage) is restored."""
    import jinja2

    deadline = time.perf_counter() + RENDER_SECONDS
    ticks = 0

    def tracer(frame, event, arg):
        nonlocal ticks
        ticks += 1
        if not ticks & 1023 and time.perf_counter() > deadline:
            raise _RenderLimit(f"rendering took more than {RENDER_SECONDS} s (the render "
                               "budget)")
        return tracer

    old = sys.gettrace()
    out, n = [], 0
    try:
        sys.settrace(tracer)
        try:
            for chunk in compiled.generate(**variables):
                n += len(chunk)
                if n > RENDER_MAX_CHARS:
                    raise _RenderLimit(f"the rendered text exceeds {RENDER_MAX_CHARS} "
                                       "characters (the render budget)")
                out.append(chunk)
        finally:
            sys.settrace(old)
        text = "".join(out)
    except _RenderLimit as exc:
        raise ChatTemplateError(f"{where}: the chat template exceeded its budget: {exc}") \
            from None
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"{where}: the chat template raised: {exc}") from None
    except (Exception, RecursionError, MemoryError) as exc:  # noqa: BLE001 - any template fault
        raise ChatTemplateError(f"{where}: the chat template raised {type(exc).__name__}: "
                                f"{str(exc)[:300]}") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ChatTemplateError(f"{where}: the rendered text is not valid Unicode (a lone "
                                f"surrogate at character {exc.start})") from None
    return text


_COMPILED: dict[str, Any] = {}


def _plain(value):
    """A copy made of plain JSON types (what the sandboxed template may see)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):  # subclasses (enums, ...) back to the base type
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return str(value)


def apply_chat_template(messages: Sequence[Mapping[str, Any]], template: str, *,
                        add_generation_prompt: bool = False,
                        special_tokens: Mapping[str, Any] | None = None,
                        tools: Sequence[Mapping] | None = None,
                        documents: Sequence[Mapping] | None = None,
                        **kwargs) -> str:
    """Render ``messages`` with a Jinja chat template (transformers' rendering; module docstring).

    Parameters
    ----------
    messages : list of dict
        ``{"role": ..., "content": ...}`` (plus any keys the template reads).
    template : str
        The Jinja source (``tokenizer_config.json`` ``chat_template``, ``chat_template.jinja``,
        or GGUF ``tokenizer.chat_template``).
    add_generation_prompt : bool
        Append the assistant turn header (the text the model continues).
    special_tokens : dict, optional
        Template variables such as ``bos_token`` / ``eos_token`` (:func:`load_chat_template`
        reads them from tokenizer_config.json).
    tools, documents : list of dict, optional
    **kwargs
        More template variables (they override ``special_tokens`` of the same name).

    Returns
    -------
    str

    Raises
    ------
    ChatTemplateError
        The template does not compile, is longer than :data:`TEMPLATE_MAX_CHARS`, raises
        (``raise_exception``, or any exception: OverflowError, RecursionError, TypeError, ...),
        exceeds the render budget (:data:`RENDER_SECONDS`, :data:`RENDER_MAX_CHARS`,
        :data:`RENDER_MAX_INT_BITS`: checked before a string, list or integer of that size is
        built) or renders text with a lone surrogate; or a message / variable nested too deep.
        The message names the template's source (``template.source`` of a
        :class:`ChatTemplateText`, e.g. from :func:`load_chat_template`).
    InvalidArgument
        A message that is not a mapping.
    """
    import jinja2

    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidArgument(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
    where = getattr(template, "source", None) or "the chat template"
    if not isinstance(template, str) or not template:
        raise ChatTemplateError(f"{where}: the chat template must be a non-empty string")
    if len(template) > TEMPLATE_MAX_CHARS:
        raise ChatTemplateError(f"{where}: the chat template has {len(template)} characters; "
                                f"at most {TEMPLATE_MAX_CHARS} are accepted")
    compiled = _COMPILED.get(template)
    if compiled is None:
        try:
            compiled = _environment().from_string(str(template))
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{where}: the chat template does not compile: {exc}") \
                from None
        except (Exception, RecursionError, MemoryError) as exc:  # noqa: BLE001 - parser faults
            raise ChatTemplateError(f"{where}: the chat template does not compile "
                                    f"({type(exc).__name__}: {str(exc)[:200]})") from None
        _COMPILED[template] = compiled
    try:
        variables = {**_plain(dict(special_tokens or {})), **_plain(kwargs)}
        variables.update(messages=_plain(list(messages)), tools=_plain(tools),
                         documents=_plain(documents),
                         add_generation_prompt=bool(add_generation_prompt))
    except RecursionError:
        raise ChatTemplateError(f"{where}: a message or template variable is nested too deep "
                                "to render") from None
    return _render(compiled, where, variables)


def _token_text(v):
    if isinstance(v, Mapping):
        return v.get("content")
    return v


def load_chat_template(model_path) -> tuple[str | None, dict[str, Any]]:
    """A model's chat template and special tokens, from the files beside it.

    Looks in the directory of ``model_path`` (or ``model_path`` itself if it is a directory)
    for ``chat_template.jinja`` (transformers >= 4.43 saves it so), then the ``chat_template``
    of ``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}`` of which
    ``"default"`` is taken). Special tokens: the ``*_token`` entries of tokenizer_config.json
    (strings or ``{"content": ...}``) and ``additional_special_tokens``.

    Returns
    -------
    (str or None, dict)
        The template (None when there is none) and the special tokens by name.

    Raises
    ------
    ChatTemplateError
        tokenizer_config.json that is not JSON, or a template list without a default.
    """
    p = pathlib.Path(model_path)
    d = p if p.is_dir() else p.parent
    special: dict[str, Any] = {}
    template = None
    cfg_path = d / "tokenizer_config.json"
    if p.is_file():  # the model's own (olv_runtime.io.sidecars: digest recorded at conversion)
        cfg_path = sidecar_path(p, "tokenizer_config.json") or d / "-absent-"
    if cfg_path.is_file():
        size = cfg_path.stat().st_size
        if size > CONFIG_MAX_BYTES:
            raise ChatTemplateError(f"{cfg_path}: {size} bytes; a tokenizer_config.json of at "
                                    f"most {CONFIG_MAX_BYTES} bytes is read")
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (ValueError, RecursionError) as exc:
            raise ChatTemplateError(f"{cfg_path}: not JSON ({type(exc).__name__}: "
                                    f"{str(exc)[:200]})") from None
        if not isinstance(cfg, dict):
            raise ChatTemplateError(f"{cfg_path}: expected a JSON object, got "
                                    f"{type(cfg).__name__}")
        for k, v in cfg.items():
            # unset (null) tokens are not template variables (they render as undefined, "");
            # booleans such as add_bos_token are settings, not tokens
            if not k.endswith("_token") or v is None or isinstance(v, bool):
                continue
            text = _token_text(v)
            if not isinstance(text, str) and (text is not None or not isinstance(v, Mapping)):
                raise ChatTemplateError(
                    f"{cfg_path}: {k} must be a string or {{\"content\": string}}, got "
                    f"{type(text).__name__} {str(text)[:40]!r}")
            if text is not None:
                special[k] = text
        extra = cfg.get("additional_special_tokens")
        if isinstance(extra, list):
            texts = [_token_text(t) for t in extra]
            bad = next((t for t in texts if not isinstance(t, str)), 0)
            if bad != 0:
                raise ChatTemplateError(f"{cfg_path}: additional_special_tokens holds "
                                        f"{type(bad).__name__} {str(bad)[:40]!r}, expected "
                                        "strings")
            special["additional_special_tokens"] = texts
        t = cfg.get("chat_template")
        if isinstance(t, list):
            named = {e.get("name"): e.get("template") for e in t if isinstance(e, Mapping)}
            if "default" not in named:
                raise ChatTemplateError(
                    f"{cfg_path}: chat_template is a list without a 'default' entry "
                    f"(names: {sorted(n for n in named if n)})")
            t = named["default"]
        if isinstance(t, str) and t:
            template = ChatTemplateText(t, f"{cfg_path} chat_template")
        elif t is not None:
            raise ChatTemplateError(f"{cfg_path}: chat_template must be a string, got "
                                    f"{type(t).__name__}")
    jinja_file = d / "chat_template.jinja"
    if p.is_file():
        jinja_file = sidecar_path(p, "chat_template.jinja") or d / "-absent-"
    if jinja_file.is_file():
        template = read_template_file(jinja_file)
    return template, special


def read_template_file(path) -> ChatTemplateText:
    """A Jinja chat template file (``chat_template.jinja``, ``olv chat --chat-template``),
    at most :data:`TEMPLATE_MAX_CHARS` characters of UTF-8.

    Raises
    ------
    ChatTemplateError
        Not a readable file, too long, not UTF-8 (the message names the path).
    """
    path = pathlib.Path(path)
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise ChatTemplateError(f"{path}: not a regular file")
        if size > 4 * TEMPLATE_MAX_CHARS:
            raise ChatTemplateError(f"{path}: {size} bytes; a chat template of at most "
                                    f"{TEMPLATE_MAX_CHARS} characters is read")
        with open(path, encoding="utf-8") as fh:
            text = fh.read(TEMPLATE_MAX_CHARS + 1)
    except OSError as exc:
        raise ChatTemplateError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(f"{path}: not UTF-8 (byte {exc.start}: {exc.reason})") from None
    if len(text) > TEMPLATE_MAX_CHARS:
        raise ChatTemplateError(f"{path}: more than {TEMPLATE_MAX_CHARS} characters; a chat "
                                "template that long is not read")
    return ChatTemplateText(text, str(path))


@dataclasses.dataclass
class TurnReport:
    """One :meth:`Conversation.send` turn.

    Attributes
    ----------
    rendered : str
        The whole conversation rendered for this turn (with the generation prompt).
    answer : str
        The assistant message recorded (special tokens kept, a final eos removed, cut before a
        stop string).
    ids : numpy.ndarray
        int64 generated ids.
    finish_reason : str
        See :class:`~olv_runtime.GenerationResult`.
    prefill_tokens, cached_tokens : int
        Tokens fed in the prompt call / reused from the KV cache (see GenerationStats).
    reused_prefix : bool
        False when the rendered text did not extend the cached text and the cache was cut
        back to the longest common token prefix.
    stats : GenerationStats
    """

    rendered: str
    answer: str
    ids: np.ndarray
    finish_reason: str
    prefill_tokens: int
    cached_tokens: int
    reused_prefix: bool
    stats: Any


class Conversation:
    """A multi-turn chat on one model, its KV cache kept across turns.

    Parameters
    ----------
    session : InferenceSession
    tokenizer : tokenizers.Tokenizer
    template : str
        Jinja chat template.
    special_tokens : dict, optional
        Template variables (bos_token, eos_token, ...).
    system : str, optional
        A system message put first.
    generate_kwargs : dict, optional
        Defaults passed to :func:`olv_runtime.generate` each turn (sampling, eos_token_id, stop,
        ...; ``eos_token_id`` defaults to ``"auto"``: the eos ids of generation_config.json
        plus the ``eos_token`` of the special tokens).

    Attributes
    ----------
    messages : list of dict
    state : State
    """

    def __init__(self, session, tokenizer, template: str, special_tokens=None, system=None,
                 generate_kwargs: Mapping[str, Any] | None = None):
        if not template:
            raise ChatTemplateError("the model has no chat template (tokenizer_config.json "
                                    "chat_template or chat_template.jinja)")
        self.session, self.tokenizer, self.template = session, tokenizer, template
        self.special_tokens = dict(special_tokens or {})
        self.system = system
        self.generate_kwargs = {"eos_token_id": "auto", **dict(generate_kwargs or {})}
        if self.generate_kwargs["eos_token_id"] == "auto":
            # generation_config.json's eos ids, plus the template's end-of-turn token
            # (tokenizer_config.json eos_token) when a model has no generation_config.json
            eos = list(eos_token_ids(session))
            extra = tokenizer.token_to_id(self.special_tokens.get("eos_token") or "")
            if extra is not None and extra not in eos:
                eos.append(int(extra))
            self.generate_kwargs["eos_token_id"] = eos
        self.state = make_state(session, empty_cache(session))
        self.messages: list[dict[str, Any]] = []
        self._text: str | None = ""  # the text whose tokens state.tokens holds
        self.reset()

    def render(self, add_generation_prompt: bool = True) -> str:
        """The conversation so far rendered with the template."""
        return apply_chat_template(self.messages, self.template,
                                   add_generation_prompt=add_generation_prompt,
                                   special_tokens=self.special_tokens)

    def reset(self) -> None:
        """Forget the conversation (the system message stays) and empty the KV cache."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.state.reset(empty_cache(self.session))
        self._text = ""

    def send(self, content: str, max_new_tokens: int = 256, *,
             text_callback: Callable[[str], object] | None = None, **generate_kwargs) -> TurnReport:
        """Add a user message, generate the assistant's answer, record it.

        Parameters
        ----------
        content : str
            The user's message.
        max_new_tokens : int
        text_callback : callable, optional
            Receives the answer's text as it is generated (special tokens skipped).
        **generate_kwargs
            Override the conversation's generate defaults for this turn.

        Returns
        -------
        TurnReport
            ``finish_reason == "interrupted"`` after a KeyboardInterrupt during generation: the
            partial answer is kept in the conversation and the session goes on.

        Raises
        ------
        ChatTemplateError
            The template raised; the conversation is left as it was.
        """
        self.messages.append({"role": "user", "content": content})
        try:
            rendered = self.render(add_generation_prompt=True)
        except BaseException:
            self.messages.pop()
            raise
        st = self.state
        reused = self._text is not None and rendered.startswith(self._text)
        if reused:
            new_ids = self.tokenizer.encode(rendered[len(self._text):], add_special_tokens=False).ids
        else:
            full = self.tokenizer.encode(rendered, add_special_tokens=False).ids
            n = trim_state(st, full, leave_one=False)
            new_ids = full[n:]
        kwargs = {**self.generate_kwargs, **generate_kwargs}
        shown = TextStream(self.tokenizer, kwargs.get("stop") or (), skip_special_tokens=True) \
            if text_callback is not None else None

        def on_token(tok):
            if shown is not None:
                piece = shown.push(tok)
                if piece:
                    text_callback(piece)

        stats = GenerationStats()
        before = list(st.tokens)
        try:
            res = generate(None, new_ids, max_new_tokens, state=st, tokenizer=self.tokenizer,
                           callback=on_token, stats=stats, return_result=True, **kwargs)
        except BaseException:
            self.messages.pop()  # the turn did not happen
            if st.tokens != before:
                self._text = None  # the cache moved on: the next turn cuts it back by tokens
            raise
        if shown is not None and res.finish_reason != "stop":
            rest = shown.flush()
            if rest:
                text_callback(rest)
        ids = res.ids.tolist()
        eos = set()
        if res.finish_reason == "eos":
            eos = {ids[-1]}
        body = ids[:-1] if ids and ids[-1] in eos else ids
        if res.finish_reason == "stop":
            answer = res.text
        else:
            answer = self.tokenizer.decode(body, skip_special_tokens=False)
        self.messages.append({"role": "assistant", "content": answer})
        # the cache holds tokenize(rendered) (or its new suffix after the cached text) + ids
        self._text = rendered + self.tokenizer.decode(ids, skip_special_tokens=False)
        return TurnReport(rendered, answer, res.ids, res.finish_reason, stats.prefill_tokens,
                          stats.cached_tokens, reused, stats)

    def close(self) -> None:
        self.state.close()
