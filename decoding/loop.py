"""The one decoding loop. Every method is this loop with a drafter and a verifier.

Invariant between steps: the target cache holds every committed token but the
last one ("pending"); a step feeds [pending, drafts...] to the target, the
verifier commits m accepted drafts plus one target token, and the cache length
moves to cover pending + the m accepted drafts. AR is the same loop with a
drafter that proposes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decoding.adapter import ModelAdapter
from decoding.drafters import DecodeState, Drafter, Proposal
from decoding.metrics import GenerationStats, StepRecord, summarize
from decoding.sampling import SamplingParams, warp
from decoding.verify import Verdict, verify_greedy, verify_speculative, verify_tree_greedy, verify_tree_speculative

GREEDY = SamplingParams()


class ContextTooLong(ValueError):
    pass


@dataclass
class Generation:
    token_ids: list[int]  # the new tokens (batch row 0)
    finish_reason: str  # "stop" (EOS) or "length"
    stats: GenerationStats
    steps: list[StepRecord] = field(default_factory=list)


def verify(proposal: Proposal, logits: torch.Tensor, sampling: SamplingParams, generator) -> Verdict:
    """Dispatch to the greedy or the speculative-sampling rule. logits: [B, j+1, V]."""
    if sampling.greedy:
        return verify_greedy(proposal.tokens, logits)
    bsz, j = proposal.tokens.shape
    target_probs = warp(logits, sampling)
    u_accept = torch.rand(bsz, j, generator=generator, device=logits.device)
    u_sample = torch.rand(bsz, generator=generator, device=logits.device)
    return verify_speculative(proposal.tokens, proposal.probs, target_probs, u_accept, u_sample)


def verify_tree(proposal: Proposal, logits: torch.Tensor, sampling: SamplingParams, generator, pending: torch.Tensor) -> Verdict:
    """The tree rules: greedy (longest matching path) or recursive rejection sampling. logits: [B, T, V], pending [B, 1]."""
    tree = proposal.tree
    nodes = torch.cat([pending, proposal.tokens], dim=1)  # [B, T]
    if sampling.greedy:
        dev = logits.device
        return verify_tree_greedy(nodes, tree.parents.to(dev), tree.mask.to(dev), tree.depth.to(dev), logits)
    bsz, t = nodes.shape
    q = None if proposal.probs is None else torch.cat([proposal.probs[:, :1], proposal.probs], dim=1)  # [B, T, V], row 0 unused
    u_accept = torch.rand(bsz, t, generator=generator, device=logits.device)
    u_sample = torch.rand(bsz, generator=generator, device=logits.device)
    return verify_tree_speculative(nodes, tree.parents, q, warp(logits, sampling), u_accept, u_sample)


@dataclass
class StepResult:
    proposal: Proposal
    num_accepted: int  # m
    committed: list[int]  # the m accepted drafts and the target's token (batch row 0)
    logits: torch.Tensor  # [B, j+1, V] the target's logits that judged the proposal
    record: StepRecord


def speculative_step(state: DecodeState, drafter: Drafter, k: int) -> StepResult:
    """One step of the loop: propose up to k drafts, run the target on [pending, drafts], verify, commit.

    Mutates ``state`` (tokens grow by m+1, the target cache covers pending and
    the m accepted drafts) and tells the drafter the verdict. It is the whole
    body of ``generate``, and a drafter that speculates itself (TriForce's
    middle level) calls it on its own state with its own inner drafter.
    """
    target, cache, tokens = state.target, state.target_cache, state.tokens
    bsz = tokens.shape[0]
    t0 = time.perf_counter()
    proposal = drafter.propose(state, k) if k > 0 else Proposal.empty(bsz, tokens.device)
    t1 = time.perf_counter()
    n = tokens.shape[1]
    tree = {}
    if proposal.tree is not None:  # one forward over [pending, nodes] with the tree mask; positions = n-1 + depth
        positions = proposal.tree.positions(n - 1).to(target.device).unsqueeze(0).expand(bsz, -1)
        tree = dict(positions=positions, tree_mask=proposal.tree.mask)
    if proposal.hidden is not None:
        h = target.forward(cache, n - 1, hidden=proposal.hidden, first=proposal.layer, **tree)
    else:
        h = target.forward(cache, n - 1, input_ids=torch.cat([tokens[:, -1:], proposal.tokens], dim=1), **tree)
    logits = target.logits(h)
    if proposal.tree is not None:
        verdict = verify_tree(proposal, logits, state.sampling, state.generator, tokens[:, -1:])
    else:
        verdict = verify(proposal, logits, state.sampling, state.generator)
    m = int(verdict.num_accepted[0])
    committed = verdict.tokens[0, : m + 1].tolist()
    state.tokens = torch.cat([tokens, torch.tensor([committed], dtype=tokens.dtype, device=tokens.device)], dim=1)
    state.accepted_path = None
    state.target_hidden = h[:, : m + 1]  # [B, m+1, H] pending + accepted drafts
    if proposal.tree is not None:  # the accepted branch becomes the committed prefix: slots n-1+path -> n-1..n-1+m
        path = verdict.path[0, : m + 1]
        cache.compact(n - 1, path + (n - 1))
        state.accepted_path = path.tolist()
        state.target_hidden = h[:, path]
    cache.rollback(n + m)
    state.last_logits = logits  # [B, T, V] every fed position's logits, rejected ones included (Token Recycling)
    drafter.update(state, m)
    t2 = time.perf_counter()
    record = StepRecord(drafted=proposal.tokens.shape[1], accepted=m, draft_s=t1 - t0, verify_s=t2 - t1)
    return StepResult(proposal, m, committed, logits, record)


def generate(
    target: ModelAdapter,
    prompt_ids: torch.Tensor,  # [B, T]
    *,
    drafter: Drafter | None = None,
    k: int = 4,
    sampling: SamplingParams = GREEDY,
    max_new_tokens: int = 128,
    eos_token_ids: tuple[int, ...] | list[int] = (),
    generator: torch.Generator | None = None,
    on_step: Callable[[list[int]], None] | None = None,
) -> Generation:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``; stop after an EOS token.

    ``on_step`` receives each step's newly committed tokens (for streaming).
    """
    bsz, prompt_len = prompt_ids.shape
    if bsz != 1:
        raise ValueError(f"the loop runs batch size 1 for now, got {bsz}")
    if prompt_len < 1:
        raise ValueError("empty prompt")
    if prompt_len + max_new_tokens > target.max_context:
        raise ContextTooLong(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of {target.max_context}"
        )
    drafter = drafter or Drafter()
    eos = set(int(e) for e in eos_token_ids)
    max_len = prompt_len + max_new_tokens + getattr(drafter, "max_nodes", lambda k: k)(k) + 1
    t_start = time.perf_counter()

    cache = target.new_cache(bsz, max_len)
    h = target.forward(cache, 0, input_ids=prompt_ids)
    first = verify(Proposal.empty(bsz, prompt_ids.device), target.logits(h[:, -1:]), sampling, generator)
    cache.rollback(prompt_len)
    tokens = torch.cat([prompt_ids, first.tokens[:, :1]], dim=1)
    new = [int(first.tokens[0, 0])]
    if on_step:
        on_step(list(new))
    prefill_s = time.perf_counter() - t_start

    state = DecodeState(tokens, target, cache, sampling, generator, max_len, target_hidden=h)
    drafter.start(state)
    steps: list[StepRecord] = []
    finished = new[0] in eos
    while not finished and len(new) < max_new_tokens:
        # never draft more than can be committed: m + 1 <= remaining
        step = speculative_step(state, drafter, min(k, max_new_tokens - len(new) - 1))
        committed = step.committed
        for i, tok in enumerate(committed):
            if tok in eos:
                committed, finished = committed[: i + 1], True
                break
        new.extend(committed)
        steps.append(step.record)
        if on_step:
            on_step(committed)

    wall = time.perf_counter() - t_start
    reason = "stop" if finished else "length"
    return Generation(token_ids=new, finish_reason=reason, stats=summarize(len(new), wall, prefill_s, steps), steps=steps)
