"""Serve an entry whose draft and target run on actors (PEARL, two-actor SpS, TriForce over actors) as it was tuned.

Such an entry gets a deployment of its own (:class:`PlacedWorker`) whose replica
reserves a placement group through Serve's ``placement_group_bundles`` /
``placement_group_strategy``: the replica in bundle 0, and its target and draft
workers (``actors.worker.ModelActor``) created inside that group, so the group
comes and goes with the replica. The layout depends on the cluster
(:func:`plan_replica` is pure, so it is tested without one):

- three nodes that can each hold one of replica, target, draft: three bundles,
  ``STRICT_SPREAD``: draft and target on different nodes, the replica on a third;
- otherwise the layout of a Tune trial (``tuning.resources``): two bundles
  ``[target, draft]`` as ``cluster.placement.plan_placement`` sizes them
  (``STRICT_SPREAD`` on two nodes, ``STRICT_PACK`` on one), the replica pinned
  to bundle 0 beside the target and asking no CPUs of its own (it tokenizes and
  waits while the workers compute). Three bundles on two nodes would leave Ray
  free to put draft and target together.

An entry the cluster cannot hold fails at deploy time (``build_app``, ``specray
serve``) with one line naming what it wants and what the cluster has.

>>> three = [{"Alive": True, "Resources": {"CPU": 1.0}} for _ in range(3)]
>>> cfg = SpecConfig(method="pearl", target_threads=1, draft_threads=1)
>>> p = plan_replica(cfg, three)
>>> p.strategy, p.bundles, p.index
('STRICT_SPREAD', [{'CPU': 1.0}, {'CPU': 1.0}, {'CPU': 1.0}], {'target': 1, 'draft': 2})
>>> p = plan_replica(cfg, [{"Alive": True, "Resources": {"CPU": 2.0}}] * 2)
>>> p.strategy, p.bundles, p.index, p.replica
('STRICT_SPREAD', [{'CPU': 1.0}, {'CPU': 1.0}], {'target': 0, 'draft': 1}, {'CPU': 0.0})
>>> plan_replica(SpecConfig(method="pearl"), [{"Alive": True, "Resources": {"CPU": 2.0}}]).bundles  # one 2-core machine
[{'CPU': 1.0}, {'CPU': 1.0}]
>>> try:
...     plan_replica(cfg.replace(num_gpus_per_model=1.0), three)
... except PlacementError as e:
...     print(str(e).split(' (on')[0])
placement: the entry wants a replica {'CPU': 1.0}, a target worker {'CPU': 1.0, 'GPU': 1.0} and a draft worker {'CPU': 1.0, 'GPU': 1.0}
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from dataclasses import asdict, dataclass

from cluster.placement import ROLES, PlacementError, _fits, _fmt, plan_placement
from decoding.config import SpecConfig
from decoding.errors import ConfigError

log = logging.getLogger("ray.serve")


def on_actors(cfg: SpecConfig) -> bool:
    """Whether ``cfg`` runs its draft and target in two Ray actors (what Tune measured it with)."""
    return cfg.method == "pearl" or cfg.placement == "actors"


@dataclass
class ReplicaPlan:
    strategy: str  # STRICT_SPREAD | STRICT_PACK
    bundles: list[dict]  # Serve's placement_group_bundles; bundle 0 holds the replica
    index: dict  # role -> the bundle its worker goes into
    workers: dict  # role -> what the worker asks of its bundle
    threads: dict  # role -> torch threads
    replica: dict  # what the replica itself asks ({"CPU": n})
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ReplicaPlan:
        return cls(**d)

    def layout(self) -> dict:
        """``cluster.placement.place_workers``' ``layout`` argument."""
        return {r: {"index": self.index[r], "bundle": self.workers[r], "threads": self.threads[r]} for r in ROLES}


def _distinct(bundles: list[dict], nodes: list[dict]) -> bool:
    """Can each bundle go to a different node? (tiny search: a handful of bundles and nodes)"""

    def place(i: int, used: set) -> bool:
        if i == len(bundles):
            return True
        return any(j not in used and _fits(bundles[i], n) and place(i + 1, used | {j}) for j, n in enumerate(nodes))

    return place(0, set())


