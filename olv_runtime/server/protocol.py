"""The OpenAI wire format: request bodies checked field by field into engine settings, and the
response, chunk and error objects (https://platform.openai.com/docs/api-reference/completions,
/chat, and the error object ``{"error": {"message", "type", "param", "code"}}``).

Everything here is plain data (no HTTP, no engine): :func:`parse_completion` and
:func:`parse_chat` turn a decoded JSON body into a :class:`ParsedRequest` or raise
:class:`ApiError` (status 400, naming the field); the ``*_response`` / ``*_chunk`` functions build
the JSON objects the server sends.
"""
from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import Mapping

from olv_runtime.engine import RequestResult

__all__ = [
    "MAX_MESSAGES",
    "MAX_STOP",
    "MAX_TOP_LOGPROBS",
    "ApiError",
    "ParsedRequest",
    "error_body",
    "openai_finish_reason",
    "parse_chat",
    "parse_completion",
]

MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
MAX_MESSAGES = 4096
ROLES = ("system", "developer", "user", "assistant", "tool")

#: fields accepted and ignored (they change nothing here), with the values accepted
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "modalities"}


class ApiError(Exception):
    """An HTTP error with an OpenAI error object.

    Parameters
    ----------
    status : int
        400 invalid field, 401, 404, 413, 429, 500, 503.
    message : str
    type : str
        ``invalid_request_error``, ``authentication_error``, ``not_found_error``,
        ``rate_limit_error``, ``server_error``, ``service_unavailable``.
    param : str or None
        The field at fault (``messages[1].content``, ``max_tokens``, ...).
    code : str or None
    headers : dict, optional
        Extra response headers (``Retry-After``).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, dict(headers or {})


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


@dataclasses.dataclass
class ParsedRequest:
    """A checked completions / chat request.

    Attributes
    ----------
    kind : str
        "completion" or "chat".
    model : str or None
        The ``model`` field (None when absent).
    prompt_ids : list of int or None
        Token ids given directly (completions with a list of ids).
    prompt_text : str or None
        Text to tokenize (a completions string prompt).
    messages : list of dict or None
        Chat messages ``{"role", "content": str}`` (content parts joined).
    max_tokens : int or None
        None: the server's default (completions 16; chat: the rest of the context).
    config : dict
        :class:`~olv_runtime.GenerationConfig` fields (max_new_tokens set by the server).
    stream, include_usage : bool
    logprobs : int or None
        Completions: top alternatives per token (None: no logprobs); chat: ``top_logprobs`` when
        ``logprobs`` is true.
    json_schema : dict or None
        The schema of ``response_format`` (``{"type": "object"}`` for ``json_object``).
    structured : bool
        ``response_format`` asks for JSON.
    """

    kind: str
    model: str | None
    prompt_ids: list | None = None
    prompt_text: str | None = None
    messages: list | None = None
    max_tokens: int | None = None
    config: dict = dataclasses.field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    json_schema: dict | None = None
    structured: bool = False


# -- field readers --------------------------------------------------------------------------------
def _number(body, name, lo, hi, default, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(name, f"must be a number, got {type(v).__name__}", "invalid_type")
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        raise _bad(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}")
    return float(v)


def _integer(body, name, lo, hi, default):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer() and lo <= v <= hi:
            return int(v)
        raise _bad(name, f"must be an integer, got {type(v).__name__} {str(v)[:40]}",
                   "invalid_type")
    if not lo <= v <= hi:
        raise _bad(name, f"must be an integer in [{lo}, {hi}], got {v}")
    return v


def _boolean(body, name, default=False):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"must be a boolean, got {type(v).__name__}", "invalid_type")
    return v


def _stop(body) -> list:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop", "must be a string or a list of strings", "invalid_type")
    if len(stops) > MAX_STOP:
        raise _bad("stop", f"at most {MAX_STOP} stop strings, got {len(stops)}")
    if any(not s for s in stops):
        raise _bad("stop", "stop strings must be non-empty")
    return stops


def _response_format(body) -> tuple[bool, dict | None]:
    rf = body.get("response_format")
    if rf is None:
        return False, None
    if not isinstance(rf, Mapping) or not isinstance(rf.get("type"), str):
        raise _bad("response_format", "must be an object with a 'type'", "invalid_type")
    t = rf["type"]
    if t == "text":
        return False, None
    if t == "json_object":
        return True, {"type": "object"}
    if t == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, Mapping):
            raise _bad("response_format.json_schema", "must be an object with a 'schema'",
                       "invalid_type")
        schema = js.get("schema", {})
        if isinstance(schema, bool) or not isinstance(schema, Mapping):
            raise _bad("response_format.json_schema.schema", "must be a JSON Schema object",
                       "invalid_type")
        return True, dict(schema)
    raise _bad("response_format.type", f"must be 'text', 'json_object' or 'json_schema', "
                                       f"got {t[:40]!r}")


def _common(body: Mapping, kind: str, known: set) -> ParsedRequest:
    """The fields completions and chat share."""
    unknown = sorted(k for k in body if k not in known and k not in _IGNORED)
    if unknown:
        shown = ", ".join(repr(k[:40]) for k in unknown[:5])
        raise ApiError(400, f"unrecognized request argument(s): {shown}", param=unknown[0][:100],
                       code="unknown_parameter")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"must be a string, got {type(model).__name__}", "invalid_type")
    _integer(body, "n", 1, 1, 1)  # one choice per request
    max_tokens = _integer(body, "max_tokens", 0, 2**31 - 1, None)
    if kind == "chat":
        mct = _integer(body, "max_completion_tokens", 0, 2**31 - 1, None)
        max_tokens = mct if mct is not None else max_tokens
    top_k = _integer(body, "top_k", -1, 2**31 - 1, 0)
    cfg = {
        "temperature": _number(body, "temperature", 0.0, 2.0, 1.0),
        "top_p": _number(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
        "top_k": max(top_k, 0),
        "min_p": _number(body, "min_p", 0.0, 1.0, 0.0),
        "presence_penalty": _number(body, "presence_penalty", -2.0, 2.0, 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", -2.0, 2.0, 0.0),
        "repetition_penalty": _number(body, "repetition_penalty", 0.0, 10.0, 1.0, lo_open=True),
        "seed": _integer(body, "seed", 0, 2**63 - 1, None),
        "stop": _stop(body),
    }
    if _boolean(body, "ignore_eos"):
        cfg["eos_token_id"] = None
    else:
        cfg["eos_token_id"] = "auto"
    stream = _boolean(body, "stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, Mapping):
            raise _bad("stream_options", "must be an object", "invalid_type")
        if not stream:
            raise _bad("stream_options", "only allowed with stream: true")
        extra = sorted(k for k in so if k not in ("include_usage", "continuous_usage_stats"))
        if extra:
            raise _bad(f"stream_options.{extra[0][:40]}", "unrecognized", "unknown_parameter")
        include_usage = _boolean(so, "include_usage")
    structured, schema = _response_format(body)
    for name in ("tools", "functions", "logit_bias"):
        if body.get(name):
            raise _bad(name, "not supported by this server", "unsupported_parameter")
    tc = body.get("tool_choice")
    if tc is not None and tc != "none":
        raise _bad("tool_choice", "not supported by this server", "unsupported_parameter")
    return ParsedRequest(kind, model, max_tokens=max_tokens, config=cfg, stream=stream,
                         include_usage=include_usage, json_schema=schema, structured=structured)


_SAMPLING = {"model", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p",
             "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop",
             "ignore_eos", "stream", "stream_options", "response_format", "tools", "functions",
             "logit_bias", "tool_choice"}


def _prompt(v) -> tuple[str | None, list | None]:
    """A completions prompt: a string, a list of token ids, or a list holding one of them."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]
    if isinstance(v, str):
        if not v:
            raise _bad("prompt", "must not be empty")
        return v, None
    if isinstance(v, list):
        if not v:
            raise _bad("prompt", "must not be empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            if all(isinstance(t, (str, list)) for t in v):
                raise _bad("prompt", f"one prompt per request (got a batch of {len(v)})",
                           "unsupported_value")
            raise _bad("prompt", "must be a string or a list of integer token ids",
                       "invalid_type")
        return None, list(v)
    raise _bad("prompt", f"must be a string or a list of token ids, got {type(v).__name__}",
               "invalid_type")


def parse_completion(body) -> ParsedRequest:
    """Check a ``POST /v1/completions`` body.

    Raises
    ------
    ApiError
        400 naming the field: a missing prompt, a field of the wrong type or out of its range,
        an unknown field, ``n`` other than 1, ``echo``, ``best_of`` > 1 or a ``suffix``.
    """
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_type")
    known = _SAMPLING | {"prompt", "logprobs", "echo", "best_of", "suffix"}
    req = _common(body, "completion", known)
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("prompt", "is required", "missing_required_parameter")
    req.prompt_text, req.prompt_ids = _prompt(body["prompt"])
    if _boolean(body, "echo"):
        raise _bad("echo", "not supported by this server", "unsupported_parameter")
    _integer(body, "best_of", 1, 1, 1)
    if body.get("suffix"):
        raise _bad("suffix", "not supported by this server", "unsupported_parameter")
    req.logprobs = _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS, None)
    return req


