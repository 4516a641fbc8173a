"""The console report of a search: the trials ranked, the winner, its verification, the files (or the summary as JSON)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def render(summary: dict, rows: list[dict], file=None, as_json: bool = False, top: int = 10) -> None:
    file = file or sys.stdout
    if as_json:
        print(json.dumps(summary, indent=2, default=str), file=file)
        return
    print("", file=file)
    print(
        f"specray tune {Path(summary['experiment']).name}: {summary['trials']} trials in {summary['wall_s']:.0f}s "
        f"({_f(summary['trials_per_hour'], '{:.0f}')} trials/hour), {summary['prompts']} prompts, {summary['model']} {summary['dtype']}"
        + (" (INTERRUPTED)" if summary["interrupted"] else ""),
        file=file,
    )
    for line in trial_table(rows, summary["prompts"], top):
        print(line, file=file)
    if len(rows) > top:
        print(f"... {len(rows) - top} more in {summary['files']['parquet']}", file=file)
    best = summary["best"]
    print("", file=file)
    if best is None:
        print("no winner: no trial ran to a speedup with its greedy output faithful to AR", file=file)
    else:
        print(
            f"best: trial {best['trial_id']} {best['config']['method']}: speedup {_f(best['speedup'])}x over AR, "
            f"tau {_f(best['mean_accepted_tokens'])}, identical {_f(best['identical_fraction'])}, suspicious {best['suspicious']}",
            file=file,
        )
        if summary.get("verify"):
            print(verify_line(summary["verify"]), file=file)
        print("best config (JSON):", file=file)
        print(json.dumps(best["config"], sort_keys=True), file=file)
    for k, p in summary["files"].items():
        print(f"{k}: {p}", file=file)


def _note(r: dict) -> str:
    note = "BEST" if r["best"] else ""
    if r.get("error"):
        note = "error"
    elif not r.get("valid"):
        note = "invalid: " + str(r.get("invalid_reason"))[:40]
    elif not r.get("fidelity_ok"):
        note = "FAILED FIDELITY"
    elif not r.get("complete"):
        note = (note + " stopped early").strip()
    return (note + " pareto").strip() if r.get("pareto") else note


def trial_table(rows: list[dict], prompts: int, top: int = 10) -> list[str]:
    """The ``top`` trials (the winner first, then by score) as aligned text lines under a header."""
    from tuning.space import METHOD_KNOBS

    head = ["trial", "method", "knobs", "prompts", "speedup", "tau", "identical", "suspicious", "note"]
    ranked = sorted(rows, key=lambda r: (bool(r["best"]), r.get("score") or 0.0), reverse=True)
    table = []
    for r in ranked[:top]:
        knobs = " ".join(f"{k.field}={r[k.field]}" for k in METHOD_KNOBS.get(r["method"], ()) if r.get(k.field) is not None)
        ident = f"{r['identical']}/{r['compared']}" if r.get("compared") else "-"
        done = f"{r.get('prompts') or 0}/{r.get('prompts_total') or prompts}"
        table.append([str(r["trial_id"]), str(r["method"]), knobs, done, _f(r.get("speedup")), _f(r.get("mean_accepted_tokens"))])
        table[-1] += [ident, _f(r.get("suspicious"), "{}"), _note(r)]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table, strict=False)]
    return ["  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=False)).rstrip() for line in [head] + table]


def verify_line(v: dict) -> str:
    """One line on the winner measured again outside Tune (``tuning.remeasure``), with the noise bands."""
    where = f"on {v.get('prompt_count', '?')} {v.get('prompts', 'tuning')} prompts x {v.get('repeats', 1)} pass(es)"

    def band(fig: dict) -> str:
        lo, hi = fig.get("speedup_band_low"), fig.get("speedup_band_high")
        return f" [{_f(lo)}, {_f(hi)}]" if lo is not None and hi is not None else ""

    winner = f"verified outside Tune {where}: winner {_f(v['winner']['speedup'])}x{band(v['winner'])} over AR"
    if v["winner_is_defaults"]:
        return winner + " (the winner is the untuned defaults)"
    verdict = {True: "beyond the noise band", False: "within the noise band", None: "no band (1 pass)"}[v.get("beats_defaults")]
    return (
        f"{winner}; untuned defaults {_f(v['defaults']['speedup'])}x{band(v['defaults'])}; winner / defaults "
        f"{_f(v['winner_over_defaults'])} ({verdict})"
    )
