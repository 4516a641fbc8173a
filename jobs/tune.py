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
import json
import sys
import time
from pathlib import Path

from decoding.config import SpecConfig
from decoding.paths import specray_home
from evaluation.workloads import DEFAULT_PROMPTS, WorkloadError, load_prompts, select, split_held_out
from jobs.common import Parser, add_config_args, config_from_args, fail, output_dir, path_name, run_cli

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
    p.add_argument("--time-budget-s", type=float, help="stop starting trials after S seconds")
    p.add_argument("--searcher", choices=["optuna", "random"], default="optuna", help="Optuna TPE (default) or Tune's random search")
    p.add_argument("--search-seed", type=int, default=0, help="seed of the searcher (default 0)")
    p.add_argument("--no-seed-defaults", action="store_true", help="do not start the search from each method's untuned defaults")
    p.add_argument("--no-early-stop", action="store_true", help="no ASHA: every trial runs every prompt")
    p.add_argument("--grace-period", type=int, default=1, help="ASHA: prompts every trial runs before it can be stopped (default 1)")
    p.add_argument("--reduction-factor", type=int, default=2, help="ASHA reduction factor (default 2)")
    p.add_argument("--cpus-per-trial", type=int, help="CPUs (and torch threads) per trial (default: --threads, else 1)")
    p.add_argument("--gpus-per-trial", type=float, default=0.0, help="GPUs per trial (default 0)")
    p.add_argument("--max-concurrent", type=int, help="at most N trials at once (default: cluster CPUs // CPUs per trial)")
    p.add_argument("--max-failures", type=int, default=2, help="retries of a trial whose worker failed (default 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up generations per config in each trial (default 1)")
    p.add_argument(
        "--holdout",
        type=float,
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
    )


def load_workload(settings) -> list:
    try:
        return select(load_prompts(settings.prompts_file), settings.categories, settings.limit, source=settings.prompts_file)
    except WorkloadError as e:
        fail(str(e))


def model_depth(base: SpecConfig) -> int:
    """Decoder layers of the target (the bound of the layer knobs); loads the model in this process (cached)."""
    from decoding.model.adapter import ModelAdapter
    from decoding.model.models import load_model

    return len(ModelAdapter(load_model(base.model, base.dtype).model).layers)


def build_space(settings, depth: int):
    from tuning.space import SearchSpace

    base = settings.base_config
    ranges = {k: {kk: tuple(vv) if isinstance(vv, list) else vv for kk, vv in v.items()} for k, v in settings.ranges.items()}
    space = SearchSpace.build(settings.methods, depth, fixed=settings.fixed, ranges=ranges, draft_model=base.draft_model)
    space.check_base(base)
    return space


# ---- the run -------------------------------------------------------------------------------------
def trial_statuses(grid) -> list[str]:
    analysis = getattr(grid, "_experiment_analysis", None)
    trials = getattr(analysis, "trials", None) or []
    return [str(t.status) for t in trials]


def was_interrupted(statuses: list[str], settings, wall_s: float) -> bool:
    """A trial left unfinished, or fewer trials than asked with time budget left: Tune stopped on Ctrl-C (or SIGUSR1).

    >>> from types import SimpleNamespace as S
    >>> was_interrupted(["TERMINATED"] * 3, S(num_samples=3, time_budget_s=None), 10.0)
    False
    >>> was_interrupted(["TERMINATED"], S(num_samples=3, time_budget_s=None), 10.0)
    True
    >>> was_interrupted(["TERMINATED"], S(num_samples=3, time_budget_s=5.0), 10.0)  # the budget ended it
    False
    """
    if any(s not in ("TERMINATED", "ERROR") for s in statuses):
        return True
    budget_spent = settings.time_budget_s is not None and wall_s >= settings.time_budget_s
    return len(statuses) < settings.num_samples and not budget_spent


