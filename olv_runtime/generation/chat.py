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
import pathlib
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
    """A chat template is missing, does not compile, or raised while rendering."""


_ENV = None


def _environment():
    global _ENV
    if _ENV is not None:
        return _ENV
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

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

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    _ENV = env
    return env


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
        The template does not compile or raises (``raise_exception``), naming the message.
    InvalidArgument
        A message that is not a mapping.
    """
    import jinja2

    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidArgument(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
    if not isinstance(template, str) or not template:
        raise ChatTemplateError("the chat template must be a non-empty string")
    compiled = _COMPILED.get(template)
    if compiled is None:
        try:
            compiled = _environment().from_string(template)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from None
        _COMPILED[template] = compiled
    variables = {**_plain(dict(special_tokens or {})), **_plain(kwargs)}
    try:
        return compiled.render(messages=_plain(list(messages)), tools=_plain(tools),
                               documents=_plain(documents),
                               add_generation_prompt=bool(add_generation_prompt), **variables)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template raised: {exc}") from None


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
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ChatTemplateError(f"{cfg_path}: not JSON ({exc})") from None
        for k, v in cfg.items():
            # unset (null) tokens are not template variables (they render as undefined, "")
            if k.endswith("_token") and isinstance(v, (str, Mapping)) and _token_text(v) is not None:
                special[k] = _token_text(v)
        if isinstance(cfg.get("additional_special_tokens"), list):
            special["additional_special_tokens"] = [
                _token_text(t) for t in cfg["additional_special_tokens"]]
        t = cfg.get("chat_template")
        if isinstance(t, list):
            named = {e.get("name"): e.get("template") for e in t if isinstance(e, Mapping)}
            if "default" not in named:
                raise ChatTemplateError(
                    f"{cfg_path}: chat_template is a list without a 'default' entry "
                    f"(names: {sorted(n for n in named if n)})")
            t = named["default"]
        if isinstance(t, str) and t:
            template = t
    jinja_file = d / "chat_template.jinja"
    if p.is_file():
        jinja_file = sidecar_path(p, "chat_template.jinja") or d / "-absent-"
    if jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    return template, special


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
