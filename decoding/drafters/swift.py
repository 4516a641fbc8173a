"""SWIFT (Xia et al. 2025, "SWIFT: On-the-Fly Self-Speculative Decoding for LLM Inference Acceleration"): the target
drafts for itself with some of its intermediate layers skipped, the skipped set chosen during generation. No
training, no second model.

Drafting runs the target's kept layers only (their KV goes into the target's own cache at the draft slots, where
verification overwrites it) and its own norm and head; the layers before the first skipped one compute exactly what
the full model would, so verification continues from their hidden states (as early exit does). A confidence stop
(``confidence_threshold``, SWIFT's) ends a chain early.

Choosing the layers (SWIFT's optimisation phase). The paper searches layer subsets by Bayesian optimisation, each
scored by how well the skipped model matches the full one on the context so far against what it costs. Here the
search is simpler, and says so: a local (hill-climbing) random search. The first skipped set is a block of ``n``
layers around the middle (n = ``swift_skip`` x the layers that may be skipped: every one but the first and the last);
every trial changes it by one random move (swap a skipped layer for a kept one, skip one more, skip one fewer;
``swift_trials`` trials, one per decoding step once :data:`WINDOW` tokens were generated, drafted or not (the trials
run after each step's verdict, so the search ends in the first request even while k=auto drafts nothing: a search
left to the steps that draft ran one 60 ms trial at each probe of later requests), then the set stays). A
trial scores the incumbent and the candidate on the same window of the latest generated tokens (teacher-forced: each
set predicts every next token of the window in one forward over its kept layers, the window's exact KV saved before
and restored after), by the expected committed tokens per unit of drafting and verification cost
(:func:`best_length`, its cost counted in weights read: kept layers and the LM head); the candidate replaces the
incumbent when it scores higher. Once scored, a step drafts the length that expectation is best at (at most ``k``),
and nothing where even the best set does not beat a plain target step (speculation that never loses, by this
estimate). The search lives in the decoder's ``DraftMemory`` (``draft_memory=warm``: what one request found, the
next starts from; ``cold``: every request searches anew).

Host reads: one per trial (the two scores), and the confidence stop's one per drafted token; the search's own draws are
a seeded ``random.Random`` on the host.

>>> kept_segments((3, 4, 6), depth=8)
[(0, 3), (5, 6), (7, 8)]
>>> first_skip_set(depth=8, skip=0.5), first_skip_set(depth=30, skip=0.15)
((3, 4, 5), (13, 14, 15, 16))
"""

from __future__ import annotations

import random
import threading

import torch

from decoding.builders import builds
from decoding.drafters.base import DecodeState, Drafter, Proposal
from decoding.drafters.draft_model import model_depth
from decoding.drafters.drafting import draft_chain
from decoding.errors import ConfigError
from decoding.model.adapter import KVCache, ModelAdapter

WINDOW = 32  # generated tokens a trial scores the two layer sets on


def skippable(depth: int) -> list[int]:
    """The layers a draft may skip: all but the first and the last."""
    return list(range(1, depth - 1))


def skip_count(depth: int, skip: float) -> int:
    """How many layers ``skip`` (a fraction of the skippable ones) skips: at least 1."""
    return max(1, min(depth - 2, round(skip * (depth - 2))))