def run(args, callbacks=None) -> tuple[int, dict]:
    """Search (or resume), write results, verify and publish as asked; returns (exit code, summary)."""
    try:
        import ray  # noqa: F401
        from ray import tune  # noqa: F401
    except ImportError:
        fail("specray tune needs Ray Tune: pip install 'specray[cluster]'")
    from tuning import results as res
    from tuning.search import TuneSettings, can_restore, new_tuner, restore_tuner
    from tuning.trainable import TrialSetup

    if args.resume:
        exp = Path(args.resume).resolve()
        if not can_restore(exp):
            fail(f"--resume: {exp} is not a specray tune experiment that can be restored (no {exp}/specray_tune.json or Tune state)")
        settings = TuneSettings.load(exp)
        settings.storage, settings.name = str(exp.parent), exp.name  # the directory may have moved
    else:
        settings = settings_from_args(args)
    base = settings.base_config
    prompts, held_out = split_held_out(load_workload(settings), settings.holdout)
    if not prompts:
        fail("no prompts selected")
    if not args.resume and settings.experiment_path.exists() and any(settings.experiment_path.iterdir()):
        fail(f"{settings.experiment_path} already exists: choose another --name, or --resume it")
    publish_name = args.publish
    if publish_name:
        from cluster.registry import InvalidName, validate_name

        try:
            validate_name(publish_name)
        except InvalidName as e:
            fail(f"--publish: {e}")

    depth = model_depth(base)  # fails early (one line) on a bad model
    space = build_space(settings, depth)

    from cluster.runtime import connect, shutdown_if_started_here

    ray_info = connect(args.address)
    print(
        f"specray tune {settings.name}: {len(prompts)} prompts to tune on, {len(held_out)} held out, {settings.num_samples} trials, "
        f"Ray {ray_info['address']}",
        file=sys.stderr,
    )
    for line in space.describe():
        print(line, file=sys.stderr)
    setup = TrialSetup(space, base, prompts, warmup=settings.warmup, cpus_per_trial=settings.cpus_per_trial)
    t0 = time.time()
    tuner = restore_tuner(settings.experiment_path, setup, settings) if args.resume else new_tuner(settings, setup, callbacks, args.verbose)
    grid = tuner.fit()
    wall = time.time() - t0
    interrupted = was_interrupted(trial_statuses(grid), settings, wall)
    rows = res.rows_from_grid(grid, space, base)
    exp = settings.experiment_path
    meta = {
        "experiment": str(exp),
        "model": base.model,
        "dtype": base.dtype,
        "max_new_tokens": base.max_new_tokens,
        "workload": settings.workload,
        "prompts_file": settings.prompts_file,
        "categories": sorted({p.category for p in prompts}, key=[p.category for p in prompts].index),
        "prompts": len(prompts),
        "held_out_prompts": len(held_out),
        "space": space.to_dict(),
        "searcher": settings.searcher,
        "trials": len(rows),
        "num_samples": settings.num_samples,
        "wall_s": wall,
        "trials_per_hour": 3600.0 * len(rows) / wall if wall > 0 else None,
        "resumed": bool(args.resume),
        "interrupted": interrupted,
        "finished": res.now(),
        "title": f"{settings.name}: {base.model} on {settings.workload}",
    }
    written = res.write_outputs(rows, exp, meta)  # on disk before anything is published
    best = written["best"]
    summary = {**meta, "files": {k: str(v) for k, v in written["paths"].items()}, "best": None, "verify": None, "published": None}
    winner = None
    if best is not None:
        # the config as the trial ran it (threads = the trial's CPUs); published with the user's threads setting
        winner = SpecConfig.from_json(best["config_json"])
        summary["best"] = {"trial_id": best["trial_id"], "config": winner.to_dict(), **{k: best.get(k) for k in res.WINNER_METRICS}}

    code = 0
    if interrupted:
        summary["resume"] = f"specray tune --resume {exp}"
    elif best is not None and (args.verify_best if args.verify_best is not None else publish_name is not None):
        summary["verify"] = verify(winner, space, base, held_out or prompts, settings.warmup, settings.verify_repeats, bool(held_out))
        doc = res.best_document(best, meta)
        doc["verify"] = summary["verify"]
        res.write_json(doc, written["paths"]["best_json"])

    render(summary, rows, file=sys.stdout, as_json=args.json)
    if interrupted:
        print(f"interrupted: {len(rows)} trial(s) kept in {exp}; continue with: specray tune --resume {exp}", file=sys.stderr)
        code = 130
    elif publish_name is not None:
        code = do_publish(publish_name, winner, best, summary, settings, base, args.registry)
    shutdown_if_started_here()
    return code, summary


