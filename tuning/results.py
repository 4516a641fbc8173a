"""From a Tune result grid to files and a winner: one row per trial, Parquet, the Pareto plot, best.json, the registry.

Row columns: ``trial_id``, ``status``, ``error``, the config knobs
(:func:`tuning.space.knob_fields`; null where the trial's method does not read
the knob), ``config_json`` (the full ``SpecConfig``), every metric of
:data:`tuning.trainable.METRIC_KEYS`, ``iterations`` and ``time_total_s``,
then ``pareto`` and ``best`` flags.

The winner (:func:`select_best`) is the highest speedup among trials that ran
(valid, no error), passed fidelity (no suspicious divergence from AR) and, when
any did, finished every prompt (ASHA stops poor trials early; their figures
cover fewer prompts). A trial that failed fidelity is never chosen, whatever
its speed.

>>> rows = [
...     {"trial_id": "a", "valid": True, "error": None, "fidelity_ok": True, "complete": True, "speedup": 1.4, "score": 1.4,
...      "mean_accepted_tokens": 2.0},
...     {"trial_id": "b", "valid": True, "error": None, "fidelity_ok": False, "complete": True, "speedup": 3.0, "score": 0.0,
...      "mean_accepted_tokens": 4.0},
... ]
>>> select_best(rows)["trial_id"]
'a'
>>> [r["trial_id"] for r in pareto_front(rows)]
['a']
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

from decoding.config import SpecConfig
from decoding.errors import ConfigError
from tuning.space import METHOD_KNOBS, knob_fields
from tuning.trainable import METRIC_KEYS, METRIC_TYPES

PARQUET = "trials.parquet"
PARETO_PNG = "pareto.png"
BEST_JSON = "best.json"

_ARROW = {"float": "float64", "int": "int64", "bool": "bool_", "str": "string"}  # METRIC_TYPES -> pyarrow type names


# ---- rows -----------------------------------------------------------------------------------
def row_from_result(metrics: dict | None, sample: dict | None, error: str | None, space=None, base: SpecConfig | None = None) -> dict:
    """One trial's row from its last reported metrics (may be empty for a trial that errored before reporting)."""
    metrics = dict(metrics or {})
    row = {"trial_id": metrics.get("trial_id"), "status": "ERROR" if error else "TERMINATED", "error": error}
    cfg = None
    if metrics.get("config_json"):
        cfg = SpecConfig.from_json(metrics["config_json"])
    elif space is not None and base is not None and sample:
        try:
            cfg = space.to_config(sample, base)
        except ConfigError:
            cfg = None
    method = cfg.method if cfg else (sample or {}).get("method")
    read = {k.field for k in METHOD_KNOBS.get(method, ())}
    row["method"] = method
    for f in knob_fields():
        row[f] = getattr(cfg, f) if (cfg is not None and f in read) else None
    for k in METRIC_KEYS:
        row[k] = metrics.get(k)
    row["config_json"] = cfg.to_json() if cfg else None
    if row["valid"] is None:  # never reported
        row.update(valid=False, fidelity_ok=False, complete=False, score=0.0, prompts=0)
    row["iterations"] = metrics.get("training_iteration")
    row["time_total_s"] = metrics.get("time_total_s")
    row["pareto"] = False
    row["best"] = False
    return row


def rows_from_grid(grid, space=None, base: SpecConfig | None = None) -> list[dict]:
    """One row per trial of a ``tune.ResultGrid``, ordered by trial id."""
    rows = []
    for result in grid:
        err = None
        if result.error is not None:
            err = f"{type(result.error).__name__}: {result.error}".splitlines()[0][:500]
        metrics = dict(result.metrics or {})
        if not metrics.get("trial_id"):
            metrics["trial_id"] = Path(result.path).name if result.path else None
        rows.append(row_from_result(metrics, result.config, err, space, base))
    return sorted(rows, key=lambda r: str(r["trial_id"]))


