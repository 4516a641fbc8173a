"""The OpenAI-compatible ingress: FastAPI routes on a Serve deployment, and the runs that turn events into answers.

Routes (``OpenAIIngress``, FastAPI via ``@serve.ingress``):

- ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` gives
  server-sent events ending in ``data: [DONE]``); responses carry ``usage`` and
  specray's figures under ``"specray"``;
- ``GET /v1/models``: every served name (registry entries, then plain-AR model ids);
- ``GET /health``: deployments' replica states (``serve.status()``), the registry,
  corrupt entries; 200 when every deployment is healthy, else 503;
- ``GET /metrics``: Prometheus text;
- ``GET /v1/specray/stats``, ``GET /v1/specray/requests/{id}``: the model
  replica's generation counters and one request's record (state, tokens).

The ingress resolves the model name to a ``SpecConfig`` through the :class:`~serving.catalog.Catalog`, applies the
admission limit (``max_queued_requests``; beyond it 429 with ``Retry-After``) and streams the model deployment's
events (``ModelWorker.stream``) back as OpenAI JSON (:class:`_Run`: one answer, or server-sent events).
"""

import asyncio
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.runtime import keep_replica_grpc_on_loopback
from serving import protocol as P
from serving.catalog import Catalog, ModelNotFound
from serving.guard import Guard
from serving.prometheus import ServingMetrics
from serving.settings import ServeSettings

log = logging.getLogger("ray.serve")

HEALTHY_STATES = ("HEALTHY", "UPSCALING", "DOWNSCALING")
WORKER_QUERY_TIMEOUT_S = 10.0

# /docs and /redoc would load their assets from a CDN (blank on an offline cluster): off; /openapi.json stays
api = FastAPI(title="specray", description="OpenAI-compatible speculative decoding", docs_url=None, redoc_url=None)


