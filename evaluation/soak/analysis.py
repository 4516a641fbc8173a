"""The figures of a soak: per fault the recovery time (fault to the first success of a request it could affect, sent
after it), the requests it affected and p99 latency before, during and after; over the run the outcomes, the
greedy identity checks and the growth of every process's RSS and fds; and the targets met or missed."""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict

from evaluation.load import percentile
from evaluation.soak.answers import ABANDONED, ERROR, OK, VIOLATIONS, RequestRecord
from evaluation.soak.faults import first_success
from evaluation.soak.harness import Soak
from evaluation.soak.processes import TRANSIENT_ROLES


def window_latency(records: list[RequestRecord], t0: float, t1: float) -> dict:
    """p50/p99 latency of the load's completed requests sent in [t0, t1), and how many were sent and failed."""
    sent = [r for r in records if r.kind == "load" and t0 <= r.t_start < t1 and r.t_end is not None]
    lat = [r.latency for r in sent if r.outcome == OK]
    return {
        "sent": len(sent),
        "ok": len(lat),
        "errors": sum(r.outcome == ERROR for r in sent),
        "p50_s": percentile(lat, 50, digits=6),
        "p99_s": percentile(lat, 99, digits=6),
    }


def fault_rows(soak: Soak) -> list[dict]:
    """Per fault: recovery, the requests it affected, p99 latency before, during and after."""
    out = []
    w = soak.plan.window_s
    for f in soak.faults:
        row = {"fault": f.name, "index": f.index, "t_planned_s": f.t_planned, "t_s": f.t_inject, "target": f.target, "error": f.error}
        row.update(f.detail)
        if f.t_inject is None:
            out.append(row)
            continue
        first = first_success(soak.records, f.t_inject, soak.affected_models(f.name))
        recovered = first.t_end if first is not None else None
        row["recovery_s"] = None if recovered is None else round(recovered - f.t_inject, 2)
        end = max(f.t_end or f.t_inject, recovered or f.t_inject)
        row["during_s"] = round(end - f.t_inject, 2)
        touched = [r for r in soak.records if r.t_start < end and (r.t_end or math.inf) > f.t_inject]
        row["in_flight"] = sum(r.t_start <= f.t_inject < (r.t_end or math.inf) for r in soak.records)
        row["affected"] = sum(r.outcome not in (OK, ABANDONED) for r in touched)
        row["violations"] = sum(r.outcome in VIOLATIONS for r in touched)
        for name, (a, b) in {
            "before": (f.t_inject - w, f.t_inject),
            "during": (f.t_inject, max(end, f.t_inject + 1)),
            "after": (end, end + w),
        }.items():
            fig = window_latency(soak.records, a, b)
            row[f"p99_{name}_s"] = fig["p99_s"]
            row[f"sent_{name}"] = fig["sent"]
        out.append(row)
    return out


