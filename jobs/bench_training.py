"""``specray bench-training``: a shipped drafter's training step, one sequence at a time against one batch, side by side.

    specray bench-training --only eagle --steps 6 --batch 8              # this machine (a GPU when there is one)

Both modes train the same drafter from the same start on the same draws of the committed self-distillation data
(``data/distill/<model>``), for ``--steps`` optimiser steps of ``--batch`` sequences each: ``one-by-one`` runs the
target's features and the drafter's forward and backward once per sequence (``TrainSpec.micro_batch=1``, how the
trainer works on a CPU), ``batched`` once per step over the step's right-padded windows (how it works on a GPU). The
modes alternate (one-by-one, batched, batched, one-by-one) so a drift of the machine's speed falls on both; the first
step of each run is a warm-up and not timed. Prints seconds per step, sequences per second and the ratio; ``--json``
prints them as JSON. Bad input prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from jobs.common import Parser, command, distill_data, fail

ROOT = Path(__file__).resolve().parent.parent
MODES = ("one-by-one", "batched")  # TrainSpec.micro_batch 1, and the whole step


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or Parser(prog="specray bench-training", description="A drafter's training step: one sequence at a time against one batch.")
    p.add_argument("--only", default="eagle", help="the shipped drafter to train (default eagle)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", help="self-distillation data (default data/distill/<model> in this repository)")
    p.add_argument("--steps", type=int, default=6, help="optimiser steps per run, the first a warm-up (default 6)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--max-sequences", type=int, help="draw from the first N training sequences only (default all: their lengths vary)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", action="store_true")
    return p


def measure(run, target, features, train_set, eval_set, model: str, micro: int, steps: int, batch: int) -> float:
    """Seconds per optimiser step after the first, training ``run`` with ``micro_batch=micro`` (nothing is saved)."""
    from training.trainer import TrainSpec, train

    spec = TrainSpec(
        run.recipe,
        run.knobs,
        run.loss,
        steps,
        batch,
        run.lr,
        run.seed,
        run.window,
        autocast=True,
        micro_batch=micro,
        checkpoint_every=10**9,
    )
    stamps: list[float] = []
    with tempfile.TemporaryDirectory() as out:
        train(
            spec,
            target,
            train_set,
            Path(out),
            model,
            progress=False,
            on_step=lambda step, row: stamps.append(time.perf_counter()),
            save=False,
            features=features,
            eval_examples=eval_set,
        )
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def main_with_args(args) -> int:
    from decoding.drafters.trained import get_recipe
    from decoding.model.loading import load_model, set_threads
    from training.features import TargetFeatures, distill_training_set
    from training.runs import SHIPPED_RECIPES

    choices = [n for n, r in SHIPPED_RECIPES.items() if r.recipe != "stop"]  # the stop heads are fitted at once
    if args.only not in choices:
        fail(f"--only: expected a shipped drafter trained step by step, one of {', '.join(choices)}; got {args.only!r}")
    if args.steps < 2 or args.batch < 1 or (args.max_sequences is not None and args.max_sequences < 2):
        fail("--steps must be >= 2 (the first is a warm-up), --batch >= 1 and --max-sequences >= 2")
    data = distill_data(args.data, args.model)
    set_threads(args.threads)
    run = SHIPPED_RECIPES[args.only]
    target = load_model(args.model, "float32", args.device).model
    depth = target.config.num_hidden_layers
    recipe = get_recipe(run.recipe)
    run = dataclasses.replace(run, knobs=recipe.check(run.knobs, depth))
    features = TargetFeatures(load_model(args.model, "bfloat16", args.device).model, recipe.data_layers(run.knobs, depth), run.max_context)
    train_set, eval_set = distill_training_set(data, args.max_sequences, 2)
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    for mode in ("one-by-one", "batched", "batched", "one-by-one"):
        micro = 1 if mode == "one-by-one" else args.batch
        seconds[mode].append(measure(run, target, features, train_set, eval_set, args.model, micro, args.steps, args.batch))
    device = str(next(target.parameters()).device)
    if device.startswith("cuda"):
        import torch

        device = torch.cuda.get_device_name(next(target.parameters()).device)
    result = {"drafter": args.only, "device": device, "batch": args.batch, "steps_timed": args.steps - 1, "window": run.window}
    for mode, values in seconds.items():
        per_step = sum(values) / len(values)
        result[mode] = {
            "seconds_per_step": round(per_step, 4),
            "sequences_per_s": round(args.batch / per_step, 2),
            "runs": [round(v, 4) for v in values],
        }
    result["speedup"] = round(result["one-by-one"]["seconds_per_step"] / result["batched"]["seconds_per_step"], 2)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.only} on {device}, {args.batch} sequences a step, windows of {run.window}:")
    for mode in MODES:
        r = result[mode]
        print(f"  {mode:<11} {r['seconds_per_step']:.3f} s/step  {r['sequences_per_s']:.2f} sequences/s  (runs: {r['runs']})")
    print(f"  batched is {result['speedup']}x one-by-one")
    return 0


main = command(build_parser, main_with_args)


if __name__ == "__main__":
    sys.exit(main())