def error_response(err: P.ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class _BodyRefused(StarletteHTTPException):
    """A body the strict JSON decoder refused, carrying its answer (FastAPI lets HTTP exceptions through its body read)."""

    def __init__(self, err: P.ApiError):
        super().__init__(err.status, err.message)
        self.err = err


class _StrictJSONRequest(Request):
    async def json(self):
        if not hasattr(self, "_json"):
            try:
                self._json = P.parse_body(await self.body())
            except P.ApiError as e:
                raise _BodyRefused(e) from None
        return self._json


class _StrictJSONRoute(APIRoute):
    """Every route reads its body with ``serving.protocol.parse_body``; FastAPI then validates it with the route's
    request model and hands the handler the model: one decode, one validation."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict(request: Request):
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict


api.router.route_class = _StrictJSONRoute


def _request_id(request: Request) -> str:
    return request.headers.get("x-request-id") or uuid.uuid4().hex[:16]


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    status = exc.status_code if 400 <= exc.status_code < 600 else 400
    detail = exc.detail if status < 500 else "internal error"
    return error_response(
        P.ApiError(status, f"{request.method} {request.url.path}: {detail}", code=code, headers=getattr(exc, "headers", None))
    )


@api.exception_handler(_BodyRefused)
async def _body_refused(request: Request, exc: _BodyRefused):
    return error_response(exc.err)


@api.exception_handler(RequestValidationError)
async def _invalid_request(request: Request, exc: RequestValidationError):
    return error_response(P.validation_error(list(exc.errors())))


@api.exception_handler(Exception)
async def _server_error(request: Request, exc: Exception):
    rid = _request_id(request)
    log.error("specray: unhandled error on %s (request %s)", request.url.path, rid, exc_info=exc)
    return error_response(P.ApiError(500, f"internal error (request {rid}; details in the server log)", code="internal_error"))


api.add_middleware(Guard)


def _worker_error(ev: dict, rid: str) -> P.ApiError:
    """The model replica's error event as an answer; a server fault's own words stay in the log."""
    if ev["status"] < 500:
        return P.ApiError(ev["status"], ev["message"], param=ev.get("param"), code=ev.get("code"))
    log.error("specray: %s failed on the model replica: %s", rid, ev["message"])
    return P.ApiError(
        ev["status"], f"the model replica failed (request {rid}; details in the server log)", code=ev.get("code") or "internal_error"
    )


def _failure(e: BaseException, code: str = "generation_failed") -> tuple[int, str]:
    """(status, code) of a generation the model deployment broke off: 503 when its replica died or became unreachable
    (a lost node: Serve replaces the replica, a retry can succeed), else 500."""
    import ray.exceptions as rex

    if isinstance(e, rex.RayActorError | rex.ActorUnavailableError) or isinstance(getattr(e, "cause", None), rex.RayActorError):
        return 503, "replica_unavailable"
    return 500, code


class _Slot:
    """One admitted request; released exactly once."""

    def __init__(self, owner: "OpenAIIngress"):
        self._owner = owner
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._owner._inflight -= 1
            self._owner.metrics.inflight.set(self._owner._inflight)

    def __del__(self):  # a streaming response that never started still gives its slot back
        self.release()


class _Run:
    """One admitted generation: turns the model deployment's events into OpenAI bodies or SSE chunks."""

    def __init__(self, ingress: "OpenAIIngress", req: P.GenerationRequest, served, rid: str, prompt_tokens: int, t0: float, stream, slot):
        self.ingress, self.req, self.served, self.rid = ingress, req, served, rid
        self.prompt_tokens = prompt_tokens
        self.t0 = t0
        self.created = P.now()
        self.stream = stream
        self.slot = slot
        self.tokens = 0
        self.t_first: float | None = None
        self.finished = False
        self.failed = False
        self.closed = False

    def _tokens(self, ev: dict) -> None:
        if ev["tokens"] and self.t_first is None:
            self.t_first = time.perf_counter()
        self.tokens += ev["tokens"]

    def _finish(self, ev: dict) -> None:
        self.finished = True
        self.tokens = ev["completion_tokens"]
        self._observe(ev["stats"], cancelled=False)

    def _observe(self, stats: dict | None, cancelled: bool) -> None:
        ttft = self.t_first - self.t0 if self.t_first is not None else None
        self.ingress.metrics.observe_generation(
            self.served.name,
            self.served.config.method,
            self.prompt_tokens,
            self.tokens,
            ttft,
            time.perf_counter() - self.t0,
            stats,
            cancelled=cancelled,
        )

    def _stats(self, ev: dict) -> dict:
        s = dict(ev["stats"])
        s["model"] = self.served.name
        s["kind"] = self.served.kind
        s["registry_version"] = self.served.version
        s["time_to_first_token_s"] = self.t_first - self.t0 if self.t_first is not None else None
        s["request_s"] = time.perf_counter() - self.t0
        return s

    async def collect(self):
        parts = []
        try:
            async for ev in self.stream:
                if ev["type"] == "delta":
                    self._tokens(ev)
                    parts.append(ev["text"])
                elif ev["type"] == "error":
                    self.failed = True
                    return _worker_error(ev, self.rid)
                elif ev["type"] == "end":
                    self._finish(ev)
                    use = P.usage(self.prompt_tokens, self.tokens)
                    build = P.chat_response if self.req.endpoint == "chat" else P.completion_response
                    return build(self.rid, self.served.name, self.created, "".join(parts), ev["finish_reason"], use, self._stats(ev))
        except Exception as e:  # the model replica died or failed mid-generation
            self.failed = True
            log.error("specray: %s broke mid-generation", self.rid, exc_info=e)
            status, code = _failure(e)
            return P.ApiError(status, f"the generation failed (request {self.rid}; details in the server log)", code=code)
        self.failed = True
        return P.ApiError(500, "the model deployment ended the stream early", code="internal_error")

    def _chunk(self, text: str | None, finish: str | None = None, role: bool = False, **extra):
        if self.req.endpoint == "chat":
            delta = P.ChatDelta(role="assistant" if role else None, content=text)
            return P.chat_chunk(self.rid, self.served.name, self.created, delta, finish, **extra)
        return P.completion_chunk(self.rid, self.served.name, self.created, text or "", finish, **extra)

    async def sse(self):
        status = 200
        try:
            if self.req.endpoint == "chat":
                yield P.sse(self._chunk("", role=True))
            try:
                async for ev in self.stream:
                    if ev["type"] == "delta":
                        self._tokens(ev)
                        if ev["text"]:
                            yield P.sse(self._chunk(ev["text"]))
                    elif ev["type"] == "error":
                        self.failed, status = True, ev["status"]
                        yield P.sse(_worker_error(ev, self.rid).body())
                        break
                    elif ev["type"] == "end":
                        self._finish(ev)
                        use = P.usage(self.prompt_tokens, self.tokens)
                        stats = self._stats(ev)
                        yield P.sse(self._chunk(None if self.req.endpoint == "chat" else "", ev["finish_reason"], usage=use, specray=stats))
                        if self.req.include_usage:
                            yield P.sse(P.usage_chunk(self.rid, self.served.name, self.created, self.req.endpoint, use, stats))
                        break
            except Exception as e:  # the model replica died or failed mid-generation: say so in the stream
                (status, code), self.failed = _failure(e), True
                log.error("specray: %s broke mid-stream", self.rid, exc_info=e)
                yield P.sse(P.ApiError(status, f"the generation failed (request {self.rid}; details in the server log)", code=code).body())
            yield P.DONE
        finally:
            if not self.finished and not self.failed:  # the client went away: stop the generation
                status = 499
                self._observe(None, cancelled=True)
            self.ingress.metrics.observe_request(self.served.name, self.req.endpoint, status)
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if not self.finished:
                self.stream.cancel()
            self.slot.release()


@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, model: DeploymentHandle, settings: dict, placed: dict | None = None):
        keep_replica_grpc_on_loopback()
        self.settings = ServeSettings.from_dict(settings)
        Guard.configure(self.settings)
        self.model = model
        self.placed = dict(placed or {})  # entry name -> {"config": its config JSON at deploy time, "handle"} (serving.placed_worker)
        self.metrics = ServingMetrics()
        self.catalog = Catalog(
            self.settings.registry,
            base_model=self.settings.base_model,
            dtype=self.settings.dtype,
            refresh_s=self.settings.registry_refresh_s,
            watch=self.settings.watch_registry,
        )
        self._inflight = 0

    # ---- admission --------------------------------------------------------
    def _admit(self) -> _Slot:
        if self._inflight >= self.settings.max_queued_requests:
            self.metrics.rejected.inc()
            raise P.ApiError(
                429,
                f"the server is at its limit of {self.settings.max_queued_requests} queued requests; retry later",
                code="queue_full",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            )
        self._inflight += 1
        self.metrics.inflight.set(self._inflight)
        return _Slot(self)

    # ---- routes -------------------------------------------------------------
    @api.post("/v1/completions", response_model=P.CompletionResponse, responses=P.ERROR_RESPONSES)
    async def completions(self, body: P.CompletionRequest):
        return await self._generate(body.to_request())

    @api.post("/v1/chat/completions", response_model=P.ChatCompletionResponse, responses=P.ERROR_RESPONSES)
    async def chat_completions(self, body: P.ChatCompletionRequest):
        return await self._generate(body.to_request())

    @api.get("/v1/models")
    async def list_models(self):
        await asyncio.to_thread(self.catalog.refresh)
        data = [m.describe() for m in self.catalog.models()]
        return {"object": "list", "data": data}

    @api.get("/v1/models/{name:path}")
    async def get_model(self, name: str):
        try:
            m = await asyncio.to_thread(self.catalog.resolve, name)
        except ModelNotFound as e:
            return error_response(P.ApiError(404, str(e), param="model", code="model_not_found"))
        return m.describe()

    @api.get("/health")
    async def health(self):
        deployments, app_status, problems = {}, None, []
        try:
            app_name = serve.get_replica_context().app_name
            status = await asyncio.to_thread(serve.status)
            app = status.applications.get(app_name)
            if app is not None:
                app_status = str(getattr(app.status, "value", app.status))
                for dname, d in app.deployments.items():
                    states = {str(getattr(k, "value", k)): v for k, v in (d.replica_states or {}).items()}
                    st = str(getattr(d.status, "value", d.status))
                    deployments[dname] = {"status": st, "replica_states": states, "running_replicas": states.get("RUNNING", 0)}
                    if d.message:
                        deployments[dname]["message"] = d.message
                    if st not in HEALTHY_STATES:
                        problems.append(f"deployment {dname} is {st}")
                    elif not states.get("RUNNING"):
                        problems.append(f"deployment {dname} has no running replica ({states or 'none'})")
        except Exception as e:
            problems.append(f"serve status unavailable: {e}")
        await asyncio.to_thread(self.catalog.refresh_if_stale)
        corrupt = [{"name": n, "error": why} for n, why in sorted(self.catalog.corrupt.items())]
        if self.catalog.error:
            problems.append(f"registry: {self.catalog.error}")
        body = {
            "status": "ok" if not problems else "degraded",
            "problems": problems,
            "application": app_status,
            "deployments": deployments,
            "registry": {
                "location": self.catalog.registry.location,
                "served": [m.name for m in self.catalog.models()],
                "corrupt": corrupt,
                "error": self.catalog.error,
            },
            "ingress": {"inflight": self._inflight, "max_queued_requests": self.settings.max_queued_requests},
        }
        return JSONResponse(body, status_code=200 if not problems else 503)

    @api.get("/metrics")
    async def metrics(self):
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def _ask_worker(self, method: str, *args):
        """A model replica's answer; these calls queue behind generations (max_ongoing_requests), so bound the wait."""
        response = getattr(self.model, method).remote(*args)
        try:
            return await asyncio.wait_for(response, timeout=WORKER_QUERY_TIMEOUT_S)
        except TimeoutError:
            response.cancel()
            raise P.ApiError(503, f"the model replica did not answer within {WORKER_QUERY_TIMEOUT_S}s (busy)", code="busy") from None

    @api.get("/v1/specray/stats")
    async def specray_stats(self):
        ingress = {"inflight": self._inflight, "max_queued_requests": self.settings.max_queued_requests}
        try:
            worker = await self._ask_worker("stats")
        except P.ApiError as e:
            worker = {"error": e.message}
        return {"ingress": ingress, "worker": worker}

    @api.get("/v1/specray/requests/{request_id}")
    async def specray_request(self, request_id: str):
        try:
            rec = await self._ask_worker("request_record", request_id)
        except P.ApiError as e:
            return error_response(e)
        if rec is None:
            return error_response(P.ApiError(404, f"no record of request {request_id!r} on the replica that answered", code="not_found"))
        return rec

    def _handle_for(self, served) -> DeploymentHandle:
        """An actor entry's own deployment while the entry is what was deployed; the model replica otherwise."""
        placed = self.placed.get(served.name)
        if placed is not None and placed["config"] == served.config.to_json():
            return placed["handle"]
        return self.model

    # ---- generation -----------------------------------------------------------
    async def _generate(self, req: P.GenerationRequest):
        """A validated request: resolve its model, admit it, and answer (in one body or as server-sent events)."""
        t0 = time.perf_counter()
        try:
            try:
                served = self.catalog.lookup(req.model)
                if served is None:
                    served = await asyncio.to_thread(self.catalog.resolve, req.model)
                else:
                    await asyncio.to_thread(self.catalog.refresh_if_stale)
                    served = self.catalog.lookup(req.model) or served
            except ModelNotFound as e:
                raise P.ApiError(404, str(e), param="model", code="model_not_found") from None
            slot = self._admit()
        except P.ApiError as e:
            self.metrics.observe_request(req.model if e.status != 404 else "unknown", req.endpoint, e.status)
            return error_response(e)

        try:
            return await self._admitted(req, served, slot, t0)
        except BaseException:
            slot.release()
            raise

    async def _admitted(self, req: P.GenerationRequest, served, slot: _Slot, t0: float):
        endpoint = req.endpoint
        self.metrics.describe_model(served.name, served.config.method, served.config.model, served.version, served.metrics.get("speedup"))
        rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        work = {**req.to_worker(), "request_id": rid, "model": served.name, "config": served.config.to_dict()}
        stream = self._handle_for(served).options(stream=True).stream.remote(work)
        try:
            first = await stream.__anext__()
        except (Exception, StopAsyncIteration) as e:
            stream.cancel()
            slot.release()
            log.error("specray: %s failed before its first event", rid, exc_info=e)
            status, code = _failure(e, "internal_error")
            self.metrics.observe_request(served.name, endpoint, status)
            return error_response(P.ApiError(status, f"the model deployment failed (request {rid}; details in the server log)", code=code))
        except BaseException:  # cancelled: the client went away while waiting
            stream.cancel()
            raise
        if first["type"] == "error":
            slot.release()
            err = _worker_error(first, rid)
            self.metrics.observe_request(served.name, endpoint, err.status)
            return error_response(err)

        run = _Run(self, req, served, rid, first["prompt_tokens"], t0, stream, slot)
        if req.stream:
            headers = {"X-Specray-Request-Id": rid, "Cache-Control": "no-cache"}
            return StreamingResponse(run.sse(), media_type="text/event-stream", headers=headers)
        try:
            out = await run.collect()
        finally:
            run.close()
        status = 500 if isinstance(out, P.ApiError) else 200
        self.metrics.observe_request(served.name, endpoint, status)
        if isinstance(out, P.ApiError):
            return error_response(out)
        return Response(out.model_dump_json(), media_type="application/json", headers={"X-Specray-Request-Id": rid})