# ---- choosing -------------------------------------------------------------------------------
def eligible(row: dict, allow_lossy: bool = False) -> bool:
    """Ran, measured a speedup, and passed fidelity; or, with ``allow_lossy`` (``specray tune --allow-lossy``), a lossy
    method's trial (EAD: it never passes fidelity)."""
    ran = bool(row.get("valid")) and not row.get("error") and row.get("speedup") is not None
    return ran and (bool(row.get("fidelity_ok")) or (allow_lossy and bool(row.get("lossy"))))


def select_best(rows: Sequence[dict], allow_lossy: bool = False) -> dict | None:
    """The fastest eligible trial, preferring those that finished every prompt; None when no trial qualifies. Lossy
    trials compete only with ``allow_lossy``, by their speedup (their score is 0: the searcher never chases them).

    >>> rows = [{"valid": True, "fidelity_ok": True, "complete": True, "speedup": 1.2, "score": 1.2},
    ...         {"valid": True, "fidelity_ok": False, "lossy": True, "complete": True, "speedup": 1.9, "score": 0.0}]
    >>> select_best(rows)["speedup"], select_best(rows, allow_lossy=True)["speedup"]
    (1.2, 1.9)
    """
    ok = [r for r in rows if eligible(r, allow_lossy)]
    pool = [r for r in ok if r.get("complete")] or ok
    if not pool:
        return None

    def key(r):
        score = r["speedup"] if r.get("lossy") else r["score"]
        return (score, r["speedup"], r.get("mean_accepted_tokens") or 0.0)

    return max(pool, key=key)


def pareto_front(rows: Sequence[dict], x: str = "mean_accepted_tokens", y: str = "speedup") -> list[dict]:
    """Eligible trials no other eligible trial beats on both ``x`` and ``y`` (higher is better), sorted by ``x``.

    >>> pts = [{"t": i, "valid": True, "error": None, "fidelity_ok": True, "speedup": s, "mean_accepted_tokens": a}
    ...        for i, (a, s) in enumerate([(1.0, 1.0), (2.0, 1.5), (3.0, 1.2), (2.5, 1.1)])]
    >>> [p["t"] for p in pareto_front(pts)]
    [1, 2]
    """
    pts = [r for r in rows if eligible(r) and r.get(x) is not None]
    front = []
    for r in pts:
        dominated = any(
            o is not r and o[x] >= r[x] and o[y] >= r[y] and (o[x] > r[x] or o[y] > r[y])
            for o in pts  # noqa: B023
        )
        if not dominated:
            front.append(r)
    return sorted(front, key=lambda r: (r[x], r[y]))


def mark(rows: list[dict], allow_lossy: bool = False) -> dict | None:
    """Set the ``pareto`` and ``best`` flags in place; returns the best row."""
    front = {id(r) for r in pareto_front(rows)}
    best = select_best(rows, allow_lossy)
    for r in rows:
        r["pareto"] = id(r) in front
        r["best"] = r is best
    return best


# ---- files --------------------------------------------------------------------------------
def schema():
    import pyarrow as pa

    fields = [("trial_id", pa.string()), ("status", pa.string()), ("error", pa.string()), ("method", pa.string())]
    kinds = {k.field: k.kind for ks in METHOD_KNOBS.values() for k in ks}
    for f in knob_fields():
        fields.append((f, pa.int64() if kinds[f] == "int" else pa.float64() if kinds[f] == "float" else pa.string()))
    for k in METRIC_KEYS:
        if k == "config_json":
            continue
        fields.append((k, getattr(pa, _ARROW[METRIC_TYPES[k].__name__])()))
    fields += [
        ("config_json", pa.string()),
        ("iterations", pa.int64()),
        ("time_total_s", pa.float64()),
        ("pareto", pa.bool_()),
        ("best", pa.bool_()),
    ]
    return pa.schema(fields)