def verify(winner: SpecConfig, space, base: SpecConfig, prompts, warmup: int, repeats: int = 1, held_out: bool = False) -> dict:
    """The winner vs AR, and the untuned defaults of its method vs AR, measured again here (interleaved per prompt),
    on the held-out prompts when there are any, ``repeats`` passes: each figure comes with its noise band (the
    slowest and fastest pass), and the winner ``beats_defaults`` only when its band lies above the defaults'."""
    from tuning.resources import hosts_actors
    from tuning.trainable import decoder_for, measure

    default = next(p for p in space.default_points(base) if p["method"] == winner.method)
    default_cfg = space.to_config(default, base).replace(threads=winner.threads, device=winner.device)  # same host, same device
    extra = {"defaults": default_cfg} if default_cfg != winner else {}
    if extra and hosts_actors(winner.to_dict()) and not _room_for_two_pairs(winner):
        print("the cluster holds one draft/target worker pair at a time: the defaults are not re-measured", file=sys.stderr)
        extra = {}
    split = "held-out" if held_out else "tuning"
    if not held_out:
        print("no held-out prompts (--holdout 0, or no category has 2 prompts): re-measuring on the tuning prompts", file=sys.stderr)
    print(f"verifying the winner outside Tune on {len(prompts)} {split} prompts, {repeats} pass(es)...", file=sys.stderr)
    m = measure(winner, prompts, warmup=warmup, extra=extra, build=decoder_for, repeats=repeats)
    d = m.get("extra", {}).get("defaults", m)
    keys = (
        "speedup",
        "speedup_band_low",
        "speedup_band_high",
        "tokens_per_s",
        "ar_tokens_per_s",
        "mean_accepted_tokens",
        "identical_fraction",
        "suspicious",
        "fidelity_ok",
    )
    beats = None
    if extra and m.get("speedup_band_low") is not None and d.get("speedup_band_high") is not None:
        beats = m["speedup_band_low"] > d["speedup_band_high"]
    return {
        "prompts": split,
        "prompt_count": len(prompts),
        "repeats": repeats,
        "winner": {k: m.get(k) for k in keys},
        "defaults": {"config": default_cfg.to_dict(), **{k: d.get(k) for k in keys}},
        "winner_is_defaults": not extra,
        "winner_over_defaults": (m["speedup"] / d["speedup"]) if m.get("speedup") and d.get("speedup") else None,
        "beats_defaults": beats,
    }


def _room_for_two_pairs(cfg: SpecConfig) -> bool:
    import ray

    from cluster.placement import PlacementError, plan_placement

    try:
        plan = plan_placement(cfg, ray.nodes())
    except PlacementError:
        return False
    need = sum(b.get("CPU", 0.0) for b in plan.bundles)
    return ray.available_resources().get("CPU", 0.0) >= 2 * need


def do_publish(
    name: str, winner: SpecConfig | None, best: dict | None, summary: dict, settings, base: SpecConfig, registry: str | None
) -> int:
    from cluster.registry import RegistryError, default_name
    from tuning import results as res

    files = summary["files"]
    kept = f"results kept in {files['parquet']}, best config in {files['best_json']}"
    if winner is None:
        print(f"error: nothing to publish: no trial passed the fidelity check; {kept}", file=sys.stderr)
        return 1
    name = name or default_name(base.model, settings.workload, winner.method)
    published = winner.replace(threads=base.threads)
    metrics = {k: best.get(k) for k in res.WINNER_METRICS}
    metrics["tuning"] = {
        "experiment": summary["experiment"],
        "trial_id": best["trial_id"],
        "trials": summary["trials"],
        "workload": settings.workload,
        "prompts": summary["prompts"],
        "categories": summary["categories"],
    }
    if summary.get("verify"):
        metrics["verify"] = summary["verify"]
        metrics["speedup_verified"] = summary["verify"]["winner"]["speedup"]
    source = {"tool": "specray tune", "experiment": summary["experiment"], "trials_parquet": files["parquet"]}
    try:
        location, version = res.publish(name, published, metrics, registry, source)
    except RegistryError as e:
        print(f"error: publishing {name!r} failed: {e}; nothing lost: {kept}", file=sys.stderr)
        return 2
    summary["published"] = {"name": name, "version": version, "registry": location}
    print(f"published {name} v{version} to {location}")
    return 0


