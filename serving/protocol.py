"""The OpenAI wire format as pydantic models: the one validator of a request body, and every answer's shape.

- :func:`parse_body`: a body's JSON decoded strictly (depth, huge integers, NaN, lone surrogates: a 400 naming the
  place), which is all that is checked before the models;
- :class:`CompletionRequest`, :class:`ChatCompletionRequest`: the field rules and specray's refusals (validators
  whose error type is the OpenAI code); FastAPI validates each body with them and hands the handler the model, whose
  ``to_request()`` is what specray acts on (:class:`GenerationRequest`); :func:`validation_error` turns pydantic's
  errors into OpenAI's 400;
- responses, chunks and errors are built as :class:`CompletionResponse`, :class:`ChatCompletionChunk`,
  :class:`ErrorResponse`, ... (also what ``/openapi.json`` describes).

No Ray, no HTTP server, so every rule is unit-testable.

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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator
from pydantic_core import PydanticCustomError

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
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code)).model_dump()


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
    """What specray acts on, from a validated request model (:meth:`CompletionRequest.to_request`): no checks left."""

    endpoint: str  # "completions" | "chat"
    model: str
    prompt: str | None = None  # completions
    messages: list | None = None  # chat: [{"role", "content"}] with the text parts joined
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


def _check_json_value(body) -> None:
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
    """The JSON of a request body, decoded strictly, or a 400 naming what is wrong with it (never a 500): JSON nested
    deeper than :data:`MAX_JSON_DEPTH`, integer literals over :data:`MAX_INT_DIGITS` digits, NaN/Infinity and lone
    UTF-16 surrogates are refused (JSON text that Python's own decoder would pass on to fail later), and so is a body
    that is not an object. What its fields must be is the request models' business (``serving.ingress`` reads every
    body with this, then FastAPI validates it with them)."""
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
    _check_json_value(body)
    return body


# ---- request models: the one validator of a request body -------------------------------------------------------
# FastAPI validates every body with them and hands the handler the model; /openapi.json describes them. The field
# rules are declared on the fields; specray's refusals (parameters it does not implement, prompts it cannot run) are
# the models' validators, raising errors whose type is the OpenAI error code (see validation_error).
_STRICT = ConfigDict(strict=True, extra="allow")
UNSUPPORTED_PARAMETER, UNSUPPORTED_VALUE, INVALID_VALUE = "unsupported_parameter", "unsupported_value", "invalid_value"
_CODES = (UNSUPPORTED_PARAMETER, UNSUPPORTED_VALUE, INVALID_VALUE)


def _refuse(code: str, message: str):
    """A refusal inside a model validator: the error type is the OpenAI ``code``, the message is said as it is."""
    raise PydanticCustomError(code, message)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = _STRICT

    model: str = Field(min_length=1, description="a registry entry name or a plain model id (GET /v1/models)")
    max_tokens: int | None = Field(None, **L.BOUNDS["max_tokens"])
    temperature: float | None = Field(None, **L.BOUNDS["temperature"], allow_inf_nan=False)
    top_p: float | None = Field(None, **L.BOUNDS["top_p"], allow_inf_nan=False)
    top_k: int | None = Field(None, **L.BOUNDS["top_k"], description="0 disables it")
    seed: int | None = Field(None, **L.BOUNDS["seed"])
    n: int | None = Field(None, description="only 1")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description=f"at most {L.MAX_STOP_SEQUENCES} non-empty sequences")
    user: str | None = None
    presence_penalty: float | None = Field(None, description="only 0")
    frequency_penalty: float | None = Field(None, description="only 0")
    response_format: dict | None = Field(None, description='only {"type": "text"}')
    logit_bias: dict | None = Field(None, description="not supported")
    logprobs: bool | int | None = Field(None, description="not supported")
    top_logprobs: int | None = Field(None, description="not supported")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n):
        if n is not None and n != 1:
            _refuse(UNSUPPORTED_VALUE, f"only n=1 is supported, got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        try:
            L.check_sampling(stop=stop)
        except ConfigError as e:
            _refuse(INVALID_VALUE, f"'stop' {str(e).partition(': ')[2]}")
        return stop

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v, info):
        if v:  # would change the output and is not implemented: refused rather than ignored
            _refuse(UNSUPPORTED_PARAMETER, f"'{info.field_name}' is not supported (only 0)")
        return v

    @field_validator("logit_bias", "logprobs", "top_logprobs")
    @classmethod
    def _not_supported(cls, v, info):
        if v:
            _refuse(UNSUPPORTED_PARAMETER, f"'{info.field_name}' is not supported")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        if v is not None and v != {"type": "text"}:
            _refuse(UNSUPPORTED_PARAMETER, 'only response_format {"type": "text"} is supported')
        return v

    def _request(self, endpoint: str, **fields) -> GenerationRequest:
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return GenerationRequest(
            endpoint=endpoint,
            model=self.model,
            max_tokens=self.max_tokens,
            temperature=None if self.temperature is None else float(self.temperature),
            top_p=None if self.top_p is None else float(self.top_p),
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            stream=bool(self.stream),
            include_usage=bool(self.stream_options and self.stream_options.include_usage),
            user=self.user,
            **fields,
        )


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[str] = Field(description="one prompt (a list of one string is accepted)")
    echo: bool | None = Field(None, description="not supported")
    suffix: str | None = Field(None, description="not supported")
    best_of: int | None = Field(None, description="only 1")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list):
            if len(prompt) != 1:
                _refuse(UNSUPPORTED_VALUE, "only a single string prompt is supported (no batches or token lists)")
            prompt = prompt[0]
        if not prompt.strip():
            _refuse(INVALID_VALUE, "'prompt' is empty")
        return prompt

    @field_validator("echo", "suffix")
    @classmethod
    def _not_supported_here(cls, v, info):
        if v:
            _refuse(UNSUPPORTED_PARAMETER, f"'{info.field_name}' is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, v):
        if v is not None and v != 1:
            _refuse(UNSUPPORTED_VALUE, "only best_of=1 is supported")
        return v

    def to_request(self) -> GenerationRequest:
        return self._request("completions", prompt=self.prompt)


class TextPart(BaseModel):
    model_config = _STRICT
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text(self):
        if self.type != "text" or not isinstance(self.text, str):
            _refuse(UNSUPPORTED_VALUE, "only text content parts are supported")
        return self


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: str
    content: list[TextPart] | str | None = None  # parts first: a refused part is the error said, not "not a string"

    @field_validator("role")
    @classmethod
    def _known_role(cls, role):
        if role not in CHAT_ROLES:
            _refuse(INVALID_VALUE, f"role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        return role

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, **L.BOUNDS["max_tokens"])
    tools: list | None = Field(None, description="not supported")
    functions: list | None = Field(None, description="not supported")

    @field_validator("messages")
    @classmethod
    def _some_text(cls, messages):
        if not any(m.text.strip() for m in messages):
            _refuse(INVALID_VALUE, "every message is empty")
        return messages

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v):
        if v:
            _refuse(UNSUPPORTED_PARAMETER, "tool calling is not supported")
        return v

    def to_request(self) -> GenerationRequest:
        req = self._request("chat", messages=[{"role": m.role, "content": m.text} for m in self.messages])
        if self.max_completion_tokens is not None:
            req.max_tokens = self.max_completion_tokens
        return req


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
    """A 400 in OpenAI's shape from pydantic's (or FastAPI's) errors: the first one, its field named as a path; a
    refusal of specray's (:data:`_CODES`) keeps its code and its words."""
    e = errors[0]
    kind = e.get("type", "")
    if kind == "json_invalid":
        why = (e.get("ctx") or {}).get("error") or e.get("msg")
        return invalid(None, f"the request body is not valid JSON: {why}", code="invalid_json")
    parts: list = []
    for p in (p for p in e.get("loc", ()) if p != "body"):
        if isinstance(p, int) or (parts and p in _NESTED) or not parts:
            parts.append(p)
    param = _path(parts) if parts else None
    if param is None:
        return invalid(None, "the request body must be a JSON object with the request's fields", code="invalid_json")
    msg = str(e.get("msg", "invalid value"))
    if kind in _CODES:
        return invalid(param, msg, code=kind)
    if kind == "missing":
        return invalid(param, f"'{param}' is required", code="missing_required_parameter")
    last = next((p for p in reversed(parts) if isinstance(p, str)), None)
    if kind.endswith("_type") or kind in ("union_tag_invalid", "model_attributes_type", "dict_type", "list_type"):
        want = _EXPECTED.get(last) or msg.removeprefix("Input should be ").lower()
        return invalid(param, f"'{param}' must be {want}", code="invalid_type")
    return invalid(param, f"'{param}': {msg.removeprefix('Value error, ')}")


def _validate(model: type[BaseModel], body) -> BaseModel:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False, include_input=False)) from None


