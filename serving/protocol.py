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

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from decoding import limits as L
from decoding.errors import ConfigError

MAX_STOP_SEQUENCES = L.MAX_STOP_SEQUENCES
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
    if status == 429:
        return "rate_limit_error"
    if status == 503:
        return "service_unavailable"
    if 400 <= status < 500:
        return "invalid_request_error"
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
    top_k: int | None = None  # None: the configuration's
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
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": list(self.stop),
        }


MAX_JSON_DEPTH = 32  # objects and lists nested deeper than this are refused (the OpenAI bodies need 4)
MAX_INT_DIGITS = 30  # an integer literal longer than this cannot be a valid value of any field


def _int_literal(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer literal of {len(text)} digits is out of range")
    return int(text)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _path(parts: list) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "the body"


def check_json_value(body) -> None:
    """Refuse nesting deeper than :data:`MAX_JSON_DEPTH` and strings that are not valid Unicode (lone surrogates
    from ``\\ud800`` escapes): both would only fail later, deep inside the server. Iterative, so depth costs no stack."""
    todo = [(body, [], 1)]
    while todo:
        value, where, depth = todo.pop()
        if isinstance(value, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise invalid(
                    _path(where) if where else None, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
                )
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                if isinstance(k, str):
                    _check_text(k, where)
                todo.append((v, [*where, k], depth + 1))
        elif isinstance(value, str):
            _check_text(value, where)


def _check_text(s: str, where: list) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = f"\\u{ord(s[e.start]):04x}"
        name = _path(where) if where else None
        raise invalid(
            name, f"{name or 'a key'} holds a lone UTF-16 surrogate ({bad}), which is not valid Unicode", code="invalid_unicode"
        ) from None


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body, or a 400 naming what is wrong with it (never a 500)."""
    try:
        body = json.loads(raw or b"", parse_int=_int_literal, parse_constant=_reject_constant)
    except RecursionError:
        raise invalid(None, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid(None, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except ValueError as e:
        raise invalid(None, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(None, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    check_json_value(body)
    return body


# ---- request models (FastAPI validates bodies with them; /openapi.json describes them) ----------------
_STRICT = ConfigDict(strict=True, extra="allow")


class _Sampling(BaseModel):
    model_config = _STRICT

    model: str = Field(min_length=1, description="a registry entry name or a plain model id (GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, le=L.MAX_TOKENS_MAX)
    temperature: float | None = Field(None, ge=0.0, le=L.TEMPERATURE_MAX, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0, le=L.TOP_K_MAX, description="0 disables it")
    seed: int | None = Field(None, ge=0, le=L.SEED_MAX)
    n: int | None = Field(None, description="only 1")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description=f"at most {L.MAX_STOP_SEQUENCES} non-empty sequences")
    user: str | None = None
    presence_penalty: float | None = Field(None, description="only 0")
    frequency_penalty: float | None = Field(None, description="only 0")
    response_format: dict | None = Field(None, description='only {"type": "text"}')


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[str] = Field(description="one prompt (a list of one string is accepted)")


class TextPart(BaseModel):
    model_config = _STRICT
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=L.MAX_TOKENS_MAX)


_Sampling.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()

# what a field must be, for the message when a value has the wrong type (unions give one error per member)
_EXPECTED = {
    "prompt": "a string",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
    "messages": "a list of messages",
    "stream_options": "an object",
}
_NESTED = {"role", "content", "include_usage", "type", "text"}


def validation_error(errors: list[dict]) -> ApiError:
    """A 400 in OpenAI's shape from pydantic's (or FastAPI's) errors: the first one, its field named as a path."""
    e = errors[0]
    loc = [p for p in e.get("loc", ()) if p != "body"]
    parts: list = []
    for p in loc:
        if isinstance(p, int) or (parts and p in _NESTED) or not parts:
            parts.append(p)
    param = _path(parts) if parts else None
    kind = e.get("type", "")
    if kind == "missing":
        return invalid(param, f"'{param}' is required", code="missing_required_parameter")
    last = next((p for p in reversed(parts) if isinstance(p, str)), None)
    if param is None:
        return invalid(None, "the request body must be a JSON object with the request's fields", code="invalid_json")
    if kind.endswith("_type") or kind in ("union_tag_invalid", "model_attributes_type", "dict_type", "list_type"):
        want = _EXPECTED.get(last) or e.get("msg", "invalid").removeprefix("Input should be ").lower()
        return invalid(param, f"'{param}' must be {want}", code="invalid_type")
    if kind == "json_invalid":
        return invalid(None, f"the request body is not valid JSON: {e.get('msg')}", code="invalid_json")
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    return invalid(param, f"'{param}': {msg}")


def _validate(model: type[BaseModel], body: dict) -> BaseModel:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False, include_input=False)) from None


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
        if not 1 <= max_tokens <= L.MAX_TOKENS_MAX:
            raise invalid(max_key, f"'{max_key}' must be in [1, {L.MAX_TOKENS_MAX}], got {max_tokens}")
        req.max_tokens = max_tokens

    for name in ("temperature", "top_p"):
        v = body.get(name)
        if v is not None and not _is_number(v):
            raise _type_error(name, "a number", v)
    for name in ("top_k", "seed"):
        v = body.get(name)
        if v is not None and not _is_int(v):
            raise _type_error(name, "an integer", v)
    try:
        L.check_sampling(body.get("temperature"), body.get("top_p"), body.get("top_k"), body.get("seed"))
    except ConfigError as e:
        raise invalid(e.field, f"'{e.field}' {str(e).partition(': ')[2]}") from None
    req.temperature = None if body.get("temperature") is None else float(body["temperature"])
    req.top_p = None if body.get("top_p") is None else float(body["top_p"])
    req.top_k = body.get("top_k")
    req.seed = body.get("seed")
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
        try:
            L.check_sampling(stop=stop)
        except ConfigError as e:
            raise invalid("stop", f"'stop' {str(e).partition(': ')[2]}", code="invalid_type" if "must be" in str(e) else None) from None
        req.stop = [stop] if isinstance(stop, str) else list(stop)
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
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise invalid("response_format", 'only response_format {"type": "text"} is supported', code="unsupported_parameter")
    for name in ("logprobs", "top_logprobs"):
        v = body.get(name)
        if v not in (None, False, 0):
            raise invalid(name, f"'{name}' is not supported", code="unsupported_parameter")
    return req


def parse_completion(body: dict) -> GenerationRequest:
    """A validated completions request: the model's field rules (:class:`CompletionRequest`), then specray's."""
    _validate(CompletionRequest, body)
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
    """A validated chat request: the model's field rules (:class:`ChatCompletionRequest`), then specray's."""
    _validate(ChatCompletionRequest, body)
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


# ---- response models (what /openapi.json describes; the builders below produce these shapes) -------------
class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None


class AssistantMessage(BaseModel):
    role: str
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    """A non-streamed completion; with ``stream: true`` the answer is server-sent ``text_completion`` chunks."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    specray: dict = Field(description="specray's figures: method, tokens/s, accepted tokens per forward, ...")


class ChatCompletionResponse(BaseModel):
    """A non-streamed chat completion; with ``stream: true`` the answer is server-sent ``chat.completion.chunk`` events."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    specray: dict


ERROR_RESPONSES = {
    status: {"model": ErrorResponse, "description": what}
    for status, what in (
        (400, "invalid request (the field is named in error.param)"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (413, "request body too large"),
        (429, "admission limit reached (Retry-After)"),
    )
}


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


# ---- prompt size, before tokenizing ---------------------------------------------
def longest_token_chars(tokenizer) -> int:
    """Characters in the longest vocabulary entry (byte-level entries hold one character per byte), at least 1.

    No token covers more text than that, so a text of C characters has at least C / this many tokens.
    """
    n = getattr(tokenizer, "_specray_longest_token", None)
    if n is None:
        n = max([len(t) for t in tokenizer.get_vocab()] + [1])
        try:
            tokenizer._specray_longest_token = n  # computed once per tokenizer (a vocabulary scan)
        except AttributeError:
            pass
    return n


def prompt_surely_exceeds(tokenizer, chars: int, context: int) -> bool:
    """True when a text of ``chars`` characters cannot fit ``context`` tokens whatever it holds.

    >>> class Tok:
    ...     def get_vocab(self):
    ...         return {"a": 0, "abcd": 1}
    >>> prompt_surely_exceeds(Tok(), 400, 100), prompt_surely_exceeds(Tok(), 401, 100)
    (False, True)
    """
    return chars > context * longest_token_chars(tokenizer)
