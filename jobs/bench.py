"""`specray bench` / `python -m jobs.bench`: every method on a Spec-Bench prompt set, side by side.

    specray bench --methods ar,sps,ngram,early-exit --categories summarization,rag --limit 2 \\
        --max-new-tokens 64 --dtype bfloat16 --peer hf --out bench-out

For each prompt every method runs back to back, in an order rotated per prompt,
so machine noise does not favour one side; ``ar`` (always included) is the
denominator of every speedup. After each prompt its per-step traces and
per-generation records are appended to Parquet datasets::

    OUT/traces/run=<id>/method=<m>/part-<n>.parquet       one row per decoding step
    OUT/generations/run=<id>/method=<m>/part-<n>.parquet  one row per generation

The summary (``OUT/summary.json`` and the printed table) and the plots
(``OUT/plots/*.png``) are computed from those files, so a run stopped with
Ctrl-C still reports what finished. ``--peer hf`` adds Hugging Face
``generate()`` on the same model object (plain, prompt lookup, a shallow
assistant made of the target's first layers, early exit). ``--on-cluster`` fans
the prompts out over Ray actors, one model per actor.

Bad input (missing prompt file, unknown category, malformed JSONL line) prints
one line naming the file and line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path

from decoding.config import METHODS, SpecConfig
from evaluation import bench_figures as bm
from evaluation.bench_report import publish, render
from evaluation.bench_run import finish, long_prompts, run_cluster, run_local
from evaluation.hf_peer import PEER_MODES
from evaluation.traces import TraceWriter
from evaluation.workloads import DEFAULT_PROMPTS, Prompt, WorkloadError, load_prompts, select, with_later_turns
from jobs.common import (
    Parser,
    add_config_args,
    check_cluster_flags,
    check_readme,
    config_from_args,
    fail,
    output_dir,
    parse_ints,
    run_cli,
)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or Parser(prog="specray bench", description="Benchmark speculative methods against AR (and Hugging Face generate).")
    p.add_argument(
        "--methods",
        default=",".join(m for m in METHODS if m != "trained"),
        help=f"comma list from {', '.join(METHODS)} or trained:NAME (a trained drafter); ar is always added (default: all untrained)",
    )
    add_config_args(p, method=False)
    p.add_argument("--prompts", help=f"Spec-Bench style JSONL (question_id, category, turns); default {DEFAULT_PROMPTS}")
    p.add_argument("--categories", help="comma list of categories to run (default: all in the file)")
    p.add_argument("--limit", type=int, help="at most N prompts per category (with --context-tokens: prompts per length, default 1)")
    p.add_argument(
        "--context-tokens",
        help="comma list of prompt lengths, e.g. 2048,4096,8192: long prompts built from the summarization and RAG prompts "
        "(documents concatenated, then a question), capped at the model's context minus --max-new-tokens",
    )
    p.add_argument("--repeats", type=int, default=1, help="run the whole prompt set R times and report the spread")
    p.add_argument(
        "--peer-repeats",
        type=int,
        default=None,
        help="with --peer: run the HF modes in the first N repeats only (default: all); each is compared with AR on the same runs",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up generations per method before measuring (default 1)")
    p.add_argument("--peer", choices=["hf"], help="also run Hugging Face generate() (plain and assisted) on the same model")
    p.add_argument(
        "--peer-modes",
        help=f"with --peer hf: comma list of HF modes from {', '.join(PEER_MODES)} (default all; the assistant and early-exit "
        "modes are slow on a CPU)",
    )
    p.add_argument(
        "--later-turns",
        action="store_true",
        help="also run the later turns of multi-turn questions (MT-bench), each after the conversation so far with ar's answers",
    )
    p.add_argument(
        "--readme",
        metavar="README.md",
        help="write the per-category Results table into README.md's <!-- bench-results --> block and the plots to docs/bench/",
    )
    p.add_argument("--on-cluster", action="store_true", help="fan prompts out over Ray actors (RAY_ADDRESS, else a local Ray)")
    p.add_argument("--workers", type=int, help="with --on-cluster: number of actors (default: the cluster's CPUs)")
    p.add_argument("--out", default="bench-out", help="output directory (default ./bench-out)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    return p


# ---- driving a run ------------------------------------------------------------------------------
def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    for m in methods:
        if m.partition(":")[0] not in METHODS:
            fail(f"--methods: unknown method {m!r}; choose from {', '.join(METHODS)}")
        if ":" in m and ("/" in m or "\\" in m):  # the label names a Parquet partition directory
            fail(f"--methods: {m!r}: name an artifact under $SPECRAY_HOME/drafters, or use trained with --set drafter=PATH")
    if not methods:
        fail("--methods: no method given")
    return list(dict.fromkeys([bm.BASELINE] + methods))


def parse_context_tokens(text: str | None) -> list[int]:
    if not text:
        return []
    return list(dict.fromkeys(parse_ints(text, "--context-tokens", 64, " tokens")))


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The prompt selection :func:`load_workload` reads, and the untimed warm-up, for the bench's side jobs
    (``jobs.bench_variants``, ``jobs.bench_trees``)."""
    p.add_argument("--prompts", help="Spec-Bench style JSONL (default: the bundled Spec-Bench questions)")
    p.add_argument("--categories", help="comma list of categories")
    p.add_argument("--limit", type=int, help="at most N prompts per category")
    p.add_argument("--warmup", type=int, default=1)


