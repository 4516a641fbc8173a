"""Turning logits into the distribution that is sampled: temperature, top-k, top-p.

Draft and target logits go through the same ``warp`` so that speculative
sampling is lossless with respect to the *warped* target distribution, which is
exactly what plain sampling from the target would draw from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p. logits: [..., V] -> probs [..., V] float32.

    Top-p keeps the smallest set of most likely tokens whose mass reaches
    ``top_p`` (always at least the top token), as in Holtzman et al. 2019.
    """
    logits = logits.float()
    if params.temperature > 0:
        logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling with a pre-drawn uniform. probs: [B, V], u: [B] in [0, 1) -> [B] int64.

    Zero-probability tokens are never returned (``right=True`` skips flat CDF steps).
    """
    cdf = probs.cumsum(-1)  # [B, V]
    target = (u * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None):
    """Pick one token per row. logits [B, V] -> (tokens [B], probs [B, V] or None, confidence [B]).

    Greedy returns ``probs=None`` (the draft is deterministic) and the softmax
    top-1 probability as confidence; sampling returns the warped distribution
    the token was drawn from.
    """
    if params.greedy:
        probs = logits.float().softmax(-1)
        conf, tok = probs.max(-1)
        return tok, None, conf
    probs = warp(logits, params)
    u = torch.rand(probs.shape[0], generator=generator, device=probs.device)
    tok = sample_from(probs, u)
    return tok, probs, probs.max(-1).values


def warp_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None):
    """``warp`` with each row's own parameters: logits [R, T, V], temperature / top_k / top_p [R] -> probs [R, T, V].

    ``top_k`` (0 = off) and ``top_p`` (1 = off) are None when no row uses them (the sort they need is skipped). Rows
    of a batch sample with different settings and no value is read back to the host.

    >>> logits = torch.tensor([[[2.0, 1.0, 0.0]], [[2.0, 1.0, 0.0]]])
    >>> p = warp_rows(logits, torch.tensor([1.0, 0.5]), top_k=torch.tensor([0, 1]))
    >>> torch.allclose(p[0], warp(logits[0], SamplingParams(1.0))), p[1].tolist()
    (True, [[1.0, 0.0, 0.0]])
    """
    logits = logits.float() / temperature[:, None, None]
    if top_k is None and top_p is None:
        return logits.softmax(-1)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    if top_k is not None:  # as ``warp``: drop what is below the k-th largest logit (ties kept)
        on = (top_k > 0)[:, None, None]
        kth = sorted_logits.gather(-1, (top_k - 1).clamp(min=0)[:, None, None].expand(*logits.shape[:2], 1))
        logits = logits.masked_fill(on & (logits < kth), float("-inf"))
        sorted_logits = sorted_logits.masked_fill(on & (sorted_logits < kth), float("-inf"))
    if top_p is not None:
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        drop = torch.zeros_like(mass_before, dtype=torch.bool).scatter(-1, order, mass_before >= top_p[:, None, None])
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)
