"""Suffix decoding (Oliaro et al., "SuffixDecoding", 2024): draft the most frequent continuations of the context's
longest match in suffix tries over this request and over earlier requests' outputs.

Two depth-limited suffix tries (every substring of up to ``depth`` tokens, with how often it occurred):

* the request's own, over its prompt and output, grown token by token as tokens are committed;
* a global one over the outputs of earlier requests (bounded: at most ``cache_tokens`` tokens, oldest dropped).

To draft, the longest suffix of the context (up to ``max_match`` tokens) that occurred before with a
continuation is found in each trie; from that node a tree grows best-first by the empirical probability of the
path (count of a child / total count of its siblings, multiplied along the path), up to ``ceil(factor *
match length)`` nodes (longer matches earn bigger drafts) and never a node under ``min_prob``. The trie whose
tree has the larger expected accepted length (the sum of its nodes' path probabilities) wins.

>>> trie = SuffixTrie(depth=4)
>>> trie.extend([1, 2, 3, 1, 2, 4, 1, 2])
>>> node, m = trie.match_open(max_match=3)      # the context ends "1 2": seen twice before, followed by 3 and 4
>>> m, sorted((tok, child.count) for tok, child in node.kids.items())
(2, [(3, 1), (4, 1)])
>>> best_first(node, depth=2, budget=3, min_prob=0.1)   # tokens, parents, path probabilities
([3, 4, 1], [0, 0, 1], [0.5, 0.5, 0.5])
"""

from __future__ import annotations

import heapq
import math
from collections import deque

import torch

from decoding.drafters.base import DecodeState, Drafter, Proposal
from decoding.trees.shapes import Tree


class _Node:
    __slots__ = ("count", "kids", "depth")

    def __init__(self, depth: int):
        self.count = 0
        self.kids: dict[int, _Node] = {}
        self.depth = depth


class SuffixTrie:
    """Every substring of at most ``depth`` tokens of the text fed so far, with counts; ``open[i]`` is the node of
    the text's current suffix of length i+1, so appending a token costs O(depth)."""

    def __init__(self, depth: int = 24):
        self.depth = depth
        self.root = _Node(0)
        self.open: list[_Node] = []
        self.nodes = 1

    def append(self, tok: int) -> None:
        new = []
        for node in [self.root] + self.open[: self.depth - 1]:
            child = node.kids.get(tok)
            if child is None:
                child = node.kids[tok] = _Node(node.depth + 1)
                self.nodes += 1
            child.count += 1
            new.append(child)
        self.open = new

    def extend(self, tokens) -> None:
        for t in tokens:
            self.append(int(t))

    def end_text(self) -> None:
        """The next tokens start a new text (no substring spans the two)."""
        self.open = []

    def match_open(self, max_match: int) -> tuple[_Node | None, int]:
        """The longest current suffix (<= max_match tokens) that has a continuation: (node, length), or (None, 0)."""
        for m in range(min(max_match, len(self.open)), 0, -1):
            node = self.open[m - 1]
            if node.kids:
                return node, m
        return None, 0

    def match(self, context: list[int], max_match: int) -> tuple[_Node | None, int]:
        """The longest suffix of ``context`` (<= max_match tokens) present in the trie with a continuation."""
        for m in range(min(max_match, len(context), self.depth - 1), 0, -1):
            node = self.root
            for t in context[-m:]:
                node = node.kids.get(t)
                if node is None:
                    break
            if node is not None and node.kids:
                return node, m
        return None, 0


def best_first(node: _Node, depth: int, budget: int, min_prob: float) -> tuple[list[int], list[int], list[float]]:
    """The ``budget`` most probable continuations under ``node`` (depth <= ``depth``), as a tree.

    Returns (tokens, parents, probs); parents index [root, nodes...] (0 = the pending token).
    """
    tokens, parents, probs = [], [], []
    heap: list = []
    tie = 0

    def offer(n: _Node, index: int, p: float, d: int):
        nonlocal tie
        if d >= depth or not n.kids:
            return
        total = sum(c.count for c in n.kids.values())
        for tok, child in n.kids.items():
            q = p * child.count / total
            if q >= min_prob:
                tie += 1
                heapq.heappush(heap, (-q, tie, tok, child, index, d + 1))

    offer(node, 0, 1.0, 0)
    while heap and len(tokens) < budget:
        neg, _, tok, child, parent, d = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        probs.append(-neg)
        offer(child, len(tokens), -neg, d)
    return tokens, parents, probs


