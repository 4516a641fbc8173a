"""`specray ship-drafters` / `python -m jobs.ship_drafters`: retrain the drafters specray ships for the bundled model.

    specray ship-drafters                                   # every shipped drafter, from the committed data
    specray ship-drafters --only eagle --on-cluster         # one of them, under Ray Train
    specray ship-drafters --repack                          # rewrite the shipped artifacts in the current storage
    specray ship-drafters --only eagle --init shipped --as-stored   # further, computing with the weights as stored
    specray ship-drafters --check                           # the shipped drafters on the check set, by category

Each drafter of ``training.runs.SHIPPED_RECIPES`` (the feature head ``eagle``, the distilled draft ``distill``,
Kangaroo adapters ``kangaroo-l<exit layer>``) trains on the self-distillation data committed in
``data/distill/<model>`` (``specray distill`` made it) with the settings recorded there. Checkpoints live in
``$SPECRAY_HOME/ship/<model>/<name>`` (rerunning resumes; the shipped run's checkpoint is kept in ``<name>-shipped``
for warm starts and repacks); the finished artifact is copied into
``decoding/drafters/shipped/<model>/<name>`` (the methods' defaults) and the learning curves into ``--docs``, unless
the **check set** (``training.check_set``: the target's answers to the last prompts of each Spec-Bench category, none
of them in the data or the README's runs) finds it agreeing with the target less than the shipped one; then it stays
in ``$SPECRAY_HOME/ship`` and the shipped one stays (``--ship always`` ships it anyway; ``--check`` trains nothing
and measures the shipped drafters there).
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

from evaluation.workloads import DEFAULT_PROMPTS
from jobs.common import Parser, check_cluster_flags, command, distill_data, fail, finite_float, output_dir
from training.check_set import CHECK_PER_CATEGORY

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
    p.add_argument(
        "--refresh-vocab",
        action="store_true",
        help="with --init shipped: a trimmed head drafts over the data's most frequent tokens now (new ones start from the target's rows)",
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
    p.add_argument(
        "--ship",
        choices=["better", "always"],
        default="better",
        help="better (default): a retrained drafter replaces the shipped one only where it agrees with the target at least as "
        "well on the check set (training.check_set); always: in any case",
    )
    p.add_argument("--check", action="store_true", help="train nothing: measure the shipped drafters on the check set, by category")
    p.add_argument("--check-prompts", default=str(DEFAULT_PROMPTS), help="the check set's Spec-Bench style JSONL (default Spec-Bench)")
    p.add_argument(
        "--check-per-category",
        type=int,
        default=CHECK_PER_CATEGORY,
        help=f"the check set: the last N first turns of each category (default {CHECK_PER_CATEGORY})",
    )
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
    if args.refresh_vocab and args.init != "shipped":
        fail("--refresh-vocab refreshes a warm start's vocabulary: give it with --init shipped")
    if args.check_per_category < 1:
        fail(f"--check-per-category must be >= 1, got {args.check_per_category}")
    if args.strategy not in STRATEGIES:
        fail(f"--strategy: unknown strategy {args.strategy!r}; choose from {', '.join(STRATEGIES)}")
    if args.workers is not None and args.workers < 1:
        fail(f"--workers must be >= 1, got {args.workers}")
    check_cluster_flags(args, {"workers": None, "strategy": "ddp"})


def main_with_args(args) -> int:
    from decoding.model.loading import set_threads
    from training.runs import SHIPPED_RECIPES, agreement_vs_data, learning_curves, read_history, record_runs

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
    checker = Checker(args)
    if args.check:
        return check_shipped(args, names, shipped, checker)
    results = {name: train_one(args, name, data, shipped, checker) for name in names}
    # the record and the curves cover every shipped drafter trained so far, not only this run's (runs of a few
    # drafters each, e.g. in parallel, add up); a drafter the check kept from shipping is only in agreement_vs_data
    record = Path(args.docs) / "training.json"
    Path(args.docs).mkdir(parents=True, exist_ok=True)
    merged = {**_read_json(record), **{n: r for n, r in results.items() if r["shipped"]}}
    record.write_text(json.dumps(merged, indent=1, sort_keys=True))
    kept = [name for name in merged if results.get(name, {}).get("shipped", True)]  # a run not shipped is not the curve's
    histories = {n: h for n in kept if (h := read_history(shipped_run(args, n).parent))}
    if histories:
        learning_curves(histories, Path(args.docs) / "learning_curves.png")
    device = next((r.get("device") for r in results.values() if r.get("device")), args.device)
    runs = record_runs(Path(args.docs) / "agreement_vs_data.json", results, device, data)
    agreement_vs_data(runs, Path(args.docs) / "agreement_vs_data.png")
    if args.json:
        print(json.dumps(results))
        return 0
    for name, r in results.items():
        after = ", ".join(f"{a:.3f}" for a in r["agreement_after"] or [])
        where = r["shipped"] or f"not shipped (below the shipped one on the check set; kept in {r['artifact']})"
        print(f"{name}: {r['train_sequences']} sequences, {r['train_seconds']}s; held-out top-1 agreement [{after}] -> {where}")
    return 0


def ship_home(args) -> Path:
    """Where the runs train: one folder per drafter (its checkpoint: rerunning resumes)."""
    from decoding.paths import specray_home

    return specray_home() / "ship" / Path(args.model).name


def shipped_run(args, name: str) -> Path:
    """The checkpoint of the run that made the shipped artifact (its weights as trained): kept in ``<name>-shipped``
    when it was shipped, as the next run reuses ``<name>`` (one the check kept from shipping would take its place);
    else the run folder's (shipped before this was kept)."""
    kept = ship_home(args) / f"{name}-shipped" / "checkpoint.pt"
    return kept if kept.is_file() else ship_home(args) / name / "checkpoint.pt"


