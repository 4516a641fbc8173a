"""What a soak leaves: the Markdown report, the plot (latency, RSS and fds over the run) and the files under its
output folder."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from evaluation.soak.answers import ABANDONED, ERROR, OK
from evaluation.soak.harness import Soak
from evaluation.soak.processes import TRANSIENT_ROLES


# ---- writing it down -------------------------------------------------------------------------------------------
def _f(v, fmt="{:.1f}", none="-") -> str:
    return none if v is None else fmt.format(v)


def report_markdown(summary: dict, plot_name: str | None = "soak.png") -> str:
    """The run's tables in Markdown: outcomes, faults, resources, targets."""
    from evaluation.markdown import markdown_table

    run, th, ch = summary["run"], summary["throughput"], summary["checks"]
    host = run.get("host") or {}
    where = f"{run.get('model', 'the model')} float32 on {host.get('cpus', '?')} CPUs" + (
        f" (1-minute load average {host['load_avg_mean']:.1f} on average, {host['load_avg_max']:.1f} at most)"
        if host.get("load_avg_mean") is not None
        else ""
    )
    lines = [
        f"Soak of {run['duration_s'] / 60:.0f} min started {run['started']}, {where}: {ch['requests']} requests "
        f"({th['load_requests']} of the steady load at {run['plan']['min_streams']}-{run['plan']['max_streams']} streams, "
        f"{th['tokens_per_s']:.1f} tok/s, p99 {_f(th['latency_p99_s'])} s), faults injected: "
        + ", ".join(f"{k} x{v}" for k, v in summary["faults_injected"].items())
        + ".",
        "",
        markdown_table(["outcome", "requests"], [[k, str(v)] for k, v in summary["outcomes"].items()]),
        "",
        f"Violations (lost, hung, bad error, duplicated, mixed, wrong output, malformed): **{ch['violations']}**. "
        f"Greedy answers checked against the same request alone in float32: {ch['greedy_checked']}, "
        f"{ch['greedy_mismatched']} differ; seeded answers checked against their repeats: {ch['seeded_checked']}, "
        f"{ch['seeded_inconsistent']} differ; clients that hung up and whose generation was cancelled: "
        f"{ch['hangups_cancelled']} of {ch['hangups']}; ingress and engine drained at the end: {ch['drained']}.",
        "",
    ]
    rows = []
    for f in summary["faults"]:
        if f.get("t_s") is None:
            rows.append([f["fault"], "-", "-", "-", "-", "-", "-", "-", f.get("error") or ""])
            continue
        note = f.get("error") or f["target"]
        if f["fault"] == "redis_restart" and not f.get("error"):
            note += f"; publish exit {f.get('publish_exit')}, one line {f.get('publish_one_line')}, results kept {f.get('results_kept')}"
        if f["fault"] == "queue_fill" and not f.get("error"):
            note += f"; {f.get('answered_429')} answered 429"
        if f["fault"] == "slow_reader" and not f.get("error"):
            note += f"; slow stream {f.get('slow_outcome')} in {f.get('slow_s')}s, hung-up one {f.get('hangup_server_state')}"
        rows.append(
            [f["fault"], _f(f["t_s"], "{:.0f}"), _f(f.get("recovery_s")), str(f["in_flight"]), str(f["affected"]), str(f["violations"]),
             f"{_f(f.get('p99_before_s'))} / {_f(f.get('p99_during_s'))} / {_f(f.get('p99_after_s'))}", _f(f.get("during_s")), note]
        )  # fmt: skip
    head = ["fault", "at s", "recovery s", "in flight", "affected", "violations", "p99 s before / during / after", "during s", "what"]
    lines += [markdown_table(head, rows), ""]
    g = summary["resources"]
    res_rows = [
        [r["role"], str(r["processes"]), f"{r['alive_from']} / {r['alive_to']}", _f(r["rss_sum_from_mb"]), _f(r["rss_sum_to_mb"]),
         _f(r["rss_growth_pct"], "{:+.1f}%") + (f" (pid {r['worst_pid']})" if r.get("worst_pid") else ""), _f(r["fds_growth"], "{:+.0f}")]
        for r in g["roles"]
    ]  # fmt: skip
    lines += [
        f"RSS and open fds by role from minute {g['t_from_s'] / 60:.1f} to the end, minute {g['t_to_s'] / 60:.1f} (medians over "
        f"{g['span_s']:.0f} s). Growth is each process's over its own life in that window (from {g['span_s']:.0f} s after it "
        "started, when a fault replaced it, to its end); the worst of the role's processes is shown:",
        "",
        markdown_table(["role", "processes", "alive from / end", "RSS MB sum from", "RSS MB sum end", "worst growth", "fds"], res_rows),
        "",
    ]
    procs = g["processes"]
    if procs:
        worst = max(procs, key=lambda p: p["rss_growth_pct"] or 0)
        fd_worst = max(procs, key=lambda p: p["fds_growth"])
        lines += [
            f"{len(procs)} processes lived through the whole window: the largest RSS growth {worst['rss_growth_pct']:+.1f}% "
            f"({worst['role']}, pid {worst['pid']}, {worst['rss_from_mb']:.0f} -> {worst['rss_to_mb']:.0f} MB), the largest fd "
            f"change {fd_worst['fds_growth']:+.0f} ({fd_worst['role']}, pid {fd_worst['pid']}).",
            "",
        ]
    if summary["targets"]:
        lines += [
            markdown_table(
                ["target", "figure", "met"],
                [[t["target"], _f(t["value"], "{}"), "yes" if t["met"] else "**no**"] for t in summary["targets"]],
            ),
            "",
        ]
    if plot_name:
        lines.append(f"![latency, RSS and fds over the run]({plot_name})")
    return "\n".join(lines)