def _median_in(series: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    vals = [v for t, v in series if t0 <= t <= t1]
    return statistics.median(vals) if vals else None


def _growth(rs: list[dict], t0: float, t1: float, span_s: float) -> dict | None:
    """RSS and fd change of one process between the medians of its samples in [t0, t0 + span] and [t1 - span, t1]."""
    rss = [(r["t_s"], r["rss_mb"]) for r in rs]
    fds = [(r["t_s"], r["fds"]) for r in rs]
    a, b = _median_in(rss, t0, t0 + span_s), _median_in(rss, t1 - span_s, t1)
    fa, fb = _median_in(fds, t0, t0 + span_s), _median_in(fds, t1 - span_s, t1)
    if None in (a, b, fa, fb):
        return None
    return {"rss_from_mb": round(a, 1), "rss_to_mb": round(b, 1), "rss_growth_pct": round(100 * (b - a) / a, 2) if a else None,
            "fds_from": fa, "fds_to": fb, "fds_growth": fb - fa}  # fmt: skip


def resource_growth(rows: list[dict], t_from: float, t_to: float, span_s: float = 60.0) -> dict:
    """RSS and fd change over [t_from, t_to] (medians of the samples within ``span_s`` at either end).

    ``processes``: every process alive through the whole window. ``lives``: every process of a lasting role (idle
    workers and the like left out) over its own part of the window: from ``span_s`` after it started (a replacement
    loads its model first) or ``t_from``, to its end or ``t_to``, when that leaves at least ``2 * span_s``; a process
    replaced by a fault is judged over its own life, not summed with its successor mid-restart (a role's total
    straddling a restart compares a loading process with a loaded one). ``roles``: per role, the processes seen, how
    many it kept through either end's span (the fewest in any one sample there: a role that ends with more processes
    than it had leaks processes), the RSS sum at either end, and its worst life's growth."""
    by_pid: dict[int, list[dict]] = {}
    for r in rows:
        by_pid.setdefault(r["pid"], []).append(r)
    procs, lives = [], []
    warm_before = max(t_from - span_s, min((r["t_s"] for r in rows), default=0.0))  # there by then (or from the start): warm
    for pid, rs in by_pid.items():
        ts = [r["t_s"] for r in rs]
        role = rs[-1]["role"]
        warm = min(ts) <= warm_before
        if warm and max(ts) >= t_to - span_s:
            g = _growth(rs, t_from, t_to, span_s)
            if g is not None:
                procs.append({"pid": pid, "role": role, **g})
        if role in TRANSIENT_ROLES:
            continue
        t0 = t_from if warm else max(t_from, min(ts) + span_s)
        t1 = min(t_to, max(ts))
        if t1 - t0 >= 2 * span_s:
            g = _growth(rs, t0, t1, span_s)
            if g is not None:
                lives.append({"pid": pid, "role": role, "from_s": round(t0, 1), "to_s": round(t1, 1), **g})

    sample_times = sorted({r["t_s"] for r in rows})

    def kept(mine: dict[int, list[dict]], lo: float, hi: float) -> int:
        """The fewest of a role's processes in any one sample within [lo, hi]: what it kept through that span. A
        replacement overlapping the process it replaces (both seen in a sample or two) is not a second process."""
        counts = {t: 0 for t in sample_times if lo <= t <= hi}
        for rs in mine.values():
            for r in rs:
                if r["t_s"] in counts:
                    counts[r["t_s"]] += 1
        return min(counts.values(), default=0)

    roles = []
    for role in sorted({rs[-1]["role"] for rs in by_pid.values()} - TRANSIENT_ROLES):
        mine = {pid: rs for pid, rs in by_pid.items() if rs[-1]["role"] == role}
        sums = {}
        for end, t in (("from", t_from), ("to", t_to)):
            series: dict[float, float] = {}
            for rs in mine.values():
                for r in rs:
                    series[r["t_s"]] = series.get(r["t_s"], 0.0) + r["rss_mb"]
            lo, hi = (t, t + span_s) if end == "from" else (t - span_s, t)
            sums[end] = _median_in(sorted(series.items()), lo, hi)
        role_lives = [x for x in lives if x["role"] == role]
        worst = max(role_lives, key=lambda x: x["rss_growth_pct"] or 0, default=None)
        roles.append(
            {"role": role, "processes": len(mine), "alive_from": kept(mine, t_from, t_from + span_s),
             "alive_to": kept(mine, t_to - span_s, t_to),
             "rss_sum_from_mb": sums["from"] and round(sums["from"], 1), "rss_sum_to_mb": sums["to"] and round(sums["to"], 1),
             "lives": len(role_lives), "rss_growth_pct": worst["rss_growth_pct"] if worst else None, "worst_pid": worst and worst["pid"],
             "fds_growth": max((x["fds_growth"] for x in role_lives), default=None)}
        )  # fmt: skip
    return {
        "t_from_s": t_from,
        "t_to_s": t_to,
        "span_s": span_s,
        "processes": sorted(procs, key=lambda p: (p["role"], p["pid"])),
        "lives": sorted(lives, key=lambda p: (p["role"], p["from_s"], p["pid"])),
        "roles": roles,
    }


def load_figures(load: list[tuple[float, float]]) -> dict:
    """The host's 1-minute load average over the run (mean and max): how much else the CPUs were doing."""
    vals = [v for _, v in load]
    return {"load_avg_mean": round(statistics.mean(vals), 2) if vals else None, "load_avg_max": round(max(vals), 2) if vals else None}


def outcome_counts(records: list[RequestRecord]) -> dict:
    out: dict[str, int] = {}
    for r in records:
        out[r.outcome or "unfinished"] = out.get(r.outcome or "unfinished", 0) + 1
    return dict(sorted(out.items()))


def duplicate_ids(records: list[RequestRecord]) -> list[str]:
    """Response ids given to more than one request (an answer given twice)."""
    seen: dict[str, int] = {}
    for r in records:
        if r.response_id:
            seen[r.response_id] = seen.get(r.response_id, 0) + 1
    return sorted(k for k, n in seen.items() if n > 1)


def analyse(soak: Soak, recovery_targets: dict | None = None, growth_from_s: float = 300.0) -> dict:
    """Everything the report says, as one JSON-plain dict (the targets met or missed included)."""
    recs = soak.records
    dups = duplicate_ids(recs)
    for r in recs:
        if r.response_id in dups and r.outcome == OK:
            r.outcome, r.detail = "duplicated", f"response id {r.response_id} answered another request too"
    counts = outcome_counts(recs)
    violations = {k: counts.get(k, 0) for k in VIOLATIONS}
    load = [r for r in recs if r.kind == "load" and r.t_end is not None]
    oks = [r for r in load if r.outcome == OK]
    duration = soak.plan.duration_s
    faults = fault_rows(soak)
    targets = recovery_targets or {"replica_kill": 30.0, "worker_kill": 30.0, "node_removal": 60.0}
    t_end = max((r["t_s"] for r in soak.sampler.rows), default=duration)
    t_from = min(growth_from_s, t_end / 2)
    growth = resource_growth(soak.sampler.rows, t_from, t_end, span_s=min(60.0, (t_end - t_from) / 4))  # a short run: shorter spans
    greedy = [r for r in recs if r.check in ("match", "mismatch")]
    seeded = [r for r in recs if r.check in ("consistent", "inconsistent")]
    hangups = [r for r in recs if r.kind == "hangup"]
    injected = {}
    for f in soak.faults:
        if f.t_inject is not None and f.error is None:
            injected[f.name] = injected.get(f.name, 0) + 1
    checks = {
        "requests": len(recs),
        "violations": sum(violations.values()),
        "greedy_checked": len(greedy),
        "greedy_mismatched": sum(r.check == "mismatch" for r in greedy),
        "seeded_checked": len(seeded),
        "seeded_inconsistent": sum(r.check == "inconsistent" for r in seeded),
        "duplicate_ids": dups[:10],
        "hangups_cancelled": sum(r.check == "cancelled" for r in hangups),
        "hangups": len(hangups),
        "drained": soak.drain.get("drained"),
    }
    target_rows = []
    for name, limit in targets.items():
        vals = [f["recovery_s"] for f in faults if f["fault"] == name and f.get("t_s") is not None]
        if vals:
            worst = None if None in vals else max(vals)
            target_rows.append({"target": f"{name} recovery <= {limit:.0f}s", "value": worst, "met": worst is not None and worst <= limit})
    redis = [f for f in faults if f["fault"] == "redis_restart" and f.get("t_s") is not None and not f.get("error")]
    if redis:
        ok = all(f.get("publish_one_line") and f.get("results_kept") and f.get("entries_kept") for f in redis)
        target_rows.append({"target": "publish during a Redis restart: succeeds or one line, results kept", "value": len(redis), "met": ok})
    summary = {
        "run": {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(soak.wall_start)),
            "duration_s": duration,
            "plan": asdict(soak.plan),
            "mix": asdict(soak.mix),
            "prompts": len(soak.prompts),
            "arrivals_over_ceiling": soak.arrivals_over_ceiling,
            "host": {"cpus": os.cpu_count(), **load_figures(soak.sampler.load)},
            "cluster": {"removed_nodes": len(soak.cluster.removed), "added_nodes": soak.cluster.added, "logs": soak.cluster.session_logs()}
            if soak.cluster
            else None,
        },
        "outcomes": counts,
        "violations": violations,
        "checks": checks,
        "throughput": {
            "load_requests": len(load),
            "load_ok": len(oks),
            "tokens_per_s": sum(r.tokens or 0 for r in oks) / duration if duration else None,
            "latency_p50_s": percentile([r.latency for r in oks], 50, digits=6),
            "latency_p99_s": percentile([r.latency for r in oks], 99, digits=6),
            "streams_mean": sum(r.latency for r in load) / duration if duration else None,
        },
        "faults_injected": injected,
        "faults": faults,
        "resources": growth,
        "drain": soak.drain,
        "targets": target_rows,
    }
    summary["targets"] += resource_targets(summary)
    return summary


