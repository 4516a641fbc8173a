"""What the trained drafters learn from: the losses (KL, TVD++, cross-entropy), top-1 agreement, VocabTrim's token
ranking, and each recipe's objective on a batch of windows (:class:`Windows`: pairs of student and teacher logits over
the scored rows, plus an auxiliary loss).

The modules and drafters the recipes build live in ``decoding/drafters/trained.py`` (what decodes); the training loop in
``training/trainer.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decoding.drafters.eagle import VocabHead
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
    for ex in examples:  # what a drafter predicts: the answers (every token where the example marks none)
        counts += torch.bincount(ex["tokens"][ex.get("answer_from", 0) :], minlength=vocab_size)[:vocab_size]
    order = torch.argsort(-counts, stable=True)
    return order[: int((counts > 0).sum())]


# ---- each recipe's objective on one example ----------------------------------------------------------
def teacher_logits(shared: Shared, final: torch.Tensor) -> torch.Tensor:
    """The target's logits from its final hidden states (no gradient)."""
    with torch.no_grad():
        return shared.logits(final)


def student_logits(module, shared: Shared, hidden: torch.Tensor) -> torch.Tensor:
    """A drafter's logits from its hidden states: its own trimmed head when it has one (over the same tokens as a
    trimmed ``shared`` in training, over the full vocabulary with -inf elsewhere in evaluation), else the target's."""
    head = getattr(module, "lm_head", None)
    if isinstance(head, VocabHead):
        normed = shared.norm(hidden)
        return head.trimmed(normed) if shared.head_rows is not None else head(normed)
    return shared.logits(hidden)


@dataclass
class Windows:
    """A batch of training windows, right-padded: column t of row b is position ``start[b] + t`` of that row's text.

    What every recipe's objective reads: ``tokens`` [B, T] (long) the windows' tokens, ``start`` [B] their first
    positions, ``length`` [B] their real columns (the rest is padding), ``answer_from`` [B] the first answer position
    of each text (0: every position), ``hidden`` {layer l: [B, T, H]} the target's hidden state after l layers. A
    batch runs every module once (one forward and backward for a whole optimiser step); padding is causal-safe, as it
    only follows real columns.

    >>> w = Windows.of([{"tokens": torch.arange(6), "start": 2, "hidden": {1: torch.ones(4, 2)}, "answer_from": 4},
    ...                 {"tokens": torch.arange(3), "start": 0, "hidden": {1: torch.ones(3, 2)}}])
    >>> w.tokens.tolist(), w.length.tolist(), w.answer(4, 1).int().tolist()
    ([[2, 3, 4, 5], [0, 1, 2, 0]], [4, 3], [[0, 1, 1, 1], [1, 1, 1, 0]])
    """

    tokens: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor
    answer_from: torch.Tensor
    hidden: dict

    @staticmethod
    def of(examples: list[dict]) -> Windows:
        """One batch from single windows: ``tokens`` [S] the text from its (possibly cropped) beginning, ``start``
        (int) the position of the first hidden row, ``hidden`` {layer: [rows, H]}, ``answer_from`` (optional)."""
        rows = [next(iter(ex["hidden"].values())).shape[0] for ex in examples]
        width, device = max(rows), examples[0]["tokens"].device
        tokens = torch.zeros(len(examples), width, dtype=torch.long, device=device)
        for b, (ex, n) in enumerate(zip(examples, rows, strict=True)):
            tokens[b, :n] = ex["tokens"][ex["start"] : ex["start"] + n]
        hidden = {}
        for layer in examples[0]["hidden"]:
            first = examples[0]["hidden"][layer]
            h = first.new_zeros(len(examples), width, first.shape[-1])
            for b, (ex, n) in enumerate(zip(examples, rows, strict=True)):
                h[b, :n] = ex["hidden"][layer]
            hidden[layer] = h
        ints = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        return Windows(
            tokens, ints([ex["start"] for ex in examples]), ints(rows), ints([ex.get("answer_from", 0) for ex in examples]), hidden
        )

    def columns(self, width: int) -> torch.Tensor:  # [1, width]
        return torch.arange(width, device=self.tokens.device)[None]

    def real(self, width: int, offset: int = 0) -> torch.Tensor:
        """[B, width] bool: column t + ``offset`` is a real column of the row (a teacher row ``offset`` columns on)."""
        return self.columns(width) + offset < self.length[:, None]

    def answer(self, width: int, ahead: int) -> torch.Tensor:
        """[B, width] bool: column t predicts the token ``ahead`` positions on, that token is part of the answer, and the
        target's distribution of it (column t + ahead - 1) is a real column."""
        positions = self.start[:, None] + self.columns(width)
        return (positions + ahead >= self.answer_from[:, None]) & self.real(width, ahead - 1)


def as_windows(ex) -> Windows:
    """A :class:`Windows` batch, or one window (a dict, as ``training.features.TargetFeatures.example`` makes) as a
    batch of one."""
    return ex if isinstance(ex, Windows) else Windows.of([ex])


