"""Drafters: propose k tokens, then learn from the verdict.

The interface is deliberately narrow (after transformers' candidate
generators): ``start`` once per generation, ``propose`` before each target
forward, ``update`` after the verdict. A drafter that ran the target's own
first layers on the proposed tokens (self-speculation) hands back their hidden
states so verification continues from that layer instead of recomputing it.

Shapes keep the batch dimension; the loop currently runs batch 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.adapter import KVCache, ModelAdapter
from decoding.sampling import SamplingParams, choose


@dataclass
class DecodeState:
    """What a drafter may read. The last committed token is pending: its KV is not yet in the target cache."""

    tokens: torch.Tensor  # [B, n] prompt + generated tokens
    target: ModelAdapter
    target_cache: KVCache
    sampling: SamplingParams
    generator: torch.Generator | None
    max_len: int  # cache capacity a drafter should allocate
    # [B, c, H] the target's last-layer (pre-norm) hidden states of the c positions its last forward kept in the
    # cache, ending at position n-2 (the prompt after prefill, pending + accepted drafts after a step)
    target_hidden: torch.Tensor | None = None


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, j] drafted tokens, 0 <= j <= k
    probs: torch.Tensor | None = None  # [B, j, V] warped draft distributions; None = deterministic drafts
    hidden: torch.Tensor | None = None  # [B, j+1, H] target hidden after `layer` layers for [pending, drafts]
    layer: int = 0

    @staticmethod
    def empty(batch: int, device=None) -> Proposal:
        return Proposal(tokens=torch.zeros(batch, 0, dtype=torch.long, device=device))


class Drafter:
    """Base class: the no-op drafter proposes nothing (that is the AR baseline)."""

    name = "none"

    def start(self, state: DecodeState) -> None:
        pass

    def propose(self, state: DecodeState, k: int) -> Proposal:
        return Proposal.empty(state.tokens.shape[0], state.tokens.device)

    def update(self, state: DecodeState, num_accepted: int) -> None:
        pass


def _draft_chain(step, first_logits, k, state, threshold, feed_last):
    """Draft up to k tokens autoregressively; shared by every model-based drafter.

    ``step(token [B], i, need_logits) -> logits [B, V] | None`` feeds draft i
    (0-based) and returns the next-token logits when asked for them. Drafting stops early when the top-1 probability of
    the next draft falls below ``threshold`` for every row (Kangaroo's double
    early exit). With ``feed_last`` the final draft is fed too (its logits are
    not needed, but its state is), else it is not.
    Returns (tokens [B, j], probs [B, j, V] or None, number of drafts fed).
    """
    tokens, probs = [], []
    logits, fed = first_logits, 0
    for i in range(k):
        tok, q, conf = choose(logits, state.sampling, state.generator)
        if threshold > 0 and bool((conf < threshold).all()):
            break
        tokens.append(tok)
        if q is not None:
            probs.append(q)
        if i == k - 1 and not feed_last:
            break
        logits = step(tok, i, i < k - 1)
        fed += 1
    bsz = first_logits.shape[0]
    out = torch.stack(tokens, 1) if tokens else torch.zeros(bsz, 0, dtype=torch.long, device=first_logits.device)
    return out, (torch.stack(probs, 1) if probs else None), fed


class DraftModelDrafter(Drafter):
    """SpS: a separate (smaller) model with its own cache drafts k tokens.

    The draft cache lags the committed tokens by whatever the last verdict
    added; ``propose`` first catches up on those tokens in one forward.
    """

    name = "sps"

    def __init__(self, adapter: ModelAdapter, confidence_threshold: float = 0.0):
        self.adapter = adapter
        self.threshold = confidence_threshold
        self.cache: KVCache | None = None
        self._base = 0  # committed length when drafting started
        self._fed = 0  # drafts fed into the draft cache

    def start(self, state: DecodeState) -> None:
        self.cache = self.adapter.new_cache(state.tokens.shape[0], state.max_len)

    def propose(self, state: DecodeState, k: int) -> Proposal:
        n = state.tokens.shape[1]
        cache, a = self.cache, self.adapter
        h = a.forward(cache, cache.length, input_ids=state.tokens[:, cache.length : n])
        self._base = n

        def step(tok, i, need_logits):
            return a.logits(a.forward(cache, n + i, input_ids=tok[:, None]))[:, -1]

        tokens, probs, self._fed = _draft_chain(step, a.logits(h[:, -1:])[:, -1], k, state, self.threshold, feed_last=False)
        return Proposal(tokens=tokens, probs=probs)

    def update(self, state: DecodeState, num_accepted: int) -> None:
        # valid draft KV: the committed prefix plus the fed drafts that were accepted
        self.cache.rollback(self._base + min(num_accepted, self._fed))


class EarlyExitDrafter(Drafter):
    """Self-speculation: the target's first ``exit_layer`` layers plus its norm and head draft.

    The shallow layers write straight into the target's cache, so verification
    runs only layers [exit_layer, N) on the drafted tokens' saved hidden states.
    """

    name = "early-exit"

    def __init__(self, exit_layer: int, confidence_threshold: float = 0.0):
        self.exit_layer = exit_layer
        self.threshold = confidence_threshold

    def propose(self, state: DecodeState, k: int) -> Proposal:
        t, cache, L = state.target, state.target_cache, self.exit_layer
        n = state.tokens.shape[1]
        hiddens = [t.forward(cache, n - 1, input_ids=state.tokens[:, -1:], last=L)]

        def step(tok, i, need_logits):
            hiddens.append(t.forward(cache, n + i, input_ids=tok[:, None], last=L))
            return self.exit_logits(state, hiddens[-1], n + i, need_logits)

        first = self.exit_logits(state, hiddens[0], n - 1, True)
        tokens, probs, _ = _draft_chain(step, first, k, state, self.threshold, feed_last=True)
        return Proposal(tokens=tokens, probs=probs, hidden=torch.cat(hiddens, 1), layer=L)

    def exit_logits(self, state: DecodeState, hidden: torch.Tensor, slot: int, need_logits: bool) -> torch.Tensor | None:
        """Next-token logits [B, V] from the exit layer's hidden [B, 1, H] at cache slot ``slot`` (Kangaroo adds an adapter)."""
        return state.target.logits(hidden)[:, -1] if need_logits else None


