"""Serve an entry whose draft and target run on actors (PEARL, two-actor SpS, TriForce over actors) as it was tuned.

Such an entry gets a deployment of its own (:class:`PlacedWorker`: the request pipeline of ``serving.worker`` over a
decoder on two workers) whose replica reserves a placement group through Serve's ``placement_group_bundles`` /
``placement_group_strategy``: the replica in bundle 0, and its target and draft workers (``actors.model_actor.ModelActor``)
created inside that group, so the group comes and goes with the replica. The layout depends on the cluster
(``cluster.placement.plan_replica``: three nodes, one each; else the layout of a Tune trial, the replica beside the
target).

An entry the cluster cannot hold fails at deploy time (``build_app``, ``specray
serve``) with one line naming what it wants and what the cluster has.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time

from cluster.decoders import current_placement_group, open_decoder
from cluster.placement import ReplicaPlan, plan_replica
from decoding.config import SpecConfig
from decoding.errors import ConfigError
from decoding.methods import runs_on_actors
from serving.worker import Worker

log = logging.getLogger("ray.serve")

RESTART_WAIT_S = 120.0  # how long the replica waits for a crashed model worker to be back (its model loaded again)


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

    wanted = [m for m in catalog.models() if m.kind == "registry" and runs_on_actors(m.config.method, m.config.placement)]
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


# ---- the replica ---------------------------------------------------------------------------------
class PlacedWorker(Worker):
    """The replica of one actor entry: the request pipeline of ``serving.worker`` over an ``ActorDecoder`` whose target
    and draft workers live in the replica's own placement group. Generations run one at a time (each worker holds one
    cache; the pipeline's pool has one thread), the others wait their turn in the replica."""

    def __init__(self, name: str, config: dict, plan: dict):
        import ray

        super().__init__(alone_threads=1)
        self.name = name
        self.cfg = SpecConfig.from_dict(config)
        self.plan = ReplicaPlan.from_dict(plan)
        if current_placement_group() is None:
            raise RuntimeError(f"{name}: the replica has no placement group (deploy it with placement_group_bundles)")
        t0 = time.perf_counter()
        self.dec = open_decoder(self.cfg, layout=self.plan.layout())
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
        self.load_s = time.perf_counter() - t0
        self._exiting = False
        self._restart_seen: float | None = None  # when a worker was seen restarting (time.monotonic); None: both answer
        log.info("specray: %s placed (%s) in %.1fs: %s", name, self.plan.strategy, self.load_s, self.where())

    async def _decoder(self, cfg: SpecConfig):
        return self.dec

    def where(self) -> dict:
        """Where the replica and each worker run (node id and ip, device)."""
        p = self.dec.placement
        return {r: {k: p[r].get(k) for k in ("node_id", "node_ip", "device", "pid")} for r in ("replica", "target", "draft")}

    def _placement(self, stats: dict) -> dict:
        return {**stats.get("placement", self.dec.placement), "where": self.where(), "served": "placement group"}

    def stats(self) -> dict:
        return {"entry": self.name, "placement": self.where(), "totals": dict(self.totals)}

    # ---- a lost worker ---------------------------------------------------------------------------
    # A model worker whose process dies is started again by Ray in its bundle (actors.model_actor.WORKER_RESTARTS): the
    # replica waits for it (a new process loading the model) instead of exiting, which would cost a new replica, a new
    # placement group and both workers loaded from scratch. The generations it lost end as 503s, unless they had not
    # delivered a token yet: those run again once the worker is back. A worker dead for good (its restarts spent, a
    # compiled graph that cannot follow a restart) or not back within RESTART_WAIT_S: the replica exits and Serve
    # replaces it (a new group).

    def _run(self, dec, seq) -> None:
        from actors.driver import WorkerDied

        self._await_workers()
        try:
            dec.run(seq)
        except WorkerDied as e:
            if seq.delivered or not self._lost(e):
                raise
            log.warning("specray: %s: %s lost before its first token; it runs again once the workers are back", self.name, seq.tag)
            self._await_workers()
            dec.run(seq)

    def _await_workers(self) -> None:
        """Return once both workers answer (at once, unless a restart was seen); raise WorkerDied if one is dead for
        good or not back within RESTART_WAIT_S (and then the replica exits)."""
        from actors.driver import WorkerDied

        while self._restart_seen is not None:
            states = self.dec.worker_states()
            if all(v == "alive" for v in states.values()):
                self.dec.refresh_placement()
                back_s = time.monotonic() - self._restart_seen
                log.info("specray: %s: workers back %.1fs after the loss: %s", self.name, back_s, self.where())
                self._restart_seen = None
                return
            err = None
            if "dead" in states.values():
                err = WorkerDied(f"a model worker is dead for good: {states}")
            elif time.monotonic() - self._restart_seen > RESTART_WAIT_S:
                err = WorkerDied(f"a model worker was not back within {RESTART_WAIT_S:.0f}s: {states}")
            if err is not None:
                self._exit(err)
                raise err
            time.sleep(0.25)

    async def check_health(self) -> None:
        """Serve calls this periodically: a worker restarting is noted (the next generation waits for it); one dead
        for good, or restarting for longer than RESTART_WAIT_S, makes the replica exit, and Serve replaces it. The
        pings wait off the event loop (a restarting worker answers unavailable after about 1.5 s)."""
        import asyncio

        await asyncio.get_running_loop().run_in_executor(None, self._check_workers)

    def _check_workers(self) -> None:
        from actors.driver import WorkerDied

        states = self.dec.worker_states(timeout_s=5.0)
        if "restarting" not in states.values() and "dead" not in states.values():
            return  # alive, or busy with a generation
        if "dead" not in states.values() and self.dec.executor.transport != "compiled":
            self._restart_seen = self._restart_seen or time.monotonic()
            if time.monotonic() - self._restart_seen <= RESTART_WAIT_S:
                return
        err = WorkerDied(f"workers' health check: {states}")
        self._exit(err)
        raise err

    def _lost(self, err: Exception) -> bool:
        """A generation failed with ``err``. True when a model worker is restarting (the replica waits for it);
        otherwise, for a worker lost for good, the replica exits."""
        from actors.driver import WorkerDied

        if not isinstance(err, WorkerDied) or self._exiting:
            return False
        states = self.dec.worker_states()
        if "dead" not in states.values() and self.dec.executor.transport != "compiled":
            self._restart_seen = self._restart_seen or time.monotonic()
            log.warning("specray: %s: %s; waiting for the worker's restart (%s)", self.name, str(err).splitlines()[0], states)
            return True
        self._exit(err)
        return False

    def _exit(self, err: Exception) -> None:
        """This replica can serve nothing more: it exits now and Serve, seeing the crash, starts a replacement (a new
        group) at once, instead of after three failed health checks 5 s apart. The requests it holds end as 503s
        (their error events, or the ingress's answer to a lost replica)."""
        if not self._exiting:
            self._exiting = True
            log.error("specray: %s: %s; the replica exits so that Serve replaces it", self.name, str(err).splitlines()[0])
            threading.Timer(0.5, os._exit, args=(1,)).start()  # time for the error events already queued to leave