def parse_completion(body: dict) -> GenerationRequest:
    """A validated completions request (:class:`CompletionRequest`): what FastAPI does with a body, for a dict."""
    return _validate(CompletionRequest, body).to_request()


def parse_chat(body: dict) -> GenerationRequest:
    """A validated chat request (:class:`ChatCompletionRequest`): what FastAPI does with a body, for a dict."""
    return _validate(ChatCompletionRequest, body).to_request()


# ---- response models: every answer is built as one of them ----------------------------------------------------
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


class _Answer(BaseModel):
    """A response or chunk: ``usage`` and ``specray`` are left out of its JSON when it carries none."""

    id: str
    object: str
    created: int
    model: str
    usage: Usage | None = None
    specray: dict | None = Field(None, description="specray's figures: method, tokens/s, accepted tokens per forward, ...")

    @model_serializer(mode="wrap")
    def _without_empty_extras(self, handler):
        out = handler(self)
        for key in ("usage", "specray"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatDelta(BaseModel):
    """What a chat chunk adds: the role once, then content; an empty delta ends the stream."""

    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _given_only(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(_Answer):
    """A non-streamed completion; with ``stream: true`` the answer is server-sent :class:`CompletionChunk` events."""

    object: str = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionResponse(_Answer):
    """A non-streamed chat completion; with ``stream: true`` the answer is server-sent :class:`ChatCompletionChunk` events."""

    object: str = "chat.completion"
    choices: list[ChatChoice]


class CompletionChunk(_Answer):
    object: str = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionChunk(_Answer):
    object: str = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


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
def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)


def completion_response(rid: str, model: str, created: int, text: str, finish_reason: str, use: Usage, stats: dict) -> CompletionResponse:
    choice = CompletionChoice(text=text, finish_reason=finish_reason)
    return CompletionResponse(id=rid, created=created, model=model, choices=[choice], usage=use, specray=stats)


def chat_response(rid: str, model: str, created: int, text: str, finish_reason: str, use: Usage, stats: dict) -> ChatCompletionResponse:
    choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)
    return ChatCompletionResponse(id=rid, created=created, model=model, choices=[choice], usage=use, specray=stats)


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None = None, **extra) -> CompletionChunk:
    choice = CompletionChoice(text=text, finish_reason=finish_reason)
    return CompletionChunk(id=rid, created=created, model=model, choices=[choice], **extra)


def chat_chunk(rid: str, model: str, created: int, delta: ChatDelta, finish_reason: str | None = None, **extra) -> ChatCompletionChunk:
    choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
    return ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice], **extra)


def usage_chunk(rid: str, model: str, created: int, endpoint: str, use: Usage, stats: dict) -> _Answer:
    """The last chunk of a stream asked for ``stream_options.include_usage``: no choices, the usage and specray's figures."""
    kind = ChatCompletionChunk if endpoint == "chat" else CompletionChunk
    return kind(id=rid, created=created, model=model, choices=[], usage=use, specray=stats)


def sse(data: BaseModel | dict | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    if isinstance(data, BaseModel):
        payload = data.model_dump_json()
    else:
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