def _content(m: Mapping, i: int) -> str:
    c = m.get("content")
    if c is None:
        if m.get("role") == "assistant":
            return ""
        raise _bad(f"messages[{i}].content", "is required", "missing_required_parameter")
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for j, p in enumerate(c):
            if not isinstance(p, Mapping) or p.get("type") != "text" \
                    or not isinstance(p.get("text"), str):
                raise _bad(f"messages[{i}].content[{j}]",
                           "only {\"type\": \"text\", \"text\": string} parts are supported",
                           "unsupported_value")
            parts.append(p["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content", f"must be a string or a list of text parts, got "
                                         f"{type(c).__name__}", "invalid_type")


def parse_chat(body) -> ParsedRequest:
    """Check a ``POST /v1/chat/completions`` body (see :func:`parse_completion`).

    Messages: a non-empty list (at most :data:`MAX_MESSAGES`) of ``{"role", "content"}`` with a
    role in :data:`ROLES` (``developer`` is rendered as ``system``) and a string content or a
    list of text parts (joined).
    """
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_type")
    known = _SAMPLING | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
    req = _common(body, "chat", known)
    msgs = body.get("messages")
    if msgs is None:
        raise _bad("messages", "is required", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty list", "invalid_type")
    if len(msgs) > MAX_MESSAGES:
        raise _bad("messages", f"at most {MAX_MESSAGES} messages, got {len(msgs)}")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping):
            raise _bad(f"messages[{i}]", "must be an object with 'role' and 'content'",
                       "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role", f"must be one of {list(ROLES)}, got "
                                              f"{str(role)[:40]!r}")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content(m, i)})
    req.messages = out
    lp = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, None)
    if top is not None and not lp:
        raise _bad("top_logprobs", "needs logprobs: true")
    req.logprobs = (top or 0) if lp else None
    return req


