"""`specray train-drafter` / `python -m jobs.train_drafter`: train a drafter on the target's own outputs.

    specray train-drafter --recipe kangaroo --model smollm2-135m --knob exit_layer=10 \\
        --prompts data/spec_bench/question.jsonl --limit 5 --max-new-tokens 64 --steps 300 --name kangaroo-l10

1. data: the target answers the prompts greedily (method ar); tokens and the
   hidden states the recipe needs go to Parquet shards, cached under
   ``$SPECRAY_HOME/drafter-data`` (``--data-dir`` to choose) and shared by recipes;
2. training: plain torch on this machine (checkpoints in the output directory,
   resumed by rerunning the same command), or Ray Train on a cluster
   (``--on-cluster`` or RAY_ADDRESS set; ``--strategy deepspeed`` needs GPUs and deepspeed);
3. the artifact (``drafter.safetensors`` + ``drafter.json`` + ``loss.png``) goes to
   ``--out`` or ``$SPECRAY_HOME/drafters/<name>``; use it with
   ``--method trained --set drafter=<name>`` (or ``specray bench --methods ar,trained:<name>``).

Bad input prints one line naming the problem and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from decoding.config import DEVICE_RE
from evaluation.workloads import DEFAULT_PROMPTS, WorkloadError, load_prompts, select
from jobs.common import Parser, command, fail, finite_float, output_dir, path_name

RECIPE_NAMES = ("kangaroo", "medusa", "hydra", "feature", "distill", "eagle", "stop")
LOSS_NAMES = ("kl", "tvdpp", "ce")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or Parser(prog="specray train-drafter", description="Train a drafter (adapter, heads, feature head, draft model).")
    p.add_argument("--recipe", required=True, help=f"one of {', '.join(RECIPE_NAMES)}")
    p.add_argument("--model", default="smollm2-135m", help="the target: smollm2-135m (default) or a local HF model directory")
    p.add_argument(
        "--data",
        help="a `specray distill` data directory: train on its token ids, the target's hidden states computed as training "
        "draws each window (no --prompts generation); its held-out split is the evaluation set",
    )
    p.add_argument("--max-sequences", type=int, help="with --data: train on the first N training sequences (data-size curves)")
    p.add_argument("--eval-sequences", type=int, default=64, help="with --data: held-out sequences to evaluate on (default 64)")
    p.add_argument("--features-quant", default="auto", help="with --data: the target's weights when it computes features (default auto)")
    p.add_argument("--eval-every", type=int, default=0, help="held-out agreement every N steps (the learning curve; default: at the end)")
    p.add_argument("--prompts", help=f"Spec-Bench style JSONL (default {DEFAULT_PROMPTS})")
    p.add_argument("--categories", help="comma list of categories (default all)")
    p.add_argument("--limit", type=int, help="at most N prompts per category")
    p.add_argument("--skip", type=int, default=0, help="skip the first N prompts of each category (keep them for the bench)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="response length per prompt (default 128)")
    p.add_argument(
        "--knob",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="recipe knob, e.g. exit_layer=10, num_heads=4, source=smollm2-135m/eagle (stop)",
    )
    p.add_argument("--loss", default="kl", help=f"one of {', '.join(LOSS_NAMES)} (default kl)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=4, help="sequences per optimiser step (default 4)")
    p.add_argument("--lr", type=finite_float, default=1e-3)
    p.add_argument(
        "--window",
        type=int,
        default=256,
        help="train on N consecutive positions of each sequence: a random window of the stored ones (the last 512) per draw (default 256)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-vocab", type=int, default=0, help="losses over the data's N most frequent tokens (0 = all; cheaper on CPU)")
    p.add_argument("--max-minutes", type=finite_float, help="stop training after this long (the artifact is saved at that step)")
    p.add_argument("--data-dtype", default="bfloat16", help="dtype the target generates the data in (default bfloat16)")
    p.add_argument("--data-dir", help="where the data set lives (default: a cache under $SPECRAY_HOME/drafter-data)")
    p.add_argument("--name", help="artifact name under $SPECRAY_HOME/drafters (default recipe-model-knobs)")
    p.add_argument("--out", help="artifact directory (overrides --name)")
    p.add_argument("--threads", type=int, help="torch threads")
    p.add_argument("--device", default="auto", help="where the target runs and the drafter trains: auto, cpu, cuda, cuda:N")
    p.add_argument("--on-cluster", action="store_true", help="train with Ray Train (RAY_ADDRESS, else a local Ray)")
    p.add_argument("--workers", type=int, help="with --on-cluster: training workers (default: 1 per GPU, else 1)")
    p.add_argument("--strategy", default="ddp", help="with --on-cluster: ddp (default) or deepspeed (ZeRO; GPUs and deepspeed needed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def parse_knobs(items: list[str]) -> dict:
    knobs = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            fail(f"--knob: expected KEY=INT, got {item!r}")
        try:
            knobs[key] = int(value)
        except ValueError:
            knobs[key] = value.strip()  # a name (the stop head's source drafter); the recipe checks its knobs
    return knobs


def check_args(args) -> None:
    if args.recipe not in RECIPE_NAMES:
        fail(f"--recipe: unknown recipe {args.recipe!r}; choose from {', '.join(RECIPE_NAMES)}")
    if args.loss not in LOSS_NAMES:
        fail(f"--loss: unknown loss {args.loss!r}; choose from {', '.join(LOSS_NAMES)}")
    if args.train_vocab < 0:
        fail(f"--train-vocab: must be >= 0, got {args.train_vocab}")
    if args.skip < 0:
        fail(f"--skip: must be >= 0, got {args.skip}")
    if args.max_minutes is not None and args.max_minutes <= 0:
        fail(f"--max-minutes: must be > 0, got {args.max_minutes}")
    if args.name is not None:
        path_name(args.name, "--name")  # it becomes a folder under $SPECRAY_HOME/drafters
    if args.out is not None:
        output_dir(args.out, "--out")
    for name in ("steps", "batch", "window", "max_new_tokens"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.lr <= 0:
        fail(f"--lr: must be > 0, got {args.lr}")
    if args.data_dtype not in ("float32", "bfloat16"):
        fail(f"--data-dtype: unknown dtype {args.data_dtype!r}; choose from float32, bfloat16")
    from training.ray_train import STRATEGIES

    if args.strategy not in STRATEGIES:
        fail(f"--strategy: unknown strategy {args.strategy!r}; choose from {', '.join(STRATEGIES)}")
    if args.threads is not None and args.threads < 1:
        fail(f"--threads: must be >= 1, got {args.threads}")
    if args.data is not None and not (Path(args.data) / "manifest.json").is_file():
        fail(f"--data: {args.data} is not a `specray distill` data directory (no manifest.json)")
    if (args.max_sequences is not None and args.max_sequences < 2) or args.eval_sequences < 1:
        fail("--max-sequences must be >= 2 and --eval-sequences >= 1")
    if DEVICE_RE.fullmatch(args.device) is None:
        fail(f"--device: unknown device {args.device!r}; choose from auto, cpu, cuda, cuda:N")


def _progress(label: str, quiet: bool):
    if quiet:
        return None

    def show(done: int, total: int) -> None:
        print(f"\r{label}: {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)

    return show


def main_with_args(args) -> int:
    check_args(args)
    knobs = parse_knobs(args.knob)
    if args.data is not None:
        return train_from_data(args, knobs)
    try:
        prompts = load_prompts(args.prompts)
        cats = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
        limit = None if args.limit is None else args.limit + args.skip
        prompts = select(prompts, cats, limit, source=str(args.prompts or DEFAULT_PROMPTS))
    except WorkloadError as e:
        fail(str(e))
    if args.skip:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] > args.skip:
                kept.append(p)
        prompts = kept
    if len(prompts) < 2:
        fail(f"--prompts: need at least 2 prompts (one is held out for evaluation), got {len(prompts)}")

    from decoding.config import SpecConfig  # heavy imports after the cheap checks
    from decoding.drafters.trained import get_recipe
    from decoding.in_process import SpecDecoder
    from decoding.model.loading import load_model, model_fingerprint
    from decoding.paths import portable, specray_home
    from training.data import data_dir, generate_data, load_examples
    from training.trainer import TrainSpec

    decoder = SpecDecoder(SpecConfig(model=args.model, dtype=args.data_dtype, threads=args.threads, device=args.device))
    depth = len(decoder.target.layers)
    recipe = get_recipe(args.recipe)
    knobs = recipe.check(knobs, depth)
    layers = recipe.data_layers(knobs, depth)
    fp = model_fingerprint(decoder.loaded.model)
    ddir = Path(args.data_dir) if args.data_dir else data_dir(fp, prompts, args.max_new_tokens, 512, args.data_dtype)
    t0 = time.perf_counter()
    generate_data(decoder, prompts, layers, ddir, args.max_new_tokens, progress=_progress("data", args.no_progress))
    data_s = time.perf_counter() - t0

    name = args.name or f"{args.recipe}-{Path(args.model).name}" + "".join(f"-{k}{v}" for k, v in sorted(knobs.items()))
    out = Path(args.out) if args.out else specray_home() / "drafters" / name
    spec = TrainSpec(args.recipe, knobs, args.loss, args.steps, args.batch, args.lr, args.seed, args.window, train_vocab=args.train_vocab)
    target = load_model(args.model, "float32", args.device).model  # training runs in float32
    extra = {"data_dir": portable(ddir), "data_seconds": round(data_s, 1), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens}
    t1 = time.perf_counter()
    if args.on_cluster or os.environ.get("RAY_ADDRESS"):
        from training.ray_train import train_on_cluster

        training = train_on_cluster(spec, args.model, ddir, layers, out, workers=args.workers, strategy=args.strategy, extra=extra)
    else:
        from training.trainer import train

        examples = load_examples(ddir, layers)
        deadline = None if args.max_minutes is None else time.time() + 60 * args.max_minutes
        training = train(spec, target, examples, out, args.model, progress=not args.no_progress, extra_training=extra, deadline=deadline)
    result = {
        "artifact": str(out),
        "recipe": args.recipe,
        "knobs": knobs,
        "data_seconds": round(data_s, 1),
        "train_seconds": round(time.perf_counter() - t1, 1),
        "loss_first": training.get("loss_first"),
        "loss_last": training.get("loss_last"),
        "agreement_before": training.get("eval_agreement_before"),
        "agreement_after": training.get("eval_agreement"),
    }
    if args.json:
        print(json.dumps(result))
    else:
        fmt = lambda xs: ", ".join(f"{x:.3f}" for x in xs or [])  # noqa: E731
        print(f"{args.recipe} {knobs}: artifact {out}")
        print(f"  data {result['data_seconds']}s, training {result['train_seconds']}s", end="")
        print(f", loss {result['loss_first']:.4f} -> {result['loss_last']:.4f}")
        print(f"  held-out top-1 agreement per head: before [{fmt(result['agreement_before'])}] after [{fmt(result['agreement_after'])}]")
        print(f"  use: --method trained --set drafter={out}")
    return 0


def train_from_data(args, knobs: dict) -> int:
    """--data: self-distillation token ids, features computed on the fly (locally or under Ray Train)."""
    from decoding.paths import specray_home
    from training.runs import DataRun, train_on_data

    name = args.name or f"{args.recipe}-{Path(args.model).name}" + "".join(f"-{k}{v}" for k, v in sorted(knobs.items()))
    out = Path(args.out) if args.out else specray_home() / "drafters" / name
    run = DataRun(
        args.recipe,
        knobs,
        args.steps,
        args.batch,
        args.lr,
        args.window,
        args.loss,
        args.seed,
        args.max_sequences,
        args.eval_sequences,
        args.eval_every,
    )
    deadline = None if args.max_minutes is None else time.time() + 60 * args.max_minutes
    on_cluster = bool(args.on_cluster or os.environ.get("RAY_ADDRESS"))
    result = train_on_data(
        run,
        Path(args.data),
        out,
        args.model,
        args.device,
        args.features_quant,
        on_cluster,
        args.workers,
        args.strategy,
        not args.no_progress,
        deadline,
    )
    if args.json:
        print(json.dumps(result))
    else:
        fmt = lambda xs: ", ".join(f"{x:.3f}" for x in xs or [])  # noqa: E731
        print(f"{args.recipe} {result['knobs']}: artifact {out} ({result['train_sequences']} sequences, {result['train_seconds']}s)")
        print(f"  held-out top-1 agreement per step: before [{fmt(result['agreement_before'])}] after [{fmt(result['agreement_after'])}]")
    return 0


main = command(build_parser, main_with_args)


if __name__ == "__main__":
    sys.exit(main())
