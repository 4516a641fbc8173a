"""`specray ship-drafters` / `python -m jobs.ship_drafters`: retrain the drafters specray ships for the bundled model.

    specray ship-drafters                                   # every shipped drafter, from the committed data
    specray ship-drafters --only eagle --on-cluster         # one of them, under Ray Train
    specray ship-drafters --repack                          # rewrite the shipped artifacts in the current storage
    specray ship-drafters --only eagle --init shipped --as-stored   # further, computing with the weights as stored

Each drafter of ``training.runs.SHIPPED_RECIPES`` (the feature head ``eagle``, the distilled draft ``distill``,
Kangaroo adapters ``kangaroo-l<exit layer>``) trains on the self-distillation data committed in
``data/distill/<model>`` (``specray distill`` made it) with the settings recorded there. Checkpoints live in
``$SPECRAY_HOME/ship/<model>/<name>`` (rerunning resumes); the finished artifact is copied into
``decoding/drafters/shipped/<model>/<name>`` (the methods' defaults) and the learning curves into ``--docs``.
``--repack`` trains nothing: it rewrites the shipped artifacts in the current storage (``decoding.drafters.storage``),
from the weights as trained where their run's checkpoint is still in ``$SPECRAY_HOME/ship`` (else from the weights as
stored), and measures their held-out agreement before and after on the data. ``--as-stored`` trains the weights as the
artifact stores them (``training.trainer.StoredView``): what training measures is what the shipped drafter computes
with, and a warm start from stored weights keeps what it learns. A warm start draws its sequences and windows with its
start's seed + 1 (``--seed`` sets it), so it does not see its start's first draws again. Bad input prints one line and
exits 2.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from jobs.common import Parser, check_cluster_flags, command, distill_data, fail, finite_float, output_dir

ROOT = Path(__file__).resolve().parent.parent


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or Parser(prog="specray ship-drafters", description="Retrain the drafters shipped for the bundled model.")
    p.add_argument("--model", default="smollm2-135m", help="the target (default smollm2-135m, the bundled model)")
    p.add_argument("--data", help="self-distillation data (default data/distill/<model> in this repository)")
    p.add_argument("--only", help="comma list of shipped drafters to train (default all)")
    p.add_argument("--shipped", help="where finished artifacts go (default decoding/drafters/shipped/<model>)")
    p.add_argument("--docs", default=str(ROOT / "docs" / "drafters"), help="where the learning curves go (default docs/drafters)")
    p.add_argument("--max-sequences", type=int, help="train on the first N training sequences only")
    p.add_argument("--steps-scale", type=finite_float, default=1.0, help="multiply every drafter's steps (e.g. 0.1 for a quick run)")
    p.add_argument("--batch", type=int, help="sequences per step for every drafter but the stop heads (default: each one's own)")
    p.add_argument("--init", choices=["shipped"], help="shipped: train each drafter further from its shipped artifact (warm start)")
    p.add_argument(
        "--as-stored", action="store_true", help="train the weights as the artifact stores them (straight through the storage's rounding)"
    )
    p.add_argument("--seed", type=int, help="the seed of the draws of sequences and windows (default 0; with --init, its start's seed + 1)")
    p.add_argument("--lr-scale", type=finite_float, default=1.0, help="multiply every drafter's learning rate (e.g. 0.5 with --init)")
    p.add_argument(
        "--max-minutes", type=finite_float, help="stop each drafter's training after M minutes; its artifact records the steps done"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--on-cluster", action="store_true", help="train with Ray Train (RAY_ADDRESS, else a local Ray)")
    p.add_argument("--workers", type=int, help="with --on-cluster: training workers")
    p.add_argument("--strategy", default="ddp", help="with --on-cluster: ddp (default) or deepspeed (GPUs)")
    p.add_argument("--repack", action="store_true", help="train nothing: rewrite the shipped artifacts in the current storage")
    p.add_argument("--eval-sequences", type=int, default=64, help="with --repack: held-out sequences to measure on (default 64)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the summaries as JSON")
    return p


def check_knobs(args) -> None:
    """The training knobs, before any work: scales, limits, and the Ray Train flags (with --on-cluster only)."""
    from training.ray_train import STRATEGIES

    if args.steps_scale <= 0 or args.lr_scale <= 0 or (args.max_sequences is not None and args.max_sequences < 2):
        fail("--steps-scale and --lr-scale must be > 0 and --max-sequences >= 2")
    if args.max_minutes is not None and args.max_minutes <= 0:
        fail("--max-minutes must be > 0")
    if args.batch is not None and args.batch < 1:
        fail("--batch must be >= 1")
    if args.strategy not in STRATEGIES:
        fail(f"--strategy: unknown strategy {args.strategy!r}; choose from {', '.join(STRATEGIES)}")
    if args.workers is not None and args.workers < 1:
        fail(f"--workers must be >= 1, got {args.workers}")
    check_cluster_flags(args, {"workers": None, "strategy": "ddp"})


def main_with_args(args) -> int:
    import dataclasses

    from decoding.model.loading import set_threads
    from decoding.paths import portable, specray_home
    from training.runs import SHIPPED_RECIPES, agreement_vs_data, learning_curves, publish, read_history, record_runs, train_on_data

    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else list(SHIPPED_RECIPES)
    unknown = sorted(set(names) - set(SHIPPED_RECIPES))
    if unknown:
        fail(f"--only: unknown shipped drafter {unknown[0]!r}; choose from {', '.join(SHIPPED_RECIPES)}")
    check_knobs(args)
    data = distill_data(args.data, args.model)
    shipped = output_dir(args.shipped, "--shipped") if args.shipped else ROOT / "decoding" / "drafters" / "shipped" / args.model
    set_threads(args.threads)
    if args.repack:
        return repack_shipped(args, names, data, shipped)
    results, histories = {}, {}
    ship_home = specray_home() / "ship" / Path(args.model).name  # checkpoints, one folder per drafter (rerunning resumes)
    for name in names:
        run = SHIPPED_RECIPES[name]
        run = dataclasses.replace(run, steps=max(1, round(run.steps * args.steps_scale)), max_sequences=args.max_sequences)
        if args.batch is not None and run.recipe != "stop":
            run = dataclasses.replace(run, batch=args.batch)
        run = dataclasses.replace(run, lr=run.lr * args.lr_scale, as_stored=run.as_stored or args.as_stored)
        if args.init == "shipped":
            if not (shipped / name / "drafter.json").is_file():
                fail(f"--init shipped: {shipped / name} holds no artifact to start {name} from")
            start = ship_home / f"{name}-init"  # a copy: the shipped one is replaced at the end
            shutil.rmtree(start, ignore_errors=True)
            shutil.copytree(shipped / name, start)
            if (ship_home / name / "checkpoint.pt").is_file():  # its run's weights as trained, used if they are its
                shutil.copy2(ship_home / name / "checkpoint.pt", start / "checkpoint.pt")
            # a warm start draws other sequences and windows than the run it continues (the draws are a function of
            # (seed, step), so with the same seed every warm start would see that run's first sequences again)
            before = json.loads((start / "drafter.json").read_text()).get("training", {}).get("spec", {}).get("seed", run.seed)
            run = dataclasses.replace(run, init=portable(start), seed=before + 1)
        if args.seed is not None:
            run = dataclasses.replace(run, seed=args.seed)
        work = ship_home / name
        print(f"{name}: {run.recipe} {run.knobs}, {run.steps} steps of {run.batch} sequences", file=sys.stderr)
        results[name] = train_on_data(
            run,
            data,
            work,
            args.model,
            args.device,
            on_cluster=args.on_cluster,
            workers=args.workers,
            strategy=args.strategy,
            progress=not args.no_progress,
            deadline=None if args.max_minutes is None else time.time() + 60 * args.max_minutes,
        )
        results[name]["shipped"] = publish(work, shipped / name)
        for key in ("artifact", "shipped"):  # the committed record names no place of this machine
            results[name][key] = portable(results[name][key])
    # the record and the curves cover every shipped drafter trained so far, not only this run's (runs of a few
    # drafters each, e.g. in parallel, add up)
    record = Path(args.docs) / "training.json"
    Path(args.docs).mkdir(parents=True, exist_ok=True)
    merged = {**_read_json(record), **results}
    record.write_text(json.dumps(merged, indent=1, sort_keys=True))
    for name in merged:
        histories[name] = read_history(ship_home / name)
    learning_curves({n: h for n, h in histories.items() if h}, Path(args.docs) / "learning_curves.png")
    device = next((r.get("device") for r in results.values() if r.get("device")), args.device)
    runs = record_runs(Path(args.docs) / "agreement_vs_data.json", results, device, data)
    agreement_vs_data(runs, Path(args.docs) / "agreement_vs_data.png")
    if args.json:
        print(json.dumps(results))
        return 0
    for name, r in results.items():
        after = ", ".join(f"{a:.3f}" for a in r["agreement_after"] or [])
        print(f"{name}: {r['train_sequences']} sequences, {r['train_seconds']}s; held-out top-1 agreement [{after}] -> {r['shipped']}")
    return 0


def repack_shipped(args, names: list[str], data: Path, shipped: Path) -> int:
    from decoding.drafters.storage import Storage
    from decoding.paths import specray_home
    from training.runs import SHIPPED_RECIPES, repack

    missing = [n for n in names if not (shipped / n / "drafter.json").is_file()]
    if missing:
        fail(f"--repack: {shipped / missing[0]} holds no artifact to repack")
    results = {}
    for name in names:
        print(f"{name}: repacking {shipped / name}", file=sys.stderr)
        storage = Storage(**SHIPPED_RECIPES[name].storage)  # each drafter's own encoding
        run = specray_home() / "ship" / Path(args.model).name / name / "checkpoint.pt"  # the weights as trained, if kept
        results[name] = repack(shipped / name, args.model, data, args.device, storage, args.eval_sequences, run)
    if args.json:
        print(json.dumps(results))
        return 0
    fmt = lambda xs: ", ".join(f"{x:.4f}" for x in xs or [])  # noqa: E731
    for name, r in results.items():
        print(
            f"{name}: {r['bytes_before'] / 1e6:.2f} MB -> {r['bytes_after'] / 1e6:.2f} MB; held-out top-1 agreement "
            f"[{fmt(r['agreement_before'])}] -> [{fmt(r['agreement_stored'])}]"
            + (" (from the weights as trained)" if r["from_checkpoint"] else "")
        )
    return 0


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


main = command(build_parser, main_with_args)


if __name__ == "__main__":
    sys.exit(main())
