"""The model side of serving: SpecDecoders per configuration, generation in threads, streamed events.

``ModelWorker`` is a plain class (``serving.app`` wraps it in ``serve.deployment``).
One replica hosts a decoder per configuration, loaded on first use and kept
in an LRU; model weights are shared between configurations of the same model
and dtype (``decoding.model.models`` caches loads per process).

A request is a dict (``GenerationRequest.to_worker()`` plus ``request_id``,
``model`` and ``config``); :meth:`ModelWorker.stream` yields events:

- ``{"type": "start", "prompt_tokens", "max_tokens"}`` once the prompt is encoded and fits;
- ``{"type": "delta", "text", "tokens"}`` as steps commit tokens (several steps coalesce
  when the consumer is slower than the model);
- ``{"type": "end", "finish_reason", "completion_tokens", "stats"}``;
- ``{"type": "error", "status", "message", "param", "code"}`` instead of any of them.

Generation is batched: a replica runs one :class:`serving.batching.EngineLoop`
per model and dtype, a thread that steps one ``decoding.loop.loop.Batch`` whose rows
are the in-flight requests, whatever their configuration's drafter. A request
becomes a ``Sequence`` with its own drafter, sampling and seeded generator;
its ``on_step`` callback hands tokens to the event loop with
``call_soon_threadsafe`` and ends the row (returns a finish reason) at a stop
sequence or once the consumer is gone. Drafters that decode one sequence at a
time (TriForce in process) run alone in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import kernels
from actors.devices import placed
from decoding.config import SpecConfig
from decoding.errors import ConfigError
from decoding.loop.loop import PREFILL_CHUNK
from decoding.methods import METHOD_TABLE, runs_on_actors
from serving.batching import EngineFailed, EngineLoop, run_alone
from serving.protocol import prompt_surely_exceeds
from serving.textstream import TextAssembler

log = logging.getLogger("ray.serve")


def encode_chat(tokenizer, messages: list[dict]):
    """Ids [1, T] of a conversation with the generation prompt (``decoding.engine.encode_chat``)."""
    from decoding.engine import encode_chat as chat_ids

    return chat_ids(tokenizer, messages, field="messages", hint="; use /v1/completions")


class ModelWorker:
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
        self.max_batch_rows, self.max_step_tokens, self.adaptive_k = max_batch_rows, max_step_tokens, adaptive_k
        self.max_prefill_tokens = max_prefill_tokens
        self._engines: dict[tuple[str, str], EngineLoop] = {}
        self._engine_lock = threading.Lock()
        self.max_loaded = max_loaded_configs
        self._decoders: OrderedDict[str, object] = OrderedDict()
        self._load_locks: dict[str, asyncio.Lock] = {}
        self._pool = ThreadPoolExecutor(max_workers=max_ongoing_requests, thread_name_prefix="specray-gen")
        self._records: OrderedDict[str, dict] = OrderedDict()
        self._log_size = request_log_size
        self._lock = threading.Lock()
        self.active = 0
        self.totals = {"completed": 0, "cancelled": 0, "stopped": 0, "error": 0, "tokens": 0}
        for cfg in preload or []:
            self._load_sync(SpecConfig.from_dict(cfg))

    # ---- decoders ---------------------------------------------------------
    def _load_sync(self, cfg: SpecConfig):
        from decoding.engine import SpecDecoder

        key = cfg.to_json()
        if key not in self._decoders:
            t0 = time.perf_counter()
            self._decoders[key] = SpecDecoder(placed(cfg))  # device=auto: the replica's GPU (model_num_gpus), else CPU
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

    # ---- bookkeeping ------------------------------------------------------
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

    def stats(self) -> dict:
        with self._lock:
            out = {"active_generations": self.active, "totals": dict(self.totals), "loaded": self.loaded_configs()}
        out["engines"] = {f"{m}/{d}": e.stats() for (m, d), e in list(self._engines.items())}
        return out

    # ---- generation -------------------------------------------------------
    def _engine(self, dec) -> EngineLoop:
        """The batch of this decoder's model and dtype (started on first use; k=auto needs its cost model)."""
        key = (dec.cfg.model, dec.cfg.dtype)
        with self._engine_lock:
            engine = self._engines.get(key)
            if engine is None or not engine.alive:
                engine = EngineLoop(
                    dec.target,
                    f"{key[0]}/{key[1]}",
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

    def served_config(self, cfg: SpecConfig, seeded_sampling: bool = False) -> SpecConfig:
        """Served entries draft k=auto (the goodput choice, capped at the entry's k) unless the settings say otherwise;
        trees and methods that keep a fixed schedule (pearl, triforce) keep their k. So does a sampled request with a
        seed: under k=auto its draft lengths follow the load, and so would its tokens (same distribution, other
        draws); with the entry's k the same seed gives the same text whatever else the replica is doing."""
        if seeded_sampling:
            return cfg
        if self.adaptive_k and not cfg.adaptive_k and METHOD_TABLE[cfg.method].serves_auto_k and cfg.tree == "chain":
            return cfg.replace(adaptive_k=True)
        return cfg

    async def stream(self, req: dict):
        """Async generator of events for one request (see the module docstring)."""
        rid = req.get("request_id", "?")
        t_arrive = time.perf_counter()
        try:
            entry = SpecConfig.from_dict(req["config"])
            temperature = entry.temperature if req.get("temperature") is None else req["temperature"]
            cfg = self.served_config(entry, seeded_sampling=req.get("seed") is not None and temperature > 0)
            dec = await self._decoder(cfg)
        except ConfigError as e:
            yield {"type": "error", "status": 400, "message": f"model {req.get('model')!r} cannot be served: {e}", "param": "model"}
            return
        except Exception as e:  # a broken model directory, out of memory, ...
            log.exception("specray: loading %s failed", req.get("model"))
            yield {
                "type": "error",
                "status": 500,
                "message": f"loading model {req.get('model')!r} failed: {e}",
                "code": "model_load_failed",
            }
            return
        load_s = time.perf_counter() - t_arrive

        param = "messages" if req.get("messages") is not None else "prompt"
        context = dec.loaded.max_context
        chars = sum(len(m["content"]) for m in req["messages"]) if param == "messages" else len(req["prompt"])
        if prompt_surely_exceeds(dec.tokenizer, chars, context):  # refuse before tokenizing a huge text
            yield {
                "type": "error",
                "status": 400,
                "message": f"the prompt ({chars} characters) cannot fit the model's context of {context} tokens",
                "param": param,
                "code": "context_length_exceeded",
            }
            return
        try:
            if param == "messages":
                prompt_ids = encode_chat(dec.tokenizer, req["messages"])
            else:
                prompt_ids = dec.encode(req["prompt"], chat=False)
        except ConfigError as e:
            yield {"type": "error", "status": 400, "message": str(e), "param": param}
            return
        except Exception as e:  # the tokenizer refused the text (e.g. a lone surrogate): the request's fault
            log.warning("specray: %s: the tokenizer refused the %s: %s", rid, param, e)
            yield {"type": "error", "status": 400, "message": f"'{param}' cannot be tokenized", "param": param, "code": "invalid_value"}
            return
        prompt_len = int(prompt_ids.shape[1])
        max_tokens = req.get("max_tokens")
        if max_tokens is None:
            max_tokens = min(cfg.max_new_tokens, context - prompt_len)
            if max_tokens < 1:
                yield {
                    "type": "error",
                    "status": 400,
                    "message": f"the prompt ({prompt_len} tokens) fills the model's context of {context} tokens",
                    "param": "messages" if req.get("messages") else "prompt",
                    "code": "context_length_exceeded",
                }
                return
        elif prompt_len + max_tokens > context:
            yield {
                "type": "error",
                "status": 400,
                "message": f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's context of {context} tokens",
                "param": "max_tokens",
                "code": "context_length_exceeded",
            }
            return

        # a per-request view of the decoder: same weights and tokenizer, its own drafter and sampling
        temperature = cfg.temperature if req.get("temperature") is None else req["temperature"]
        top_p = cfg.top_p if req.get("top_p") is None else req["top_p"]
        top_k = cfg.top_k if req.get("top_k") is None else req["top_k"]
        sampling = (temperature, top_p, top_k)
        same = sampling == (cfg.temperature, cfg.top_p, cfg.top_k)
        view = dec if same else dec.fork(temperature=temperature, top_p=top_p, top_k=top_k)

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        assembler = TextAssembler(dec.decode, req.get("stop") or [])
        progress = {"tokens": 0, "steps": 0, "first_token_s": None}
        t_start = time.perf_counter()

        def on_step(new_ids: list[int]) -> str | None:  # runs in the engine thread
            if cancel.is_set():
                return "cancelled"
            progress["tokens"] += len(new_ids)
            progress["steps"] += 1
            if progress["first_token_s"] is None:
                progress["first_token_s"] = time.perf_counter() - t_start
            text = assembler.feed(new_ids)
            loop.call_soon_threadsafe(queue.put_nowait, ("delta", text, len(new_ids)))
            return "stopped" if assembler.stopped else None

        def done(seq, error: Exception | None) -> None:  # runs in the engine (or the alone) thread
            outcome = {"stopped": "stopped", "cancelled": "cancelled", "error": "error"}.get(seq.finish_reason, "completed")
            if error is not None:
                outcome = "error"
                if isinstance(error, EngineFailed):
                    err = (503, str(error))
                elif isinstance(error, ConfigError | ValueError):
                    err = (400, str(error))
                else:
                    err = (500, f"generation failed: {type(error).__name__}: {error}")
            else:
                err = None
            ended.set()
            wall = time.perf_counter() - t_start
            with self._lock:
                self.active -= 1
                self.totals[outcome] += 1
                self.totals["tokens"] += progress["tokens"]
            self._record(rid, state=outcome, tokens=progress["tokens"], steps=progress["steps"], wall_s=wall, finished=time.time())
            loop.call_soon_threadsafe(queue.put_nowait, ("end", outcome, seq, err, wall))

        try:
            seq = view.sequence(prompt_ids, max_new_tokens=max_tokens, seed=req.get("seed"), on_step=on_step, tag=rid)
        except ConfigError as e:
            yield {"type": "error", "status": 400, "message": str(e), "param": "model"}
            return
        yield {"type": "start", "prompt_tokens": prompt_len, "max_tokens": max_tokens}
        with self._lock:
            self.active += 1
        self._record(rid, model=req.get("model"), state="running", tokens=0, max_tokens=max_tokens, started=time.time())
        ended = threading.Event()
        if seq.drafter.batchable:
            self._engine(dec).submit(seq, done)
        else:

            def alone() -> None:
                try:
                    run_alone(dec.target, seq)
                except Exception as e:
                    log.exception("specray: generation %s failed", rid)
                    done(seq, e)
                    return
                done(seq, None)

            loop.run_in_executor(self._pool, alone)
        try:
            while True:
                item = await queue.get()
                if item[0] == "delta":
                    text, ntok = item[1], item[2]
                    while not queue.empty():  # coalesce the deltas that are already there
                        nxt = queue.get_nowait()
                        if nxt[0] != "delta":
                            queue.put_nowait(nxt)  # the end stays last: nothing is queued after it
                            break
                        text, ntok = text + nxt[1], ntok + nxt[2]
                    yield {"type": "delta", "text": text, "tokens": ntok}
                    continue
                _, outcome, seq, error, wall = item
                if error is not None:
                    yield {"type": "error", "status": error[0], "message": error[1], "code": "generation_failed"}
                    return
                tail = assembler.finish()
                if tail:
                    yield {"type": "delta", "text": tail, "tokens": 0}
                stats = self._stats(cfg, seq, outcome, load_s)
                finish = "stop" if outcome == "stopped" else (seq.finish_reason if seq.finish_reason in ("stop", "length") else "length")
                yield {"type": "end", "finish_reason": finish, "completion_tokens": progress["tokens"], "stats": stats}
                return
        finally:
            cancel.set()  # the consumer is gone (or done): the row ends at its next step
            if not ended.is_set():
                self._record(rid, cancel_requested=time.time())

    @staticmethod
    def _stats(cfg, seq, outcome, load_s) -> dict:
        gen = seq.result()
        s = gen.stats
        out = {
            "new_tokens": s.new_tokens,
            "wall_s": s.wall_s,
            "tokens_per_s": s.tokens_per_s,
            "prefill_s": s.prefill_s,
            "target_forwards": s.target_forwards,
            "mean_accepted_tokens": s.mean_accepted_tokens,
            "acceptance_rate": s.acceptance_rate,
            "per_position_acceptance": s.per_position_acceptance,
            "draft_s": s.draft_s,
            "verify_s": s.verify_s,
            "drafted_tokens": sum(r.drafted for r in gen.steps),
            "accepted_tokens": sum(r.accepted for r in gen.steps),
            "batch_rows_mean": sum(r.rows for r in gen.steps) / len(gen.steps) if gen.steps else 1.0,
            "k_chosen": [r.k for r in gen.steps] if cfg.adaptive_k else None,
            "adaptive_k": cfg.adaptive_k,
        }
        out["method"] = cfg.method
        if runs_on_actors(cfg.method, cfg.placement):
            out["placement"] = "local"  # served in the replica with the sequential schedule (same output, lossless)
        out["outcome"] = outcome
        out["load_s"] = load_s
        return out

    def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy (and Serve replaces it)."""
        try:
            self._pool.submit(int)  # a no-op; a shut-down pool refuses new work (its public face)
        except RuntimeError:
            raise RuntimeError("generation pool is shut down") from None
        for key, engine in list(self._engines.items()):
            if not engine.alive:
                raise RuntimeError(f"the batch engine of {key[0]}/{key[1]} stopped")
