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