class SuffixCache:
    """The global trie over earlier requests' outputs, at most ``cache_tokens`` tokens (oldest outputs dropped; the
    trie is rebuilt from the kept ones when a quarter of the budget must go)."""

    def __init__(self, depth: int = 24, cache_tokens: int = 16384):
        self.depth, self.cache_tokens = depth, cache_tokens
        self.outputs: deque[list[int]] = deque()
        self.tokens = 0
        self.trie = SuffixTrie(depth)

    def add(self, output: list[int]) -> None:
        if not output or self.cache_tokens <= 0:
            return
        output = list(output[-self.cache_tokens :])
        self.outputs.append(output)
        self.tokens += len(output)
        if self.tokens > self.cache_tokens:
            while self.tokens > 0.75 * self.cache_tokens and len(self.outputs) > 1:
                self.tokens -= len(self.outputs.popleft())
            self.trie = SuffixTrie(self.depth)
            for out in self.outputs:
                self.trie.extend(out)
                self.trie.end_text()
        else:
            self.trie.extend(output)
            self.trie.end_text()

    def reset(self) -> None:
        self.outputs.clear()
        self.tokens = 0
        self.trie = SuffixTrie(self.depth)


class SuffixDrafter(Drafter):
    """Suffix decoding over this request (prompt + output) and earlier requests' outputs (``memory``, warm across
    requests; ``cold`` forgets them at every ``start``)."""

    name = "suffix"
    model_free = True

    def __init__(
        self,
        budget: int = 16,
        factor: float = 1.0,
        min_prob: float = 0.1,
        depth: int = 24,
        max_match: int = 16,
        cache_tokens: int = 16384,
        memory=None,
        cold: bool = False,
        chooser=None,
    ):
        from decoding.drafters.draft_memory import DraftMemory

        self.chooser = chooser  # hardware.TreeChooser: verify the prefix of the draft that pays best on this host

        self.budget, self.factor, self.min_prob = budget, factor, min_prob
        self.depth, self.max_match, self.cache_tokens, self.cold = depth, min(max_match, depth - 1), cache_tokens, cold
        self.memory = memory if memory is not None else DraftMemory()
        self.local: SuffixTrie | None = None
        self._fed = 0  # tokens of the request fed into the local trie
        self._prompt_len = 0
        self._last: DecodeState | None = None  # the running request (its output goes to the global cache at the next start)

    @property
    def cache(self) -> SuffixCache:
        return self.memory.get(("suffix-cache", self.depth, self.cache_tokens), lambda: SuffixCache(self.depth, self.cache_tokens))

    def max_nodes(self, k: int) -> int:
        return self.chooser.max_budget if self.chooser is not None else self.budget

    def start(self, state: DecodeState) -> None:
        if state.tokens.shape[0] != 1:
            raise ValueError("suffix decoding drafts trees for batch size 1")
        if self._last is not None:  # the previous request's output joins the global cache
            self.cache.add(self._last.tokens[0, self._prompt_len :].tolist())
        self._last = state
        if self.cold:
            self.cache.reset()
        self.local = SuffixTrie(self.depth)
        self._prompt_len = state.tokens.shape[1] - 1  # the first generated token is already committed
        self._fed = 0
        self.catch_up(state)

    def catch_up(self, state: DecodeState) -> None:
        """Extend this request's suffix trie with the tokens committed since the last call (the hybrid calls it too)."""
        seq = state.tokens[0, self._fed :].tolist()
        self.local.extend(seq)
        self._fed += len(seq)

    def draft(self, context: list[int], k: int, budget: int | None = None) -> tuple[list[int], list[int], list[float], int]:
        """(tokens, parents, path probabilities, match length) of the better of the local and global trees."""
        cap = self.max_nodes(k) if budget is None else budget
        best = ([], [], [], 0)
        if k <= 0 or cap <= 0:
            return best
        local = self.local.match_open(self.max_match) if self.local is not None else (None, 0)
        found = [local, self.cache.trie.match(context, self.max_match)]
        for node, m in found:
            if node is None:
                continue
            n = min(cap, max(1, math.ceil(self.factor * m)))
            toks, pars, probs = best_first(node, min(k, self.depth - node.depth), n, self.min_prob)
            if sum(probs) > sum(best[2]):
                best = (toks, pars, probs, m)
        return best

    def propose(self, state: DecodeState, k: int) -> Proposal:
        self.catch_up(state)
        tokens, parents, probs, _ = self.draft(state.tokens[0, -self.max_match :].tolist(), k)
        if self.chooser is not None:  # best-first order: every prefix is a tree
            b = self.chooser.prefix(probs)
            tokens, parents = tokens[:b], parents[:b]
        if not tokens:
            return Proposal.empty(1, state.tokens.device)
        ids = torch.tensor([tokens], dtype=torch.long, device=state.tokens.device)
        return Proposal(tokens=ids, tree=Tree.from_parents([-1] + parents))

    def finish(self) -> None:
        """Hand the running request's output to the global cache now (``start`` does it for the previous one)."""
        if self._last is not None:
            self.cache.add(self._last.tokens[0, self._prompt_len :].tolist())
            self._last = None
