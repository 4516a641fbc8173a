"""The training loop of a drafter recipe: plain torch, one process; checkpoints, resume, progress, loss curve.

``train`` trains a recipe's module (``decoding.drafters.trained``) on self-distillation
examples (``training.data``) against the frozen target, then saves the
artifact (``decoding.drafters.artifacts``) in ``out``. Every ``checkpoint_every`` steps
(and on Ctrl-C) ``out/checkpoint.pt`` holds module, optimiser, step and loss
history; a rerun with the same spec resumes there. Batches are drawn from a
generator seeded by (seed, step), so a resumed run computes what the
uninterrupted one would have. Ray Train runs this same function per worker
(``training.ray_train``) with ``wrap`` (DDP) and ``report`` hooks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decoding.drafters.artifacts import base_state, save_artifact, stored_copy
from decoding.drafters.eagle import VocabHead
from decoding.drafters.storage import Storage, as_stored, is_matrix
from decoding.drafters.trained import Shared, get_recipe
from training.objectives import LOSSES, Windows, agreement, objectives, vocab_order


@dataclass(frozen=True)
class TrainSpec:
    recipe: str
    knobs: dict = field(default_factory=dict)
    loss: str = "kl"  # kl | tvdpp | ce
    steps: int = 200
    batch: int = 4  # sequences per optimiser step
    lr: float = 1e-3
    seed: int = 0
    window: int = 256  # train on `window` consecutive stored positions of each sequence (a random window per draw)
    eval_fraction: float = 0.1
    checkpoint_every: int = 25
    train_vocab: int = 0  # > 0: losses over the data's most frequent tokens only (the LM head dominates CPU training cost)
    autocast: bool = False  # bfloat16 autocast for the drafter's forward and backward (about 2x on this kind of CPU)
    eval_every: int = 0  # > 0: held-out agreement every this many steps (the learning curve against data seen)
    init: str | None = None  # start from this artifact (``decoding.paths.portable``), its trimmed vocabulary kept
    # sequences of a step that go through the modules at once: 0 (auto) all of them on a GPU, where a step is launch
    # bound and padding is free, one at a time on a CPU, where the padding of windows of unlike lengths is compute
    # (`specray bench-training`: 0.76x batched on this 2-core CPU at 4 sequences a step)
    micro_batch: int = 0
    # train the weights as the artifact stores them: every forward computes with each matrix rounded as its storage
    # rounds it, and the gradient there moves the float weights (straight through). Trained in float and stored after,
    # the eagle head lost 0.03 of held-out agreement to storage, and a warm start from stored weights lost most of what
    # it learned when it was stored again (docs/drafters.md)
    as_stored: bool = False
    # with ``init``: the trimmed head drafts over this data's most frequent tokens, not its start's (ranked on the data
    # its start saw): the tokens it drafted keep their trained rows, the new ones start from the target's rows
    refresh_vocab: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _crop(ex: dict, window: int, generator: torch.Generator | None = None, device: torch.device | None = None) -> dict:
    """``window`` consecutive positions of an example (hidden rows and their start position).

    With ``generator`` the window starts at a random stored row (training sees
    every part of long sequences); without it, the last ``window`` rows (evaluation). The window is moved to
    ``device`` (the target's; stored examples are on the CPU).
    """
    rows = next(iter(ex["hidden"].values())).shape[0]
    cut = max(0, rows - window)
    if generator is not None and cut > 0:
        cut = int(torch.randint(0, cut + 1, (1,), generator=generator))
    end = cut + min(rows, window)
    tokens = ex["tokens"][: ex["start"] + end].to(device)
    hidden = {k: v[cut:end].to(device=device, dtype=torch.float32) for k, v in ex["hidden"].items()}
    return {**ex, "tokens": tokens, "start": ex["start"] + cut, "hidden": hidden}


def windows_loss(recipe, module, shared, ex: Windows, knobs, loss_fn) -> tuple[torch.Tensor, list[float]]:
    """Mean over heads of loss_fn(teacher, student) (each a mean over the batch's scored rows), plus the recipe's
    auxiliary loss; and per-head agreement.

    A head with no row in these windows (every row masked) adds nothing and agrees 0 of 0 (reported as 0)."""
    pairs, aux = objectives(recipe, module, shared, ex, knobs)
    live = [(s, t) for s, t in pairs if s.shape[0] > 0]
    if not live:
        zero = sum(p.sum() * 0.0 for p in module.parameters() if p.requires_grad)
        return zero, [0.0] * len(pairs)
    loss = sum(loss_fn(t, s) for s, t in live) / len(live)
    if aux is not None:
        loss = loss + aux
    return loss, [agreement(t, s.detach()) for s, t in pairs]


EVAL_BATCH = 8  # held-out windows per forward


@torch.no_grad()
def evaluate(recipe, module, shared, examples, knobs, window, device: torch.device | None = None, prepare=None) -> list[float]:
    """Per-head top-1 agreement with the target over the examples' windows (head 1 = the first draft), weighted by the
    rows each window scores. ``prepare(ex, window, generator, device)`` makes a window (default: stored hidden
    states, ``_crop``; on the fly: ``training.features.TargetFeatures.example``); ``EVAL_BATCH`` of them go through
    the module at once."""
    return agreement_of(*agreement_sums(recipe, module, shared, examples, knobs, window, device, prepare))


def agreement_of(sums: list[float], rows: list[int]) -> list[float]:
    """Per-head agreement from :func:`agreement_sums` (of one set, or of several added head by head)."""
    return [s / r if r else 0.0 for s, r in zip(sums, rows, strict=True)]


@torch.no_grad()
def agreement_sums(recipe, module, shared, examples, knobs, window, device=None, prepare=None) -> tuple[list[float], list[int]]:
    """:func:`evaluate`'s parts: per head, the agreeing rows (summed) and the rows scored."""
    prepare = prepare or _crop
    sums, rows = [], []
    for lo in range(0, len(examples), EVAL_BATCH):
        ex = Windows.of([prepare(e, window, None, device) for e in examples[lo : lo + EVAL_BATCH]])
        pairs, _ = objectives(recipe, module, shared, ex, knobs)
        n = [s.shape[0] for s, _ in pairs]
        agree = [agreement(t, s) * k if k else 0.0 for (s, t), k in zip(pairs, n, strict=True)]
        sums = agree if not sums else [a + b for a, b in zip(sums, agree, strict=False)]
        rows = n if not rows else [a + b for a, b in zip(rows, n, strict=False)]
    return sums, rows


def draws(spec: TrainSpec, size: int, step: int) -> tuple[torch.Generator, list[int]]:
    """Step ``step``'s generator and the training sequences it draws (a function of (seed, step): a resumed run draws
    what the uninterrupted one would have); the generator goes on to pick the windows.

    >>> draws(TrainSpec("eagle", batch=2), 10, 3)[1] == draws(TrainSpec("eagle", batch=2), 10, 3)[1]
    True
    """
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + step)
    return g, torch.randperm(size, generator=g)[: spec.batch].tolist()


def lr_at(spec: TrainSpec, step: int, done: float | None = None) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to 10%. ``done``: the share of the training done when a
    time budget bounds it (:func:`train`'s ``deadline``), where the schedule runs over the budget, not the steps.

    >>> spec = TrainSpec("eagle", steps=100, lr=1.0)
    >>> round(lr_at(spec, 99), 3), lr_at(spec, 3, done=1.0), lr_at(spec, 0, done=0.0) == lr_at(spec, 0)
    (0.1, 0.1, True)
    """
    warm = max(1, spec.steps // 20)
    if done is None:
        if step < warm:
            return spec.lr * (step + 1) / warm
        frac = (step - warm) / max(1, spec.steps - warm)
    else:
        if done < 0.05:
            return spec.lr * max(done / 0.05, 1 / warm)
        frac = (done - 0.05) / 0.95
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def share_done(step: int, steps: int, began: float, deadline: float | None) -> float | None:
    """The share of a training done at ``step``: of its steps or of its time budget (``began`` to ``deadline``,
    ``time.time()``s), whichever is further; None without a deadline (the schedule goes by steps alone)."""
    if deadline is None:
        return None
    return min(1.0, max(step / steps, (time.time() - began) / max(1e-9, deadline - began)))


class _Progress:
    """tqdm when installed, else a printed line every ~5%."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar, self.total, self.enabled = None, total, enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, desc="train", file=sys.stderr)
            except ImportError:
                pass

    def update(self, step: int, loss: float, agree: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", agree=f"{agree:.2f}")
        elif step % max(1, self.total // 20) == 0 or step == self.total:
            print(f"step {step}/{self.total} loss {loss:.4f} agree {agree:.3f}", file=sys.stderr)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _save_checkpoint(path: Path, module, opt, step: int, history: list, spec: TrainSpec, extra: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    state = {"spec": spec.to_dict(), "step": step, "module": module.state_dict(), "opt": opt.state_dict(), "history": history}
    torch.save({**state, **extra}, tmp)
    os.replace(tmp, path)


def plot_loss(history: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax2 = ax.twinx()
    ax2.plot([h["step"] for h in history], [h["agree"] for h in history], color="tab:orange", lw=0.8, alpha=0.7)
    ax2.set_ylabel("train agreement (head 1)", color="tab:orange")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def train(
    spec: TrainSpec,
    target_hf,
    examples: list[dict],
    out: Path,
    target_name: str,
    progress: bool = True,
    on_step: Callable[[int, dict], None] | None = None,
    wrap: Callable | None = None,
    report: Callable[[dict, Path | None], None] | None = None,
    save: bool = True,
    extra_training: dict | None = None,
    shard: tuple[int, int] = (0, 1),
    deadline: float | None = None,
    features=None,
    eval_examples: list[dict] | None = None,
    storage: Storage | None = None,
) -> dict:
    """Train (or resume) and save the artifact in ``out``; returns the artifact's ``training`` description.

    Under Ray Train each worker calls this with ``shard=(rank, world)`` (it draws its batches from every world-th
    training sequence), ``wrap`` (DDP or a DeepSpeed engine: ``wrap(module, optimizer) -> (model, backward, step)``)
    and ``report``; only rank 0 writes checkpoints and the artifact.
    ``deadline`` (a ``time.time()``) ends training early; the artifact records the steps done. The learning rate's
    schedule then runs over the time left when the steps begin, or over the steps if they end first (:func:`lr_at`).
    ``features`` (``training.features.TargetFeatures``): the examples hold token ids only and the target's hidden
    states are computed per window as training draws it (else they are stored in the examples). ``eval_examples``:
    the held-out set (default: the last ``eval_fraction`` of ``examples``). ``storage``: how the artifact stores its
    weights (default ``Storage()``); ``eval_agreement`` is the agreement of the weights as trained,
    ``eval_agreement_stored`` of the weights as the artifact stores them (what its drafter computes with).
    """
    _check_inputs(spec, examples)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    s = _session(spec, target_hf, examples, shard, features, eval_examples, storage)
    ckpt_path = out / "checkpoint.pt"
    step, history, before, earlier_s = _resume(s, ckpt_path)
    if before is None:
        before = s.evaluate()
    model, backward, opt_step = wrap(s.module, s.opt) if wrap else (s.module, lambda loss: loss.backward(), s.opt.step)
    bar = _Progress(spec.steps, step, progress and s.chief)
    seen = {i for done in range(step) for i in draws(spec, len(s.train_set), done)[1]}  # distinct sequences drawn so far

    def checkpoint() -> None:
        if s.chief:
            seconds = earlier_s + time.perf_counter() - t0  # the run's training time over all its legs
            _save_checkpoint(ckpt_path, s.module, s.opt, step, history, spec, {"eval_before": before, "seconds": seconds})

    t0, began = time.perf_counter(), time.time()
    try:
        while step < spec.steps:
            total, agree, idx = _optimiser_step(s, step, model, backward, opt_step, done := share_done(step, spec.steps, began, deadline))
            step += 1
            seen.update(idx)
            row = {"step": step, "loss": total, "agree": agree, "lr": lr_at(spec, step - 1, done), "sequences_seen": len(seen)}
            s.learning_curve(row, step)
            history.append(row)
            bar.update(step, total, agree)
            if step % spec.checkpoint_every == 0 or step == spec.steps:
                checkpoint()
                if report:
                    report(row, ckpt_path if s.chief else None)
            if on_step:
                on_step(step, row)
            if deadline is not None and time.time() > deadline:
                checkpoint()
                break
    except KeyboardInterrupt:
        checkpoint()
        bar.close()
        raise
    bar.close()
    training = _training(s, step, history, before, t0, extra_training, earlier_s)
    if save and s.chief:
        training["eval_agreement_stored"] = s.evaluate(stored_copy(s.module, spec.recipe, s.knobs, target_hf, storage))
        plot_loss(history, out / "loss.png", f"{spec.recipe} ({spec.loss})")
        ranking = s.vocab if s.recipe.drafts else None  # VocabTrim's ranking, for drafters (not the stop head)
        save_artifact(out, spec.recipe, s.knobs, s.module, target_hf, target_name, training, vocab=ranking, storage=storage)
        (out / "history.json").write_text(json.dumps(history))
    return training


def _check_inputs(spec: TrainSpec, examples: list[dict]) -> None:
    if spec.loss not in LOSSES:
        raise ValueError(f"loss: unknown loss {spec.loss!r}; choose from {', '.join(LOSSES)}")
    if len(examples) < 2:
        raise ValueError(f"need at least 2 sequences (one held out), got {len(examples)}")


def _training(s: _Session, step: int, history: list, before, t0: float, extra: dict | None, earlier_s: float = 0.0) -> dict:
    """The artifact's ``training`` description, the held-out agreement after training measured now (``t0``: when
    this call's steps began; ``earlier_s``: the seconds the run trained before this call, when it resumed)."""
    s.module.eval()
    after = s.evaluate()
    seconds = time.perf_counter() - t0
    return {
        "spec": s.spec.to_dict(),
        "knobs": s.knobs,
        "steps": step,
        "train_sequences": len(s.train_set),
        "eval_sequences": len(s.eval_set),
        "loss_first": history[0]["loss"] if history else None,
        "loss_last": history[-1]["loss"] if history else None,
        "eval_agreement_before": before,
        "eval_agreement": after,
        "train_seconds_this_run": round(seconds, 1),
        "train_seconds": round(earlier_s + seconds, 1),  # every leg of a resumed run
        **(extra or {}),
    }


class StoredView:
    """A module's matrices as an artifact in ``storage`` stores them (``decoding.drafters.storage.as_stored``), swapped in
    for the forwards of a step and swapped out for its optimiser step: the forward and its gradient are computed at the
    weights as stored, the update applied to the weights as trained (``TrainSpec.as_stored``)."""

    def __init__(self, module: torch.nn.Module, recipe: str, knobs: dict, target_hf, storage: Storage | None):
        state = module.state_dict(keep_vars=True)
        bases = base_state(get_recipe(recipe), knobs, target_hf, {k: v.detach().cpu() for k, v in state.items()})
        # as storage rounds them, once (not every step), where the module trains (a GPU rounds its step there)
        self.bases = {k: v.to(device=state[k].device, dtype=torch.bfloat16) for k, v in bases.items()}
        self.matrices = {k: v for k, v in state.items() if is_matrix(v)}
        self.storage = storage or Storage()

    @contextlib.contextmanager
    def swapped(self):
        trained = {name: t.data for name, t in self.matrices.items()}
        try:
            for name, t in self.matrices.items():
                t.data = as_stored(t.data, self.bases.get(name), self.storage).to(device=t.device, dtype=t.dtype)
            yield
        finally:
            for name, t in self.matrices.items():
                t.data = trained[name]


@dataclass
class _Session:
    """What one call of :func:`train` trains and measures with (:func:`_session` builds it)."""

    spec: TrainSpec
    recipe: object
    knobs: dict
    shared: Shared  # evaluation: agreement over the full vocabulary
    train_shared: Shared  # the losses' vocabulary
    vocab: list
    train_set: list[dict]
    eval_set: list[dict]
    features: object  # training.features.TargetFeatures, or None: the examples store their hidden states
    device: torch.device
    module: torch.nn.Module
    opt: torch.optim.Optimizer
    chief: bool  # rank 0: writes checkpoints and the artifact
    stored: StoredView | None = None  # TrainSpec.as_stored: the weights as stored, for every forward

    def evaluate(self, module: torch.nn.Module | None = None) -> list[float]:
        """Held-out agreement of the module now (as stored where it trains as stored), or of ``module`` (e.g. its weights
        as the artifact stores them)."""
        s = self
        m = s.module if module is None else module.to(s.device).eval()
        with s.view() if module is None else contextlib.nullcontext():
            return evaluate(s.recipe, m, s.shared, s.eval_set, s.knobs, s.spec.window, s.device, s.prepare)

    def view(self):
        """The weights a forward computes with: as stored (``TrainSpec.as_stored``), else as trained."""
        return self.stored.swapped() if self.stored is not None else contextlib.nullcontext()

    @property
    def prepare(self) -> Callable:
        """One window of an example (evaluation): the target's features on the fly, else the stored ones."""
        return self.features.example if self.features is not None else _crop

    def windows(self, examples: list[dict], generator: torch.Generator) -> Windows:
        """Training windows of ``examples`` as one batch (the target run once over all of them on the fly)."""
        s = self
        if s.features is not None:
            return s.features.batch(examples, s.spec.window, generator, s.device)
        return Windows.of([_crop(ex, s.spec.window, generator, s.device) for ex in examples])

    def learning_curve(self, row: dict, step: int) -> None:
        """Every ``eval_every`` steps (rank 0), the held-out agreement into the step's ``row``."""
        if self.spec.eval_every and step % self.spec.eval_every == 0 and self.chief:
            self.module.eval()
            row["eval_agreement"] = self.evaluate()
            self.module.train()


def _session(
    spec: TrainSpec, target_hf, examples: list[dict], shard: tuple[int, int], features, eval_examples, storage: Storage | None = None
) -> _Session:
    """The recipe's module and optimiser, and the training and held-out sets of this worker (``shard``)."""
    recipe = get_recipe(spec.recipe)
    depth = target_hf.config.num_hidden_layers
    knobs = recipe.check(spec.knobs, depth)
    shared = Shared(target_hf)  # evaluation: agreement over the full vocabulary
    vocab = vocab_order(examples, target_hf.config.vocab_size)
    if eval_examples:
        train_set, eval_set = examples, eval_examples
    else:
        n_eval = max(1, round(len(examples) * spec.eval_fraction))
        train_set, eval_set = examples[:-n_eval], examples[-n_eval:]
    rank, world = shard
    train_set = train_set[rank::world] or train_set
    device = next(target_hf.parameters()).device  # the drafter trains where the target is (SpecConfig.device)

    torch.manual_seed(spec.seed)  # module init (random parts) is reproducible
    if spec.init:  # warm start: the artifact's weights and its head's vocabulary, trained further
        from decoding.drafters.artifacts import load_artifact
        from decoding.paths import local

        art = load_artifact(str(local(spec.init)), target_hf)
        if art.recipe.name != recipe.name or art.knobs != knobs:
            raise ValueError(f"init: {spec.init} is a {art.recipe.name} drafter with {art.knobs}, not {recipe.name} with {knobs}")
        module = recipe.build(target_hf, knobs).float()
        module.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in art.module.state_dict().items()})
        # the weights as trained where the artifact's run left its checkpoint beside it: a warm start from the weights
        # as stored begins on their 2-bit grid, and storing it again rounds most of what it learns away
        weights_as_trained(module, local(spec.init) / "checkpoint.pt", art.description.get("training") or {})
        if spec.refresh_vocab and isinstance(getattr(module, "lm_head", None), VocabHead):
            module.lm_head.refresh(vocab)
        module = module.to(device).train()
    else:
        module = recipe.build(target_hf, knobs).float().to(device).train()
        recipe.prepare(module, vocab)  # a trimmed head drafts over the data's most frequent tokens
    head = getattr(module, "lm_head", None)
    if isinstance(head, VocabHead):  # the losses over the head's own tokens
        train_shared = Shared(target_hf, head.vocab)
    else:
        train_shared = Shared(target_hf, vocab[: spec.train_vocab]) if spec.train_vocab else shared
    opt = torch.optim.AdamW(module.parameters(), lr=spec.lr, weight_decay=0.0)
    stored = StoredView(module, spec.recipe, knobs, target_hf, storage) if spec.as_stored else None
    return _Session(spec, recipe, knobs, shared, train_shared, vocab, train_set, eval_set, features, device, module, opt, rank == 0, stored)


def weights_as_trained(module: torch.nn.Module, checkpoint: Path, training: dict) -> bool:
    """Load into ``module`` the weights of the run an artifact's ``training`` record describes, from that run's
    ``checkpoint`` (float, as trained); False, with nothing loaded, when there is none or it holds another run (another
    spec, or not the steps the artifact records)."""
    if not Path(checkpoint).is_file():
        return False
    ckpt = torch.load(checkpoint, weights_only=False, map_location="cpu")
    if ckpt.get("spec") != training.get("spec") or ckpt.get("step") != training.get("steps"):
        return False
    module.load_state_dict(ckpt["module"])
    return True


def _resume(s: _Session, ckpt_path: Path) -> tuple[int, list, list | None, float]:
    """(step, history, held-out agreement before training, seconds trained so far) from a checkpoint of the same spec,
    else from the start."""
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False, map_location=s.device)
        if ckpt["spec"] == s.spec.to_dict():
            s.module.load_state_dict(ckpt["module"])
            s.opt.load_state_dict(ckpt["opt"])
            return ckpt["step"], ckpt["history"], ckpt.get("eval_before"), float(ckpt.get("seconds", 0.0))
    return 0, [], None, 0.0


def _optimiser_step(s: _Session, step: int, model, backward, opt_step, done: float | None) -> tuple[float, float, list[int]]:
    """One optimiser step over the sequences ``step`` draws, as batches of ``micro_batch`` windows (auto: one batch on
    a GPU, one window at a time on a CPU): (mean loss, mean head agreement, the sequences drawn). ``done``: the share of
    a time-bounded training done (:func:`lr_at`)."""
    spec = s.spec
    for group in s.opt.param_groups:
        group["lr"] = lr_at(spec, step, done)
    g, idx = draws(spec, len(s.train_set), step)
    s.opt.zero_grad(set_to_none=True)
    total, agree = 0.0, 0.0
    size = spec.micro_batch or (len(idx) if s.device.type == "cuda" else 1)
    with s.view():  # the forwards and their gradients at the weights as stored, where it trains as stored
        for lo in range(0, len(idx), size):
            part = idx[lo : lo + size]
            ex = s.windows([s.train_set[i] for i in part], g)
            with torch.autocast(s.device.type, dtype=torch.bfloat16, enabled=spec.autocast):
                loss, head_agree = windows_loss(s.recipe, model, s.train_shared, ex, s.knobs, LOSSES[spec.loss])
            share = len(part) / len(idx)
            backward(loss * share)
            total += float(loss.detach()) * share
            agree += head_agree[0] * share
    torch.nn.utils.clip_grad_norm_(s.module.parameters(), 1.0)
    opt_step()
    return total, agree, idx
