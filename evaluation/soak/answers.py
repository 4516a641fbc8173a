"""How a soak request was answered: the outcomes, the classifiers of a plain answer and of a stream, and the record
of one request.

Every request ends in exactly one of three ways: ``ok`` (it completes); ``error``, a clean OpenAI-shaped error
(503, or 429 with ``Retry-After``), or in a stream an error event just before ``[DONE]``. Anything else is a
violation (:data:`VIOLATIONS`): ``lost`` (connection broken, no ``[DONE]``, no finish), ``hung`` (past its
timeout), ``bad_error`` (another status or shape), ``duplicated`` (two finishes, data after ``[DONE]``, an id
answered twice), ``mixed`` (another response's chunks in a stream) or ``wrong_output`` (a completed greedy
answer that differs from the same request run alone in float32, or a seeded answer that differs from the same
seeded request's other answers).

>>> events = ['{"id":"c1","choices":[{"index":0,"text":"Hi","finish_reason":null}]}',
...           '{"id":"c1","choices":[{"index":0,"text":"","finish_reason":"length"}],"usage":{"completion_tokens":1}}', "[DONE]"]
>>> v = classify_stream(200, {}, events, "completions")
>>> (v.outcome, v.text, v.finish_reason, v.tokens)
('ok', 'Hi', 'length', 1)
>>> classify_stream(200, {}, events[:1] + ['{"error":{"message":"m","type":"service_unavailable","code":"x"}}', "[DONE]"],
...                 "completions").outcome
'error'
>>> classify_stream(200, {}, events[:2], "completions").outcome
'lost'
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

OK, ERROR = "ok", "error"
VIOLATIONS = ("lost", "hung", "bad_error", "duplicated", "mixed", "wrong_output", "malformed")
ABANDONED = "abandoned"  # the hang-up client leaves on purpose: checked for its cancellation instead
CLEAN_STREAM_ERRORS = {"service_unavailable": 503, "rate_limit_error": 429}


@dataclass
class Answer:
    """How a request was answered: what the classifiers find (a :class:`Verdict`), and what its record keeps."""

    outcome: str = ""
    detail: str = ""
    status: int | None = None
    code: str | None = None
    response_id: str | None = None
    text: str | None = None
    tokens: int | None = None
    finish_reason: str | None = None
    retry_after: str | None = None


@dataclass
class Verdict(Answer):
    where: dict | None = None  # an actor entry's placement (specray.placement.where): which pids and nodes served it


def _error_shape(doc) -> dict | None:
    """OpenAI's error body ``{"error": {"message", "type", "code", ...}}``, else None."""
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str) and "code" in err:
        return err
    return None


def _where(doc: dict) -> dict | None:
    placement = (doc.get("specray") or {}).get("placement")
    return placement.get("where") if isinstance(placement, dict) else None


