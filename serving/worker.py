"""The model side of serving: one request pipeline over decoders, whatever runs them.

:class:`Worker` is the pipeline (``serving.app`` wraps its two kinds in ``serve.deployment``): a request is a dict
(``GenerationRequest.to_worker()`` plus ``request_id``, ``model`` and ``config``) and :meth:`Worker.stream` yields
events:

- ``{"type": "start", "prompt_tokens", "max_tokens"}`` once the prompt is encoded and fits;
- ``{"type": "delta", "text", "tokens"}`` as steps commit tokens (several steps coalesce
  when the consumer is slower than the model);
- ``{"type": "end", "finish_reason", "completion_tokens", "stats"}``;
- ``{"type": "error", "status", "message", "param", "code"}`` instead of any of them.

The steps: admit (the decoder of the request's configuration), tokenise and check the context, sample (a fork of
the decoder when the request's sampling differs from the entry's), pump events (a sequence of the decoder whose
``on_step`` hands tokens to the event loop with ``call_soon_threadsafe`` and ends the row, returning a finish reason,
at a stop sequence or once the consumer is gone).

:class:`ModelWorker` hosts a decoder per configuration in process, loaded on first use and kept in an LRU (weights
shared between configurations of one model and dtype: ``decoding.model.loading`` caches loads per process); it runs
one :class:`serving.batching.EngineLoop` per model and dtype, a thread that steps one batch whose rows are the
in-flight requests, whatever their drafter. Sequences that decode alone (TriForce in process) run in a thread pool.
An actor entry's replica (``serving.placed_worker.PlacedWorker``) is the same pipeline over one decoder on two workers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import kernels
from cluster.decoders import open_decoder
from decoding.config import SpecConfig
from decoding.decoder import GenerationLost
from decoding.errors import ConfigError
from decoding.loop.prefill import PREFILL_CHUNK
from decoding.methods import METHOD_TABLE
from serving.batching import EngineLoop
from serving.protocol import prompt_surely_exceeds
from serving.textstream import TextAssembler

log = logging.getLogger("ray.serve")


class _Refused(Exception):
    """A request that ends with one error event before it starts."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.event = {"type": "error", "status": status, "message": message, "param": param, "code": code}


def _failure(error: Exception) -> tuple[int, str]:
    """(status, message) of a generation that failed: 503 when the runtime lost it (a retry may succeed), 400 when the
    request could not run, else 500."""
    if isinstance(error, GenerationLost):
        return 503, str(error)
    if isinstance(error, ConfigError | ValueError):
        return 400, str(error)
    return 500, f"generation failed: {type(error).__name__}: {error}"