def plot(soak: Soak, summary: dict, path: Path) -> Path:
    """Latency of every request over time (faults marked), and RSS and fds of each role."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(14, 11), sharex=True)
    ax = axes[0]
    colors = {OK: "tab:blue", ERROR: "tab:orange", ABANDONED: "tab:gray"}
    for outcome in sorted({r.outcome for r in soak.records if r.t_end is not None}):
        rs = [r for r in soak.records if r.outcome == outcome and r.t_end is not None]
        ax.scatter(
            [r.t_start / 60 for r in rs], [r.latency for r in rs], s=6, color=colors.get(outcome, "tab:red"), label=f"{outcome} ({len(rs)})"
        )
    ax.set_ylabel("request latency (s)")
    ax.set_yscale("log")
    for a in axes:
        for f in summary["faults"]:
            if f.get("t_s") is not None:
                a.axvline(f["t_s"] / 60, color="tab:red", alpha=0.3, lw=1)
    for f in summary["faults"]:
        if f.get("t_s") is not None:
            ax.text(f["t_s"] / 60, ax.get_ylim()[1], f["fault"], rotation=90, va="top", ha="right", fontsize=7, color="tab:red")
    by_role: dict[str, dict[float, list[float]]] = {}
    for r in soak.sampler.rows:
        if r["role"] in TRANSIENT_ROLES:
            continue
        slot = by_role.setdefault(r["role"], {}).setdefault(r["t_s"], [0.0, 0.0])
        slot[0] += r["rss_mb"]
        slot[1] += r["fds"]
    palette = plt.get_cmap("tab20")
    for i, (role, series) in enumerate(sorted(by_role.items())):
        ts = sorted(series)
        style = {"lw": 1.2, "color": palette(i % 20), "ls": ("-", "--", ":")[i // 20 % 3], "label": role}
        axes[1].plot([t / 60 for t in ts], [series[t][0] for t in ts], **style)
        axes[2].plot([t / 60 for t in ts], [series[t][1] for t in ts], **style)
    axes[1].set_ylabel("RSS (MB, sum per role)")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("open fds (sum per role)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("minutes")
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.suptitle("specray soak: requests under faults, and every process's memory and file descriptors")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(soak: Soak, summary: dict, out: Path) -> dict[str, Path]:
    """requests.parquet (one row per request), processes.parquet (one row per process and sample), faults.parquet,
    summary.json, report.md and soak.png under ``out``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "requests": out / "requests.parquet",
        "processes": out / "processes.parquet",
        "faults": out / "faults.parquet",
        "summary": out / "summary.json",
        "report": out / "report.md",
        "plot": out / "soak.png",
    }
    rows = [{**asdict(r), "latency_s": r.latency} for r in soak.records]
    pq.write_table(pa.Table.from_pylist(rows) if rows else pa.table({}), paths["requests"])
    pq.write_table(pa.Table.from_pylist(soak.sampler.rows) if soak.sampler.rows else pa.table({}), paths["processes"])
    frows = [{k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in f.items()} for f in summary["faults"]]
    pq.write_table(pa.Table.from_pylist(frows) if frows else pa.table({}), paths["faults"])
    paths["summary"].write_text(json.dumps(summary, indent=1, default=str))
    plot(soak, summary, paths["plot"])
    paths["report"].write_text(report_markdown(summary, paths["plot"].name) + "\n")
    return paths