def keep_shipped_run(work: Path, keep: Path) -> None:
    """Copy a shipped run's checkpoint and history beside the other runs (a half-copied one is never read)."""
    tmp = keep.with_name(keep.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in ("checkpoint.pt", "history.json"):
        if (work / f).is_file():
            shutil.copy2(work / f, tmp / f)
    shutil.rmtree(keep, ignore_errors=True)
    tmp.rename(keep)


def train_one(args, name: str, data: Path, shipped: Path, checker: Checker) -> dict:
    """Train one shipped drafter; publish it unless the check set finds it below the shipped one (``--ship better``)."""
    import dataclasses

    from decoding.paths import portable
    from training.runs import SHIPPED_RECIPES, publish, train_on_data

    run = SHIPPED_RECIPES[name]
    run = dataclasses.replace(run, steps=max(1, round(run.steps * args.steps_scale)), max_sequences=args.max_sequences)
    if args.batch is not None and run.recipe != "stop":
        run = dataclasses.replace(run, batch=args.batch)
    run = dataclasses.replace(run, lr=run.lr * args.lr_scale, as_stored=run.as_stored or args.as_stored)
    if args.init == "shipped":
        if not (shipped / name / "drafter.json").is_file():
            fail(f"--init shipped: {shipped / name} holds no artifact to start {name} from")
        start = ship_home(args) / f"{name}-init"  # a copy: the shipped one is replaced at the end
        shutil.rmtree(start, ignore_errors=True)
        shutil.copytree(shipped / name, start)
        if shipped_run(args, name).is_file():  # its run's weights as trained, used if they are its
            shutil.copy2(shipped_run(args, name), start / "checkpoint.pt")
        # a warm start draws other sequences and windows than the run it continues (the draws are a function of
        # (seed, step), so with the same seed every warm start would see that run's first sequences again)
        before = json.loads((start / "drafter.json").read_text()).get("training", {}).get("spec", {}).get("seed", run.seed)
        run = dataclasses.replace(run, init=portable(start), seed=before + 1, refresh_vocab=args.refresh_vocab)
    if args.seed is not None:
        run = dataclasses.replace(run, seed=args.seed)
    work = ship_home(args) / name
    print(f"{name}: {run.recipe} {run.knobs}, {run.steps} steps of {run.batch} sequences", file=sys.stderr)
    deadline = None if args.max_minutes is None else time.time() + 60 * args.max_minutes
    cluster = {"on_cluster": args.on_cluster, "workers": args.workers, "strategy": args.strategy}
    result = train_on_data(run, data, work, args.model, args.device, **cluster, progress=not args.no_progress, deadline=deadline)
    ship = True
    if args.ship == "better" and run.recipe != "stop" and (shipped / name / "drafter.json").is_file():
        result["check"] = checker.compare({"new": Path(result["artifact"]), "shipped": shipped / name})
        ship = result["check"]["ship"]
    result["shipped"] = portable(publish(work, shipped / name)) if ship else None
    if ship:
        keep_shipped_run(work, ship_home(args) / f"{name}-shipped")
    result["artifact"] = portable(result["artifact"])  # the committed record names no place of this machine
    return result


class Checker:
    """The check set (``training.check_set``): the target's answers, made once per command when first needed."""

    def __init__(self, args):
        self.args, self._examples = args, None

    def examples(self) -> list[dict]:
        from training.check_set import check_examples, check_prompts

        if self._examples is None:
            from evaluation.workloads import WorkloadError

            path = Path(self.args.check_prompts)
            try:
                prompts = check_prompts(path, self.args.check_per_category)
            except WorkloadError as e:
                fail(f"--check-prompts: {e}")
            print(f"check set: the target answers {len(prompts)} prompts of {path.name}", file=sys.stderr)
            self._examples = check_examples(self.args.model, prompts, self.args.device)
        return self._examples

    def measure(self, artifacts: dict[str, Path]) -> dict[str, dict]:
        from training.check_set import check_agreement

        return check_agreement(artifacts, self.args.model, self.examples(), self.args.device)

    def compare(self, artifacts: dict[str, Path]) -> dict:
        """{"new": ..., "shipped": ... (check_agreement's), "ship": whether the new one is not below the shipped one}."""
        from training.check_set import better

        out = self.measure(artifacts)
        out["ship"] = better(out["new"]["agreement"], out["shipped"]["agreement"])
        fmt = lambda xs: ", ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        print(f"check set: new [{fmt(out['new']['agreement'])}], shipped [{fmt(out['shipped']['agreement'])}]", file=sys.stderr)
        return out


def check_shipped(args, names: list[str], shipped: Path, checker: Checker) -> int:
    """``--check``: the shipped drafters' agreement on the check set, per depth and by category (stop heads excluded)."""
    from training.runs import SHIPPED_RECIPES

    names = [n for n in names if SHIPPED_RECIPES[n].recipe != "stop"]
    missing = [n for n in names if not (shipped / n / "drafter.json").is_file()]
    if missing:
        fail(f"--check: {shipped / missing[0]} holds no artifact to check")
    if not names:
        fail("--check: stop heads predict acceptance, they do not draft; name a drafter with --only")
    results = checker.measure({n: shipped / n for n in names})
    if args.json:
        print(json.dumps(results))
        return 0
    print(check_table(results))
    return 0


def check_table(results: dict[str, dict]) -> str:
    """The check set's agreements as a table: a column per drafter; rows: each draft depth, then the first draft's
    agreement per category.

    >>> print(check_table({"eagle": {"agreement": [0.4, 0.3], "by_category": {"qa": 0.5}, "tokens": 9}}))
    top-1 agreement (9 answer tokens)  eagle
    depth 1                            0.400
    depth 2                            0.300
    qa (depth 1)                       0.500
    """
    names = list(results)
    depths = max(len(r["agreement"]) for r in results.values())
    rows = [(f"depth {i + 1}", [r["agreement"][i] if i < len(r["agreement"]) else None for r in results.values()]) for i in range(depths)]
    for c in sorted({c for r in results.values() for c in r["by_category"]}):
        rows.append((f"{c} (depth 1)", [r["by_category"].get(c) for r in results.values()]))
    first = f"top-1 agreement ({next(iter(results.values()))['tokens']} answer tokens)"
    width = max(len(first), *(len(label) for label, _ in rows))
    lines = [first.ljust(width) + "".join(f"  {n:>{max(5, len(n))}}" for n in names)]
    for label, values in rows:
        cells = ["-" if v is None else f"{v:.3f}" for v in values]
        lines.append(label.ljust(width) + "".join(f"  {c:>{max(5, len(n))}}" for c, n in zip(cells, names, strict=True)))
    return "\n".join(lines)


def repack_shipped(args, names: list[str], data: Path, shipped: Path) -> int:
    from decoding.drafters.storage import Storage
    from training.runs import SHIPPED_RECIPES, repack

    missing = [n for n in names if not (shipped / n / "drafter.json").is_file()]
    if missing:
        fail(f"--repack: {shipped / missing[0]} holds no artifact to repack")
    results = {}
    for name in names:
        print(f"{name}: repacking {shipped / name}", file=sys.stderr)
        storage = Storage(**SHIPPED_RECIPES[name].storage)  # each drafter's own encoding
        run = shipped_run(args, name)  # the weights as trained, if kept
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
