"""The lossless rules: pure, batched, no cache and no I/O.

Both verifiers take the k drafted tokens and the target's k+1 next-token
distributions (for the pending token and after each draft) and return how many
drafts are accepted and the tokens to commit: the accepted drafts followed by
one token from the target (a correction where a draft was rejected, a bonus
where all were accepted). So every target forward commits between 1 and k+1
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.sampling import sample_from


@dataclass
class Verdict:
    num_accepted: torch.Tensor  # [B] int64, m in 0..k
    tokens: torch.Tensor  # [B, k+1]; tokens[b, :m+1] are committed, the rest is undefined


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Greedy rule: accept the longest prefix of drafts equal to the target's argmax.

    draft_tokens [B, k], target_logits [B, k+1, V].

    >>> logits = torch.tensor([[[0., 5, 0], [0, 0, 5], [5, 0, 0]]])   # argmax 1, 2, 0
    >>> v = verify_greedy(torch.tensor([[1, 0]]), logits)
    >>> v.num_accepted.tolist(), v.tokens[0, :2].tolist()              # 1 accepted, then target's 2
    ([1], [1, 2])
    """
    target_tokens = target_logits.argmax(-1)  # [B, k+1]
    k = draft_tokens.shape[1]
    match = draft_tokens == target_tokens[:, :k]  # [B, k]
    num_accepted = match.long().cumprod(-1).sum(-1)  # [B]
    # accepted drafts equal the argmax, so the argmax row is already the committed sequence
    return Verdict(num_accepted=num_accepted, tokens=target_tokens)


def verify_speculative(
    draft_tokens: torch.Tensor,  # [B, k]  x_1..x_k drawn from q
    draft_probs: torch.Tensor | None,  # [B, k, V] q_i(.), or None for a deterministic drafter (q = one-hot)
    target_probs: torch.Tensor,  # [B, k+1, V] p_i(.), warped exactly like q
    u_accept: torch.Tensor,  # [B, k] uniforms r_i in [0, 1)
    u_sample: torch.Tensor,  # [B] uniform for the correction / bonus draw
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

    Accept draft x_i while r_i <= p_i(x_i) / q_i(x_i). At the first rejection j,
    draw from the residual norm(max(0, p_j - q_j)); if all k are accepted, draw
    the bonus token from p_{k+1}. The committed tokens are distributed exactly
    as tokens sampled one by one from p.

    For a deterministic drafter (n-gram, greedy drafts) q_i is one-hot at x_i,
    so acceptance is r_i <= p_i(x_i) and the residual is p_i with x_i removed.
    """
    bsz, k = draft_tokens.shape
    rows = torch.arange(bsz, device=draft_tokens.device)
    p_x = target_probs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, k]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    accepted = u_accept * q_x <= p_x  # r <= p/q without dividing by q
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # [B] = m

    p_m = target_probs[rows, num_accepted]  # [B, V] target distribution where the draw happens
    rejected = num_accepted < k  # rows whose draw is a residual draw
    if k > 0 and bool(rejected.any()):
        j = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_m = torch.zeros_like(p_m).scatter_(-1, draft_tokens[rows, j].unsqueeze(-1), 1.0)
        else:
            q_m = draft_probs[rows, j]
        residual = (p_m - q_m).clamp_(min=0.0)
        mass = residual.sum(-1, keepdim=True)
        # mass == 0 only when p == q, where rejection has probability 0; fall back to p for safety
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_m)
        p_m = torch.where(rejected.unsqueeze(-1), residual, p_m)
    drawn = sample_from(p_m, u_sample)  # [B]

    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(bsz, 1)], dim=1)  # [B, k+1]
    tokens[rows, num_accepted] = drawn
    return Verdict(num_accepted=num_accepted, tokens=tokens)