def kangaroo_objectives(module, shared: Shared, ex: Windows, knobs: dict) -> Objectives:
    depth, width = shared.config.num_hidden_layers, ex.tokens.shape[1]
    out = module.run(ex.hidden[knobs["exit_layer"]], ex.start)  # [B, T, H]
    keep = ex.answer(width, 1)
    return [(student_logits(module, shared, out[keep]), teacher_logits(shared, ex.hidden[depth][keep]))], None


def distill_objectives(module, shared: Shared, ex: Windows, knobs: dict) -> Objectives:
    """The draft reads the window's tokens only (a truncated context), the teacher the target's full-context states."""
    depth, width = shared.config.num_hidden_layers, ex.tokens.shape[1]
    out = module.run(shared.embed(ex.tokens), ex.start)
    keep = ex.answer(width, 1)
    return [(student_logits(module, shared, out[keep]), teacher_logits(shared, ex.hidden[depth][keep]))], None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def ttt_layer(layer, x, cos, sin, keys: list, values: list, mask: torch.Tensor):
    """One Llama decoder layer on x [B, T, H] (differentiable) whose queries see ``keys``/``values`` of earlier
    unrolled steps ([B, KV, T, D] each) and this step's own, under ``mask`` [T, (steps) * T] bool; returns the output
    and this step's keys and values (appended to the lists). The same math as the layer's own forward."""
    a = layer.self_attn
    b, t, hd = x.shape[0], x.shape[1], a.head_dim
    h = layer.input_layernorm(x)
    q = a.q_proj(h).view(b, t, -1, hd).transpose(1, 2)
    k = a.k_proj(h).view(b, t, -1, hd).transpose(1, 2)
    v = a.v_proj(h).view(b, t, -1, hd).transpose(1, 2)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    keys.append(k)
    values.append(v)
    out = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask, scale=a.scaling, enable_gqa=True)
    x = x + a.o_proj(out.transpose(1, 2).reshape(b, t, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def ttt_mask(t: int, step: int, device=None) -> torch.Tensor:
    """[t, (step + 1) * t] bool: at unrolled step j (0-based) the query at row i sees the true-feature keys (step 0)
    of rows <= i - j and, of each later step s = 1..j, the key at row i - j + s (its own chain of drafts).

    >>> ttt_mask(3, 1).int().tolist()
    [[0, 0, 0, 1, 0, 0], [1, 0, 0, 0, 1, 0], [1, 1, 0, 0, 0, 1]]
    """
    rows = torch.arange(t, device=device)[:, None]
    cols = torch.arange(t, device=device)[None, :]
    return torch.cat([cols <= rows - step] + [cols == rows - step + s for s in range(1, step + 1)], 1)


def eagle_objectives(module, shared: Shared, ex: Windows, knobs: dict) -> Objectives:
    """The feature head (``decoding.drafters.eagle``) unrolled ``ttt_steps`` steps, each step's input feature at column
    t being the previous step's output at column t-1 (what drafting feeds it), teacher the target's distribution of
    the token two positions on. One (student, teacher) pair per step (step 0 = the first draft)."""
    depth = shared.config.num_hidden_layers
    tokens = ex.tokens[:, 1:]  # x_{p+1}
    t = tokens.shape[1]  # columns p = start..T-2 (the last column has no next token)
    scored = ex.answer(t, 2)  # [B, t]: the target's distribution of x_{p+2} is column p+1
    teacher = teacher_logits(shared, ex.hidden[depth][:, 1:][scored])  # [N, V], once for every step
    positions = ex.start[:, None] + ex.columns(t)
    g = module.fuse({layer: ex.hidden[layer][:, :t] for layer in module.feature_layers})
    cos, sin = (c.unsqueeze(1) for c in module.model.rotary_emb(g, positions))
    layer = module.model.layers[0]
    keys, values, pairs, out = [], [], [], g
    for step in range(knobs["ttt_steps"]):
        if step > 0:  # the previous step's output at column t-1 stands in for the feature at column t
            g = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], 1)
        z = module.inputs(g, tokens)
        out = ttt_layer(layer, z, cos, sin, keys, values, ttt_mask(t, step, z.device))
        chained = (ex.columns(t) >= step).expand_as(scored)  # column t has a chain of `step` drafts
        student = student_logits(module, shared, out[scored & chained])
        pairs.append((student, teacher[chained[scored]]))
    return pairs, None


def feature_objectives(module, shared: Shared, ex: Windows, knobs: dict) -> Objectives:
    f = ex.hidden[shared.config.num_hidden_layers]  # [B, T, H] columns p = start..
    t = f.shape[1] - 1
    pred = module.run(module.fused(f[:, :-1], ex.tokens[:, 1:]), ex.start)  # f^_{p+1} from f_p and x_{p+1}
    keep = ex.real(t, 1)
    pred, true = pred[keep], f[:, 1:][keep]
    reg = F.smooth_l1_loss(pred, true)
    return [(shared.logits(pred), teacher_logits(shared, true))], reg * (knobs["feature_weight_pct"] / 100)


