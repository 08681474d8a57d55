"""The OpenAI API's request bodies, checked by hand, and its response and error shapes.

Every field of a request is checked for its type and range and an unknown field is refused (as
the OpenAI API does), each with a one-line message naming the field: a typo in a parameter
name is an error, not a silently ignored option. Accepted, beyond the OpenAI fields:
`top_k` (-1 or 0: off), `ignore_eos` and `return_token_ids` (the choice's token ids, as vLLM
names them). Fields the server does not implement are accepted only at their neutral value
(n 1, echo false, logprobs null, penalties 0, ...).
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from .request import SamplingParams

MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256


class APIError(Exception):
    """An error response: HTTP status and the OpenAI error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


@dataclass
class Limits:
    vocab_size: int
    max_prompt_tokens: int
    max_tokens: int  # the most new tokens a request may ask for


@dataclass
class Parsed:
    """A checked request: the prompts (text or token ids), their sampling parameters and options."""

    prompts: list  # str or list[int] each (completions); one rendered chat text (chat)
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    model: str | None
    messages: list | None = None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def _type_name(x) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(x), type(x).__name__)


def _number(body, name, lo, hi, default, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v) or v < lo or v > hi or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise bad(f"'{name}' must be a number in {left}{lo}, {hi}], got {v!r}", name)
    return float(v)


def _int(body, name, lo, hi, default):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or not lo <= v <= hi:
        raise bad(f"'{name}' must be an integer in [{lo}, {hi}], got {v!r}", name)
    return v


def _bool(body, name, default=False):
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean, got {_type_name(v)}", name)
    return v


def _neutral(body, name, allowed, what):
    if name in body and body[name] not in allowed:
        raise bad(f"'{name}' is not supported by this server ({what})", name)


_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options",
           "n", "user", "presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos", "return_token_ids"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "logprobs", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                         "tools", "tool_choice", "parallel_tool_calls"}


def _common(body: dict, fields: set[str], limits: Limits, default_max_tokens: int, max_tokens_field="max_tokens"):
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_type_name(body)}")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"'model' must be a string, got {_type_name(model)}", "model")
    max_tokens = _int(body, max_tokens_field, 0, limits.max_tokens, None)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = _int(body, "max_tokens", 0, limits.max_tokens, None)
    temperature = _number(body, "temperature", 0, 2, 1.0)
    top_p = _number(body, "top_p", 0, 1, None, lo_open=True)
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < -1):
        raise bad(f"'top_k' must be an integer >= 1 (-1 or 0: off), got {top_k!r}", "top_k")
    top_k = None if top_k in (None, -1, 0) else top_k
    stop = body.get("stop")
    stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or len(stops) > MAX_STOP or \
            not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise bad(f"'stop' must be a non-empty string or a list of at most {MAX_STOP} of them "
                  f"(each at most {MAX_STOP_CHARS} characters)", "stop")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
        raise bad(f"'seed' must be an integer in [0, 2**63), got {seed!r}", "seed")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad("'stream_options' needs 'stream': true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad("'stream_options' must be an object with the field 'include_usage'", "stream_options")
    include_usage = _bool(options or {}, "include_usage")
    _neutral(body, "n", (None, 1), "one choice per prompt; send several requests")
    _neutral(body, "presence_penalty", (None, 0), "no penalties")
    _neutral(body, "frequency_penalty", (None, 0), "no penalties")
    _neutral(body, "logit_bias", (None, {}), "no logit bias")
    if "user" in body and not isinstance(body["user"], (str, type(None))):
        raise bad(f"'user' must be a string, got {_type_name(body['user'])}", "user")
    params = SamplingParams(max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=tuple(stops),
                            ignore_eos=_bool(body, "ignore_eos"))
    return model, params, stream, include_usage, _bool(body, "return_token_ids")


def _token_list(x, vocab: int, param: str) -> list[int]:
    if not x:
        raise bad(f"'{param}' holds an empty list of token ids", param)
    for t in x:
        if not _is_int(t) or not 0 <= t < vocab:
            raise bad(f"'{param}' token ids must be integers in [0, {vocab}), got {t!r}", param)
    return list(x)


def parse_completion(body, limits: Limits) -> Parsed:
    """/v1/completions: prompt as a string, a list of strings, token ids or a list of those."""
    model, params, stream, usage, ids = _common(body, COMPLETION_FIELDS, limits, 16)
    _neutral(body, "echo", (None, False), "no echo")
    _neutral(body, "logprobs", (None,), "no log-probabilities")
    _neutral(body, "best_of", (None, 1), "one sample per prompt")
    _neutral(body, "suffix", (None,), "no suffix")
    if "prompt" not in body:
        raise bad("'prompt' is required", "prompt")
    p = body["prompt"]
    if isinstance(p, str):
        prompts = [p]
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        prompts = [_token_list(p, limits.vocab_size, "prompt")]
    elif isinstance(p, list) and p and all(isinstance(s, str) for s in p):
        prompts = list(p)
    elif isinstance(p, list) and p and all(isinstance(s, list) for s in p):
        prompts = [_token_list(s, limits.vocab_size, "prompt") for s in p]
    else:
        raise bad("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists "
                  "(non-empty)", "prompt")
    return Parsed(prompts, params, stream, usage, ids, model)


def parse_chat(body, limits: Limits) -> Parsed:
    """/v1/chat/completions: messages [{role, content}], content a string or text parts."""
    model, params, stream, usage, ids = _common(body, CHAT_FIELDS, limits, limits.max_tokens,
                                                max_tokens_field="max_completion_tokens")
    _neutral(body, "logprobs", (None, False), "no log-probabilities")
    _neutral(body, "top_logprobs", (None,), "no log-probabilities")
    _neutral(body, "response_format", (None, {"type": "text"}), "text responses only")
    _neutral(body, "tools", (None, []), "no tool calls")
    _neutral(body, "tool_choice", (None, "none"), "no tool calls")
    _neutral(body, "parallel_tool_calls", (None, False, True), "no tool calls")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty array of {role, content} objects", "messages")
    out = []
    for n, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise bad(f"messages[{n}] must be an object with a string 'role' and a 'content'", "messages")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise bad(f"messages[{n}] has the unsupported field {sorted(extra)[0]!r}", "messages")
        c = m["content"]
        if isinstance(c, list):
            if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                       for part in c):
                raise bad(f"messages[{n}].content parts must be {{'type': 'text', 'text': ...}} (text only)",
                          "messages")
            c = "".join(part["text"] for part in c)
        elif not isinstance(c, str):
            raise bad(f"messages[{n}].content must be a string or a list of text parts, got {_type_name(c)}",
                      "messages")
        out.append({**m, "content": c})
    return Parsed([], params, stream, usage, ids, model, messages=out)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
