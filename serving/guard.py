"""The guard in front of every route: the API key (401) and the body size limit (413, before the body is read).

An ASGI middleware (``serving.ingress`` installs it on the FastAPI app), configured by the ingress replica from its
settings (:meth:`Guard.configure`). It reads bytes only: what the body says is the request models' business
(``serving.protocol``).
"""

import hashlib
import hmac
import json
import os

from serving import protocol as P
from serving.settings import ServeSettings, api_key_digest


class Guard:
    """ASGI middleware in front of every route: the API key (401) and the body size limit (413, before reading it).

    Configured by the ingress replica (:meth:`configure`), so it follows the deployment's settings.
    """

    key_digest: str | None = None
    auth_health = False
    max_body_bytes = 4 * 1024 * 1024

    def __init__(self, app):
        self.app = app

    @classmethod
    def configure(cls, settings: ServeSettings) -> None:
        env_key = os.environ.get("SPECRAY_API_KEY")
        cls.key_digest = settings.api_key_sha256 or (api_key_digest(env_key) if env_key else None)
        cls.auth_health = settings.auth_health
        cls.max_body_bytes = settings.max_body_bytes

    def _needs_key(self, path: str) -> bool:
        if self.key_digest is None:
            return False
        if path in ("/health", "/metrics"):
            return self.auth_health
        return True

    def _authorized(self, headers: dict) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        presented = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).hexdigest()
        return hmac.compare_digest(presented, self.key_digest)

    @staticmethod
    async def _send(send, err: P.ApiError) -> None:
        body = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), str(v).encode()) for k, v in err.headers.items()]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self._needs_key(scope["path"]) and not self._authorized(headers):
            err = P.ApiError(
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                type_="invalid_request_error",
                headers={"WWW-Authenticate": "Bearer"},
            )
            return await self._send(send, err)
        limit = self.max_body_bytes
        too_big = P.ApiError(413, f"the request body is larger than the limit of {limit} bytes", code="request_too_large")
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                return await self._send(send, P.invalid(None, "the Content-Length header is not a number", code="invalid_header"))
            if size > limit:
                return await self._send(send, too_big)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                return await self._send(send, too_big)
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