class Worker:
    """The request pipeline (see the module docstring); a subclass says which decoder a configuration runs on."""

    def __init__(self, alone_threads: int, request_log_size: int = 1024):
        self._pool = ThreadPoolExecutor(max_workers=alone_threads, thread_name_prefix="specray-gen")
        self._records: OrderedDict[str, dict] = OrderedDict()
        self._log_size = request_log_size
        self._lock = threading.Lock()
        self.active = 0
        self.totals = {"completed": 0, "cancelled": 0, "stopped": 0, "error": 0, "tokens": 0}

    # ---- what a kind of worker decides -------------------------------------------------------
    async def _decoder(self, cfg: SpecConfig):
        """The decoder ``cfg`` runs on."""
        raise NotImplementedError

    def _config(self, entry: SpecConfig, req: dict) -> SpecConfig:
        """The configuration a request of ``entry`` runs (the entry's own, unless a worker adjusts it)."""
        return entry

    def _submit(self, dec, seq, done) -> None:
        """Start ``seq``: alone, in the pool (a worker that batches sends batchable sequences to its batch)."""

        def alone() -> None:
            try:
                self._run(dec, seq)
            except Exception as e:
                log.exception("specray: generation %s failed", seq.tag)
                done(seq, e)
                return
            done(seq, None)

        self._pool.submit(alone)

    def _run(self, dec, seq) -> None:
        """Run ``seq`` on ``dec`` (in the pool's thread)."""
        dec.run(seq)

    def _lost(self, error: Exception) -> None:
        """A generation failed with ``error`` (a worker may act on a runtime it cannot serve with any more)."""

    def _placement(self, stats: dict) -> dict:
        """A request's ``stats["placement"]`` as this worker reports it."""
        return stats.get("placement", {})

    # ---- bookkeeping ------------------------------------------------------------------------
    def _record(self, rid: str, **fields) -> None:
        with self._lock:
            rec = self._records.setdefault(rid, {"request_id": rid})
            rec.update(fields)
            self._records.move_to_end(rid)
            while len(self._records) > self._log_size:
                self._records.popitem(last=False)

    def request_record(self, request_id: str) -> dict | None:
        with self._lock:
            rec = self._records.get(request_id)
            return dict(rec) if rec else None

    # ---- the pipeline -----------------------------------------------------------------------
    async def stream(self, req: dict):
        """Async generator of events for one request (see the module docstring)."""
        t_arrive = time.perf_counter()
        try:
            cfg, dec = await self._admit(req)
            load_s = time.perf_counter() - t_arrive
            prompt_ids, max_tokens = self._tokenize(dec, cfg, req)
            view = self._sampled(dec, cfg, req)
        except _Refused as e:
            yield e.event
            return
        async for event in self._pump(req, cfg, dec, view, prompt_ids, max_tokens, load_s):
            yield event

    async def _admit(self, req: dict):
        """(configuration, decoder) of a request; a configuration that cannot be served is a 400, a model that does
        not load a 500."""
        try:
            cfg = self._config(SpecConfig.from_dict(req["config"]), req)
            return cfg, await self._decoder(cfg)
        except ConfigError as e:
            raise _Refused(400, f"model {req.get('model')!r} cannot be served: {e}", param="model") from None
        except Exception as e:  # a broken model directory, out of memory, ...
            log.exception("specray: loading %s failed", req.get("model"))
            raise _Refused(500, f"loading model {req.get('model')!r} failed: {e}", code="model_load_failed") from None

    @staticmethod
    def _tokenize(dec, cfg: SpecConfig, req: dict):
        """(prompt ids [1, T], max new tokens): the prompt refused before tokenizing when it surely cannot fit, then
        checked against the model's context with the request's (or the entry's) max tokens."""
        param = "messages" if req.get("messages") is not None else "prompt"
        context = dec.max_context
        text = req["messages"] if param == "messages" else req["prompt"]
        chars = sum(len(m["content"]) for m in text) if param == "messages" else len(text)
        if prompt_surely_exceeds(dec.tokenizer, chars, context):  # refuse before tokenizing a huge text
            message = f"the prompt ({chars} characters) cannot fit the model's context of {context} tokens"
            raise _Refused(400, message, param, "context_length_exceeded")
        try:
            prompt_ids = dec.encode(text, chat=False)
        except ConfigError as e:
            raise _Refused(400, str(e), param) from None
        except Exception as e:  # the tokenizer refused the text (e.g. a lone surrogate): the request's fault
            log.warning("specray: %s: the tokenizer refused the %s: %s", req.get("request_id"), param, e)
            raise _Refused(400, f"'{param}' cannot be tokenized", param, "invalid_value") from None
        prompt_len = int(prompt_ids.shape[1])
        max_tokens = req.get("max_tokens")
        if max_tokens is None:
            max_tokens = min(cfg.max_new_tokens, context - prompt_len)
            if max_tokens < 1:
                message = f"the prompt ({prompt_len} tokens) fills the model's context of {context} tokens"
                raise _Refused(400, message, param, "context_length_exceeded")
        elif prompt_len + max_tokens > context:
            message = f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's context of {context} tokens"
            raise _Refused(400, message, "max_tokens", "context_length_exceeded")
        return prompt_ids, max_tokens

    @staticmethod
    def _sampled(dec, cfg: SpecConfig, req: dict):
        """The decoder with the request's sampling: a fork (same weights, its own drafter and sampling) when it
        differs from the configuration's."""
        pick = {name: getattr(cfg, name) if req.get(name) is None else req[name] for name in ("temperature", "top_p", "top_k")}
        if all(pick[name] == getattr(cfg, name) for name in pick):
            return dec
        try:
            return dec.fork(**pick)
        except ConfigError as e:
            raise _Refused(400, str(e), "model") from None

    async def _pump(self, req: dict, cfg: SpecConfig, dec, view, prompt_ids, max_tokens: int, load_s: float):
        """Start the request's sequence and turn what its steps commit into events."""
        rid = req.get("request_id", "?")
        run = _Run(asyncio.get_running_loop(), TextAssembler(dec.decode, req.get("stop") or []))
        try:
            seq = view.sequence(prompt_ids, max_new_tokens=max_tokens, seed=req.get("seed"), on_step=run.on_step, tag=rid)
        except ConfigError as e:
            yield {"type": "error", "status": 400, "message": str(e), "param": "model"}
            return
        yield {"type": "start", "prompt_tokens": int(prompt_ids.shape[1]), "max_tokens": max_tokens}
        with self._lock:
            self.active += 1
        self._record(rid, model=req.get("model"), state="running", tokens=0, max_tokens=max_tokens, started=time.time())

        def done(seq, error: Exception | None) -> None:  # in the engine's or the pool's thread
            stats = None
            if error is None:
                try:
                    stats = self._stats(cfg, view, seq, load_s)
                except Exception as e:  # the figures need a worker that is gone
                    error = e
            self._finished(rid, run, seq, error)
            run.post("end", seq, error, stats)
            if error is not None:  # after the error event is on its way: a worker may wait or exit on it
                self._lost(error)

        self._submit(view, seq, done)
        try:
            async for event in run.events():
                yield event
        finally:
            run.cancel.set()  # the consumer is gone (or done): the row ends at its next step
            if not run.ended.is_set():
                self._record(rid, cancel_requested=time.time())

    def _finished(self, rid: str, run: _Run, seq, error: Exception | None) -> None:
        outcome = "error" if error is not None else {"stopped": "stopped", "cancelled": "cancelled"}.get(seq.finish_reason, "completed")
        run.outcome = outcome
        wall = time.perf_counter() - run.t_start
        with self._lock:
            self.active -= 1
            self.totals[outcome] += 1
            self.totals["tokens"] += run.tokens
        self._record(rid, state=outcome, tokens=run.tokens, steps=run.steps, wall_s=wall, finished=time.time())

    def _stats(self, cfg: SpecConfig, dec, seq, load_s: float) -> dict:
        gen = seq.result()
        out = dec.stats(gen)
        out["placement"] = self._placement(out)
        out["drafted_tokens"] = sum(r.drafted for r in gen.steps)
        out["accepted_tokens"] = sum(r.accepted for r in gen.steps)
        out["batch_rows_mean"] = sum(r.rows for r in gen.steps) / len(gen.steps) if gen.steps else 1.0
        out["k_chosen"] = [r.k for r in gen.steps] if cfg.adaptive_k else None
        out["adaptive_k"] = cfg.adaptive_k
        out["method"] = cfg.method
        out["outcome"] = {"stopped": "stopped", "cancelled": "cancelled"}.get(seq.finish_reason, "completed")
        out["load_s"] = load_s
        return out