# -- responses ------------------------------------------------------------------------------------
def openai_finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason in OpenAI's terms: eos and stop strings -> "stop", "length";
    a cancelled request (server shutdown) -> "length" (it was cut short); None while running."""
    if reason is None:
        return None
    return "stop" if reason in ("eos", "stop") else "length"


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _piece(tokenizer, tid: int) -> str:
    return tokenizer.decode([int(tid)], skip_special_tokens=False) if tokenizer is not None \
        else str(int(tid))


def logprobs_object(kind: str, lps, tokenizer, offset: int = 0) -> dict | None:
    """OpenAI logprobs of a list of TokenLogprob: chat ``{"content": [{token, logprob, bytes,
    top_logprobs}]}``; completions ``{tokens, token_logprobs, top_logprobs, text_offset}``."""
    if lps is None:
        return None
    if kind == "chat":
        content = []
        for lp in lps:
            t = _piece(tokenizer, lp.token_id)
            content.append({"token": t, "logprob": lp.logprob, "bytes": list(t.encode()),
                            "top_logprobs": [
                                {"token": (a := _piece(tokenizer, i)), "logprob": v,
                                 "bytes": list(a.encode())} for i, v in lp.top]})
        return {"content": content}
    tokens, offs, pos = [], [], offset
    for lp in lps:
        tokens.append(_piece(tokenizer, lp.token_id))
        offs.append(pos)
        pos += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{_piece(tokenizer, i): v for i, v in lp.top} for lp in lps],
            "text_offset": offs}


def full_response(req: ParsedRequest, rid: str, model: str, res: RequestResult, text: str,
                  tokenizer) -> dict:
    """The non-streamed response of a finished request."""
    fin = openai_finish_reason(res.finish_reason)
    lp = logprobs_object(req.kind, res.logprobs if req.logprobs is not None else None,
                         tokenizer)
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": lp, "finish_reason": fin}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": fin}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [choice],
            "usage": usage(res.prompt_tokens, int(res.ids.size), res.cached_tokens)}


def chunk(req: ParsedRequest, rid: str, model: str, created: int, text: str | None,
          lps=None, finish: str | None = None, role: bool = False, tokenizer=None,
          offset: int = 0) -> dict:
    """One streamed chunk (``chat.completion.chunk`` / ``text_completion``); ``tokenizer`` names
    the tokens of ``lps``, ``offset`` is the text offset of the chunk (completions logprobs)."""
    lp = logprobs_object(req.kind, lps, tokenizer, offset) \
        if lps is not None and req.logprobs is not None else None
    if req.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else \
            ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if req.include_usage:
        out["usage"] = None
    return out