# ---- the report -----------------------------------------------------------------------------------
def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def render(summary: dict, rows: list[dict], file=None, as_json: bool = False, top: int = 10) -> None:
    file = file or sys.stdout
    if as_json:
        print(json.dumps(summary, indent=2, default=str), file=file)
        return
    from tuning.space import METHOD_KNOBS

    print("", file=file)
    print(
        f"specray tune {Path(summary['experiment']).name}: {summary['trials']} trials in {summary['wall_s']:.0f}s "
        f"({_f(summary['trials_per_hour'], '{:.0f}')} trials/hour), {summary['prompts']} prompts, {summary['model']} {summary['dtype']}"
        + (" (INTERRUPTED)" if summary["interrupted"] else ""),
        file=file,
    )
    head = ["trial", "method", "knobs", "prompts", "speedup", "tau", "identical", "suspicious", "note"]
    ranked = sorted(rows, key=lambda r: (bool(r["best"]), r.get("score") or 0.0), reverse=True)
    table = []
    for r in ranked[:top]:
        knobs = " ".join(f"{k.field}={r[k.field]}" for k in METHOD_KNOBS.get(r["method"], ()) if r.get(k.field) is not None)
        note = "BEST" if r["best"] else ""
        if r.get("error"):
            note = "error"
        elif not r.get("valid"):
            note = "invalid: " + str(r.get("invalid_reason"))[:40]
        elif not r.get("fidelity_ok"):
            note = "FAILED FIDELITY"
        elif not r.get("complete"):
            note = (note + " stopped early").strip()
        if r.get("pareto"):
            note = (note + " pareto").strip()
        ident = f"{r['identical']}/{r['compared']}" if r.get("compared") else "-"
        table.append(
            [
                str(r["trial_id"]),
                str(r["method"]),
                knobs,
                f"{r.get('prompts') or 0}/{r.get('prompts_total') or summary['prompts']}",
                _f(r.get("speedup")),
                _f(r.get("mean_accepted_tokens")),
                ident,
                _f(r.get("suspicious"), "{}"),
                note,
            ]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table, strict=False)]
    for line in [head] + table:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=False)).rstrip(), file=file)
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
        v = summary.get("verify")
        if v:
            where = f"on {v.get('prompt_count', '?')} {v.get('prompts', 'tuning')} prompts x {v.get('repeats', 1)} pass(es)"

            def band(fig: dict) -> str:
                lo, hi = fig.get("speedup_band_low"), fig.get("speedup_band_high")
                return f" [{_f(lo)}, {_f(hi)}]" if lo is not None and hi is not None else ""

            if v["winner_is_defaults"]:
                print(f"verified outside Tune {where}: winner {_f(v['winner']['speedup'])}x{band(v['winner'])} over AR "
                      "(the winner is the untuned defaults)", file=file)  # fmt: skip
            else:
                verdict = {True: "beyond the noise band", False: "within the noise band", None: "no band (1 pass)"}[v.get("beats_defaults")]
                print(
                    f"verified outside Tune {where}: winner {_f(v['winner']['speedup'])}x{band(v['winner'])} over AR; untuned "
                    f"defaults {_f(v['defaults']['speedup'])}x{band(v['defaults'])}; winner / defaults "
                    f"{_f(v['winner_over_defaults'])} ({verdict})",
                    file=file,
                )
        print("best config (JSON):", file=file)
        print(json.dumps(best["config"], sort_keys=True), file=file)
    for k, p in summary["files"].items():
        print(f"{k}: {p}", file=file)


def main_with_args(args) -> int:
    code, _ = run(args)
    return code


def main(argv=None) -> int:
    return run_cli(build_parser(), main_with_args, argv)


if __name__ == "__main__":
    sys.exit(main())