def write_parquet(rows: Sequence[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sch = schema()
    table = pa.Table.from_pylist([{k: r.get(k) for k in sch.names} for r in rows], schema=sch)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path


def plot_pareto(rows: Sequence[dict], path: Path, title: str = "") -> Path:
    """Speedup vs mean accepted tokens: every trial by method, the Pareto front joined, fidelity failures as red x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    measured = [r for r in rows if r.get("speedup") is not None and r.get("mean_accepted_tokens") is not None]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def xy(pts):
        return [r["mean_accepted_tokens"] for r in pts], [r["speedup"] for r in pts]

    for i, m in enumerate(dict.fromkeys(r["method"] for r in measured)):
        pts = [r for r in measured if r["method"] == m and r.get("fidelity_ok") and r.get("valid") and not r.get("error")]
        if pts:
            sizes = [60 if r.get("complete") else 25 for r in pts]
            ax.scatter(*xy(pts), color=colors[i % len(colors)], alpha=0.6, label=m, s=sizes)
    failed = [r for r in measured if not r.get("fidelity_ok")]
    if failed:
        ax.scatter(*xy(failed), marker="x", color="red", s=70, label="failed fidelity (never chosen)")
    front = pareto_front(rows)
    if front:
        ax.plot(*xy(front), color="black", marker="o", markerfacecolor="none", markersize=11, linewidth=1, label="Pareto front")
    best = select_best(rows)
    if best is not None and best.get("mean_accepted_tokens") is not None:
        ax.scatter(*xy([best]), marker="*", s=260, color="gold", edgecolor="black", zorder=5, label="best")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("mean accepted tokens per target forward (tau)")
    ax.set_ylabel("speedup over AR (same trial)")
    ax.set_title(title or f"{len(rows)} trials: speed vs acceptance")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", loc="best")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


WINNER_METRICS = (
    "speedup",
    "speedup_median",
    "tokens_per_s",
    "ar_tokens_per_s",
    "mean_accepted_tokens",
    "acceptance_rate",
    "target_forwards_per_token",
    "identical_fraction",
    "suspicious",
    "fidelity_ok",
    "lossy",
    "differ_share",
    "large_share",
    "prompts",
    "threads",
)


def best_document(best: dict | None, meta: dict) -> dict:
    """What best.json holds: the winner's config and figures plus the search's description."""
    doc = {"meta": meta, "best": None}
    if best is not None:
        doc["best"] = {
            "trial_id": best["trial_id"],
            "config": json.loads(best["config_json"]),
            "metrics": {k: best.get(k) for k in WINNER_METRICS},
        }
    return doc


def write_json(doc: dict, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)
    return path


def write_outputs(rows: list[dict], out: Path, meta: dict, allow_lossy: bool = False) -> dict:
    """Parquet, Pareto PNG and best.json under ``out`` (written before anything is published); returns paths and the best row."""
    out = Path(out)
    best = mark(rows, allow_lossy)
    paths = {
        "parquet": write_parquet(rows, out / PARQUET),
        "pareto": plot_pareto(rows, out / PARETO_PNG, title=meta.get("title", "")),
    }
    paths["best_json"] = write_json(best_document(best, meta), out / BEST_JSON)
    return {"paths": paths, "best": best}


def write_run(rows: list[dict], settings, space, prompts: list, held_out: list, wall: float, resumed: bool, interrupted: bool):
    """Everything a finished (or interrupted) search writes under its experiment folder (:func:`write_outputs`), and
    its summary: (summary, the best row or None, the winner's ``SpecConfig`` as its trial ran it or None)."""
    base = settings.base_config
    exp = settings.experiment_path
    categories = [p.category for p in prompts]
    meta = {
        "experiment": str(exp),
        "model": base.model,
        "dtype": base.dtype,
        "max_new_tokens": base.max_new_tokens,
        "workload": settings.workload,
        "prompts_file": settings.prompts_file,
        "categories": sorted(set(categories), key=categories.index),
        "prompts": len(prompts),
        "held_out_prompts": len(held_out),
        "space": space.to_dict(),
        "searcher": settings.searcher,
        "trials": len(rows),
        "num_samples": settings.num_samples,
        "wall_s": wall,
        "trials_per_hour": 3600.0 * len(rows) / wall if wall > 0 else None,
        "resumed": resumed,
        "interrupted": interrupted,
        "finished": now(),
        "title": f"{settings.name}: {base.model} on {settings.workload}",
    }
    meta["allow_lossy"] = bool(getattr(settings, "allow_lossy", False))
    written = write_outputs(rows, exp, meta, meta["allow_lossy"])  # on disk before anything is published
    best = written["best"]
    summary = {**meta, "files": {k: str(v) for k, v in written["paths"].items()}, "best": None, "verify": None, "published": None}
    winner = None
    if best is not None:
        # the config as the trial ran it (threads = the trial's CPUs); published with the user's threads setting
        winner = SpecConfig.from_json(best["config_json"])
        summary["best"] = {"trial_id": best["trial_id"], "config": winner.to_dict(), **{k: best.get(k) for k in WINNER_METRICS}}
    return summary, best, winner


def write_verify(best: dict, summary: dict) -> Path:
    """best.json again, with the winner's verification (``tuning.remeasure``) in it."""
    meta = {k: v for k, v in summary.items() if k not in ("files", "best", "verify", "published")}
    doc = best_document(best, meta)
    doc["verify"] = summary["verify"]
    return write_json(doc, Path(summary["files"]["best_json"]))


# ---- publishing ---------------------------------------------------------------------------------
def publish(
    name: str,
    config: SpecConfig,
    metrics: dict,
    registry_url: str | None = None,
    source: dict | None = None,
) -> tuple[str, int]:
    """Put the winner into the registry with its figures, the hardware and the time; returns (location, version).

    Raises ``cluster.registry.RegistryError`` (``RegistryUnavailable`` when the store cannot be reached).
    """
    from cluster.registry import Entry, describe_hardware, open_registry

    entry = Entry(name, config, metrics=_plain(metrics), hardware=describe_hardware(), source=_plain(source or {}))
    reg = open_registry(registry_url)
    try:
        version = reg.put(entry)
        return reg.location, version
    finally:
        reg.close()


def publish_winner(name: str, winner: SpecConfig, best: dict, summary: dict, base: SpecConfig, registry: str | None) -> dict:
    """Put the winner into the registry under ``name`` (with the user's threads setting, not the trial's), its figures,
    how it was tuned and its verification; returns ``{"name", "version", "registry"}``. Raises
    ``cluster.registry.RegistryError`` (the results stay on disk)."""
    files = summary["files"]
    metrics = {k: best.get(k) for k in WINNER_METRICS}
    metrics["tuning"] = {
        "experiment": summary["experiment"],
        "trial_id": best["trial_id"],
        "trials": summary["trials"],
        "workload": summary["workload"],
        "prompts": summary["prompts"],
        "categories": summary["categories"],
    }
    if summary.get("verify"):
        metrics["verify"] = summary["verify"]
        metrics["speedup_verified"] = summary["verify"]["winner"]["speedup"]
    source = {"tool": "specray tune", "experiment": summary["experiment"], "trials_parquet": files["parquet"]}
    location, version = publish(name, winner.replace(threads=base.threads), metrics, registry, source)
    return {"name": name, "version": version, "registry": location}


def _plain(d: dict) -> dict:
    """JSON-plain (no NaN, no numpy scalars) for the registry."""
    import math

    def conv(v):
        if isinstance(v, dict):
            return {str(k): conv(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [conv(x) for x in v]
        if hasattr(v, "item") and not isinstance(v, str | bytes):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return v

    return conv(d)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
