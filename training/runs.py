"""Training a drafter on self-distillation data (``specray distill``'s token ids), locally or under Ray Train, and the
drafters specray ships for the bundled model (``SHIPPED_RECIPES``; ``specray ship-drafters`` retrains them).

The target's hidden states are computed as training draws each window (``training.features``); the drafter trains
in float32 with bfloat16 autocast, and its artifact is stored in bfloat16 (each shipped artifact stays under 30 MB).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decoding.errors import ConfigError
from decoding.paths import portable
from training.stop_head import train_stop_head


@dataclass(frozen=True)
class DataRun:
    """One training on data: the recipe and its knobs, the optimisation, the data selection."""

    recipe: str
    knobs: dict = field(default_factory=dict)
    steps: int = 200
    batch: int = 4
    lr: float = 1e-3
    window: int = 384
    loss: str = "kl"
    seed: int = 0
    max_sequences: int | None = None
    eval_sequences: int = 64
    eval_every: int = 0
    max_context: int | None = 768  # tokens the target sees up to a window's end when it computes features


# The drafters shipped for the bundled model: name -> how it is trained (``specray ship-drafters``). Exit layers of the
# Kangaroo adapters span the range Tune's exit-layer search covers.
SHIPPED_RECIPES: dict[str, DataRun] = {
    "eagle": DataRun("eagle", {"draft_vocab": 8192, "ttt_steps": 3}, steps=3000, batch=4, lr=1e-3, eval_every=250),
    # 3 layers and a 4,096-token head: 4 layers with an 8,192-token head are 37 MB in bfloat16, over the 30 MB bound
    "distill": DataRun("distill", {"draft_layers": 3, "draft_vocab": 4096}, steps=1500, batch=4, lr=5e-4, eval_every=250),
    "kangaroo-l6": DataRun("kangaroo", {"exit_layer": 6, "draft_vocab": 8192}, steps=800, batch=4, lr=1e-3, eval_every=200),
    "kangaroo-l12": DataRun("kangaroo", {"exit_layer": 12, "draft_vocab": 8192}, steps=800, batch=4, lr=1e-3, eval_every=200),
    # SpecDec++'s stop heads (decoding/drafters/stop_head.py), one per shipped drafter and one for the target's own head on
    # its upper layers (early exit without an adapter, SWIFT, DEL): 161 parameters each, a few minutes of the CPU
    **{
        f"stop-{source}": DataRun(
            "stop",
            {"source": f"smollm2-135m/{source}" if source != "exit" else "exit", "hidden": 16},
            steps=100,
            batch=2,
            lr=1e-2,
            window=128,
            eval_sequences=16,
        )
        for source in ("eagle", "distill", "kangaroo-l6", "exit")
    },
}


def train_on_data(
    run: DataRun,
    data: Path,
    out: Path,
    model: str = "smollm2-135m",
    device: str = "auto",
    features_quant: str = "auto",
    on_cluster: bool = False,
    workers: int | None = None,
    strategy: str = "ddp",
    progress: bool = True,
    deadline: float | None = None,
) -> dict:
    """Train (or resume) ``run`` on the data in ``data``; the artifact goes to ``out``. Returns a summary."""
    from decoding.drafters.trained import get_recipe
    from decoding.model.loading import load_model
    from training.features import TargetFeatures, distill_training_set
    from training.trainer import TrainSpec

    if run.recipe == "stop":  # 161 parameters: every row computed once, then fitted at once (no cluster needed)
        return train_stop_head(run, Path(data), Path(out), model, device, features_quant, deadline)

    target = load_model(model, "float32", device).model  # the drafter's shared parts train in float32
    depth = target.config.num_hidden_layers
    recipe = get_recipe(run.recipe)
    knobs = recipe.check(run.knobs, depth)
    layers = recipe.data_layers(knobs, depth)
    train_set, eval_set = distill_training_set(data, run.max_sequences, run.eval_sequences)
    if len(train_set) < 2 or not eval_set:
        raise ConfigError("data", f"{data} has {len(train_set)} training and {len(eval_set)} held-out sequences; need 2 and 1")
    spec = TrainSpec(
        run.recipe,
        knobs,
        run.loss,
        run.steps,
        run.batch,
        run.lr,
        run.seed,
        run.window,
        autocast=True,
        eval_every=run.eval_every,
    )
    tokens = sum(int(e["tokens"].shape[0] - e["answer_from"]) for e in train_set)
    extra = {"data": portable(data), "train_sequences": len(train_set), "train_answer_tokens": tokens, "eval_sequences": len(eval_set)}
    t0 = time.perf_counter()
    if on_cluster:
        from training.ray_train import train_on_cluster

        distill = {
            "max_sequences": run.max_sequences,
            "eval_sequences": run.eval_sequences,
            "quant": features_quant,
            "max_context": run.max_context,
        }
        training = train_on_cluster(spec, model, Path(data), layers, out, workers=workers, strategy=strategy, extra=extra, distill=distill)
    else:
        from training.trainer import train

        features = TargetFeatures(load_model(model, "bfloat16", device, features_quant).model, layers, run.max_context)
        training = train(
            spec,
            target,
            train_set,
            out,
            model,
            progress=progress,
            extra_training=extra,
            deadline=deadline,
            features=features,
            eval_examples=eval_set,
            weights_dtype=torch.bfloat16,
        )
    return _summary(run, out, knobs, train_set, tokens, time.perf_counter() - t0, training)


def _summary(run: DataRun, out: Path, knobs: dict, train_set: list, tokens: int, seconds: float, training: dict) -> dict:
    """What :func:`train_on_data` returns: the artifact, its recipe and data, and the figures of its training."""
    return {
        "artifact": str(out),
        "recipe": run.recipe,
        "knobs": knobs,
        "train_sequences": len(train_set),
        "train_answer_tokens": tokens,
        "train_seconds": round(seconds, 1),
        "steps": training.get("steps"),
        "loss_first": training.get("loss_first"),
        "loss_last": training.get("loss_last"),
        "agreement_before": training.get("eval_agreement_before"),
        "agreement_after": training.get("eval_agreement"),
    }


def publish(work: Path, shipped: Path) -> Path:
    """Copy a trained artifact's weights and description (not its checkpoint) into the shipped folder, atomically."""
    from decoding.drafters.artifacts import DESCRIPTION, WEIGHTS

    shipped.parent.mkdir(parents=True, exist_ok=True)
    tmp = shipped.with_name(shipped.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name in (WEIGHTS, DESCRIPTION):
        shutil.copy2(Path(work) / name, tmp / name)
    shutil.rmtree(shipped, ignore_errors=True)
    tmp.rename(shipped)
    return shipped


def learning_curves(histories: dict[str, list[dict]], path: Path) -> None:
    """One figure: per drafter, training loss by step and held-out top-1 agreement (first draft) against distinct
    training sequences seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, history in histories.items():
        left.plot([h["step"] for h in history], [h["loss"] for h in history], lw=0.8, label=name)
        evals = [h for h in history if "eval_agreement" in h]
        if evals:
            right.plot([h["sequences_seen"] for h in evals], [h["eval_agreement"][0] for h in evals], marker="o", label=name)
    left.set(xlabel="step", ylabel="training loss (KL to the target)", title="training")
    right.set(xlabel="distinct training sequences seen", ylabel="held-out top-1 agreement (first draft)")
    right.set_title("held-out agreement vs data")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def read_history(work: Path) -> list[dict]:
    try:
        return json.loads((Path(work) / "history.json").read_text())
    except (OSError, json.JSONDecodeError):
        return []
