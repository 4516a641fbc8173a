"""Self-speculation by early exit: the target's first layers draft, verification continues from their hidden states."""

from __future__ import annotations

import torch

from decoding.drafters.base import DecodeState, Drafter, Proposal
from decoding.drafters.drafting import draft_chain, draft_tree, max_nodes_of, tree_forward
from decoding.trees.shapes import Dynamic, Tree


class EarlyExitDrafter(Drafter):
    """Self-speculation: the target's first ``exit_layer`` layers plus its norm and head draft.

    The shallow layers write straight into the target's cache, so verification
    runs only layers [exit_layer, N) on the drafted tokens' saved hidden states.
    """

    reads_tokens = True  # it reads ``state.tokens`` at its steps

    name = "early-exit"

    def __init__(self, exit_layer: int, confidence_threshold: float = 0.0, tree: Tree | Dynamic | None = None):
        self.exit_layer = exit_layer
        self.threshold = confidence_threshold
        self.tree = tree

    def max_nodes(self, k: int) -> int:
        return max_nodes_of(self.tree, k)

    def propose(self, state: DecodeState, k: int) -> Proposal:
        t, cache, L = state.target, state.target_cache, self.exit_layer
        n = state.tokens.shape[1]
        hiddens = [self.shallow(t, cache, n - 1, state.tokens[:, -1:])]
        if self.tree is not None:  # the shallow layers write the nodes' KV at tree slots of the target cache

            def tree_step(toks, lo, hi, tree):
                hiddens.append(tree_forward(t, cache, n - 1, tree, lo, hi, input_ids=toks, last=L))
                return t.logits(hiddens[-1])

            order: list[int] = []
            tokens, probs, tree, _ = draft_tree(tree_step, t.logits(hiddens[0])[:, -1], self.tree, k, state, feed_last=True, order=order)
            hidden = torch.cat(hiddens, 1)[:, order]  # drafting order -> the tree's node order
            if order != list(range(len(order))):  # the shallow layers' keys at the tree slots follow the same order
                cache.compact(n - 1, [i + n - 1 for i in order])
            return Proposal(tokens=tokens, probs=probs, hidden=hidden, layer=L, tree=tree)

        def step(tok, i, need_logits):
            hiddens.append(self.shallow(t, cache, n + i, tok[:, None]))
            return self.exit_logits(state, hiddens[-1], n + i, need_logits)

        first = self.exit_logits(state, hiddens[0], n - 1, True)
        tokens, probs, _ = draft_chain(step, first, k, state, self.threshold, feed_last=True)
        return Proposal(tokens=tokens, probs=probs, hidden=torch.cat(hiddens, 1), layer=L)

    def shallow(self, t, cache, slot: int, ids: torch.Tensor) -> torch.Tensor:
        """A chain's forward: the target's first ``exit_layer`` layers on ids [B, T] written at ``slot`` -> hidden [B, T, H]
        (DEL keeps its lower candidate exits' hidden states here)."""
        return t.forward(cache, slot, input_ids=ids, last=self.exit_layer)

    def exit_logits(self, state: DecodeState, hidden: torch.Tensor, slot: int, need_logits: bool) -> torch.Tensor | None:
        """Next-token logits [B, V] from the exit layer's hidden [B, 1, H] at cache slot ``slot`` (Kangaroo adds an adapter)."""
        return state.target.logits(hidden)[:, -1] if need_logits else None
