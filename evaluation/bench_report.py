"""What a bench run shows: the printed tables (rich on a terminal, plain text otherwise) and the plots, all
computed from the run's Parquet files."""

from __future__ import annotations

import sys
from pathlib import Path

from decoding.paths import portable
from evaluation import bench_figures as bm
from evaluation.markdown import markdown_table, replace_block
from evaluation.traces import read_run


def make_plots(out: Path, run_id: str, order=()) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gens, steps = read_run(out, run_id, "generations"), read_run(out, run_id, "traces")
    if not gens:
        return []
    s = bm.summarize_methods(gens, steps, order=order)
    plots = Path(out) / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    written = []

    cats = list(s["categories"]) + ["overall"]
    methods = [m for m in s["methods_order"] if m != s["baseline"]]
    fig, ax = plt.subplots(figsize=(min(16, 4 + 0.35 * len(cats) * max(1, len(methods))), 4.5))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        vals = [(s["categories"][c][m]["speedup"] if c != "overall" else s["methods"][m]["speedup"]) or 0.0 for c in cats]
        ax.bar([i + (j - (len(methods) - 1) / 2) * width for i in range(len(cats))], vals, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label=f"{s['baseline']} (1.0)")
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    ax.set_ylabel(f"speedup over {s['baseline']} (tokens/s ratio)")
    ax.set_title(f"speedup by category, run {run_id}")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = plots / "speedup_by_category.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for m, v in s["methods"].items():
        if v["per_position_acceptance"]:
            xs = range(1, len(v["per_position_acceptance"]) + 1)
            ax.plot(xs, v["per_position_acceptance"], marker="o", label=m)
    ax.set_xlabel("draft position i")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("P(draft i accepted | proposed)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"per-position acceptance, run {run_id}")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = plots / "acceptance_by_position.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


# ---- the report -----------------------------------------------------------------------------
def _f(x, fmt="{:.2f}", none="-"):
    return none if x is None else fmt.format(x)


def report_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    head = [
        "method",
        "prompts",
        "tok/s",
        "speedup",
        "per-prompt med [min, max]",
        "tau",
        "fwd/tok",
        "draft ms/step",
        "verify ms/step",
        "identical",
        "suspicious",
    ]
    lossy = any(v.get("lossy") for v in summary["methods"].values())
    if lossy:  # a lossy method (EAD) is measured against AR: first divergence, tokens that differ, the large model's share
        head += ["first diff (med)", "differ", "large model"]
    rows = []
    for m, v in summary["methods"].items():
        q = v["speedup_per_prompt"]
        ident = v["identity"]
        d = v.get("divergence") or {}
        rows.append(
            [
                label(m, v),
                str(v["prompts"]),
                _f(v["tokens_per_s"], "{:.1f}"),
                _f(v["speedup"]),
                f"{q['median']:.2f} [{q['min']:.2f}, {q['max']:.2f}]" if q else "-",
                _f(v["mean_accepted_tokens"]),
                _f(v["target_forwards_per_token"], "{:.3f}"),
                _f(v["draft_ms_per_step"], "{:.1f}"),
                _f(v["verify_ms_per_step"], "{:.1f}"),
                f"{ident['identical']}/{ident['compared']}" if ident and ident["compared"] else "-",
                str(ident["suspicious"]) if ident and ident["compared"] else "-",
            ]
            + (
                [_f(d.get("first_diff_median"), "{:.0f}"), _f(d.get("differ_share"), "{:.0%}"), _f(d.get("large_share"), "{:.0%}")]
                if lossy
                else []
            )
        )
    return head, rows


def drafted_cell(figures: dict) -> str:
    """The share of a method's steps that drafted, and of them the share that drafted prompt lookup's chain in place of
    its model drafter's (``glance``), where any did.

    >>> drafted_cell({"steps_drafted": 0.27, "steps_looked": 0.12}), drafted_cell({"steps_drafted": 0.37, "steps_looked": 0.0})
    ('27% (12% lookup)', '37%')
    """
    looked = figures.get("steps_looked")
    cell = _f(figures.get("steps_drafted"), "{:.0%}")
    return f"{cell} ({looked:.0%} lookup)" if looked else cell


def label(method: str, figures: dict) -> str:
    """A method's name in the tables, ``(LOSSY)`` after it when its output is not verified against the target.

    >>> label("ead", {"lossy": True}), label("ngram", {"lossy": False})
    ('ead (LOSSY)', 'ngram')
    """
    return f"{method} (LOSSY)" if figures.get("lossy") else method


def render(summary: dict, file=None) -> None:
    file = file or sys.stdout
    head, rows = report_rows(summary)
    methods = summary["methods_order"]
    cat_head = ["category"] + [label(m, summary["methods"][m]) for m in methods]
    cat_rows = [[c] + [_f(v[m]["speedup"]) for m in methods] for c, v in summary["categories"].items()]
    over = summary.get("over_best_peer")
    ours = [m for m in methods if summary["methods"][m]["kind"] == "specray"]
    peer_head = ["category", "best HF"] + ours
    peer_rows = (
        [[c, v["best_peer"]] + [_f(v[m]) for m in ours] for c, v in {**over["categories"], "overall": over["overall"]}.items()]
        if over
        else []
    )
    worker_rows = (
        [[w] + [_f(v[m]["speedup"]) for m in methods] for w, v in summary["workers"].items()] if len(summary["workers"]) > 1 else []
    )
    title = (
        f"specray bench {summary['run_id']}: {summary['model']} {summary['dtype']}, {summary['threads']} threads, "
        f"max_new_tokens {summary['max_new_tokens']}, {summary['runs_complete']} prompt runs"
        + (" (INTERRUPTED)" if summary["interrupted"] else "")
    )
    notes = _notes(summary)
    ctx_head, ctx_rows = context_rows(summary)
    if file.isatty():
        from rich.console import Console
        from rich.table import Table

        console = Console(file=file)
        for t_title, h, rs in (
            (title, head, rows),
            ("speedup over ar by category", cat_head, cat_rows),
            ("tokens/s over HF's best mode by category", peer_head, peer_rows),
            ("speedup over ar by worker", ["worker"] + methods, worker_rows),
            ("long contexts", ctx_head, ctx_rows),
        ):
            if not rs:
                continue
            t = Table(title=t_title)
            for c in h:
                t.add_column(c, justify="left" if c in ("method", "category", "worker") else "right")
            for r in rs:
                t.add_row(*r)
            console.print(t)
        for n in notes:
            console.print(n, highlight=False)
        return
    print(title, file=file)
    for h, rs in ((head, rows), (cat_head, cat_rows), (peer_head, peer_rows), (["worker"] + methods, worker_rows), (ctx_head, ctx_rows)):
        if not rs:
            continue
        widths = [max(len(str(x)) for x in col) for col in zip(h, *rs, strict=False)]
        print("", file=file)
        for r in [h] + rs:
            print(
                "  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(r, widths, strict=False))),
                file=file,
            )
    print("", file=file)
    for n in notes:
        print(n, file=file)


def context_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """One row per (context length, method): speedups, acceptance at each level, memory, the attention share."""
    head = ["context", "method", "speedup", "decode speedup", "top acc", "middle acc", "peak RSS MB", "KV MB top/mid/bottom", "attn share"]
    rows = []
    for cat, c in summary.get("contexts", {}).items():
        for m, v in c["methods"].items():
            kv = v["kv_mb"]
            rows.append(
                [
                    cat,
                    m,
                    _f(v["speedup"]),
                    _f(v["decode_speedup"]),
                    _f(v["top_acceptance"]),
                    _f(v["middle_acceptance"]),
                    _f(v["peak_rss_mb"], "{:.0f}"),
                    "/".join(_f(kv.get(level), "{:.1f}") for level in ("top", "middle", "bottom")),
                    _f(c["attention_share"]),
                ]
            )
    return head, rows


def _notes(summary: dict) -> list[str]:
    notes = []
    p = summary.get("peer")
    if p:
        if p["ar_vs_plain"] is not None:
            notes.append(f"specray ar vs {p['plain_peer']}: {p['ar_vs_plain']:.2f}x")
        notes.append(f"best specray ({p['best_specray']}) vs best HF ({p['best_peer']}): {_f(p['best_vs_best'])}x")
    for mode, err in summary.get("peer_skipped", {}).items():
        notes.append(f"peer mode {mode} skipped: {err}")
    for m, v in summary["methods"].items():
        ident = v["identity"]
        if ident and ident["suspicious"]:
            worst = max((d for d in ident["divergences"] if d["suspicious"]), key=lambda d: d["margin"] or 0)
            notes.append(
                f"SUSPICIOUS: {m} diverged from ar on {ident['suspicious']} prompt(s) at margins above "
                f"{bm.margin_tolerance(summary['dtype'])} (worst: prompt {worst['prompt_id']} position {worst['first_diff']}, "
                f"margin {worst['margin']:.3f})"
            )
    if summary["runs_incomplete"]:
        notes.append(f"{summary['runs_incomplete']} prompt run(s) left out: not every method finished them")
    notes.append(f"traces: {summary['traces']}  summary: {summary['summary_path']}")
    return notes


# ---- Markdown (the README's Results) ---------------------------------------------------------
def category_mean(summary: dict, method: str) -> float | None:
    """The mean over categories of a method's speedup (every category weighs the same, however many tokens)."""
    vals = [v[method]["speedup"] for v in summary["categories"].values() if v.get(method, {}).get("speedup") is not None]
    return sum(vals) / len(vals) if vals else None


def results_markdown(summary: dict) -> str:
    """The bench's per-category table (every specray method and every HF mode, speedup over ar) with the best
    specray method over HF's best mode, and a per-method table (acceptance, drafting's share of a step, identity)."""
    base = summary["baseline"]
    methods = [m for m in summary["methods_order"] if m != base]
    over = summary.get("over_best_peer")
    ours = [m for m in methods if summary["methods"][m]["kind"] == "specray"]

    def best_over_hf(c: str) -> str:
        if not over:
            return "-"
        v = over["categories"][c] if c in over["categories"] else over["overall"]
        lossless = [m for m in ours if not summary["methods"][m].get("lossy")] or ours  # never a lossy winner
        best = max(lossless, key=lambda m: v.get(m) or 0.0)
        return f"{v[best]:.2f}x ({best} / {v['best_peer']})"

    head = ["category", "prompts"] + [label(m, summary["methods"][m]) for m in methods] + (["best specray / best HF"] if over else [])
    rows = []
    for c, v in summary["categories"].items():
        rows.append([c, str(v[base]["prompts"])] + [_f(v[m]["speedup"], "{:.2f}x") for m in methods] + ([best_over_hf(c)] if over else []))
    rows.append(["**mean of categories**", ""] + [_f(category_mean(summary, m), "**{:.2f}x**") for m in methods] + (["-"] if over else []))
    overall = [_f(summary["methods"][m]["speedup"], "{:.2f}x") for m in methods]
    rows.append(["all tokens", str(summary["prompts_complete"])] + overall)
    if over:
        rows[-1].append(best_over_hf("overall"))
    per_category = markdown_table(head, rows)

    head2 = ["method", "tok/s", "speedup", "min category", "tau", "steps drafted", "draft ms/step", "verify ms/step", "drafting share"]
    head2.append("identical to ar")
    lossy = any(summary["methods"][m].get("lossy") for m in summary["methods_order"])
    if lossy:
        head2 += ["first diff (median)", "tokens that differ", "large model's tokens"]
    rows2 = []
    for m in summary["methods_order"]:
        v = summary["methods"][m]
        div = v.get("divergence") or {}
        d, w = v.get("draft_ms_per_step"), v.get("verify_ms_per_step")
        share = d / (d + w) if d is not None and w and d + w > 0 else None
        cats = [c[m]["speedup"] for c in summary["categories"].values() if c[m]["speedup"] is not None]
        ident = v.get("identity")
        rows2.append(
            [
                label(m, v),
                _f(v["tokens_per_s"], "{:.1f}"),
                _f(v["speedup"], "{:.2f}x"),
                _f(min(cats) if cats and m != base else None, "{:.2f}x"),
                _f(v["mean_accepted_tokens"]),
                drafted_cell(v) if m != base else "-",
                _f(d, "{:.1f}"),
                _f(w, "{:.1f}"),
                _f(share, "{:.0%}"),
                f"{ident['identical']}/{ident['compared']}" if ident and ident["compared"] else "-",
            ]
            + (
                [_f(div.get("first_diff_median"), "{:.0f}"), _f(div.get("differ_share"), "{:.0%}"), _f(div.get("large_share"), "{:.0%}")]
                if lossy
                else []
            )
        )
    return per_category + "\n\n" + markdown_table(head2, rows2)


# ---- the committed copy (README's Results, docs/bench/) --------------------------------------------------------
PATH_FIELDS = ("prompts_file", "traces", "generations", "summary_path")  # the summary's file paths, besides its plots


def committed_record(summary: dict) -> dict:
    """The summary as ``docs/bench/summary.json`` keeps it: without the base config, its paths relative to the project
    or ``$SPECRAY_HOME`` (:func:`decoding.paths.portable`), never this machine's."""
    slim = {k: v for k, v in summary.items() if k != "config"}
    for key in PATH_FIELDS:
        if slim.get(key):
            slim[key] = portable(slim[key])
    slim["plots"] = [portable(p) for p in slim.get("plots") or []]
    return slim


def _repeats_caption(summary: dict) -> str:
    """', each run 3 times (the HF modes once)' where the run repeated the prompt set; '' where it did not."""
    runs = summary.get("repeats") or 1
    if runs == 1:
        return ""
    peer = summary.get("peer_repeats") or runs
    times = {1: "once", 2: "twice"}.get(peer, f"{peer} times")
    return f", each run {runs} times" + (f" (the HF modes {times})" if summary.get("peer") and peer != runs else "")


def publish(summary: dict, readme: Path) -> None:
    """The run's tables into the README's bench-results block; its plots and summary to docs/bench/ beside it."""
    import json
    import shutil

    docs = readme.resolve().parent / "docs" / "bench"
    docs.mkdir(parents=True, exist_ok=True)
    plots = []
    for p in summary["plots"]:
        shutil.copy(p, docs / Path(p).name)
        plots.append(f"docs/bench/{Path(p).name}")
    (docs / "summary.json").write_text(json.dumps(committed_record(summary), indent=2, default=str))
    host = summary["host"]
    caption = (
        f"Run {summary['run_id']} on {host['platform']} ({host['cpus']} CPUs), {summary['model']} {summary['dtype']}, "
        f"{summary['threads']} torch threads, {summary['max_new_tokens']} new tokens per prompt, "
        f"{summary['prompts_complete']} prompts"
        + (" (later turns of multi-turn questions included)" if summary.get("later_turns") else "")
        + _repeats_caption(summary)
        + f"; plots: {', '.join(f'`{p}`' for p in plots)}; figures: `docs/bench/summary.json`."
    )
    if summary.get("command"):
        caption += f"\n\nRegenerate with:\n\n```\n{summary['command']}\n```"
    replace_block(readme, "bench-results", results_markdown(summary) + "\n\n" + caption)
    print(f"wrote the Results into {readme} and the plots to {docs}", file=sys.stderr)


def plot_lossy(summary: dict, path: Path) -> Path:
    """The lossy methods' trade-off: speedup over the baseline (tokens/s ratio) against the share of their tokens that
    differ from its (greedy), each point labelled with its name, the target's share of the tokens and the median first
    divergence. One point per lossy method (EAD at several thresholds: ``python -m jobs.bench_variants``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(m, v) for m, v in summary["methods"].items() if v.get("lossy") and v.get("divergence")]
    if not points:
        raise ValueError("no lossy method with divergence figures in the summary (greedy runs measure them)")
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for m, v in points:
        d = v["divergence"]
        x, y = d["differ_share"] or 0.0, v["speedup"] or 0.0
        ax.scatter([x], [y], s=60)
        first = d["first_diff_median"]
        note = f"{m}\nlarge model {d['large_share']:.0%}" + (f", 1st diff {first:.0f}" if first is not None else "")
        ax.annotate(note, (x, y), textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel(f"share of tokens that differ from {summary['baseline']}'s (greedy)")
    ax.set_ylabel(f"speedup over {summary['baseline']} (tokens/s ratio)")
    ax.set_title("lossy methods: speed against divergence")
    ax.set_xlim(left=0.0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
