"""SpS's drafter: a separate, smaller model (or the target's first layers) with its own cache; and the adapters
it drafts with."""

from __future__ import annotations

import torch

from decoding.drafters.base import DecodeState, Drafter, Proposal
from decoding.drafters.drafting import (
    block_place,
    draft_chain,
    draft_loops,
    draft_tree,
    greedy_chain_loop,
    loop_applies,
    max_nodes_of,
    one_token_place,
    tree_forward,
)
from decoding.errors import ConfigError
from decoding.model.adapter import KVCache, ModelAdapter
from decoding.model.loading import load_model
from decoding.timing import mark
from decoding.trees.shapes import Dynamic, Tree


class DraftModelDrafter(Drafter):
    """SpS: a separate (smaller) model with its own cache drafts k tokens.

    The draft cache lags the committed tokens by whatever the last verdict
    added; ``propose`` first catches up on those tokens in one forward.
    """

    reads_tokens = True  # it reads ``state.tokens`` at its steps

    name = "sps"

    def __init__(
        self, adapter: ModelAdapter, confidence_threshold: float = 0.0, tree: Tree | Dynamic | None = None, loop_graphs: bool | None = None
    ):
        self.adapter = adapter
        self.loops = draft_loops(adapter, loop_graphs)  # greedy chains: the k drafts as one CUDA graph per shape
        self.threshold = confidence_threshold
        self.tree = tree  # None: draft a chain; else the shape of the tree to draft
        self.cache: KVCache | None = None
        self._base = 0  # committed length when drafting started
        self._fed = 0  # drafts fed into the draft cache (trees: nodes 1.._fed)

    def max_nodes(self, k: int) -> int:
        return max_nodes_of(self.tree, k)

    def start(self, state: DecodeState) -> None:
        self.cache = self.adapter.new_cache(state.tokens.shape[0], state.max_len)
        self._base, self._fed = 0, 0  # nothing of an earlier generation carries over

    def propose(self, state: DecodeState, k: int) -> Proposal:
        n = state.tokens.shape[1]
        cache, a = self.cache, self.adapter
        if self.tree is None and k > 1 and loop_applies(self, state):  # catch-up and chain as one graph
            tokens = self._caught_up_chain(state, k)
            if tokens is not None:
                self._base, self._fed = n, k - 1
                return Proposal(tokens=tokens)
        h = a.forward(cache, cache.length, input_ids=state.tokens[:, cache.length : n])
        self._base, self.caught_up = n, mark(h.device)

        if self.tree is not None:

            def tree_step(toks, lo, hi, tree):
                return a.logits(tree_forward(a, cache, n - 1, tree, lo, hi, input_ids=toks))

            tokens, probs, tree, self._fed = draft_tree(tree_step, a.logits(h[:, -1:])[:, -1], self.tree, k, state, feed_last=False)
            return Proposal(tokens=tokens, probs=probs, tree=tree)

        if loop_applies(self, state) and k > 1:
            tokens = self._chain_loop(h[:, -1:], n, k)
            if tokens is not None:
                self._fed = k - 1
                return Proposal(tokens=tokens)

        def step(tok, i, need_logits):
            return a.logits(a.forward(cache, n + i, input_ids=tok[:, None]))[:, -1]

        tokens, probs, self._fed = draft_chain(step, a.logits(h[:, -1:])[:, -1], k, state, self.threshold, feed_last=False)
        return Proposal(tokens=tokens, probs=probs)

    def _feed_one(self):
        """A loop's draft forward: one token per row written at ``slot`` [B] (a device tensor)."""
        a, cache = self.adapter, self.cache

        def feed(h, tok, slot):
            return a.eager_forward(cache, tok[:, None], None, 0, a.num_layers, slot[:, None], one_token_place(slot, cache.max_len), None)

        return feed

    def _greedy_chain(self, h: torch.Tensor, slot: torch.Tensor, k: int) -> torch.Tensor:
        """A loop's k greedy drafts [B, k] after the hidden state ``h`` [B, 1, H], the first fed at ``slot`` [B]."""
        return greedy_chain_loop(lambda x: self.adapter.logits(x)[:, -1], self._feed_one(), h, slot, k)

    def _chain_loop(self, h: torch.Tensor, n: int, k: int) -> torch.Tensor | None:
        """k greedy drafts [B, k] after the last committed token's hidden state ``h`` [B, 1, H], as one graph."""
        cache = self.cache

        def loop(h, slot):
            return self._greedy_chain(h, slot, k)

        slot = torch.full((h.shape[0],), n, dtype=torch.long, device=h.device)
        key = ("chain", cache.k_all.data_ptr(), tuple(cache.k_all.shape), k)
        return self.loops.run(key, loop, h, slot)

    def _caught_up_chain(self, state: DecodeState, k: int) -> torch.Tensor | None:
        """The catch-up (the committed tokens the draft's cache lacks, fed in one block) and k greedy drafts after it,
        as one graph per (k, width), when the catch-up is a step's usual width (at most 2: the target's token, and the
        last draft when all were accepted); None otherwise or where the capture failed (nothing fed then)."""
        a, cache, n = self.adapter, self.cache, state.tokens.shape[1]
        first, w = cache.length, n - cache.length
        if not 1 <= w <= 2:
            return None

        def loop(ids, start):
            place = block_place(start, w, cache.max_len)
            h = a.eager_forward(cache, ids, None, 0, a.num_layers, place.slots, place, None)
            return self._greedy_chain(h[:, -1:], start + w, k)

        start = torch.full((state.tokens.shape[0],), first, dtype=torch.long, device=state.tokens.device)
        key = ("caught-up-chain", cache.k_all.data_ptr(), tuple(cache.k_all.shape), start.shape[0], k, w)
        tokens = self.loops.run(key, loop, state.tokens[:, first:n], start)
        if tokens is not None:
            cache.rollback(n)  # the committed prefix is in the cache; the drafts' keys beyond it are rolled back later
        return tokens

    def update(self, state: DecodeState, num_accepted: int) -> None:
        if self.tree is not None and state.accepted_path is not None:
            # the accepted nodes that were fed sit at tree slots: move them behind the committed prefix
            fed = [i for i in state.accepted_path[1:] if i <= self._fed]
            self.cache.compact(self._base, [i + self._base - 1 for i in fed])
            self.cache.rollback(self._base + len(fed))
        else:  # valid draft KV: the committed prefix plus the fed drafts that were accepted
            self.cache.rollback(self._base + min(num_accepted, self._fed))
        # a step without a proposal (the loop skips ``propose`` at k = 0) keeps the cache as it is
        self._base, self._fed = self.cache.length, 0

    def truncate(self, length: int) -> None:
        if self.cache is not None and self.cache.length > length:
            self.cache.rollback(length)


def model_depth(target) -> int:
    """The number of decoder layers of a loaded target (``decoding.model.loading.LoadedModel``)."""
    return len(ModelAdapter(target.model).layers)


def draft_model_adapter(cfg, target, device) -> ModelAdapter:
    """The adapter of the separate ``draft_model``, on ``device``; it must share the target's tokenizer."""
    draft = load_model(cfg.draft_model, cfg.dtype, device, cfg.quant)
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ConfigError("draft_model", f"{cfg.draft_model!r} does not share the target's tokenizer")
    return ModelAdapter(draft.model.to(device))


def first_layers_adapter(cfg, target) -> ModelAdapter:
    """The adapter of the target's first ``draft_layers`` layers (plus its final norm and LM head)."""
    depth = model_depth(target)
    if cfg.draft_layers >= depth:
        raise ConfigError("draft_layers", f"must be below the model's {depth} layers, got {cfg.draft_layers}")
    return ModelAdapter(target.model, num_layers=cfg.draft_layers)
