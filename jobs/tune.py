"""`specray tune` / `python -m jobs.tune`: search the best speculative configuration for a model and workload with Ray Tune.

    specray tune --model smollm2-135m --methods ngram,early-exit --categories summarization,rag --limit 3 \\
        --num-samples 20 --max-new-tokens 64 --publish

Each trial runs one configuration and AR back to back on every prompt (AR is
measured inside the same trial), reporting after each prompt: tokens/s,
speedup over AR, mean accepted tokens and greedy fidelity (identity with AR; a
divergence at a logit margin wider than the dtype's rounding fails the trial,
which then can never win). Optuna TPE proposes configs (starting from the
untuned defaults of each method), ASHA stops poor ones at prompt-count
milestones, and Ray runs as many trials at once as the cluster's CPUs allow.

Written under ``OUT/<name>/`` (``--out``, default ``$SPECRAY_HOME/tune``):
Tune's experiment state, ``trials.parquet`` (one row per trial),
``pareto.png`` (speedup vs mean accepted tokens) and ``best.json``, all before
anything is published. ``--verify-best`` (on by default with ``--publish``)
measures the winner against AR and the untuned defaults again, in this process.
``--publish [NAME]`` puts the winner into the registry (``--registry``, else
``SPECRAY_REDIS_URL``, else ``$SPECRAY_HOME/registry``) under NAME or
``<model>/<workload>/<method>``; if the registry is unreachable the command
says so in one line, names the files it kept, and exits 2.

An interrupted search (Ctrl-C) keeps its state: ``specray tune --resume OUT/<name>``
continues it (finished trials are kept) with the settings it was started with.
Connects to ``--address``/``RAY_ADDRESS`` when given, else starts a local Ray.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from decoding.config import SpecConfig
from decoding.paths import specray_home
from evaluation.workloads import DEFAULT_PROMPTS, WorkloadError, load_prompts, select, split_held_out
from jobs.common import Parser, add_config_args, command, config_from_args, fail, finite_float, output_dir, path_name

DEFAULT_METHODS = "ngram,early-exit,sps"


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or Parser(prog="specray tune", description="Search the best speculative configuration with Ray Tune.")
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma list of methods to search over (default {DEFAULT_METHODS})")
    add_config_args(p, method=False)
    p.add_argument("--prompts", help=f"Spec-Bench style JSONL (question_id, category, turns); default {DEFAULT_PROMPTS}")
    p.add_argument("--categories", help="comma list of categories (default: all in the file)")
    p.add_argument("--limit", type=int, help="at most N prompts per category")
    p.add_argument("--workload", help="workload name for the registry (default: the prompt file's name plus the categories)")
    p.add_argument("--range", action="append", default=[], metavar="KEY=LO:HI|KEY=a,b", help="narrow a knob's search range")
    p.add_argument("--num-samples", type=int, default=20, help="trials to run (default 20)")
    p.add_argument("--time-budget-s", type=finite_float, help="stop starting trials after S seconds")
    p.add_argument("--searcher", choices=["optuna", "random"], default="optuna", help="Optuna TPE (default) or Tune's random search")
    p.add_argument("--search-seed", type=int, default=0, help="seed of the searcher (default 0)")
    p.add_argument("--no-seed-defaults", action="store_true", help="do not start the search from each method's untuned defaults")
    p.add_argument("--no-early-stop", action="store_true", help="no ASHA: every trial runs every prompt")
    p.add_argument("--grace-period", type=int, default=1, help="ASHA: prompts every trial runs before it can be stopped (default 1)")
    p.add_argument("--reduction-factor", type=int, default=2, help="ASHA reduction factor (default 2)")
    p.add_argument("--cpus-per-trial", type=int, help="CPUs (and torch threads) per trial (default: --threads, else 1)")
    p.add_argument("--gpus-per-trial", type=finite_float, default=0.0, help="GPUs per trial (default 0)")
    p.add_argument("--max-concurrent", type=int, help="at most N trials at once (default: cluster CPUs // CPUs per trial)")
    p.add_argument("--max-failures", type=int, default=2, help="retries of a trial whose worker failed (default 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up generations per config in each trial (default 1)")
    p.add_argument(
        "--holdout",
        type=finite_float,
        default=0.5,
        help="fraction of every category's prompts kept out of the search; the winner and its method's defaults are "
        "re-measured on them (default 0.5; 0: re-measure on the tuning prompts)",
    )
    p.add_argument(
        "--verify-repeats", type=int, default=3, help="passes over the held-out prompts when re-measuring: the noise band (default 3)"
    )
    p.add_argument(
        "--publish", nargs="?", const="", metavar="NAME", help="put the winner into the registry (default name <model>/<workload>/<method>)"
    )
    p.add_argument(
        "--allow-lossy",
        action="store_true",
        help="let a lossy method (ead: unverified tokens) be the winner; it is labelled lossy and published as "
        "<model>/<workload>/<method>-lossy (without this flag lossy trials are measured but never chosen)",
    )
    p.add_argument("--registry", help="registry URL (redis://...) or directory (default SPECRAY_REDIS_URL, else $SPECRAY_HOME/registry)")
    p.add_argument(
        "--verify-best",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="re-measure the winner against AR (and the defaults) in this process (default: on with --publish)",
    )
    p.add_argument("--out", help="where experiments go (default $SPECRAY_HOME/tune)")
    p.add_argument("--name", help="experiment name (default tune-<time>)")
    p.add_argument("--resume", metavar="DIR", help="continue the interrupted experiment in DIR with its saved settings")
    p.add_argument("--address", help="Ray address to join (default RAY_ADDRESS, else start a local Ray)")
    p.add_argument("--verbose", type=int, default=1, help="Tune's progress output: 0 silent, 1 (default), 2 detailed")
    p.add_argument("--json", action="store_true", help="print the final summary as JSON")
    return p


# ---- settings ------------------------------------------------------------------------------------
def _split(text: str | None) -> list[str] | None:
    return [x.strip() for x in text.split(",") if x.strip()] if text else None


def workload_name(prompts_file: str, categories: list[str] | None) -> str:
    """``spec_bench`` for the bundled file, else the file's stem; plus the categories asked for.

    >>> workload_name(str(DEFAULT_PROMPTS), ["summarization", "rag"])
    'spec_bench-summarization-rag'
    """
    p = Path(prompts_file)
    stem = "spec_bench" if p.resolve() == DEFAULT_PROMPTS.resolve() else p.stem
    return "-".join([stem] + list(categories or []))


def settings_from_args(args):
    from tuning.search import TuneSettings
    from tuning.space import parse_range

    base = config_from_args(args)
    methods = _split(args.methods)
    if not methods:
        fail("--methods: no method given")
    for name, value, low in (
        ("--num-samples", args.num_samples, 1),
        ("--limit", args.limit, 1),
        ("--cpus-per-trial", args.cpus_per_trial, 1),
        ("--gpus-per-trial", args.gpus_per_trial, 0),
        ("--max-concurrent", args.max_concurrent, 1),
        ("--max-failures", args.max_failures, 0),
        ("--warmup", args.warmup, 0),
        ("--verify-repeats", args.verify_repeats, 1),
        ("--grace-period", args.grace_period, 1),
        ("--reduction-factor", args.reduction_factor, 2),
    ):
        if value is not None and value < low:
            fail(f"{name} must be >= {low}, got {value}")
    if not 0 <= args.holdout < 1:
        fail(f"--holdout must be in [0, 1), got {args.holdout}")
    if args.time_budget_s is not None and args.time_budget_s <= 0:
        fail(f"--time-budget-s must be > 0, got {args.time_budget_s}")
    fixed = [item.partition("=")[0].strip().replace("-", "_") for item in args.set]
    ranges = dict(parse_range(r) for r in args.range)
    prompts_file = str(Path(args.prompts).resolve()) if args.prompts else str(DEFAULT_PROMPTS)
    categories = _split(args.categories)
    out = output_dir(Path(args.out).resolve() if args.out else specray_home() / "tune", "--out")
    if args.name is not None:
        path_name(args.name, "--name")  # the experiment folder under --out
    return TuneSettings(
        base=base.to_dict(),
        methods=methods,
        name=args.name or time.strftime("tune-%Y%m%dT%H%M%S"),
        storage=str(out),
        prompts_file=prompts_file,
        categories=categories,
        limit=args.limit,
        workload=args.workload or workload_name(prompts_file, categories),
        fixed=fixed,
        ranges={k: {kk: list(vv) if isinstance(vv, tuple) else vv for kk, vv in v.items()} for k, v in ranges.items()},
        num_samples=args.num_samples,
        time_budget_s=args.time_budget_s,
        searcher=args.searcher,
        early_stop=not args.no_early_stop,
        grace_period=args.grace_period,
        reduction_factor=args.reduction_factor,
        seed=args.search_seed,
        cpus_per_trial=args.cpus_per_trial or base.threads or 1,
        gpus_per_trial=args.gpus_per_trial,
        max_concurrent=args.max_concurrent,
        max_failures=args.max_failures,
        warmup=args.warmup,
        seed_defaults=not args.no_seed_defaults,
        holdout=args.holdout,
        verify_repeats=args.verify_repeats,
        allow_lossy=args.allow_lossy,
    )


def load_workload(settings) -> list:
    try:
        return select(load_prompts(settings.prompts_file), settings.categories, settings.limit, source=settings.prompts_file)
    except WorkloadError as e:
        fail(str(e))


def settings_for(args):
    """The settings of a new search, or the saved ones of the experiment ``--resume`` names."""
    from tuning.search import TuneSettings, can_restore

    if not args.resume:
        return settings_from_args(args)
    exp = Path(args.resume).resolve()
    if not can_restore(exp):
        fail(f"--resume: {exp} is not a specray tune experiment that can be restored (no {exp}/specray_tune.json or Tune state)")
    settings = TuneSettings.load(exp)
    settings.storage, settings.name = str(exp.parent), exp.name  # the directory may have moved
    return settings


def check_trial_fits(settings, resources: dict) -> None:
    """Fail (one line) when one trial asks for more CPUs or GPUs than the whole cluster has: Tune would leave it
    pending for good, without a word (a cluster that grows nodes on demand can start with fewer: then ask for what
    it has, or join it once it has grown).

    >>> from types import SimpleNamespace
    >>> check_trial_fits(SimpleNamespace(cpus_per_trial=2, gpus_per_trial=0), {"CPU": 2.0})
    >>> check_trial_fits(SimpleNamespace(cpus_per_trial=1, gpus_per_trial=1), {"CPU": 2.0})
    Traceback (most recent call last):
    ...
    jobs.common.UsageError: --gpus-per-trial: a trial asks for 1 GPU and the cluster has 0 in all
    """
    for flag, unit, wanted in (("--cpus-per-trial", "CPU", settings.cpus_per_trial), ("--gpus-per-trial", "GPU", settings.gpus_per_trial)):
        have = resources.get(unit, 0.0)
        if wanted > have:
            fail(f"{flag}: a trial asks for {wanted:g} {unit} and the cluster has {have:g} in all")


def check_publish_name(name: str | None, registry: str | None = None, flag: str = "--publish") -> None:
    """Before the search: the name the winner is published under, and the registry it goes to (a URL of an unknown
    kind failed only after the trials, their results kept)."""
    if name is None:
        return
    from cluster.registry import InvalidName, RegistryError, open_registry, validate_name

    if name:
        try:
            validate_name(name)
        except InvalidName as e:
            fail(f"{flag}: {e}")
    try:
        open_registry(registry)
    except RegistryError as e:
        fail(f"--registry: {e}")


# ---- the run -------------------------------------------------------------------------------------
def run(args, callbacks=None) -> tuple[int, dict]:
    """Search (or resume), write results, verify and publish as asked; returns (exit code, summary)."""
    try:
        from ray import tune  # noqa: F401
    except ImportError:
        fail("specray tune needs Ray Tune: pip install 'specray[cluster]'")
    from cluster.runtime import connect, shutdown_if_started_here
    from tuning import results as res
    from tuning.search import build_space, model_depth, new_tuner, restore_tuner, trial_statuses, was_interrupted
    from tuning.search_report import render
    from tuning.trainable import TrialSetup

    settings = settings_for(args)
    base = settings.base_config
    prompts, held_out = split_held_out(load_workload(settings), settings.holdout)
    if not prompts:
        fail("no prompts selected")
    exp = settings.experiment_path
    if not args.resume and exp.exists() and any(exp.iterdir()):
        fail(f"{exp} already exists: choose another --name, or --resume it")
    check_publish_name(args.publish, args.registry)
    space = build_space(settings, model_depth(base))  # fails early (one line) on a bad model
    ray_info = connect(args.address)
    check_trial_fits(settings, ray_info["resources"])
    print(
        f"specray tune {settings.name}: {len(prompts)} prompts to tune on, {len(held_out)} held out, {settings.num_samples} trials, "
        f"Ray {ray_info['address']}",
        file=sys.stderr,
    )
    for line in space.describe():
        print(line, file=sys.stderr)
    setup = TrialSetup(space, base, prompts, warmup=settings.warmup, cpus_per_trial=settings.cpus_per_trial)
    t0 = time.time()
    tuner = restore_tuner(exp, setup, settings) if args.resume else new_tuner(settings, setup, callbacks, args.verbose)
    grid = tuner.fit()
    wall = time.time() - t0
    interrupted = was_interrupted(trial_statuses(grid), settings, wall)
    rows = res.rows_from_grid(grid, space, base)
    summary, best, winner = res.write_run(rows, settings, space, prompts, held_out, wall, bool(args.resume), interrupted)
    if interrupted:
        summary["resume"] = f"specray tune --resume {exp}"
    elif best is not None and (args.verify_best if args.verify_best is not None else args.publish is not None):
        from tuning.remeasure import verify

        summary["verify"] = verify(winner, space, base, held_out or prompts, settings.warmup, settings.verify_repeats, bool(held_out))
        res.write_verify(best, summary)
    render(summary, rows, file=sys.stdout, as_json=args.json)
    code = 0
    if interrupted:
        print(f"interrupted: {len(rows)} trial(s) kept in {exp}; continue with: specray tune --resume {exp}", file=sys.stderr)
        code = 130
    elif args.publish is not None:
        code = publish(args.publish, winner, best, summary, settings, args.registry)
    shutdown_if_started_here()
    return code, summary


def publish(name: str, winner: SpecConfig | None, best: dict | None, summary: dict, settings, registry: str | None) -> int:
    """The winner into the registry; exit code 1 without a winner, 2 when the registry fails (the results stay on disk)."""
    from cluster.registry import RegistryError, default_name
    from decoding.methods import method_of
    from tuning.results import publish_winner

    files = summary["files"]
    kept = f"results kept in {files['parquet']}, best config in {files['best_json']}"
    if winner is None:
        print(f"error: nothing to publish: no trial passed the fidelity check; {kept}", file=sys.stderr)
        return 1
    lossy = method_of(winner.method).lossy  # only with --allow-lossy: the name says so (the registry checks it too)
    name = name or default_name(settings.base_config.model, settings.workload, winner.method + ("-lossy" if lossy else ""))
    try:
        summary["published"] = publish_winner(name, winner, best, summary, settings.base_config, registry)
    except RegistryError as e:
        print(f"error: publishing {name!r} failed: {e}; nothing lost: {kept}", file=sys.stderr)
        return 2
    print(f"published {name} v{summary['published']['version']} to {summary['published']['registry']}")
    return 0


def main_with_args(args) -> int:
    code, _ = run(args)
    return code


main = command(build_parser, main_with_args)


if __name__ == "__main__":
    sys.exit(main())
