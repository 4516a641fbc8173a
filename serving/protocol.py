"""The OpenAI wire format: request validation, error bodies, response and chunk shapes.

Pure functions on dicts (no Ray, no HTTP server), so every rule is unit-testable.

>>> p = parse_completion({"model": "m", "prompt": "Hi", "max_tokens": 8})
>>> (p.model, p.prompt, p.max_tokens, p.stream, p.stop)
('m', 'Hi', 8, False, [])
>>> try:
...     parse_completion({"model": "m", "prompt": "Hi", "max_tokens": 0})
... except ApiError as e:
...     (e.status, e.param, e.body()["error"]["type"])
(400, 'max_tokens', 'invalid_request_error')
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

MAX_STOP_SEQUENCES = 4
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _default_type(status)
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _default_type(status: int) -> str:
    if status == 404:
        return "invalid_request_error"
    if status == 429:
        return "rate_limit_error"
    if status in (400, 413, 422):
        return "invalid_request_error"
    if status == 503:
        return "service_unavailable"
    return "server_error"


def invalid(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code or "invalid_value")


@dataclass
class GenerationRequest:
    """A validated completions or chat request (the fields specray acts on)."""

    endpoint: str  # "completions" | "chat"
    model: str
    prompt: str | None = None  # completions
    messages: list | None = None  # chat
    max_tokens: int | None = None  # None: the configuration's max_new_tokens, capped by the context
    temperature: float | None = None  # None: the configuration's
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    user: str | None = None

    def to_worker(self) -> dict:
        return {
            "endpoint": self.endpoint,
            "prompt": self.prompt,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": list(self.stop),
        }


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid(None, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(None, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _type_error(name: str, want: str, v) -> ApiError:
    return invalid(name, f"'{name}' must be {want}, got {type(v).__name__} {json.dumps(v)[:60]}", code="invalid_type")


def _common(body: dict, endpoint: str) -> GenerationRequest:
    model = body.get("model")
    if model is None:
        raise invalid("model", "'model' is required", code="missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise _type_error("model", "a non-empty string", model)
    req = GenerationRequest(endpoint=endpoint, model=model)

    max_key = "max_tokens"
    max_tokens = body.get("max_tokens")
    if endpoint == "chat" and body.get("max_completion_tokens") is not None:
        max_key, max_tokens = "max_completion_tokens", body["max_completion_tokens"]
    if max_tokens is not None:
        if not _is_int(max_tokens):
            raise _type_error(max_key, "an integer", max_tokens)
        if max_tokens < 1:
            raise invalid(max_key, f"'{max_key}' must be at least 1, got {max_tokens}")
        req.max_tokens = max_tokens

    t = body.get("temperature")
    if t is not None:
        if not _is_number(t):
            raise _type_error("temperature", "a number", t)
        if not 0.0 <= t <= 2.0:
            raise invalid("temperature", f"'temperature' must be between 0 and 2, got {t}")
        req.temperature = float(t)
    p = body.get("top_p")
    if p is not None:
        if not _is_number(p):
            raise _type_error("top_p", "a number", p)
        if not 0.0 < p <= 1.0:
            raise invalid("top_p", f"'top_p' must be in (0, 1], got {p}")
        req.top_p = float(p)
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed):
            raise _type_error("seed", "an integer", seed)
        if not 0 <= seed < 2**63:
            raise invalid("seed", f"'seed' must be in [0, 2**63), got {seed}")
        req.seed = seed
    n = body.get("n")
    if n is not None:
        if not _is_int(n):
            raise _type_error("n", "an integer", n)
        if n != 1:
            raise invalid("n", f"only n=1 is supported, got {n}", code="unsupported_value")
    stream = body.get("stream")
    if stream is not None:
        if not isinstance(stream, bool):
            raise _type_error("stream", "a boolean", stream)
        req.stream = stream
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _type_error("stream_options", "an object", so)
        iu = so.get("include_usage", False)
        if not isinstance(iu, bool):
            raise _type_error("stream_options.include_usage", "a boolean", iu)
        req.include_usage = iu
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _type_error("stop", "a string or a list of strings", stop)
        if len(stops) > MAX_STOP_SEQUENCES:
            raise invalid("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
        if any(s == "" for s in stops):
            raise invalid("stop", "stop sequences must not be empty")
        req.stop = stops
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _type_error("user", "a string", user)
    req.user = user
    # parameters that would change the output and are not implemented: refuse rather than ignore
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v is not None:
            if not _is_number(v):
                raise _type_error(name, "a number", v)
            if v != 0:
                raise invalid(name, f"'{name}' is not supported (only 0)", code="unsupported_parameter")
    if body.get("logit_bias"):
        raise invalid("logit_bias", "'logit_bias' is not supported", code="unsupported_parameter")
    for name in ("logprobs", "top_logprobs"):
        v = body.get(name)
        if v not in (None, False, 0):
            raise invalid(name, f"'{name}' is not supported", code="unsupported_parameter")
    return req


def parse_completion(body: dict) -> GenerationRequest:
    req = _common(body, "completions")
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("prompt", "'prompt' is required", code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise invalid("prompt", "only a single string prompt is supported (no batches or token lists)", code="unsupported_value")
    if not isinstance(prompt, str):
        raise _type_error("prompt", "a string", prompt)
    if not prompt.strip():
        raise invalid("prompt", "'prompt' is empty")
    if body.get("echo"):
        raise invalid("echo", "'echo' is not supported", code="unsupported_parameter")
    if body.get("suffix"):
        raise invalid("suffix", "'suffix' is not supported", code="unsupported_parameter")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise invalid("best_of", "only best_of=1 is supported", code="unsupported_value")
    req.prompt = prompt
    return req


def _message_text(i: int, content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"messages[{i}].content[{j}]", "only text content parts are supported", code="unsupported_value")
            parts.append(part["text"])
        return "".join(parts)
    raise _type_error(f"messages[{i}].content", "a string or a list of text parts", content)


def parse_chat(body: dict) -> GenerationRequest:
    req = _common(body, "chat")
    messages = body.get("messages")
    if messages is None:
        raise invalid("messages", "'messages' is required", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise _type_error("messages", "a list of messages", messages)
    if not messages:
        raise invalid("messages", "'messages' must not be empty")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _type_error(f"messages[{i}]", "an object", m)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role", f"role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        clean.append({"role": role, "content": _message_text(i, m.get("content"))})
    if not any(m["content"].strip() for m in clean):
        raise invalid("messages", "every message is empty")
    if body.get("tools") or body.get("functions"):
        raise invalid("tools", "tool calling is not supported", code="unsupported_parameter")
    req.messages = clean
    return req


# ---- responses -------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def completion_response(rid: str, model: str, created: int, text: str, finish_reason: str, use: dict, stats: dict) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": use,
        "specray": stats,
    }


def chat_response(rid: str, model: str, created: int, text: str, finish_reason: str, use: dict, stats: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish_reason}],
        "usage": use,
        "specray": stats,
    }


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None = None, **extra) -> dict:
    out = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    out.update(extra)
    return out


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None = None, **extra) -> dict:
    out = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    out.update(extra)
    return out


def usage_chunk(rid: str, model: str, created: int, endpoint: str, use: dict, stats: dict) -> dict:
    obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use, "specray": stats}


def sse(data: dict | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


DONE = sse("[DONE]")


def now() -> int:
    return int(time.time())