class _Run:
    """One running request between the thread that steps it and the event loop that streams it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, assembler: TextAssembler):
        self.loop, self.assembler = loop, assembler
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel, self.ended = threading.Event(), threading.Event()
        self.tokens = self.steps = 0
        self.outcome = "completed"
        self.t_start = time.perf_counter()

    def post(self, *item) -> None:
        if item[0] == "end":
            self.ended.set()
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def on_step(self, new_ids: list[int]) -> str | None:  # in the thread that steps the sequence
        if self.cancel.is_set():
            return "cancelled"
        self.tokens += len(new_ids)
        self.steps += 1
        self.post("delta", self.assembler.feed(new_ids), len(new_ids))
        return "stopped" if self.assembler.stopped else None

    async def events(self):
        while True:
            item = await self.queue.get()
            if item[0] == "delta":
                text, ntok = item[1], item[2]
                while not self.queue.empty():  # coalesce the deltas that are already there
                    nxt = self.queue.get_nowait()
                    if nxt[0] != "delta":
                        self.queue.put_nowait(nxt)  # the end stays last: nothing is queued after it
                        break
                    text, ntok = text + nxt[1], ntok + nxt[2]
                yield {"type": "delta", "text": text, "tokens": ntok}
                continue
            _, seq, error, stats = item
            if error is not None:
                status, message = _failure(error)
                yield {"type": "error", "status": status, "message": message, "code": "generation_failed"}
                return
            tail = self.assembler.finish()
            if tail:
                yield {"type": "delta", "text": tail, "tokens": 0}
            reason = seq.finish_reason
            finish = "stop" if self.outcome == "stopped" else (reason if reason in ("stop", "length") else "length")
            yield {"type": "end", "finish_reason": finish, "completion_tokens": self.tokens, "stats": stats}
            return


def _engine_name(cfg: SpecConfig) -> str:
    """Which batch a configuration's sequences join: one per target as run (model, dtype, weights, compiled or not).

    >>> _engine_name(SpecConfig(model="m", dtype="float32")), _engine_name(SpecConfig(model="m", quant="q4", compile=True))
    ('m/float32', 'm/bfloat16/q4/compiled')
    """
    extra = ([] if cfg.quant == "auto" else [cfg.quant]) + (["compiled"] if cfg.compile else [])
    return "/".join([cfg.model, cfg.dtype, *extra])


class ModelWorker(Worker):
    """The model replica: decoders in process per configuration (an LRU), one batch engine per model and dtype."""

    def __init__(
        self,
        max_ongoing_requests: int = 4,
        max_loaded_configs: int = 4,
        threads: int | None = None,
        preload: list[dict] | None = None,
        request_log_size: int = 1024,
        max_batch_rows: int = 32,
        max_step_tokens: int | None = None,
        adaptive_k: bool = True,
        max_prefill_tokens: int | None = PREFILL_CHUNK,
    ):
        if threads:
            import torch

            torch.set_num_threads(threads)
        kernels.install()
        super().__init__(alone_threads=max_ongoing_requests, request_log_size=request_log_size)
        self.max_batch_rows, self.max_step_tokens, self.adaptive_k = max_batch_rows, max_step_tokens, adaptive_k
        self.max_prefill_tokens = max_prefill_tokens
        self._engines: dict[str, EngineLoop] = {}
        self._engine_lock = threading.Lock()
        self.max_loaded = max_loaded_configs
        self._decoders: OrderedDict[str, object] = OrderedDict()
        self._load_locks: dict[str, asyncio.Lock] = {}
        for cfg in preload or []:
            self._load_sync(SpecConfig.from_dict(cfg))

    # ---- decoders ---------------------------------------------------------
    def _load_sync(self, cfg: SpecConfig):
        key = cfg.to_json()
        if key not in self._decoders:
            t0 = time.perf_counter()
            self._decoders[key] = open_decoder(cfg, in_process=True)  # the replica hosts the models it serves
            log.info("specray: loaded %s/%s (%s) in %.1fs", cfg.model, cfg.method, cfg.dtype, time.perf_counter() - t0)
        self._decoders.move_to_end(key)
        while len(self._decoders) > self.max_loaded:
            self._decoders.popitem(last=False)
        return self._decoders[key]

    async def _decoder(self, cfg: SpecConfig):
        key = cfg.to_json()
        if key in self._decoders:
            self._decoders.move_to_end(key)
            return self._decoders[key]
        lock = self._load_locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key not in self._decoders:
                await asyncio.get_running_loop().run_in_executor(None, self._load_sync, cfg)
            return self._decoders[key]

    def loaded_configs(self) -> list[dict]:
        return [SpecConfig.from_json(k).to_dict() for k in self._decoders]

    def stats(self) -> dict:
        with self._lock:
            out = {"active_generations": self.active, "totals": dict(self.totals), "loaded": self.loaded_configs()}
        out["engines"] = {name: e.stats() for name, e in list(self._engines.items())}
        return out

    # ---- generation -------------------------------------------------------
    def _engine(self, dec) -> EngineLoop:
        """The batch of this decoder's model and dtype (started on first use; k=auto needs its cost model)."""
        key = _engine_name(dec.cfg)
        with self._engine_lock:
            engine = self._engines.get(key)
            if engine is None or not engine.alive:
                engine = EngineLoop(
                    dec.target,
                    key,
                    max_rows=self.max_batch_rows,
                    max_step_tokens=self.max_step_tokens,
                    prefill_budget=self.max_prefill_tokens,
                )
                self._engines[key] = engine
                if self.adaptive_k:  # measured (or read from its cache file) beside the first requests, not before them

                    def measure(engine=engine):
                        try:
                            engine.set_cost(dec.cost_model(self.max_batch_rows))
                        except Exception:
                            log.exception("specray: measuring the forward cost failed; k=auto rows draft their full k")

                    threading.Thread(target=measure, name="specray-calibrate", daemon=True).start()
            return engine

    def _submit(self, dec, seq, done) -> None:
        if dec.batches(seq):
            self._engine(dec).submit(seq, done)
        else:
            super()._submit(dec, seq, done)

    def _config(self, entry: SpecConfig, req: dict) -> SpecConfig:
        """Served entries draft k=auto (the goodput choice, capped at the entry's k) unless the settings say otherwise;
        trees and methods that keep a fixed schedule (triforce) keep their k. A sampled request with a seed
        runs with the fixed k whatever the entry says (``SpecDecoder.adaptive``): the same seed gives the same text."""
        if self.adaptive_k and not entry.adaptive_k and METHOD_TABLE[entry.method].serves_auto_k and entry.tree == "chain":
            return entry.replace(adaptive_k=True)
        return entry

    def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy (and Serve replaces it)."""
        try:
            self._pool.submit(int)  # a no-op; a shut-down pool refuses new work (its public face)
        except RuntimeError:
            raise RuntimeError("generation pool is shut down") from None
        for key, engine in list(self._engines.items()):
            if not engine.alive:
                raise RuntimeError(f"the batch engine of {key} stopped")
