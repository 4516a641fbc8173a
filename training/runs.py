"""Training a drafter on self-distillation data (``specray distill``'s token ids), locally or under Ray Train, and the
drafters specray ships for the bundled model (``SHIPPED_RECIPES``; ``specray ship-drafters`` retrains them).

The target's hidden states are computed as training draws each window (``training.features``); the drafter trains
in float32 with bfloat16 autocast, and its artifact stores each matrix as a 2-bit change from the target tensor it
started from (``decoding.drafters.storage``: the four shipped artifacts take about 11 MB together).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from decoding.drafters.storage import Storage
from decoding.errors import ConfigError
from decoding.paths import portable
from training.fit_stop_head import train_stop_head


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
    init: str | None = None  # warm start from this artifact (``TrainSpec.init``)
    storage: dict = field(default_factory=dict)  # how its artifact stores its weights: ``Storage`` fields off the default
    as_stored: bool = False  # train the weights as its artifact stores them (``TrainSpec.as_stored``)
    refresh_vocab: bool = False  # a warm start's head drafts over this data's top tokens (``TrainSpec.refresh_vocab``)


# The drafters shipped for the bundled model: name -> how it is trained (``specray ship-drafters``). Exit layers of the
# Kangaroo adapters span the range Tune's exit-layer search covers.
SHIPPED_RECIPES: dict[str, DataRun] = {
    # its retrained head moved over a third of its norm from the target's rows (0.378 for the head trained from scratch
    # on an H200, and 0.364 for its first layer's queries): at 4 bits for such a change it takes 4.6 MB, over the 4 MB
    # a shipped drafter may take; 0.4 keeps them at 2 bits (3.3 MB; held-out agreement 0.712 -> 0.706 as stored)
    # trained as stored: trained in float, it lost 0.028 of held-out agreement when stored (0.554 -> 0.526); trained
    # further as stored, 1,364 steps from that artifact took it to 0.567, as trained and as stored (docs/drafters.md)
    "eagle": DataRun(
        "eagle",
        {"draft_vocab": 8192, "ttt_steps": 3},
        steps=3000,
        batch=4,
        lr=1e-3,
        eval_every=250,
        storage={"max_change": 0.4},
        as_stored=True,
    ),
    # 3 layers and a 4,096-token head: the four shipped artifacts stay within 12 MB together (tests/test_tree_size.py)
    # the shipped one was trained on a GPU whose weights as trained were not kept: stored again on the normal grid (the
    # default since) its 2-bit changes would be rounded twice, so its record keeps the grid it was stored on
    "distill": DataRun(
        "distill", {"draft_layers": 3, "draft_vocab": 4096}, steps=1500, batch=4, lr=5e-4, eval_every=250, storage={"grid": "uniform"}
    ),
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
    import torch

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
    optimisation = dict(loss=run.loss, steps=run.steps, batch=run.batch, lr=run.lr, seed=run.seed, window=run.window)
    warm = {"init": run.init, "refresh_vocab": run.refresh_vocab}
    spec = TrainSpec(run.recipe, knobs, **optimisation, autocast=True, eval_every=run.eval_every, as_stored=run.as_stored, **warm)
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
        training = train_on_cluster(
            spec, model, Path(data), layers, out, workers=workers, strategy=strategy, extra=extra, distill=distill, storage=run.storage
        )
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
            storage=Storage(**run.storage),
        )
    summary = _summary(run, out, knobs, train_set, tokens, time.perf_counter() - t0, training)
    summary["eval_set"] = held_out_name(data, eval_set)
    dev = next(target.parameters()).device
    summary["device"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    return summary


def _summary(run: DataRun, out: Path, knobs: dict, train_set: list, tokens: int, seconds: float, training: dict) -> dict:
    """What :func:`train_on_data` returns: the artifact, its recipe and data, and the figures of its training."""
    return {
        "artifact": str(out),
        "recipe": run.recipe,
        "knobs": knobs,
        "train_sequences": len(train_set),
        "train_answer_tokens": tokens,
        "train_seconds": training.get("train_seconds", round(seconds, 1)),  # the training steps, every leg of a resumed run
        "wall_seconds_this_run": round(seconds, 1),  # this call, the evaluations and loading included
        "batch": run.batch,
        "steps": training.get("steps"),
        "loss_first": training.get("loss_first"),
        "loss_last": training.get("loss_last"),
        "agreement_before": training.get("eval_agreement_before"),
        "agreement_after": training.get("eval_agreement"),
        "agreement_stored": training.get("eval_agreement_stored"),
    }


def repack(
    artifact: Path,
    model: str = "smollm2-135m",
    data: Path | None = None,
    device: str = "auto",
    storage=None,
    eval_sequences: int = 64,
    checkpoint: Path | None = None,
) -> dict:
    """Rewrite a trained artifact (any readable format) in ``storage`` (default: the current one), its description and
    training record kept. ``checkpoint``: its training run's ``checkpoint.pt``; when it holds the run the artifact
    records (the same spec and steps), the weights as trained are stored, not the artifact's (a stored copy stored
    again loses twice). With ``data`` (a ``specray distill`` directory) the held-out top-1 agreement is measured as
    training measures it, before (the weights repacked) and after (as they are stored now): the record's
    ``eval_agreement_stored`` and ``repacked``; a record naming the data at another machine's place names ``data``.
    Returns a summary."""
    import copy

    from decoding.drafters.artifacts import load_artifact, save_artifact, stored_copy
    from decoding.drafters.trained import Shared
    from decoding.model.loading import load_model
    from training.features import TargetFeatures, distill_training_set
    from training.trainer import evaluate, weights_as_trained

    target = load_model(model, "float32", device).model
    art = load_artifact(str(artifact), target)
    desc, knobs, recipe = art.description, art.knobs, art.recipe
    module = copy.deepcopy(art.module).float()  # a copy: the weights as trained must not reach a cached artifact
    training = dict(desc.get("training") or {})
    from_checkpoint = checkpoint is not None and weights_as_trained(module, Path(checkpoint), training)
    kept = stored_copy(module, recipe.name, knobs, target, storage)
    if data is not None and Path(str(training.get("data", ""))).name == Path(data).name:  # the same data, elsewhere
        training["data"] = portable(data)
    repacked = {"from_format": desc["format"], "from_bytes": (Path(artifact) / "drafter.safetensors").stat().st_size}
    repacked["from"] = "the weights as trained (its run's checkpoint)" if from_checkpoint else "the weights as stored"
    if data is not None:
        run = DataRun(recipe.name)
        layers = recipe.data_layers(knobs, target.config.num_hidden_layers)
        features = TargetFeatures(load_model(model, "bfloat16", device, "auto").model, layers, run.max_context)
        _, eval_set = distill_training_set(data, None, eval_sequences)
        dev = next(target.parameters()).device
        cache: dict = {}

        def prepare(ex, window, generator, device):  # the target's features of a window, computed once for both runs
            key = (ex["id"], window)
            if key not in cache:
                cache[key] = features.example(ex, window, generator, device)
            return cache[key]

        shared = Shared(target)
        before = evaluate(recipe, module, shared, eval_set, knobs, run.window, dev, prepare)
        after = evaluate(recipe, kept.to(dev), shared, eval_set, knobs, run.window, dev, prepare)
        repacked.update({"eval_agreement_before": before, "data": portable(data), "eval_sequences": len(eval_set)})
        training["eval_agreement_stored"] = after
    training["repacked"] = repacked
    save_artifact(artifact, recipe.name, knobs, module, target, desc["target"]["name"], training, vocab=art.vocab, storage=storage)
    return {
        "artifact": portable(artifact),
        "bytes_before": repacked["from_bytes"],
        "bytes_after": (Path(artifact) / "drafter.safetensors").stat().st_size,
        "agreement_before": repacked.get("eval_agreement_before"),
        "agreement_stored": training.get("eval_agreement_stored"),
        "from_checkpoint": from_checkpoint,
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
        if ax.get_legend_handles_labels()[0]:  # a short run has no held-out point yet
            ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def held_out_name(data: Path, eval_set: list[dict]) -> str:
    """The held-out set's name: the data directory and a hash of its sequences' ids (the data grows as it is generated,
    and with it the held-out sample: agreements compare only on one set).

    >>> held_out_name(Path("data/distill/m"), [{"id": "a"}, {"id": "b"}])
    'data/distill/m#2 seqs fcd1'
    """
    import hashlib

    digest = hashlib.sha1("\n".join(str(e["id"]) for e in eval_set).encode()).hexdigest()[:4]
    return f"{portable(data)}#{len(eval_set)} seqs {digest}"


def record_runs(path: Path, results: dict[str, dict], device: str, data: Path) -> list[dict]:
    """Add each drafter's finished training (its data size, steps and held-out agreement, on the held-out set of
    ``data``) to the record of every training so far (``path``, JSON rows); returns all rows. Stop heads (they
    predict acceptance, they do not draft) are left out."""
    rows = _read_rows(path)
    for name, r in results.items():
        if r.get("recipe") == "stop" or not r.get("agreement_after"):
            continue
        rows.append(
            {
                "drafter": name,
                "train_sequences": r["train_sequences"],
                "train_answer_tokens": r["train_answer_tokens"],
                "steps": r.get("steps"),
                "batch": r.get("batch"),
                "agreement": [round(a, 4) for a in r["agreement_after"]],
                "agreement_stored": [round(a, 4) for a in r.get("agreement_stored") or []],
                "device": device,
                "date": time.strftime("%Y-%m-%d"),
                "eval_set": r.get("eval_set") or portable(data),
                "shipped": r.get("shipped", True) is not None,  # False: the check set kept it from shipping
            }
        )
        if r.get("check"):
            rows[-1]["check_agreement"] = {k: r["check"][k]["agreement"] for k in ("new", "shipped")}
    Path(path).write_text(json.dumps(rows, indent=1))
    return rows


def _read_rows(path: Path) -> list[dict]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return []


def agreement_vs_data(rows: list[dict], path: Path) -> None:
    """Per drafter, held-out top-1 agreement (first draft) of each training against its training set's size
    (sequences), each point labelled with the sequences it drew (steps x batch): does more data still help?"""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    latest = rows[-1].get("eval_set") if rows else None  # agreements on another held-out set are drawn dotted
    colors = {}
    for name in sorted({r["drafter"] for r in rows}):
        for same in (True, False):
            runs = [r for r in rows if r["drafter"] == name and (r.get("eval_set") == latest) == same]
            runs.sort(key=lambda r: r["train_sequences"])
            if not runs:
                continue
            xs, ys = [r["train_sequences"] for r in runs], [r["agreement"][0] for r in runs]
            label = name if same else f"{name} (another held-out set)"
            line = ax.plot(xs, ys, marker="o" if same else "x", ls="-" if same else ":", color=colors.get(name), label=label)[0]
            colors[name] = line.get_color()
            _label_draws(ax, runs, xs, ys)
    ax.set_xscale("log")

    ax.set(xlabel="training sequences (log)", ylabel="held-out top-1 agreement (first draft)")
    ax.set_title("held-out agreement against data size, one point per training")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _label_draws(ax, runs: list[dict], xs: list, ys: list) -> None:
    for r, x, y in zip(runs, xs, ys, strict=True):
        if r.get("steps") and r.get("batch"):
            ax.annotate(f"{r['steps'] * r['batch']:,} drawn", (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)


def read_history(work: Path) -> list[dict]:
    try:
        return json.loads((Path(work) / "history.json").read_text())
    except (OSError, json.JSONDecodeError):
        return []
