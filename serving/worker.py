"""The model side of serving: SpecDecoders per configuration, generation in threads, streamed events.

``ModelWorker`` is a plain class (``serving.app`` wraps it in ``serve.deployment``).
One replica hosts a decoder per configuration, loaded on first use and kept
in an LRU; model weights are shared between configurations of the same model
and dtype (``decoding.models`` caches loads per process).

A request is a dict (``GenerationRequest.to_worker()`` plus ``request_id``,
``model`` and ``config``); :meth:`ModelWorker.stream` yields events:

- ``{"type": "start", "prompt_tokens", "max_tokens"}`` once the prompt is encoded and fits;
- ``{"type": "delta", "text", "tokens"}`` as steps commit tokens (several steps coalesce
  when the consumer is slower than the model);
- ``{"type": "end", "finish_reason", "completion_tokens", "stats"}``;
- ``{"type": "error", "status", "message", "param", "code"}`` instead of any of them.

Generation runs in a thread; its ``on_step`` callback hands tokens to the event
loop with ``call_soon_threadsafe`` and raises :class:`GenerationCancelled` once
the consumer is gone, which ends the decoding loop at the next step.
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
from decoding.config import ConfigError, SpecConfig
from serving.textstream import TextAssembler

log = logging.getLogger("ray.serve")


class GenerationCancelled(Exception):
    """Raised from ``on_step`` when the client went away: it aborts the decoding loop."""


class _StopSequence(Exception):
    """Raised from ``on_step`` when a stop sequence appeared."""


class CountingDrafter:
    """Delegates to a drafter and counts proposed/accepted drafts (for partial stats on stop/cancel)."""

    def __init__(self, inner):
        self.inner = inner
        self.drafted = 0
        self.accepted = 0

    def start(self, state):
        self.inner.start(state)

    def propose(self, state, k):
        p = self.inner.propose(state, k)
        self.drafted += int(p.tokens.shape[1])
        return p

    def update(self, state, num_accepted):
        self.accepted += int(num_accepted)
        self.inner.update(state, num_accepted)


def encode_chat(tokenizer, messages: list[dict]):
    """Ids [1, T] of a conversation with the generation prompt: what ``SpecDecoder.encode(chat=True)`` does,
    for any number of messages."""
    import torch

    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("messages", "this model has no chat template; use /v1/completions")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor([ids], dtype=torch.long, device="cpu")  # host ids; SpecDecoder.generate_ids moves them


class ModelWorker:
    def __init__(
        self,
        max_ongoing_requests: int = 4,
        max_loaded_configs: int = 4,
        threads: int | None = None,
        preload: list[dict] | None = None,
        request_log_size: int = 1024,
    ):
        if threads:
            import torch

            torch.set_num_threads(threads)
        kernels.install()
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
            return {"active_generations": self.active, "totals": dict(self.totals), "loaded": self.loaded_configs()}

    # ---- generation -------------------------------------------------------
    async def stream(self, req: dict):
        """Async generator of events for one request (see the module docstring)."""
        rid = req.get("request_id", "?")
        t_arrive = time.perf_counter()
        try:
            cfg = SpecConfig.from_dict(req["config"])
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

        try:
            if req.get("messages") is not None:
                prompt_ids = encode_chat(dec.tokenizer, req["messages"])
            else:
                prompt_ids = dec.encode(req["prompt"], chat=False)
        except ConfigError as e:
            yield {"type": "error", "status": 400, "message": str(e), "param": "messages" if req.get("messages") else "prompt"}
            return
        prompt_len = int(prompt_ids.shape[1])
        context = dec.loaded.max_context
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
        view = dec.fork(temperature=temperature, top_p=top_p)
        counting = CountingDrafter(view.drafter) if view.drafter is not None else None
        view.drafter = counting
        seed = req.get("seed")

        yield {"type": "start", "prompt_tokens": prompt_len, "max_tokens": max_tokens}

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        assembler = TextAssembler(dec.decode, req.get("stop") or [])
        progress = {"tokens": 0, "steps": 0, "first_token_s": None}
        t_start = time.perf_counter()

        def on_step(new_ids: list[int]) -> None:
            if cancel.is_set():
                raise GenerationCancelled()
            progress["tokens"] += len(new_ids)
            progress["steps"] += 1
            if progress["first_token_s"] is None:
                progress["first_token_s"] = time.perf_counter() - t_start
            text = assembler.feed(new_ids)
            loop.call_soon_threadsafe(queue.put_nowait, ("delta", text, len(new_ids)))
            if assembler.stopped:
                raise _StopSequence()

        def run() -> None:
            with self._lock:
                self.active += 1
            self._record(rid, model=req.get("model"), state="running", tokens=0, max_tokens=max_tokens, started=time.time())
            outcome, gen, error = "completed", None, None
            try:
                if cancel.is_set():
                    raise GenerationCancelled()
                gen = view.generate_ids(prompt_ids, max_new_tokens=max_tokens, seed=seed, on_step=on_step)
            except GenerationCancelled:
                outcome = "cancelled"
            except _StopSequence:
                outcome = "stopped"
            except ConfigError as e:
                outcome, error = "error", (400, str(e))
            except Exception as e:  # a bug or resource error: report it, keep the replica alive
                log.exception("specray: generation %s failed", rid)
                outcome, error = "error", (500, f"generation failed: {type(e).__name__}: {e}")
            wall = time.perf_counter() - t_start
            with self._lock:
                self.active -= 1
                self.totals[outcome] += 1
                self.totals["tokens"] += progress["tokens"]
            self._record(rid, state=outcome, tokens=progress["tokens"], steps=progress["steps"], wall_s=wall, finished=time.time())
            loop.call_soon_threadsafe(queue.put_nowait, ("end", outcome, gen, error, wall))

        fut = loop.run_in_executor(self._pool, run)
        try:
            while True:
                item = await queue.get()
                if item[0] == "delta":
                    text, ntok = item[1], item[2]
                    while not queue.empty() and queue._queue[0][0] == "delta":  # coalesce what is already there
                        nxt = queue.get_nowait()
                        text, ntok = text + nxt[1], ntok + nxt[2]
                    yield {"type": "delta", "text": text, "tokens": ntok}
                    continue
                _, outcome, gen, error, wall = item
                if error is not None:
                    yield {"type": "error", "status": error[0], "message": error[1], "code": "generation_failed"}
                    return
                tail = assembler.finish()
                if tail:
                    yield {"type": "delta", "text": tail, "tokens": 0}
                stats = self._stats(cfg, gen, counting, progress, wall, load_s, outcome)
                finish = "stop" if outcome == "stopped" else gen.finish_reason if gen else "length"
                yield {"type": "end", "finish_reason": finish, "completion_tokens": progress["tokens"], "stats": stats}
                return
        finally:
            cancel.set()  # the consumer is gone (or done): the next on_step raises
            if not fut.done():
                self._record(rid, cancel_requested=time.time())

    @staticmethod
    def _stats(cfg, gen, counting, progress, wall, load_s, outcome) -> dict:
        if gen is not None:
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
            }
        else:  # stopped at a stop sequence: the loop returned nothing, use what on_step saw
            steps = max(progress["steps"] - 1, 0)  # the first call is the prefill's token
            decoded = max(progress["tokens"] - 1, 0)
            out = {
                "new_tokens": progress["tokens"],
                "wall_s": wall,
                "tokens_per_s": progress["tokens"] / wall if wall > 0 else 0.0,
                "prefill_s": progress["first_token_s"] or 0.0,
                "target_forwards": steps + 1,
                "mean_accepted_tokens": decoded / steps if steps else 1.0,
                "acceptance_rate": (counting.accepted / counting.drafted) if counting and counting.drafted else 0.0,
            }
        out["drafted_tokens"] = counting.drafted if counting else 0
        out["accepted_tokens"] = counting.accepted if counting else 0
        out["method"] = cfg.method
        if cfg.method == "pearl" or cfg.placement == "actors":
            out["placement"] = "local"  # served in the replica with the sequential schedule (same output, lossless)
        out["outcome"] = outcome
        out["load_s"] = load_s
        return out

    def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy (and Serve replaces it)."""
        if self._pool._shutdown:
            raise RuntimeError("generation pool is shut down")