def load_workload(args, cfg: SpecConfig | None = None) -> list[Prompt]:
    source = args.prompts or DEFAULT_PROMPTS
    wanted = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    if args.categories is not None and not wanted:
        fail(f"--categories: no category given in {args.categories!r}")
    lengths = parse_context_tokens(getattr(args, "context_tokens", None))
    try:
        if lengths:
            if wanted:
                fail("--categories and --context-tokens exclude each other (long prompts are built from summarization and rag)")
            if args.limit is not None and args.limit < 1:
                fail(f"--limit must be >= 1, got {args.limit}")
            return long_prompts(load_prompts(source), lengths, args.limit or 1, cfg)
        chosen = select(load_prompts(source), wanted, args.limit, source=str(source))
        return with_later_turns(chosen) if getattr(args, "later_turns", False) else chosen
    except WorkloadError as e:
        fail(str(e))


def check_counts(args) -> None:
    """--repeats, --warmup and --workers (the last with --on-cluster only), before any work."""
    if args.repeats < 1:
        fail(f"--repeats must be >= 1, got {args.repeats}")
    if args.peer_repeats is not None and not 1 <= args.peer_repeats <= args.repeats:
        fail(f"--peer-repeats must be between 1 and --repeats ({args.repeats}), got {args.peer_repeats}")
    if args.peer_repeats is not None and not args.peer:
        fail("--peer-repeats needs --peer hf")
    if args.warmup < 0:
        fail(f"--warmup must be >= 0, got {args.warmup}")
    if args.workers is not None and args.workers < 1:
        fail(f"--workers must be >= 1, got {args.workers}")
    check_cluster_flags(args, {"workers": None})


def run_bench(args, on_prompt_done: Callable[[int, Prompt], None] | None = None) -> tuple[int, dict]:
    """Run the benchmark the parsed ``args`` describe; returns (exit code, summary)."""
    base = config_from_args(args)
    methods = parse_methods(args.methods)
    check_counts(args)
    output_dir(args.out, "--out")  # before any work: a file or an unwritable place fails here
    peer = parse_peer_modes(args.peer, args.peer_modes)
    if args.readme:
        check_readme(args.readme, "bench-results")
    prompts = load_workload(args, base)
    if not prompts:
        fail("no prompts selected")
    for m in methods:  # check every method's config before loading anything
        cfg = base.for_method(m)
        if cfg.method == "trained":
            from decoding.drafters.artifacts import read_description

            read_description(cfg.drafter)

    out = Path(args.out)
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(2)
    writer = TraceWriter(out, run_id)
    jobs = [(r, p) for r in range(args.repeats) for p in prompts]
    meta = {
        "run_id": run_id,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": base.model,
        "dtype": base.dtype,
        "max_new_tokens": base.max_new_tokens,
        "threads": base.threads,
        "config": base.to_dict(),
        "specray_methods": methods,
        "prompts_file": str(args.prompts or DEFAULT_PROMPTS),
        "categories_run": list(dict.fromkeys(p.category for p in prompts)),
        "prompts_selected": len(prompts),
        "repeats": args.repeats,
        "peer": args.peer,
        "peer_repeats": args.peer_repeats or args.repeats,
        "later_turns": bool(args.later_turns),
        "command": getattr(args, "command_line", None),
        "peer_skipped": {},
        "on_cluster": bool(args.on_cluster),
        "host": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
    }
    from tqdm import tqdm

    interrupted = False
    bars = []

    def new_progress():  # started once the models are loaded, so a setup error stays one line
        bars.append(tqdm(total=len(jobs), desc="bench", unit="prompt", file=sys.stderr, dynamic_ncols=True))
        return bars[-1]

    try:
        runner = run_cluster if args.on_cluster else run_local
        extra = {"workers": args.workers} if args.on_cluster else {}
        extra["peer_repeats"] = args.peer_repeats
        runner(base, methods, peer, jobs, writer, new_progress, on_prompt_done, args.warmup, meta, **extra)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        for bar in bars:
            bar.close()

    summary = finish(out, run_id, meta, interrupted)
    if args.readme and not interrupted:
        publish(summary, Path(args.readme))
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        render(summary)
    return (130 if interrupted else 0), summary


def parse_peer_modes(peer: str | None, modes: str | None) -> list[str] | None:
    if modes and not peer:
        fail("--peer-modes needs --peer hf")
    if not peer:
        return None
    wanted = [m.strip() for m in (modes or ",".join(PEER_MODES)).split(",") if m.strip()]
    for m in wanted:
        if m not in PEER_MODES:
            fail(f"--peer-modes: unknown mode {m!r}; choose from {', '.join(PEER_MODES)}")
    if not wanted:
        fail("--peer-modes: no mode given")
    return wanted


def main_with_args(args) -> int:
    code, _ = run_bench(args)
    return code


def main(argv=None) -> int:
    import shlex

    argv = sys.argv[1:] if argv is None else list(argv)

    def body(args) -> int:
        args.command_line = "specray bench " + shlex.join(argv)  # what regenerates the run (the README quotes it)
        return main_with_args(args)

    return run_cli(build_parser(), body, argv)


if __name__ == "__main__":
    sys.exit(main())
