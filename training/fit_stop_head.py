"""Training SpecDec++'s stop head (``decoding.drafters.stop_head``) on self-distillation data, the fast way.

The head has 161 parameters; what costs is its data: every labelled row needs the target's hidden states over the
window's context and the source drafter's logits. The plain trainer (``training.trainer``, which the ``stop`` recipe
also runs under) computes a window for one optimiser step and throws it away; here every row is computed once:

1. windows of the training sequences (random, ``window`` rows, until the collection budget) go through the target
   (``training.features.TargetFeatures``) and the source drafter (``training.objectives.stop_rows``): per row the 8
   features of the draft distribution and the label (the draft's top-1 equals the target's);
2. the head is fitted on all rows at once (full-batch Adam on the binary cross-entropy, seconds);
3. it is evaluated on held-out sequences: accuracy, log loss against the constant base rate's, the area under the ROC
   curve, and calibration (mean predicted against observed acceptance per predicted decile), kept in the artifact's
   ``training`` record.

>>> auc(torch.tensor([0.9, 0.8, 0.3, 0.1]), torch.tensor([1.0, 1.0, 0.0, 0.0])), auc(torch.tensor([0.1, 0.9]), torch.tensor([1.0, 0.0]))
(1.0, 0.0)
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from decoding.paths import portable

EPOCHS = 400


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: P(a random accepted row scores above a random rejected one), ties count half."""
    pos, neg = scores[labels > 0.5], scores[labels <= 0.5]
    if not len(pos) or not len(neg):
        return float("nan")
    ranks = torch.cat([pos, neg]).argsort().argsort().double() + 1  # ranks of the pooled scores (ties: arbitrary order)
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def log_loss(p: torch.Tensor, y: torch.Tensor) -> float:
    p = p.clamp(1e-6, 1 - 1e-6)
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def evaluate_head(head, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Held-out figures of a head on rows ``x`` [N, 8] with labels ``y`` [N]."""
    with torch.no_grad():
        p = torch.sigmoid(head(x)).double()
    y = y.double()
    base = float(y.mean())
    deciles = []
    order = p.argsort()
    for part in order.chunk(10):
        if len(part):
            deciles.append({"predicted": round(float(p[part].mean()), 4), "observed": round(float(y[part].mean()), 4), "rows": len(part)})
    return {
        "rows": int(len(y)),
        "acceptance": round(base, 4),
        "accuracy": float(((p > 0.5).double() == y).double().mean()),
        "majority_accuracy": max(base, 1 - base),
        "log_loss": log_loss(p, y),
        "base_rate_log_loss": log_loss(torch.full_like(p, base), y) if 0 < base < 1 else 0.0,
        "auc": auc(p, y),
        "calibration": deciles,
    }


def collect(head, shared, features, sequences: list[dict], window: int, generator, deadline: float | None, windows: int | None):
    """(features [N, 8], labels [N]) of windows of ``sequences``: drawn at random (with ``generator``) until
    ``deadline`` or ``windows`` windows, else the last window of each sequence in order (evaluation)."""
    from training.objectives import stop_rows

    xs, ys, done = [], [], 0
    order = torch.randperm(len(sequences), generator=generator).tolist() if generator is not None else range(len(sequences))
    for i in order:
        if (windows is not None and done >= windows) or (deadline is not None and time.time() > deadline and done):
            break
        ex = features.example(sequences[i], window, generator, device=next(head.parameters()).device)
        with torch.no_grad(), torch.autocast(ex["tokens"].device.type, dtype=torch.bfloat16):
            x, y = stop_rows(head, shared, ex)
        xs.append(x.float().cpu())
        ys.append(y.float().cpu())
        done += 1
    return torch.cat(xs), torch.cat(ys), done


def fit(head, x: torch.Tensor, y: torch.Tensor, lr: float = 1e-2, epochs: int = EPOCHS, seed: int = 0) -> list[float]:
    """Full-batch Adam on the binary cross-entropy; returns the loss per 20 epochs."""
    torch.manual_seed(seed)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    history = []
    for epoch in range(epochs):
        opt.zero_grad(set_to_none=True)
        loss = F.binary_cross_entropy_with_logits(head(x), y)
        loss.backward()
        opt.step()
        if epoch % 20 == 0 or epoch == epochs - 1:
            history.append(round(float(loss.detach()), 5))
    return history


def train_stop_head(run, data: Path, out: Path, model: str, device: str, features_quant: str, deadline: float | None) -> dict:
    """Train the ``stop`` recipe's head of ``run`` (a ``training.runs.DataRun``) on the data in ``data``; the artifact
    goes to ``out``. ``deadline`` (a ``time.time()``) bounds the collection of training rows (default: 4 minutes)."""
    from decoding.drafters.artifacts import save_artifact
    from decoding.drafters.trained import Shared, get_recipe
    from decoding.model.loading import load_model
    from training.features import TargetFeatures, distill_training_set

    t0 = time.time()
    target = load_model(model, "float32", device).model
    depth = target.config.num_hidden_layers
    recipe = get_recipe("stop")
    knobs = recipe.check(run.knobs, depth)
    train_set, eval_set = distill_training_set(data, run.max_sequences, run.eval_sequences)
    features = TargetFeatures(
        load_model(model, "bfloat16", device, features_quant).model, recipe.data_layers(knobs, depth), run.max_context
    )
    torch.manual_seed(run.seed)
    head = recipe.build(target, knobs).float()
    shared = Shared(target)
    g = torch.Generator().manual_seed(run.seed)
    budget = deadline if deadline is not None else t0 + 240
    x, y, windows = collect(head, shared, features, train_set, run.window, g, budget, run.steps * run.batch)
    t_collect = time.time() - t0
    ex, ey, _ = collect(head, shared, features, eval_set, run.window, None, None, None)
    before = evaluate_head(head, ex, ey)
    history = fit(head, x, y, lr=run.lr, seed=run.seed)
    after = evaluate_head(head, ex, ey)
    training = {
        "recipe": "stop",
        "knobs": knobs,
        "steps": len(history) * 20,  # full-batch epochs
        "train_windows": windows,
        "train_rows": int(len(y)),
        "train_acceptance": round(float(y.mean()), 4),
        "eval_sequences": len(eval_set),
        "loss_first": history[0],
        "loss_last": history[-1],
        "eval_agreement_before": [before["accuracy"]],
        "eval_agreement": [after["accuracy"]],  # the head's accuracy: does it predict acceptance (> 0.5) right
        "eval": after,
        "data": portable(data),
        "collect_seconds": round(t_collect, 1),
        "train_seconds_this_run": round(time.time() - t0, 1),
    }
    save_artifact(out, "stop", knobs, head, target, model, training)
    return {
        "artifact": str(out),
        "recipe": "stop",
        "knobs": knobs,
        "train_sequences": len(train_set),
        "train_answer_tokens": int(len(y)),
        "train_seconds": training["train_seconds_this_run"],
        "steps": training["steps"],
        "loss_first": history[0],
        "loss_last": history[-1],
        "agreement_before": [before["accuracy"]],
        "agreement_after": [after["accuracy"]],
        "eval": {k: v for k, v in after.items() if k != "calibration"},
        "log_loss_gain": None if math.isnan(after["auc"]) else round(after["base_rate_log_loss"] - after["log_loss"], 4),
    }
