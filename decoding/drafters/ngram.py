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
    >>> d.lookup([5, 6, 7, 8, 5, 6], k=3)   # suffix [5, 6] seen at 0, followed by 7 8 5
    [7, 8, 5]
    >>> d.lookup([1, 2, 3], k=3)
    []
    """

    name = "ngram"
    model_free = True

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1, tree_budget: int | None = None):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.tree_budget = tree_budget  # None: one continuation (a chain); else a trie of up to this many nodes

    def max_nodes(self, k: int) -> int:
        return k if self.tree_budget is None else self.tree_budget

    def lookup_tree(self, seq: torch.Tensor, k: int, budget: int, sizes=None) -> tuple[list[int], list[int]]:
        """Several continuations (up to k tokens each) merged into a trie of at most ``budget`` nodes.

        Continuations of longer suffix matches come first, then the more recent ones; ``sizes`` (default
        ``ngram_max`` down to ``ngram_min``) names the suffix lengths tried. Returns (tokens, parents) of the nodes
        in insertion order; parents index [pending, nodes...] (0 = the pending token).

        >>> d = NgramDrafter(ngram_max=1, ngram_min=1)
        >>> d.lookup_tree(torch.tensor([5, 6, 7, 5, 8, 9, 5]), k=2, budget=4)   # after 5: "8 9" (latest) and "6 7"
        ([8, 9, 6, 7], [0, 1, 0, 3])
        """
        n = seq.shape[0]
        tokens, parents, child = [], [], {}  # child[(node, token)] = node
        for size in range(min(self.ngram_max, n - 1), self.ngram_min - 1, -1) if sizes is None else sizes:
            if size > n - 1:
                continue
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

    def lookup(self, seq, k: int) -> list[int]:
        """The up to k tokens after the latest earlier occurrence of the longest suffix of ``seq`` (a token list, or a
        tensor [n]) that has one; every window considered has at least one token after it."""
        seq = seq.tolist() if isinstance(seq, torch.Tensor) else list(seq)
        index = SuffixIndex(self.ngram_min, self.ngram_max)
        index.extend(seq)
        return index.continuation(seq, k)

    def start(self, state: DecodeState) -> None:
        self._index = SuffixIndex(self.ngram_min, self.ngram_max)

    def truncate(self, length: int) -> None:
        if getattr(self, "_index", None) is not None and self._index.length > length:
            self._index = SuffixIndex(self.ngram_min, self.ngram_max)

    @property
    def reads_tokens(self) -> bool:  # a chain looks up the host ids (``state.history``); a tree reads the device's
        return self.tree_budget is not None

    def propose(self, state: DecodeState, k: int) -> Proposal:
        if state.rows != 1:
            raise ValueError("the n-gram drafter drafts one sequence (the loop hands it one row)")
        if self.tree_budget is not None and k > 0:
            tokens, parents = self.lookup_tree(state.tokens[0], k, self.tree_budget)
            ids = torch.tensor([tokens], dtype=torch.long, device=state.tokens.device)
            return Proposal(tokens=ids, tree=Tree.from_parents([-1] + parents))
        seq = state.history  # host ints: looking them up reads nothing from the device
        index = getattr(self, "_index", None)
        if index is None or index.length > len(seq):
            index = self._index = SuffixIndex(self.ngram_min, self.ngram_max)
        index.extend(seq)
        drafts = index.continuation(seq, k) if k > 0 else []
        return Proposal(host=drafts, device=state.device, kind=index.matched if drafts else None)


class SuffixIndex:
    """The latest start of every n-gram (sizes lo..hi) of a growing token list, among windows followed by at least
    one token: prompt lookup in constant time per step instead of a scan of the whole text.

    >>> index = SuffixIndex(1, 2); seq = [5, 6, 7, 8, 5, 6]; index.extend(seq)
    >>> index.continuation(seq, 3)           # suffix [5, 6] seen at 0, followed by 7 8 5
    [7, 8, 5]
    >>> index.continuation([1, 2, 3], 3)
    []
    """

    def __init__(self, lo: int, hi: int):
        self.maps: dict[int, dict[tuple, int]] = {size: {} for size in range(hi, lo - 1, -1)}
        self.length = 0  # windows of seq[:length] are indexed
        self.matched = 0  # the n-gram size the latest continuation matched (0: none)

    def extend(self, seq: list[int]) -> None:
        n = len(seq)
        for size, latest in self.maps.items():
            for i in range(max(0, self.length - size), n - size):  # windows ending before the last token
                latest[tuple(seq[i : i + size])] = i
        self.length = max(self.length, n)

    def continuation(self, seq: list[int], k: int) -> list[int]:
        n = len(seq)
        for size, latest in self.maps.items():
            if size >= n:
                continue
            i = latest.get(tuple(seq[n - size :]))
            if i is not None:
                self.matched = size
                return seq[i + size : i + size + k]
        self.matched = 0
        return []


@builds("ngram")
def _ngram_drafter(cfg, target, device, memory) -> Drafter:
    shape = tree_shape(cfg)
    return NgramDrafter(cfg.ngram_max, cfg.ngram_min, tree_budget=None if shape is None else max_nodes_of(shape, cfg.k))
