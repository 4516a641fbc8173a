"""Serve an entry whose draft and target run on actors (PEARL, two-actor SpS, TriForce over actors) as it was tuned.

Such an entry gets a deployment of its own (:class:`PlacedWorker`: the request pipeline of ``serving.worker`` over a
decoder on two workers) whose replica reserves a placement group through Serve's ``placement_group_bundles`` /
``placement_group_strategy``: the replica in bundle 0, and its target and draft workers (``actors.worker.ModelActor``)
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
        from actors.driver import WorkerDied

        if isinstance(err, WorkerDied) and not self._exiting:
            self._exiting = True
            log.error("specray: %s: %s; the replica exits so that Serve replaces it", self.name, str(err).splitlines()[0])
            threading.Timer(0.5, os._exit, args=(1,)).start()  # time for the error events already queued to leave