def classify_plain(status: int, headers, body: bytes | str, endpoint: str) -> Verdict:
    """A non-streamed answer (or a stream refused before it started): ok, a clean error, or a violation.

    >>> full = '{"error":{"message":"full","type":"rate_limit_error","code":"queue_full"}}'
    >>> classify_plain(429, {"retry-after": "1"}, full, "chat").outcome
    'error'
    >>> classify_plain(429, {}, full, "chat").detail
    'HTTP 429 without a Retry-After header'
    >>> classify_plain(500, {}, '{"error":{"message":"boom","type":"server_error","code":"internal_error"}}', "chat").outcome
    'bad_error'
    """
    headers = {k.lower(): v for k, v in dict(headers).items()}
    try:
        doc = json.loads(body)
    except ValueError:
        kind = "lost" if status == 200 else "bad_error"
        return Verdict(
            kind, f"HTTP {status}: the body is not JSON ({bytes(body[:60]) if isinstance(body, bytes) else body[:60]!r})", status
        )
    if status == 200:
        try:
            choice = doc["choices"][0]
            text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
            finish, tokens, rid = choice["finish_reason"], doc["usage"]["completion_tokens"], doc["id"]
        except (KeyError, IndexError, TypeError):
            return Verdict("malformed", f"a 200 without choices, usage or id: {str(doc)[:120]}", status)
        if finish not in ("stop", "length") or len(doc["choices"]) != 1:
            return Verdict("malformed", f"finish_reason {finish!r}, {len(doc['choices'])} choices", status)
        header_id = headers.get("x-specray-request-id")
        if header_id is not None and header_id != rid:
            return Verdict("mixed", f"the body answers {rid} but the header names {header_id}", status, response_id=rid)
        return Verdict(OK, "", status, response_id=rid, text=text, tokens=tokens, finish_reason=finish, where=_where(doc))
    err = _error_shape(doc)
    if err is None:
        return Verdict("bad_error", f"HTTP {status} without OpenAI's error shape: {str(doc)[:120]}", status)
    code, message = err.get("code"), err["message"].splitlines()[0][:160] if err["message"] else ""
    if status == 503:
        return Verdict(ERROR, message, status, code=code)
    if status == 429:
        retry = headers.get("retry-after")
        if retry is None or not retry.strip().isdigit():
            return Verdict("bad_error", "HTTP 429 without a Retry-After header", status, code=code)
        return Verdict(ERROR, message, status, code=code, retry_after=retry)
    return Verdict("bad_error", f"HTTP {status} {code}: {message}", status, code=code)


def classify_stream(status: int, headers, events: list[str], endpoint: str) -> Verdict:
    """A stream's ``data:`` payloads in order (``[DONE]`` included): ok, a clean error event before ``[DONE]``, or a
    violation: no ``[DONE]`` (lost), two finishes or data after the end (duplicated), chunks of several responses (mixed).

    >>> ok = '{"id":"a","choices":[{"index":0,"text":"x","finish_reason":"stop"}],"usage":{"completion_tokens":1}}'
    >>> classify_stream(200, {}, [ok, ok, "[DONE]"], "completions").outcome
    'duplicated'
    >>> classify_stream(200, {}, [ok.replace('"a"', '"b"', 1), '{"id":"a","choices":[]}', "[DONE]"], "completions").outcome
    'mixed'
    >>> classify_stream(200, {}, [ok, "[DONE]", "[DONE]"], "completions").outcome
    'duplicated'
    """
    headers = {k.lower(): v for k, v in dict(headers).items()}
    done = [i for i, e in enumerate(events) if e == "[DONE]"]
    if not done:
        return Verdict("lost", f"the stream ended without [DONE] after {len(events)} events", status)
    if len(done) > 1 or done[0] != len(events) - 1:
        return Verdict("duplicated", f"[DONE] at events {done} of {len(events)}: data after the end or two ends", status)
    ids, parts, finishes, errors = [], [], [], []
    tokens, where = None, None
    for i, payload in enumerate(events[:-1]):
        try:
            doc = json.loads(payload)
        except ValueError:
            return Verdict("malformed", f"event {i} is not JSON: {payload[:80]!r}", status)
        if not isinstance(doc, dict):
            return Verdict("malformed", f"event {i} is not an object: {payload[:80]!r}", status)
        if "error" in doc:
            errors.append((i, doc))
            continue
        if errors:
            return Verdict("duplicated", f"a chunk after the error event (event {i})", status)
        if doc.get("id") not in ids:
            ids.append(doc.get("id"))
        for ch in doc.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content") if endpoint == "chat" else ch.get("text")
            if piece and finishes:
                return Verdict("duplicated", f"content after the finish (event {i})", status)
            if piece:
                parts.append(piece)
            if ch.get("finish_reason") is not None:
                finishes.append(ch["finish_reason"])
        if isinstance(doc.get("usage"), dict):
            tokens = doc["usage"].get("completion_tokens")
        where = _where(doc) or where
    rid = ids[0] if ids else None
    if len(ids) > 1:
        return Verdict("mixed", f"chunks of {len(ids)} responses in one stream: {ids[:4]}", status, response_id=rid)
    header_id = headers.get("x-specray-request-id")
    if header_id is not None and rid is not None and header_id != rid:
        return Verdict("mixed", f"the chunks answer {rid} but the header names {header_id}", status, response_id=rid)
    if errors:
        if len(errors) > 1 or finishes:
            return Verdict("duplicated", f"{len(errors)} error event(s) and {len(finishes)} finish(es) in one stream", status)
        if errors[0][0] != len(events) - 2:
            return Verdict("duplicated", "the error event is not the last before [DONE]", status)
        err = _error_shape(errors[0][1])
        if err is None:
            return Verdict("bad_error", f"an error event without OpenAI's shape: {events[errors[0][0]][:120]}", status)
        message = err["message"].splitlines()[0][:160] if err["message"] else ""
        if err["type"] not in CLEAN_STREAM_ERRORS:
            return Verdict("bad_error", f"a {err['type']} error event ({err.get('code')}): {message}", status, code=err.get("code"))
        return Verdict(ERROR, message, CLEAN_STREAM_ERRORS[err["type"]], code=err.get("code"), response_id=rid, text="".join(parts))
    if not finishes:
        return Verdict("lost", "[DONE] without a finish_reason or an error event", status, response_id=rid)
    if len(finishes) > 1:
        return Verdict("duplicated", f"{len(finishes)} finish_reasons in one stream", status, response_id=rid)
    if finishes[0] not in ("stop", "length"):
        return Verdict("malformed", f"finish_reason {finishes[0]!r}", status, response_id=rid)
    return Verdict(OK, "", status, response_id=rid, text="".join(parts), tokens=tokens, finish_reason=finishes[0], where=where)


