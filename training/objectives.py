"""What the trained drafters learn from: the losses (KL, TVD++, cross-entropy), top-1 agreement, VocabTrim's token
ranking, and each recipe's objective on one example (pairs of student and teacher logits plus an auxiliary loss).

The modules and drafters the recipes build live in ``decoding/drafters/trained.py`` (what decodes); the training loop in
``training/trainer.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from decoding.drafters.trained import Shared

Objectives = tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]

# ---- losses (pure) --------------------------------------------------------------------------------


def kl_loss(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean forward KL(p_target || q_draft) over rows: [N, V], [N, V] -> scalar.

    >>> t = torch.tensor([[2.0, 0.0, -1.0]])
    >>> float(kl_loss(t, t)) == 0.0, float(kl_loss(t, torch.zeros(1, 3))) > 0
    (True, True)
    """
    p_log = F.log_softmax(teacher_logits.float(), -1)
    q_log = F.log_softmax(student_logits.float(), -1)
    return (p_log.exp() * (p_log - q_log)).sum(-1).mean()


def tvd(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean total variation distance 1/2 sum_v |p(v) - q(v)|; 1 - TVD is the acceptance rate of speculative sampling."""
    return 0.5 * (F.softmax(teacher_logits.float(), -1) - F.softmax(student_logits.float(), -1)).abs().sum(-1).mean()


def tvdpp_loss(teacher_logits: torch.Tensor, student_logits: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """TVD++ (Goel et al. 2024, "Direct Alignment of Draft Model"): TVD's policy gradient with a normalised reward.

    grad TVD(p, q) = E_{v~q}[-r(v) grad log q(v)] with reward r(v) = 1[p(v) > q(v)]
    (raise the draft where it under-covers the target). TVD++ normalises the
    reward by its mean and standard deviation under q (a baseline, as in RL).
    We have the whole vocabulary, so the expectation is an exact sum, not a
    sample: the surrogate ``-sum_v sg(q(v) r~(v)) log q(v)`` has gradient
    grad TVD / std_q(r). Its value is not the TVD (use :func:`tvd` to report).

    >>> t = torch.tensor([[3.0, 0.0, -1.0]])
    >>> s = torch.zeros(1, 3, requires_grad=True)
    >>> tvdpp_loss(t, s).backward()
    >>> s2 = torch.zeros(1, 3, requires_grad=True)
    >>> tvd(t, s2).backward()
    >>> torch.allclose(s.grad / s.grad.norm(), s2.grad / s2.grad.norm(), atol=1e-5)   # same direction as grad TVD
    True
    """
    p = F.softmax(teacher_logits.float(), -1)
    log_q = F.log_softmax(student_logits.float(), -1)
    q = log_q.exp().detach()
    r = (p > q).float()
    mean = (q * r).sum(-1, keepdim=True)
    std = ((q * (r - mean) ** 2).sum(-1, keepdim=True)).sqrt()
    advantage = (r - mean) / (std + eps)
    return -(q * advantage * log_q).sum(-1).mean()


def cross_entropy_loss(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Hard labels: the target's top-1 token (what greedy acceptance checks)."""
    return F.cross_entropy(student_logits.float(), teacher_logits.argmax(-1))


LOSSES = {"kl": kl_loss, "tvdpp": tvdpp_loss, "ce": cross_entropy_loss}


def agreement(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> float:
    """Fraction of rows whose top-1 tokens agree (the greedy acceptance rate of one draft)."""
    return float((teacher_logits.argmax(-1) == student_logits.argmax(-1)).float().mean())


def vocab_order(examples: list[dict], vocab_size: int) -> torch.Tensor:
    """Token ids of the data by descending frequency (ties by id), tokens never seen left out: VocabTrim's ranking.

    >>> vocab_order([{"tokens": torch.tensor([3, 1, 3, 2, 3, 1])}], vocab_size=5).tolist()
    [3, 1, 2]
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ex in examples:
        counts += torch.bincount(ex["tokens"], minlength=vocab_size)[:vocab_size]
    order = torch.argsort(-counts, stable=True)
    return order[: int((counts > 0).sum())]


# ---- each recipe's objective on one example ----------------------------------------------------------
def teacher_logits(shared: Shared, final: torch.Tensor) -> torch.Tensor:
    """The target's logits from its final hidden states (no gradient)."""
    with torch.no_grad():
        return shared.logits(final)


def kangaroo_objectives(module, shared: Shared, ex: dict, knobs: dict) -> Objectives:
    depth = shared.config.num_hidden_layers
    h = ex["hidden"][knobs["exit_layer"]][None]  # [1, T', H]
    student = shared.logits(module.run(h, ex["start"]))[0]
    return [(student, teacher_logits(shared, ex["hidden"][depth]))], None


def distill_objectives(module, shared: Shared, ex: dict, knobs: dict) -> Objectives:
    depth = shared.config.num_hidden_layers
    tokens = ex["tokens"][ex["start"] :][None]  # the window only: positions start..T-1 (a truncated context)
    student = shared.logits(module.run(shared.embed(tokens), ex["start"]))[0]
    return [(student, teacher_logits(shared, ex["hidden"][depth]))], None


def feature_objectives(module, shared: Shared, ex: dict, knobs: dict) -> Objectives:
    f = ex["hidden"][shared.config.num_hidden_layers]  # [T', H] rows p = start..T-1
    nxt = ex["tokens"][ex["start"] + 1 :]  # x_{p+1} for p = start..T-2
    pred = module.run(module.fused(f[None, :-1], nxt[None]), ex["start"])[0]  # f^_{p+1}
    reg = F.smooth_l1_loss(pred, f[1:])
    return [(shared.logits(pred), teacher_logits(shared, f[1:]))], reg * (knobs["feature_weight_pct"] / 100)


def medusa_objectives(module, shared: Shared, ex: dict, knobs: dict) -> Objectives:
    f = ex["hidden"][shared.config.num_hidden_layers]  # [T', H]
    teacher = teacher_logits(shared, f)
    pairs = []
    for i in range(len(module.blocks)):  # head i (0-based) on f_p predicts what the target predicts at p+1+i
        if f.shape[0] > i + 1:
            pairs.append((shared.logits(module(f[: -(i + 1)], i)), teacher[i + 1 :]))
    return pairs, None


def hydra_objectives(module, shared: Shared, ex: dict, knobs: dict) -> Objectives:
    f = ex["hidden"][shared.config.num_hidden_layers]  # [T', H] rows p = start..T-1
    emb = shared.embed(ex["tokens"][ex["start"] :])  # [T', H] e(x_p)
    teacher = teacher_logits(shared, f)
    pairs, z = [], f
    for i in range(len(module.mlps)):  # z_{i+1}[p] = head_i(z_i[p], e(x_{p+1+i})) predicts what the target predicts at p+1+i
        rows = f.shape[0] - (i + 1)
        if rows <= 0:
            break
        z = module(z[:rows], emb[i + 1 : i + 1 + rows], i)
        pairs.append((shared.logits(z), teacher[i + 1 :]))
    return pairs, None


OBJECTIVES: dict[str, Callable[..., Objectives]] = {
    "kangaroo": kangaroo_objectives,
    "distill": distill_objectives,
    "feature": feature_objectives,
    "medusa": medusa_objectives,
    "hydra": hydra_objectives,
}


def objectives(recipe, module, shared: Shared, ex: dict, knobs: dict) -> Objectives:
    """[(student_logits, teacher_logits)] (per head) and the aux loss or None, for one example of ``recipe``.

    ``ex``: ``tokens`` [T] (long), ``start`` (position of the first hidden row) and
    ``hidden`` {layer: [T - start, H] float}; rows are positions start..T-1.
    """
    return OBJECTIVES[recipe.name](module, shared, ex, knobs)
