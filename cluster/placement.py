"""Place a target worker and a draft worker with a Ray placement group.

The plan depends on what the cluster has (``plan_placement`` is pure, so it is
tested without a cluster):

- two or more nodes that can each hold a worker: ``STRICT_SPREAD``, the draft
  and the target on different nodes;
- one node: ``STRICT_PACK``; with GPUs each worker asks for its own GPU (or
  half of the only one), without GPUs the node's CPUs are split between them
  (2 CPUs: one each) and each worker sets ``torch.set_num_threads`` to its share.

A request the cluster can never satisfy (more GPUs or CPUs than any node has)
fails at once with ``PlacementError``, naming what was wanted and what the
cluster has; a request that fits but whose resources are busy waits at most
``placement_timeout_s`` for the placement group, then fails the same way.

>>> one_node = [{"Alive": True, "NodeID": "n1", "Resources": {"CPU": 2.0}}]
>>> plan = plan_placement(SpecConfig(method="pearl"), one_node)
>>> plan.strategy, plan.bundles
('STRICT_PACK', [{'CPU': 1.0}, {'CPU': 1.0}])

An actor entry's Serve replica goes beside its workers (:func:`plan_replica`):

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

from dataclasses import asdict, dataclass

from decoding.config import SpecConfig
from decoding.errors import ConfigError
from decoding.methods import WORKER_ROLES as ROLES  # bundle 0 is the target, bundle 1 the draft
from decoding.methods import on_actors


class PlacementError(ConfigError):
    """The cluster cannot hold the requested workers; the message says what was wanted and what there is."""


@dataclass
class PlacementPlan:
    strategy: str  # STRICT_SPREAD | STRICT_PACK
    bundles: list[dict]  # [target bundle, draft bundle]
    threads: dict  # {"target": n, "draft": n}
    gpus_per_model: float
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def fits(bundle: dict, resources: dict) -> bool:
    return all(resources.get(k, 0.0) >= v for k, v in bundle.items() if v > 0)


def _sum(*bundles: dict) -> dict:
    out: dict = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + v
    return out


def plan_placement(cfg: SpecConfig, nodes: list[dict]) -> PlacementPlan:
    """Choose bundles and a strategy for ``nodes`` (``ray.nodes()`` rows); raise PlacementError if impossible."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    if not alive:
        raise PlacementError("placement", "the Ray cluster has no live nodes")
    total_gpus = sum(r.get("GPU", 0.0) for r in alive)
    gpus = cfg.num_gpus_per_model
    if gpus is None:
        gpus = 1.0 if total_gpus >= 2 else (0.5 if total_gpus >= 1 else 0.0)
    cpus = sorted((r.get("CPU", 0.0) for r in alive), reverse=True)
    multi = len([c for c in cpus if c >= 1]) >= 2
    if gpus > 0:
        auto = 1
    elif multi:
        auto = max(1, int(cpus[1]))  # a whole node each (the smaller of the two largest)
    else:
        auto = max(1, int(cpus[0]) // 2)  # split the one node's cores
    threads = {"target": cfg.target_threads or auto, "draft": cfg.draft_threads or auto}
    bundles = []
    for role in ROLES:
        b = {"CPU": float(threads[role])}
        if gpus > 0:
            b["GPU"] = float(gpus)
        bundles.append(b)
    have = _sum(*alive)
    wanted = f"target {bundles[0]} + draft {bundles[1]}"
    for role, b in zip(ROLES, bundles, strict=True):
        if not any(fits(b, r) for r in alive):
            field = "num_gpus_per_model" if b.get("GPU", 0) > max((r.get("GPU", 0.0) for r in alive), default=0) else f"{role}_threads"
            raise PlacementError(
                field,
                f"cannot place the {role} worker: wanted {b} per worker ({wanted}); "
                f"the cluster has {cpu_gpu(have)} over {len(alive)} node(s), largest node {cpu_gpu(_largest(alive))}",
            )
    spread_nodes = [r for r in alive if any(fits(b, r) for b in bundles)]
    if len(spread_nodes) >= 2 and _can_spread(bundles, alive):
        return PlacementPlan("STRICT_SPREAD", bundles, threads, gpus, f"{len(alive)} nodes: draft and target on different nodes")
    if not any(fits(_sum(*bundles), r) for r in alive):
        raise PlacementError(
            "placement",
            f"cannot place both workers: wanted {wanted} on one node (no two nodes can hold one each); "
            f"the cluster has {cpu_gpu(have)} over {len(alive)} node(s), largest node {cpu_gpu(_largest(alive))}",
        )
    if gpus >= 1:
        reason = "one node: a GPU each"
    elif gpus > 0:
        reason = f"one node: {gpus:g} of a GPU each"
    else:
        reason = f"one CPU node: {threads['target']} + {threads['draft']} of its {int(cpus[0])} cores"
    return PlacementPlan("STRICT_PACK", bundles, threads, gpus, reason)


def _can_spread(bundles: list[dict], nodes: list[dict]) -> bool:
    for i, a in enumerate(nodes):
        for j, b in enumerate(nodes):
            if i != j and fits(bundles[0], a) and fits(bundles[1], b):
                return True
    return False


def _largest(nodes: list[dict]) -> dict:
    return max(nodes, key=lambda r: (r.get("GPU", 0.0), r.get("CPU", 0.0)))


def cpu_gpu(res: dict) -> dict:
    return {k: res[k] for k in ("CPU", "GPU") if k in res} or {"CPU": 0.0}


# ---- a Serve replica beside its two workers ------------------------------------------------------------------
# An actor entry's replica (serving.placed_worker) reserves the group through Serve's placement_group_bundles:
#
# - three nodes that can each hold one of replica, target, draft: three bundles, STRICT_SPREAD: draft and target on
#   different nodes, the replica on a third;
# - otherwise the layout of a Tune trial (tuning.resources): two bundles [target, draft] as plan_placement sizes them
#   (STRICT_SPREAD on two nodes, STRICT_PACK on one), the replica pinned to bundle 0 beside the target and asking no
#   CPUs of its own (it tokenizes and waits while the workers compute). Three bundles on two nodes would leave Ray
#   free to put draft and target together.


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
        return any(j not in used and fits(bundles[i], n) and place(i + 1, used | {j}) for j, n in enumerate(nodes))

    return place(0, set())


def plan_replica(cfg: SpecConfig, nodes: list[dict], replica_cpus: float = 1.0) -> ReplicaPlan:
    """Bundles and strategy of the replica of an actor entry on ``nodes`` (``ray.nodes()`` rows); PlacementError if impossible."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    replica = {"CPU": float(replica_cpus)}
    try:
        p = plan_placement(cfg, nodes)
    except PlacementError:
        w = _wanted_workers(cfg)
        nodes_text = ", ".join(str(cpu_gpu(n)) for n in alive) or "none alive"
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


# ---- with a live cluster ----------------------------------------------------------------------


def place_workers(cfg: SpecConfig, placement_group=None, caller_holds_first: bool = False, layout: dict | None = None):
    """Place the two workers; returns (target, draft, placement dict, cleanup).

    Without ``placement_group`` a new one is made from :func:`plan_placement`
    (and removed by ``cleanup``). With one (a Tune trial's own group), the
    target goes into bundle 0 and the draft into bundle 1, each with as many
    torch threads as its bundle has CPUs, and ``cleanup`` leaves the group to
    its owner. ``caller_holds_first``: the caller itself occupies bundle 0 (a
    Tune trial runs in its group's first bundle), so the target asks no CPUs of
    its own there; the caller only waits while the target computes.
    ``layout`` (with ``placement_group``): ``{role: {"index", "bundle", "threads"}}``, which bundle
    each worker goes into and what it asks of it (a Serve replica's group, ``serving.placed_worker``).
    """
    import ray
    from ray.util.placement_group import placement_group as make_group
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from actors.model_actor import ModelActor

    if placement_group is None:
        plan = plan_placement(cfg, ray.nodes())
        available = ray.available_resources()
        pg, own = make_group(plan.bundles, strategy=plan.strategy, name=""), True
        try:
            ray.get(pg.ready(), timeout=cfg.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise PlacementError(
                "placement_timeout_s",
                f"the placement group {plan.bundles} ({plan.strategy}) was not ready within {cfg.placement_timeout_s:g}s; "
                f"free now: {cpu_gpu(available)} of {cpu_gpu(ray.cluster_resources())}",
            ) from None
    elif layout is not None:
        pg, own = placement_group, False
        bundles = [dict(layout[role]["bundle"]) for role in ROLES]
        threads = {role: int(layout[role]["threads"]) for role in ROLES}
        plan = PlacementPlan("given", bundles, threads, float(bundles[0].get("GPU", 0.0)), "the Serve replica's placement group")
    else:
        pg, own = placement_group, False
        specs = pg.bundle_specs[: len(ROLES)]
        if len(specs) < len(ROLES):
            raise PlacementError("placement", f"the given placement group has {len(specs)} bundle(s); the workers need {len(ROLES)}")
        threads = {role: max(1, int(spec.get("CPU", 1))) for role, spec in zip(ROLES, specs, strict=True)}
        plan = PlacementPlan("given", [dict(b) for b in specs], threads, float(specs[0].get("GPU", 0.0)), "the caller's placement group")
    workers = {}
    cfg_json = cfg.to_json()
    for i, role in enumerate(ROLES):
        shares = caller_holds_first and i == 0
        index = layout[role]["index"] if layout is not None else i
        workers[role] = ModelActor.options(
            num_cpus=0 if shares else plan.bundles[i]["CPU"],
            num_gpus=0 if shares else plan.bundles[i].get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index),
        ).remote(role, cfg_json, plan.threads[role])

    def cleanup():
        for h in workers.values():
            try:
                ray.kill(h)
            except Exception:  # noqa: S110 - already gone
                pass
        if own:
            remove_placement_group(pg)

    try:
        infos = ray.get([workers[r].info.remote() for r in ROLES], timeout=max(cfg.rpc_timeout_s, 300.0))
    except ray.exceptions.RayActorError as e:
        cleanup()
        raise PlacementError("placement", f"a model worker failed to start: {e}") from None
    except ray.exceptions.GetTimeoutError:
        cleanup()
        raise PlacementError("placement", "the model workers did not start within the timeout") from None
    placement = {"mode": "actors", **plan.to_dict(), **dict(zip(ROLES, infos, strict=True))}
    placement["same_node"] = infos[0]["node_id"] == infos[1]["node_id"]
    return workers["target"], workers["draft"], placement, cleanup


def build_actor_decoder(
    cfg: SpecConfig, address: str | None = None, placement_group=None, caller_holds_first: bool = False, layout: dict | None = None
):
    """Connect to (or start) Ray, place both workers, and return an ``actors.driver.ActorDecoder``.

    ``placement_group`` / ``caller_holds_first`` / ``layout``: place the workers in an existing group (see :func:`place_workers`).
    """
    from actors.driver import ActorDecoder
    from cluster.runtime import connect

    plan = on_actors(cfg)  # how the method runs on the workers, asked once: one they cannot run fails before anything starts
    ray_info = connect(address)
    target, draft, placement, cleanup = place_workers(cfg, placement_group, caller_holds_first, layout)
    placement["ray"] = ray_info
    try:
        return ActorDecoder(cfg, target, draft, placement, on_close=cleanup, plan=plan)
    except BaseException:
        cleanup()
        raise