class NgramDrafter(Drafter):
    """Prompt lookup: copy what followed the latest earlier occurrence of the current suffix.

    Tries suffix lengths ``ngram_max`` down to ``ngram_min``.

    >>> d = NgramDrafter(ngram_max=2, ngram_min=1)
    >>> d.lookup(torch.tensor([5, 6, 7, 8, 5, 6]), k=3).tolist()   # suffix [5, 6] seen at 0, followed by 7 8 5
    [7, 8, 5]
    >>> d.lookup(torch.tensor([1, 2, 3]), k=3).tolist()
    []
    """

    name = "ngram"

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def lookup(self, seq: torch.Tensor, k: int) -> torch.Tensor:  # seq [n] -> [j]
        n = seq.shape[0]
        for size in range(min(self.ngram_max, n - 1), self.ngram_min - 1, -1):
            suffix = seq[n - size :]
            windows = seq[: n - 1].unfold(0, size, 1)  # every window that has at least one token after it
            hits = (windows == suffix).all(-1).nonzero()
            if hits.numel():
                begin = int(hits[-1]) + size
                return seq[begin : begin + k]
        return seq[:0]

    def propose(self, state: DecodeState, k: int) -> Proposal:
        rows = [self.lookup(row, k) for row in state.tokens]
        j = min(r.shape[0] for r in rows)
        return Proposal(tokens=torch.stack([r[:j] for r in rows]))