def plan_replica(cfg: SpecConfig, nodes: list[dict], replica_cpus: float = 1.0) -> ReplicaPlan:
    """Bundles and strategy of the replica of an actor entry on ``nodes`` (``ray.nodes()`` rows); PlacementError if impossible."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    replica = {"CPU": float(replica_cpus)}
    try:
        p = plan_placement(cfg, nodes)
    except PlacementError:
        w = _wanted_workers(cfg)
        nodes_text = ", ".join(str(_fmt(n)) for n in alive) or "none alive"
        raise PlacementError(
            "placement",
            f"the entry wants a replica {replica}, a target worker {w['target']} and a draft worker {w['draft']} "
            f"(on separate nodes with STRICT_SPREAD, else one node with STRICT_PACK); the cluster has {len(alive)} node(s): {nodes_text}",
        ) from None
    w = dict(zip(ROLES, p.bundles, strict=True))
    if p.strategy == "STRICT_SPREAD" and _distinct([replica, w["target"], w["draft"]], alive):
        return ReplicaPlan(
            "STRICT_SPREAD",
            [replica, w["target"], w["draft"]],
            {"target": 1, "draft": 2},
            w,
            p.threads,
            replica,
            "replica, target and draft each on its own node",
        )
    # as a Tune trial does (tuning.resources): the replica rides in the target's bundle, asking nothing of its own
    beside = f"the replica beside the target; {p.reason}"
    return ReplicaPlan(p.strategy, [w["target"], w["draft"]], {"target": 0, "draft": 1}, w, p.threads, {"CPU": 0.0}, beside)


def _wanted_workers(cfg: SpecConfig) -> dict:
    """What each worker asks when no plan could be made (for the error message)."""
    gpus = cfg.num_gpus_per_model or 0.0
    out = {}
    for role in ROLES:
        b = {"CPU": float(getattr(cfg, f"{role}_threads") or 1)}
        if gpus:
            b["GPU"] = float(gpus)
        out[role] = b
    return out


def deployment_name(entry: str) -> str:
    """A Serve deployment name for a registry entry: ``Placed-<entry with / as ->``.

    >>> deployment_name("tiny/chat/pearl")
    'Placed-tiny-chat-pearl'
    """
    return "Placed-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", entry)


def placed_entries(catalog, replica_cpus: float) -> list[tuple[object, ReplicaPlan]]:
    """(served model, plan) of every registry entry that runs on actors, validated against the connected cluster.

    Raises ConfigError naming the entry, what it wants and what the cluster has."""
    import ray

    from cluster.runtime import connect

    wanted = [m for m in catalog.models() if m.kind == "registry" and on_actors(m.config)]
    if not wanted:
        return []
    if not ray.is_initialized():
        connect()
    nodes = ray.nodes()
    out = []
    for m in wanted:
        try:
            out.append((m, plan_replica(m.config, nodes, replica_cpus)))
        except ConfigError as e:
            why = str(e).removeprefix(f"{e.field}: ")
            raise ConfigError("registry", f"entry {m.name!r} ({m.config.method} on actors) cannot be served here: {why}") from None
    return out


def encode_prompt(tokenizer, prompt: str):
    """Ids [1, T] of a completion prompt, as the target worker encodes it (``decoding.engine.SpecDecoder.encode``)."""
    import torch

    if not prompt or not prompt.strip():
        raise ConfigError("prompt", "is empty")
    return torch.tensor([tokenizer(prompt)["input_ids"]], dtype=torch.long, device="cpu")


# ---- the replica ---------------------------------------------------------------------------------
class PlacedWorker:
    """The replica of one actor entry: an ``ActorDecoder`` over a target and a draft worker in the replica's own
    placement group. ``stream`` yields the same events as ``serving.worker.ModelWorker.stream``; generations run one
    at a time (each worker holds one cache), the others wait their turn in the replica."""

    def __init__(self, name: str, config: dict, plan: dict):
        import ray
        from ray.util import get_current_placement_group

        from cluster.placement import build_actor_decoder

        self.name = name
        self.cfg = SpecConfig.from_dict(config)
        self.plan = ReplicaPlan.from_dict(plan)
        group = get_current_placement_group()
        if group is None:
            raise RuntimeError(f"{name}: the replica has no placement group (deploy it with placement_group_bundles)")
        t0 = time.perf_counter()
        self.dec = build_actor_decoder(self.cfg, placement_group=group, layout=self.plan.layout())
        ctx = ray.get_runtime_context()
        self.dec.placement["replica"] = {
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "actor_id": ctx.get_actor_id(),
            "pid": os.getpid(),
            "device": "cpu",  # the replica tokenizes and drives; the models are on the workers
            "bundle": 0,
        }
        self.dec.placement.update(
            strategy=self.plan.strategy, bundles=self.plan.bundles, bundle_index=self.plan.index, reason=self.plan.reason
        )
        self.tokenizer = self.dec.executor.wait(self.dec.target.__ray_call__.remote(lambda actor: actor.tokenizer), "target worker")
        self.load_s = time.perf_counter() - t0
        self._turn = threading.Lock()
        self._exiting = False
        self.totals = {"completed": 0, "error": 0, "tokens": 0}
        log.info("specray: %s placed (%s) in %.1fs: %s", name, self.plan.strategy, self.load_s, self.where())

    def where(self) -> dict:
        """Where the replica and each worker run (node id and ip, device)."""
        p = self.dec.placement
        return {r: {k: p[r].get(k) for k in ("node_id", "node_ip", "device", "pid")} for r in ("replica", "target", "draft")}

    def stats(self) -> dict:
        return {"entry": self.name, "placement": self.where(), "totals": dict(self.totals)}

    def check_health(self) -> None:
        """Serve calls this periodically: a lost worker makes the replica unhealthy, and Serve replaces it (new group)."""
        from actors.driver import WorkerDied

        try:
            self.dec.executor.wait([self.dec.target.ping.remote(), self.dec.draft.ping.remote()], "workers' health check")
        except WorkerDied as e:
            self._lost(e)
            raise

    def _lost(self, err: Exception) -> None:
        """A model worker is gone for good, so this replica can serve nothing more: it exits now and Serve, seeing the
        crash, starts a replacement (a new group) at once, instead of after three failed health checks 5 s apart. The
        requests it holds end as 503s (their error events, or the ingress's answer to a lost replica)."""
        if not self._exiting:
            self._exiting = True
            log.error("specray: %s: %s; the replica exits so that Serve replaces it", self.name, str(err).splitlines()[0])
            threading.Timer(0.5, os._exit, args=(1,)).start()  # time for the error events already queued to leave

    async def stream(self, req: dict):
        from serving.textstream import TextAssembler
        from serving.worker import encode_chat

        try:  # with the replica's own copy of the target's tokenizer: no round trip to a worker that may be gone
            if req.get("messages") is not None:
                param, prompt_ids = "messages", encode_chat(self.tokenizer, req["messages"])
            else:
                param, prompt_ids = "prompt", await asyncio.to_thread(encode_prompt, self.tokenizer, req["prompt"])
        except ConfigError as e:
            yield {"type": "error", "status": 400, "message": str(e), "param": "prompt"}
            return
        context = self.dec.max_context
        prompt_len = int(prompt_ids.shape[1])
        max_tokens = req.get("max_tokens") or min(self.cfg.max_new_tokens, context - prompt_len)
        if prompt_len + max_tokens > context:
            yield {
                "type": "error",
                "status": 400,
                "message": f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's context of {context} tokens",
                "param": "max_tokens" if req.get("max_tokens") else param,
                "code": "context_length_exceeded",
            }
            return
        yield {"type": "start", "prompt_tokens": prompt_len, "max_tokens": max_tokens}

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        assembler = TextAssembler(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True), req.get("stop") or [])

        class Stop(Exception):
            pass

        def on_step(ids: list[int]) -> None:
            if cancel.is_set() or assembler.stopped:
                raise Stop
            loop.call_soon_threadsafe(queue.put_nowait, ("delta", assembler.feed(ids), len(ids)))

        def run() -> None:
            from decoding.sampling import SamplingParams

            c = self.cfg
            pick = lambda key, default: default if req.get(key) is None else req[key]  # noqa: E731
            with self._turn:
                self.dec.sampling = SamplingParams(pick("temperature", c.temperature), pick("top_k", c.top_k), pick("top_p", c.top_p))
                t0 = time.perf_counter()
                try:
                    out = self.dec.generate_ids(prompt_ids, max_tokens, req.get("seed"), on_step=on_step)
                    stats = self.dec.stats_of(out)
                except Stop:
                    out, stats = None, None
                except Exception as e:  # a worker lost mid-generation (WorkerDied / WorkerTimeout), or a bad request
                    from actors.driver import WorkerDied

                    log.error("specray: %s: generation failed: %s", self.name, str(e).splitlines()[0])
                    self.totals["error"] += 1
                    loop.call_soon_threadsafe(queue.put_nowait, ("error", e))
                    if isinstance(e, WorkerDied):
                        self._lost(e)
                    return
                finally:
                    self.dec.sampling = SamplingParams(c.temperature, c.top_k, c.top_p)
            self.totals["completed"] += 1
            self.totals["tokens"] += len(out.token_ids) if out else 0
            loop.call_soon_threadsafe(queue.put_nowait, ("end", out, stats, time.perf_counter() - t0))

        worker = threading.Thread(target=run, name="specray-placed", daemon=True)
        worker.start()
        tokens = 0
        try:
            while True:
                item = await queue.get()
                if item[0] == "delta":
                    tokens += item[2]
                    if item[1]:
                        yield {"type": "delta", "text": item[1], "tokens": item[2]}
                    continue
                if item[0] == "error":
                    e = item[1]
                    status = 400 if isinstance(e, ConfigError | ValueError) else 503
                    yield {"type": "error", "status": status, "message": f"generation failed: {e}", "code": "generation_failed"}
                    return
                _, out, stats, wall = item
                tail = assembler.finish()
                if tail:
                    yield {"type": "delta", "text": tail, "tokens": 0}
                finish = "stop" if assembler.stopped else (out.finish_reason if out else "length")
                yield {"type": "end", "finish_reason": finish, "completion_tokens": tokens, "stats": self._stats(out, stats, wall)}
                return
        finally:
            cancel.set()

    def _stats(self, out, stats: dict | None, wall: float) -> dict:
        s = dict(stats or {})
        s.update(method=self.cfg.method, outcome="completed" if out else "stopped", request_wall_s=wall)
        s["placement"] = {**s.get("placement", self.dec.placement), "where": self.where(), "served": "placement group"}
        return s
