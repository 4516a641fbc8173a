"""Prompt lookup: the n-gram drafter (chains, or a trie of continuations) and its builder."""

from __future__ import annotations

import torch

from decoding.builders import builds
from decoding.drafters.base import DecodeState, Drafter, Proposal
from decoding.drafters.drafting import max_nodes_of
from decoding.trees.shapes import Tree, tree_shape


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
    model_free = True

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1, tree_budget: int | None = None):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.tree_budget = tree_budget  # None: one continuation (a chain); else a trie of up to this many nodes

    def max_nodes(self, k: int) -> int:
        return k if self.tree_budget is None else self.tree_budget

    def lookup_tree(self, seq: torch.Tensor, k: int, budget: int) -> tuple[list[int], list[int]]:
        """Several continuations (up to k tokens each) merged into a trie of at most ``budget`` nodes.

        Continuations of longer suffix matches come first, then the more recent ones. Returns (tokens, parents)
        of the nodes in insertion order; parents index [pending, nodes...] (0 = the pending token).

        >>> d = NgramDrafter(ngram_max=1, ngram_min=1)
        >>> d.lookup_tree(torch.tensor([5, 6, 7, 5, 8, 9, 5]), k=2, budget=4)   # after 5: "8 9" (latest) and "6 7"
        ([8, 9, 6, 7], [0, 1, 0, 3])
        """
        n = seq.shape[0]
        tokens, parents, child = [], [], {}  # child[(node, token)] = node
        for size in range(min(self.ngram_max, n - 1), self.ngram_min - 1, -1):
            windows = seq[: n - 1].unfold(0, size, 1)
            for hit in (windows == seq[n - size :]).all(-1).nonzero().flatten().flip(0).tolist():
                node = 0
                for tok in seq[hit + size : hit + size + k].tolist():
                    if (node, tok) not in child:
                        if len(tokens) >= budget:
                            return tokens, parents
                        tokens.append(tok)
                        parents.append(node)
                        child[(node, tok)] = len(tokens)
                    node = child[(node, tok)]
        return tokens, parents

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
        if self.tree_budget is not None and k > 0:
            if state.tokens.shape[0] != 1:
                raise ValueError("n-gram trees run batch size 1")
            tokens, parents = self.lookup_tree(state.tokens[0], k, self.tree_budget)
            ids = torch.tensor([tokens], dtype=torch.long, device=state.tokens.device)
            return Proposal(tokens=ids, tree=Tree.from_parents([-1] + parents))
        rows = [self.lookup(row, k) for row in state.tokens]
        j = min(r.shape[0] for r in rows)
        return Proposal(tokens=torch.stack([r[:j] for r in rows]))


@builds("ngram")
def _ngram_drafter(cfg, target, device, memory) -> Drafter:
    shape = tree_shape(cfg)
    return NgramDrafter(cfg.ngram_max, cfg.ngram_min, tree_budget=None if shape is None else max_nodes_of(shape, cfg.k))