def first_skip_set(depth: int, skip: float) -> tuple[int, ...]:
    """The search's start: a block of layers around the middle, where a model's layers are the most redundant (on
    SmolLM2-135M, teacher-forced agreement with the full model skipping layer 15: 0.77, layers 13-16: 0.58; layer 28
    only: 0.46, layers 26-28: 0.04)."""
    n = skip_count(depth, skip)
    lo = max(1, min(depth - 1 - n, depth // 2 - n // 2))
    return tuple(range(lo, lo + n))


def kept_segments(skipped: tuple[int, ...], depth: int) -> list[tuple[int, int]]:
    """The kept layers as contiguous ranges [a, b), in order; the first starts at layer 0."""
    out, a = [], 0
    for layer in sorted(skipped) + [depth]:
        if layer > a:
            out.append((a, layer))
        a = layer + 1
    return out


def layer_costs(adapter: ModelAdapter) -> tuple[float, float]:
    """(weights of one decoder layer, weights of the LM head), counted from the config: what a forward reads."""
    c = adapter.config
    h, inter = c.hidden_size, c.intermediate_size
    q = c.num_attention_heads * adapter.head_dim
    kv = adapter.kv_heads * adapter.head_dim
    return float(h * (2 * q + 2 * kv) + 3 * h * inter), float(adapter.vocab_size * h)


def expected_speed(alpha: float, kept: int, depth: int, layer: float, head: float, k: int) -> float:
    """Expected committed tokens per unit of cost of one step drafting a chain of the best length 1..k with the
    acceptance ``alpha`` per draft (:func:`best_length`); AR's step is 1.

    >>> expected_speed(0.0, 20, 30, 1.0, 8.0, 4) < 1.0 < expected_speed(0.9, 15, 30, 1.0, 8.0, 4)
    True
    """
    return best_length(alpha, kept, depth, layer, head, k)[0]


def best_length(alpha: float, kept: int, depth: int, layer: float, head: float, k: int) -> tuple[float, int]:
    """(expected speed over AR, draft length 1..k that reaches it): drafts 1..j each cost the kept layers plus the
    head, the last draft's feed the layers before the first skipped one, verification the layers from there on plus
    the head (those two add up to one pass over every layer); AR's step costs one pass plus the head.

    >>> speed, j = best_length(0.9, 15, 30, 1.0, 8.0, 8); round(speed, 3), j     # longer chains cost more than they bring
    (1.226, 2)
    """
    full = depth * layer + head
    best = (0.0, 1)
    for j in range(1, k + 1):
        tokens = sum(alpha**i for i in range(j + 1))
        cost = j * (kept * layer + head) + depth * layer + head
        best = max(best, (tokens / (cost / full), j), key=lambda x: x[0])
    return best


class LayerSearch:
    """The state of SWIFT's search over skipped sets (see the module docstring); shared by a decoder's requests."""

    def __init__(self, depth: int, skip: float, trials: int, seed: int = 0):
        self.depth, self.skip, self.trials, self.seed = depth, skip, trials, seed
        self.trials_left = trials
        self.best = first_skip_set(depth, skip)
        self.speed: float | None = None  # the incumbent's expected speed over AR at its latest score (None: unscored)
        self.length = 0  # the draft length that reaches it
        self.history: list[dict] = []  # per trial: candidate, both scores, kept or not
        self.rng = random.Random(seed)  # host-side draws: the search reads nothing back from a device
        self.lock = threading.Lock()

    def candidate(self) -> tuple[int, ...]:
        """The incumbent changed at random by one move: one skipped layer swapped for a kept (skippable) one, one more
        layer skipped, or one fewer (the cost, not only the acceptance, decides between sizes)."""
        skipped = list(self.best)
        kept = [layer for layer in skippable(self.depth) if layer not in skipped]
        moves = (["swap", "add"] if kept else []) + (["drop"] if len(skipped) > 1 else [])
        if not moves:
            return self.best
        move = moves[self.rng.randrange(len(moves))]
        if move == "drop":
            skipped.pop(self.rng.randrange(len(skipped)))
        elif move == "add":
            skipped.append(kept[self.rng.randrange(len(kept))])
        else:
            skipped[self.rng.randrange(len(skipped))] = kept[self.rng.randrange(len(kept))]
        return tuple(sorted(skipped))


class SwiftDrafter(Drafter):
    """The target with the layers of ``search.best`` skipped drafts a chain; see the module docstring."""

    reads_tokens = True  # it reads ``state.tokens`` at its steps

    name = "swift"

    def __init__(self, search: LayerSearch, confidence_threshold: float = 0.0, cold: bool = False, k: int = 4):
        self.search = search
        self.k = k  # the longest chain a trial scores a set for (the config's k)
        self.cold = cold  # every generation searches anew (draft_memory=cold)
        self.threshold = confidence_threshold
        self.prompt_len = 0
        self.last: dict = {}  # the latest trial, for tests and stats

    def start(self, state: DecodeState) -> None:
        self.prompt_len = state.tokens.shape[1] - 1  # the first new token is pending
        if self.cold:
            s = self.search
            self.search = LayerSearch(s.depth, s.skip, s.trials, s.seed)

    # ---- running a skipped model ----------------------------------------------------------------------------
    @staticmethod
    def run(t: ModelAdapter, cache: KVCache, slot: int, ids: torch.Tensor, segments, whole: bool = True):
        """Run ids [B, T] at ``slot`` through the kept ``segments``: (hidden after the first segment [B, T, H], the last
        segment's output [B, T, H] or None when not ``whole``)."""
        first = t.forward(cache, slot, input_ids=ids, last=segments[0][1])
        if not whole:
            return first, None
        h = first
        for a, b in segments[1:]:
            h = t.forward(cache, slot, hidden=h, first=a, last=b)
        return first, h

    def _score(self, state: DecodeState, sets: list[tuple[int, ...]]) -> list[float]:
        """Teacher-forced agreement of each skipped set with the generated tokens of the latest window (its KV is
        restored after): one forward per set over :data:`WINDOW` tokens, one host read for all."""
        t, cache, tokens = state.target, state.target_cache, state.tokens
        n = tokens.shape[1]
        begin, end = n - 1 - WINDOW, n - 1  # positions of the window's inputs; their next tokens are the labels
        labels = tokens[:, begin + 1 : end + 1]
        saved = cache.k_all[:, :, :, begin:end].clone(), cache.v_all[:, :, :, begin:end].clone()
        agree = []
        try:
            for skipped in sets:
                _, h = self.run(t, cache, begin, tokens[:, begin:end], kept_segments(skipped, t.num_layers))
                agree.append((t.logits(h).argmax(-1) == labels).float().mean())
        finally:
            cache.k_all[:, :, :, begin:end] = saved[0]
            cache.v_all[:, :, :, begin:end] = saved[1]
        return torch.stack(agree).tolist()

    @torch.inference_mode()
    def update(self, state: DecodeState, num_accepted: int) -> None:
        """One trial of the search after each step's verdict, drafted or not (see the module docstring)."""
        s = self.search
        with s.lock:
            if s.trials_left <= 0 or state.tokens.shape[1] - 1 - self.prompt_len < WINDOW + 1:
                return
            s.trials_left -= 1
            incumbent, cand = s.best, s.candidate()
        if cand == incumbent:
            return
        alphas = self._score(state, [incumbent, cand])
        depth = state.target.num_layers
        layer, head = layer_costs(state.target)
        k = max(1, self.k)
        scored = [best_length(a, depth - len(x), depth, layer, head, k) for a, x in zip(alphas, (incumbent, cand), strict=True)]
        kept = scored[1][0] > scored[0][0]
        with s.lock:
            if s.best == incumbent:
                s.best = cand if kept else incumbent
                s.speed, s.length = scored[1] if kept else scored[0]
            self.last = {"incumbent": incumbent, "candidate": cand, "agreement": alphas, "speed": [x[0] for x in scored], "kept": kept}
            s.history.append(self.last)

    # ---- drafting ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, state: DecodeState, k: int) -> Proposal:
        if self.search.speed is not None:  # scored: draft the best length, or nothing where skipping does not pay
            k = min(k, self.search.length) if self.search.speed > 1.0 else 0
            if k == 0:
                return Proposal.empty(state.tokens.shape[0], state.tokens.device)
        t, cache = state.target, state.target_cache
        n = state.tokens.shape[1]
        skipped = self.search.best
        segments = kept_segments(skipped, t.num_layers)
        continued = [None]  # [B, 1, H] per fed token: the hidden state after the first segment (exact)

        def feed(tok, slot, need_logits):
            first, h = self.run(t, cache, slot, tok, segments, whole=need_logits)
            continued.append(first)
            return t.logits(h)[:, -1] if need_logits else None

        first, h = self.run(t, cache, n - 1, state.tokens[:, -1:], segments)
        continued[0] = first
        tokens, probs, _ = draft_chain(
            lambda tok, i, need: feed(tok[:, None], n + i, need), t.logits(h)[:, -1], k, state, self.threshold, feed_last=True
        )
        # verification continues from the first segment's end: the hidden states of [pending, drafts]
        return Proposal(tokens=tokens, probs=probs, hidden=torch.cat(continued, 1), layer=segments[0][1])


def build_swift(cfg, target, memory=None) -> SwiftDrafter:
    depth = model_depth(target)
    if depth < 3:
        raise ConfigError("method", f"swift skips intermediate layers: the model needs at least 3, it has {depth}")
    new = lambda: LayerSearch(depth, cfg.swift_skip, cfg.swift_trials, cfg.seed)  # noqa: E731
    warm = memory is not None and cfg.draft_memory == "warm"
    search = memory.get(("swift", depth, cfg.swift_skip, cfg.swift_trials, cfg.seed), new) if warm else new()
    return SwiftDrafter(search, cfg.confidence_threshold, cold=not warm, k=cfg.k)


@builds("swift")
def _swift_drafter(cfg, target, device, memory):
    return build_swift(cfg, target, memory)
