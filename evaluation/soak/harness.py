"""The soak: the load and the faults against the endpoints (the Serve app on a :class:`SoakCluster`, its registry
on a :class:`RedisServer`), run on one asyncio loop with ``httpx`` while a :class:`ProcessSampler` samples every
process.

The load is Poisson arrivals plus a concurrency floor, under a ceiling; streamed and plain completions and chat;
greedy and seeded sampling; every served model, an actor entry included. The faults (:data:`FAULTS`) come at set
times (``evaluation.soak.faults``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import queue
import random
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from evaluation.soak.answers import ERROR, OK, VIOLATIONS, RequestRecord, Verdict, classify_plain, classify_stream, has_content, path_of
from evaluation.soak.faults import FaultInjection
from evaluation.soak.plan import FaultRecord, Mix, SoakPlan, log
from evaluation.soak.processes import ProcessSampler
from evaluation.soak.services import RedisServer, SoakCluster


# ---- the soak ------------------------------------------------------------------------------------------------
class Soak(FaultInjection):
    """The load and the faults against ``base_url`` (the Serve app on ``cluster``), with ``redis`` holding its registry.

    ``engine`` and ``placed``: the model names served by the engine replica and by actor entries; ``expected(record)``
    gives a greedy request's float32 alone answer (None: not checked); ``publish(name) -> argv`` the command line of
    a publish into the registry (the redis_restart fault runs it as a subprocess)."""

    def __init__(
        self,
        base_url: str,
        plan: SoakPlan,
        mix: Mix,
        prompts: list[str],
        cluster: SoakCluster | None,
        redis: RedisServer | None,
        engine: list[str],
        placed: list[str],
        expected: Callable[[RequestRecord], str | None] | None = None,
        publish: Callable[[str, Path], list[str]] | None = None,
        workdir: Path | None = None,
    ):
        self.url, self.plan, self.mix, self.prompts = base_url.rstrip("/"), plan, mix, prompts
        self.cluster, self.redis = cluster, redis
        self.engine, self.placed = list(engine), list(placed)
        self.expected, self.publish = expected, publish
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="specray-soak-"))
        self.rng = random.Random(plan.seed)
        self.records: list[RequestRecord] = []
        self.faults: list[FaultRecord] = []
        self.where: dict = {}  # the actor entry's latest placement: role -> {node_id, pid, ...}
        self.arrivals_over_ceiling = 0
        self._t0 = time.monotonic()
        self.wall_start = time.time()
        self.sampler = ProcessSampler(self.clock, plan.sample_s)
        self._load_inflight = 0
        self._placed_inflight = 0
        self._wake: asyncio.Event | None = None
        self._calls: queue.Queue = queue.Queue()
        self.stopping = False
        self.drain: dict = {}

    def clock(self) -> float:
        return time.monotonic() - self._t0

    # ---- requests ---------------------------------------------------------------------------------------
    def _new(self, kind: str, **fixed) -> RequestRecord:
        m = self.mix
        names = list(m.models)
        weights = [m.models[n] for n in names]
        if self._placed_inflight >= m.placed_max_inflight * max(1, len(self.placed)) or kind != "load":
            keep = [i for i, n in enumerate(names) if n not in self.placed]
            names, weights = [names[i] for i in keep], [weights[i] for i in keep]
        model = fixed.pop("model", None) or self.rng.choices(names, weights)[0]
        sampled = self.rng.random() < m.sampled_share
        prompt_idx = self.rng.randrange(len(self.prompts))
        rec = RequestRecord(
            idx=len(self.records),
            kind=kind,
            model=model,
            endpoint="chat" if self.rng.random() < m.chat_share else "completions",
            stream=self.rng.random() < m.stream_share,
            temperature=m.temperature if sampled else 0.0,
            seed=1000 + prompt_idx if sampled else None,
            max_tokens=self.rng.choice(m.max_tokens),
            prompt_idx=prompt_idx,
            timeout_s=self.plan.request_timeout_s,
        )
        for k, v in fixed.items():
            setattr(rec, k, v)
        self.records.append(rec)
        return rec

    async def send(self, client, rec: RequestRecord) -> RequestRecord:
        import httpx

        placed = rec.model in self.placed
        self._placed_inflight += placed
        rec.t_start = self.clock()
        body = rec.body(self.prompts[rec.prompt_idx], self.mix.top_p)
        try:
            async with asyncio.timeout(rec.timeout_s):
                if rec.stream:
                    async with client.stream("POST", self.url + path_of(rec.endpoint), json=body) as r:
                        if r.status_code != 200 or "text/event-stream" not in r.headers.get("content-type", ""):
                            verdict = classify_plain(r.status_code, r.headers, await r.aread(), rec.endpoint)
                        else:
                            events = []
                            async for line in r.aiter_lines():
                                if line.startswith("data:"):
                                    events.append(line[5:].strip())
                                    if rec.t_first is None and has_content(line):
                                        rec.t_first = self.clock()
                            verdict = classify_stream(r.status_code, r.headers, events, rec.endpoint)
                else:
                    r = await client.post(self.url + path_of(rec.endpoint), json=body)
                    rec.t_first = self.clock()
                    verdict = classify_plain(r.status_code, r.headers, r.content, rec.endpoint)
        except TimeoutError:
            verdict = Verdict("hung", f"no end within its timeout of {rec.timeout_s:.0f}s")
        except httpx.TimeoutException as e:
            verdict = Verdict("hung", f"{type(e).__name__} past the client's timeout")
        except httpx.HTTPError as e:
            verdict = Verdict("lost", f"{type(e).__name__}: {str(e)[:160]}")
        rec.t_end = self.clock()
        rec.apply(verdict)
        self._placed_inflight -= placed
        if verdict.where:
            self.where = verdict.where
            for role in ("target", "draft"):
                pid = (verdict.where.get(role) or {}).get("pid")
                if pid:
                    self.sampler.roles[pid] = f"model worker ({role})"
        self._check(rec)
        return rec

    def _check(self, rec: RequestRecord) -> None:
        if rec.outcome != OK or rec.temperature > 0 or self.expected is None:
            return
        want = self.expected(rec)
        if want is None:
            return
        rec.check = "match" if rec.text == want else "mismatch"
        if rec.check == "mismatch":
            rec.outcome = "wrong_output"
            at = next(
                (i for i, (a, b) in enumerate(zip(rec.text or "", want, strict=False)) if a != b), min(len(rec.text or ""), len(want))
            )
            rec.detail = (
                f"differs from the float32 alone answer at character {at}: {(rec.text or '')[at : at + 30]!r} vs {want[at : at + 30]!r}"
            )

    # ---- the load ---------------------------------------------------------------------------------------
    async def _load_one(self, client, rec: RequestRecord) -> None:
        try:
            await self.send(client, rec)
        finally:
            self._load_inflight -= 1
            if self._wake is not None:
                self._wake.set()

    async def steady(self, client, until: float, tasks: set) -> None:
        """Poisson arrivals at ``plan.rate`` plus the floor of ``min_streams`` in flight, under ``max_streams``
        (an arrival that finds the ceiling is counted and dropped)."""
        p = self.plan
        self._wake = asyncio.Event()
        next_arrival = self.clock() + (self.rng.expovariate(p.rate) if p.rate > 0 else math.inf)
        while self.clock() < until and not self.stopping:
            now = self.clock()
            start = self._load_inflight < p.min_streams
            if not start and now >= next_arrival:
                next_arrival += self.rng.expovariate(p.rate)
                if self._load_inflight < p.max_streams:
                    start = True
                else:
                    self.arrivals_over_ceiling += 1
            if start:
                self._load_inflight += 1  # counted now: the task starts at the next await
                t = asyncio.create_task(self._load_one(client, self._new("load")))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                await asyncio.sleep(0)
                continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=max(0.01, min(next_arrival, until) - self.clock()))
            except TimeoutError:
                pass

    # ---- the run ------------------------------------------------------------------------------------------
    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(self.plan.progress_s)
            done = [r for r in self.records if r.t_end is not None]
            oks = [r for r in done if r.outcome == OK]
            bad = [r for r in done if r.outcome in VIOLATIONS]
            recent = [r for r in oks if r.t_end > self.clock() - self.plan.progress_s]
            toks = sum(r.tokens or 0 for r in recent) / self.plan.progress_s
            log(
                f"soak: t={self.clock():6.0f}s/{self.plan.duration_s:.0f}s in flight {self._load_inflight:2d}, done {len(done)} "
                f"(ok {len(oks)}, clean errors {sum(r.outcome == ERROR for r in done)}, violations {len(bad)}), {toks:.1f} tok/s"
                + (f"; last violation: {bad[-1].outcome} {bad[-1].detail[:100]}" if bad else "")
            )

    async def _run(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        timeout = httpx.Timeout(self.plan.request_timeout_s, connect=30)
        tasks: set = set()
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            progress = asyncio.create_task(self._progress())
            chaos = asyncio.create_task(self.chaos(client, tasks))
            try:
                await self.steady(client, self.plan.duration_s, tasks)
                log(f"soak: t={self.clock():.0f}s load stopped; waiting for {len(tasks)} request(s) in flight")
                if tasks:
                    await asyncio.wait(set(tasks))
                await chaos
            finally:
                progress.cancel()
                chaos.cancel()
            self.drain = await self._drained(client)

    async def _drained(self, client, limit_s: float = 30.0) -> dict:
        """Once every client is done: nothing left in flight on the ingress or generating on the engine replica."""
        deadline, last = self.clock() + limit_s, {}
        while self.clock() < deadline:
            try:
                doc = (await client.get(self.url + "/v1/specray/stats", timeout=15)).json()
                worker = doc.get("worker") or {}
                engines = worker.get("engines") or {}
                last = {
                    "ingress_inflight": (doc.get("ingress") or {}).get("inflight"),
                    "active_generations": worker.get("active_generations"),
                    "rows": sum(e.get("rows", 0) for e in engines.values()),
                    "waiting": sum(e.get("waiting", 0) for e in engines.values()),
                    "engine_restarts": sum(e.get("restarts", 0) for e in engines.values()),
                }
                if not any(last[k] for k in ("ingress_inflight", "active_generations", "rows", "waiting")):
                    return {**last, "drained": True}
            except Exception as e:  # noqa: BLE001 - asked again until the deadline
                last = {"error": f"{type(e).__name__}: {e}"}
            await asyncio.sleep(1)
        return {**last, "drained": False}

    def run(self) -> Soak:
        """The load and the faults on an event loop in a thread of their own; this (main) thread runs what Ray allows
        only there (adding a node registers signal handlers) when the faults ask (:meth:`on_main`). Ctrl-C stops the
        load early: the requests in flight still end and are reported."""
        self._t0 = time.monotonic()
        self.wall_start = time.time()
        self.sampler.start()
        failure: list[BaseException] = []

        def loop() -> None:
            try:
                asyncio.run(self._run())
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                failure.append(e)
            finally:
                self._calls.put(None)

        thread = threading.Thread(target=loop, name="soak-load", daemon=True)
        thread.start()
        try:
            while True:
                try:
                    call = self._calls.get(timeout=0.5)
                except queue.Empty:
                    continue
                except KeyboardInterrupt:
                    log("soak: interrupted; stopping the load, the requests in flight still end")
                    self.stopping = True
                    continue
                if call is None:
                    break
                fn, args, fut = call
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to the coroutine that asked
                    fut.set_exception(e)
            thread.join()
        finally:
            self.sampler.sample()
            self.sampler.stop()
        if failure:
            raise failure[0]
        self._check_seeded()
        return self

    async def on_main(self, fn, *args):
        """Run ``fn(*args)`` in the main thread (see :meth:`run`) and wait for it without blocking the load."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, args, fut))
        return await asyncio.wrap_future(fut)

    def _check_seeded(self) -> None:
        """Seeded requests asked the same way (model, endpoint, prompt, seed, max_tokens) must answer the same text:
        the most common answer of each group is taken as right, and every other is a wrong output."""
        groups: dict[tuple, list[RequestRecord]] = {}
        for r in self.records:
            if r.outcome == OK and r.temperature > 0 and r.seed is not None:
                groups.setdefault((r.model, r.endpoint, r.prompt_idx, r.seed, r.max_tokens), []).append(r)
        for rs in groups.values():
            if len(rs) < 2:
                continue
            texts = [r.text for r in rs]
            common = max(set(texts), key=texts.count)
            for r in rs:
                r.check = "consistent" if r.text == common else "inconsistent"
                if r.text != common:
                    r.outcome = "wrong_output"
                    r.detail = f"a seeded answer differs from {texts.count(common)} other(s) of the same request"