def resource_targets(summary: dict, limit_pct: float = 5.0) -> list[dict]:
    """The RSS and fd targets over the growth window: every process (each over its own life in the window: see
    :func:`resource_growth`), and no role ending with more processes than it had (leaked processes)."""
    g = summary["resources"]
    lives = g.get("lives", g["processes"])
    if not lives:
        return []
    worst = max(lives, key=lambda p: p["rss_growth_pct"] or 0)
    fd_up = [p for p in lives if p["fds_growth"] > 0]
    out = [
        {"target": f"RSS growth < {limit_pct:.0f}% for every process (minute {g['t_from_s'] / 60:.0f} to {g['t_to_s'] / 60:.0f}, "
         "each over its own life there)",
         "value": f"{worst['rss_growth_pct']:+.1f}% ({worst['role']}, pid {worst['pid']})",
         "met": (worst["rss_growth_pct"] or 0) < limit_pct},
        {"target": "no fd growth in any process", "value": f"{len(fd_up)} grew" + (f" (max {max(p['fds_growth'] for p in fd_up):+.0f}, "
         f"{max(fd_up, key=lambda p: p['fds_growth'])['role']})" if fd_up else ""), "met": not fd_up},
    ]  # fmt: skip
    more = [r for r in g["roles"] if "alive_to" in r and r["alive_to"] > r["alive_from"] > 0]
    if g["roles"] and "alive_to" in g["roles"][0]:
        out.append(
            {"target": "no role ends with more processes than it had (none leaked)",
             "value": ", ".join(f"{r['role']} {r['alive_from']} -> {r['alive_to']}" for r in more) or "none", "met": not more}
        )  # fmt: skip
    return out