def medusa_objectives(module, shared: Shared, ex: Windows, knobs: dict) -> Objectives:
    f = ex.hidden[shared.config.num_hidden_layers]  # [B, T, H]
    pairs = []
    for i in range(len(module.blocks)):  # head i (0-based) on f_p predicts what the target predicts at p+1+i
        t = f.shape[1] - (i + 1)
        if t > 0:
            keep = ex.real(t, i + 1)
            pairs.append((shared.logits(module(f[:, :t][keep], i)), teacher_logits(shared, f[:, i + 1 :][keep])))
    return pairs, None


def hydra_objectives(module, shared: Shared, ex: Windows, knobs: dict) -> Objectives:
    f = ex.hidden[shared.config.num_hidden_layers]  # [B, T, H] columns p = start..
    emb = shared.embed(ex.tokens)  # [B, T, H] e(x_p)
    pairs, z = [], f
    for i in range(len(module.mlps)):  # z_{i+1}[p] = head_i(z_i[p], e(x_{p+1+i})) predicts what the target predicts at p+1+i
        t = f.shape[1] - (i + 1)
        if t <= 0:
            break
        z = module(z[:, :t], emb[:, i + 1 : i + 1 + t], i)
        keep = ex.real(t, i + 1)
        pairs.append((shared.logits(z[keep]), teacher_logits(shared, f[:, i + 1 :][keep])))
    return pairs, None


def _source_drafter(name: str, target_hf):
    """(recipe, module, knobs) of the drafter artifact a stop head learns (loads are cached per target)."""
    from decoding.drafters.artifacts import load_artifact

    art = load_artifact(name, target_hf)
    return art.recipe, art.module, art.knobs


def stop_rows(module, shared: Shared, ex) -> tuple[torch.Tensor, torch.Tensor]:
    """The stop head's rows of a window or a batch of them (:func:`as_windows`): (features [N, 8] of the source
    drafter's draft distributions, labels [N] 1.0 where its top-1 equals the target's: the greedy acceptance of that
    draft, given the drafts before it were accepted). The source's own recipe objective gives its logits (frozen; for
    eagle every unrolled step, so deeper drafts' features are its own); ``exit``: the target's head on one of its
    upper layers, which each window's start picks (the full LM head over every layer would cost as many heads)."""
    ex = as_windows(ex)
    from decoding.drafters.stop_head import EXIT_SOURCE, exit_layers, stop_features

    source = None if module.source == EXIT_SOURCE else _source_drafter(module.source, module.target_hf)
    with torch.no_grad():
        if source is None:
            depth, width = shared.config.num_hidden_layers, ex.tokens.shape[1]
            keep = ex.answer(width, 1)
            layers = exit_layers(depth)
            exits = torch.stack([ex.hidden[layers[s % len(layers)]][b] for b, s in enumerate(ex.start.tolist())])
            pairs = [(shared.logits(exits[keep]), teacher_logits(shared, ex.hidden[depth][keep]))]
        else:
            recipe, src_module, src_knobs = source
            pairs, _ = OBJECTIVES[recipe.name](src_module, shared, ex, src_knobs)
        drafts = torch.cat([s for s, _ in pairs]).float()
        label = torch.cat([s.argmax(-1) == t.argmax(-1) for s, t in pairs]).float()
        return stop_features(drafts), label


def stop_objectives(module, shared: Shared, ex: Windows, knobs: dict) -> Objectives:
    """SpecDec++'s acceptance-prediction head (``decoding.drafters.stop_head``) on :func:`stop_rows`. One pair over every
    row: student = [0, z] (z the head's acceptance logit), teacher = the label's log one-hot; KL, cross-entropy and
    TVD++ then all train a binary classifier, and agreement is its accuracy. (``training.fit_stop_head`` fits the same
    head faster: every row computed once.)"""
    features, label = stop_rows(module, shared, ex)
    z = module(features)
    student = torch.stack([torch.zeros_like(z), z], -1)  # [N, 2] logits of (rejected, accepted)
    teacher = torch.stack([1 - label, label], -1).clamp(min=1e-6).log()
    return [(student, teacher)], None


OBJECTIVES: dict[str, Callable[..., Objectives]] = {
    "stop": stop_objectives,
    "eagle": eagle_objectives,
    "kangaroo": kangaroo_objectives,
    "distill": distill_objectives,
    "feature": feature_objectives,
    "medusa": medusa_objectives,
    "hydra": hydra_objectives,
}


def objectives(recipe, module, shared: Shared, ex, knobs: dict) -> Objectives:
    """[(student_logits, teacher_logits)] (per head: the scored rows of every window, [N, V] each) and the aux loss or
    None, for a :class:`Windows` batch of ``recipe`` (or one window: ``tokens`` [S] (long), ``start`` (the position of
    the first hidden row) and ``hidden`` {layer: [S - start, H] float}, rows at positions start..S-1)."""
    return OBJECTIVES[recipe.name](module, shared, as_windows(ex), knobs)