def has_content(line: str) -> bool:
    """Whether an SSE line of a chunk carries generated text (not the role chunk or an empty finish).

    >>> has_content('data: {"choices":[{"delta":{"content":"Hi"}}]}'), has_content('data: {"choices":[{"text":""}]}')
    (True, False)
    """
    return ('"content":"' in line and '"content":""' not in line) or ('"text":"' in line and '"text":""' not in line)


def sse_payloads(raw: bytes) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream (the body of a streamed answer), in order.

    >>> sse_payloads(b'data: {"a":1}\\n\\ndata: [DONE]\\n\\n')
    ['{"a":1}', '[DONE]']
    """
    out = []
    for block in raw.decode("utf-8", "replace").replace("\r\n", "\n").split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data:"):
                out.append(line[5:].strip())
    return out


@dataclass(kw_only=True)
class RequestRecord(Answer):
    idx: int
    kind: str  # load | burst | slow_reader | hangup
    model: str
    endpoint: str  # chat | completions
    stream: bool
    temperature: float
    seed: int | None
    max_tokens: int
    prompt_idx: int
    timeout_s: float
    t_start: float = 0.0
    t_first: float | None = None  # first content (stream) or the whole answer (plain)
    t_end: float | None = None
    check: str | None = None  # greedy: match | mismatch; seeded: checked later (consistent | inconsistent)
    server_state: str | None = None  # hang-up: the replica's record of the request (cancelled, completed, ...)

    @property
    def latency(self) -> float | None:
        return None if self.t_end is None else self.t_end - self.t_start

    def body(self, prompt: str, top_p: float) -> dict:
        out = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature, "stream": self.stream}
        if self.endpoint == "chat":
            out["messages"] = [{"role": "user", "content": prompt}]
        else:
            out["prompt"] = prompt
        if self.seed is not None:
            out.update(seed=self.seed, top_p=top_p)
        return out

    def apply(self, v: Verdict) -> None:
        for f in fields(Answer):
            setattr(self, f.name, getattr(v, f.name))


def path_of(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def dechunk(data: bytes) -> bytes:
    """The body of an HTTP/1.1 chunked transfer (as far as it goes).

    >>> dechunk(b"5\\r\\nhello\\r\\n0\\r\\n\\r\\n")
    b'hello'
    """
    out, i = [], 0
    while True:
        j = data.find(b"\r\n", i)
        if j < 0:
            break
        size = int(data[i:j].split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out.append(data[j + 2 : j + 2 + size])
        i = j + 2 + size + 2
    return b"".join(out)
