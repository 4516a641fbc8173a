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
import itertools
import math
from array import array
from collections import deque

import torch

from decoding.drafters.base import DecodeState, Drafter, Proposal
from decoding.drafters.ngram import NgramDrafter
from decoding.trees.shapes import Tree

STRIDE = 1 << 32  # an edge's key: parent * STRIDE + token (token ids are below 2**32)


class SuffixTrie:
    """Every substring of at most ``depth`` tokens of the text fed so far, with counts; ``open[i]`` is the node of
    the text's current suffix of length i+1, so appending a token costs O(depth).

    The nodes are integers: their edges one dict of ints, their counts, depths, tokens and children (first child,
    next sibling, in insertion order) typed arrays. None of it is an object Python's garbage collector walks: a trie
    of node objects (a global cache of 16K tokens is about 400K nodes) made every full collection of the process
    walk all of them, a pause of 100-250 ms inside whatever request was running. :class:`Node` is a view for code
    that reads the trie.
    """

    def __init__(self, depth: int = 24):
        self.depth = depth
        self.edges: dict[int, int] = {}
        self.count, self.level, self.token = array("q", [0]), array("q", [0]), array("q", [-1])
        self.first, self.last, self.sibling = array("q", [-1]), array("q", [-1]), array("q", [-1])
        self.free: list[int] = []  # ids of removed nodes, reused
        self.open: list[int] = []
        self.nodes = 1

    @property
    def root(self) -> Node:
        return Node(self, 0)

    def _new(self, parent: int, tok: int) -> int:
        level = self.level[parent] + 1
        if self.free:
            node = self.free.pop()
            self.count[node], self.level[node], self.token[node] = 0, level, tok
            self.first[node] = self.last[node] = self.sibling[node] = -1
        else:
            node = len(self.count)
            self.count.append(0)
            self.level.append(level)
            self.token.append(tok)
            self.first.append(-1)
            self.last.append(-1)
            self.sibling.append(-1)
        if self.last[parent] < 0:
            self.first[parent] = node
        else:
            self.sibling[self.last[parent]] = node
        self.last[parent] = node
        self.edges[parent * STRIDE + tok] = node
        self.nodes += 1
        return node

    def children(self, node: int):
        """(token, child) of ``node``'s children, in the order they first occurred."""
        child = self.first[node]
        while child >= 0:
            yield self.token[child], child
            child = self.sibling[child]

    def append(self, tok: int) -> None:
        new = []
        edges, count = self.edges, self.count
        for node in [0] + self.open[: self.depth - 1]:
            child = edges.get(node * STRIDE + tok)
            if child is None:
                child = self._new(node, tok)
            count[child] += 1
            new.append(child)
        self.open = new

    def extend(self, tokens) -> None:
        for t in tokens:
            self.append(int(t))

    def end_text(self) -> None:
        """The next tokens start a new text (no substring spans the two)."""
        self.open = []

    def remove(self, text: list[int]) -> None:
        """Take back one earlier text fed whole (between two ``end_text``): every substring of it loses one count, and a
        node no text passes through any more goes with its subtree. The same work as feeding it, where rebuilding the
        trie from the texts kept cost about a second at 16K tokens.

        >>> trie = SuffixTrie(depth=3)
        >>> for text in ([1, 2, 3], [1, 2, 4]):
        ...     trie.extend(text); trie.end_text()
        >>> trie.remove([1, 2, 3])
        >>> sorted(trie.root.kids), trie.root.kids[1].count, sorted(trie.root.kids[1].kids[2].kids), trie.nodes
        ([1, 2, 4], 1, [4], 7)
        """
        for start in range(len(text)):
            node = 0
            for tok in text[start : start + self.depth]:
                child = self.edges[node * STRIDE + tok]
                self.count[child] -= 1
                if self.count[child] == 0:
                    self._drop(node, child)
                    break
                node = child

    def _drop(self, parent: int, node: int) -> None:
        """Unlink ``node`` from ``parent``'s children and free its subtree."""
        prev, cur = -1, self.first[parent]
        while cur != node:
            prev, cur = cur, self.sibling[cur]
        if prev < 0:
            self.first[parent] = self.sibling[node]
        else:
            self.sibling[prev] = self.sibling[node]
        if self.last[parent] == node:
            self.last[parent] = prev
        stack = [(parent, node)]
        while stack:
            up, n = stack.pop()
            del self.edges[up * STRIDE + self.token[n]]
            stack.extend((n, c) for _, c in self.children(n))
            self.free.append(n)
            self.nodes -= 1

    def match_open(self, max_match: int) -> tuple[Node | None, int]:
        """The longest current suffix (<= max_match tokens) that has a continuation: (node, length), or (None, 0)."""
        for m in range(min(max_match, len(self.open)), 0, -1):
            node = self.open[m - 1]
            if self.first[node] >= 0:
                return Node(self, node), m
        return None, 0

    def match(self, context: list[int], max_match: int) -> tuple[Node | None, int]:
        """The longest suffix of ``context`` (<= max_match tokens) present in the trie with a continuation."""
        for m in range(min(max_match, len(context), self.depth - 1), 0, -1):
            node = 0
            for t in context[-m:]:
                node = self.edges.get(node * STRIDE + t)
                if node is None:
                    break
            if node is not None and self.first[node] >= 0:
                return Node(self, node), m
        return None, 0


class Node:
    """A view of one trie node: ``count``, ``depth`` and ``kids`` (token -> Node, in the order they first occurred)."""

    __slots__ = ("trie", "id")

    def __init__(self, trie: SuffixTrie, node: int):
        self.trie, self.id = trie, node

    @property
    def count(self) -> int:
        return self.trie.count[self.id]

    @property
    def depth(self) -> int:
        return self.trie.level[self.id]

    @property
    def kids(self) -> dict[int, Node]:
        return {tok: Node(self.trie, child) for tok, child in self.trie.children(self.id)}


def grow(kids, root, depth: int, budget: int, min_prob: float) -> tuple[list[int], list[int], list[float]]:
    """The ``budget`` most probable continuations under ``root`` (depth <= ``depth``, none under ``min_prob``), best
    first, as a tree: ``kids(node)`` lists a node's children as (token, count, child), and a child's probability is
    its count over its siblings' times its parent's. A trie's nodes (:func:`best_first`) or a suffix array's ranges
    (``suffix_corpus.CorpusIndex``).

    Returns (tokens, parents, probs); parents index [root, nodes...] (0 = the pending token).
    """
    tokens, parents, probs, heap, tie = [], [], [], [], itertools.count()

    def offer(node, index: int, p: float, d: int):
        children = kids(node) if d < depth else []
        total = sum(c for _, c, _ in children)
        for tok, c, child in children:
            q = p * c / total
            if q >= min_prob:
                heapq.heappush(heap, (-q, next(tie), tok, child, index, d + 1))

    offer(root, 0, 1.0, 0)
    while heap and len(tokens) < budget:
        neg, _, tok, child, parent, d = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        probs.append(-neg)
        offer(child, len(tokens), -neg, d)
    return tokens, parents, probs


def record_scale(accepted: float, expected: float) -> float:
    """What a copying drafter's estimates are worth, from its record: drafts accepted over drafts expected, each side
    with a prior of 2 (a source without a record keeps its estimates). Suffix decoding's trees and the hybrid's sources
    are scaled by it.

    >>> record_scale(0.0, 0.0), record_scale(1.0, 9.0)
    (1.0, 0.2727272727272727)
    """
    return (accepted + 2.0) / (expected + 2.0)


def draft_size(matched: int, factor: float, cap: int) -> int:
    """Nodes a draft from a match of ``matched`` tokens may have: ``factor`` per matched token (rounded up, at least
    one), at most ``cap`` (longer matches earn bigger drafts).

    >>> draft_size(3, 1.5, 16), draft_size(1, 0.1, 16), draft_size(20, 1.0, 16)
    (5, 1, 16)
    """
    return min(cap, max(1, math.ceil(factor * matched)))


def best_first(node: Node, depth: int, budget: int, min_prob: float) -> tuple[list[int], list[int], list[float]]:
    """:func:`grow` over a trie from ``node``."""
    trie = node.trie
    return grow(lambda n: [(tok, trie.count[c], c) for tok, c in trie.children(n)], node.id, depth, budget, min_prob)


class SuffixCache:
    """The global trie over earlier requests' outputs, at most ``cache_tokens`` tokens: the oldest outputs are taken
    back out of the trie (``SuffixTrie.remove``) as new ones come in."""

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
        self.trie.extend(output)
        self.trie.end_text()
        while self.tokens > self.cache_tokens and len(self.outputs) > 1:
            old = self.outputs.popleft()
            self.tokens -= len(old)
            self.trie.remove(old)

    def reset(self) -> None:
        self.outputs.clear()
        self.tokens = 0
        self.trie = SuffixTrie(self.depth)


class SuffixDrafter(Drafter):
    """Suffix decoding over this request (prompt + output) and earlier requests' outputs (``memory``, warm across
    requests; ``cold`` forgets them at every ``start``)."""

    reads_tokens = True  # it reads ``state.tokens`` at its steps

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
        corpus=None,
    ):
        from decoding.drafters.draft_memory import DraftMemory

        self.chooser = chooser  # hardware.TreeChooser: verify the prefix of the draft that pays best on this host
        self.corpus = corpus  # suffix_corpus.CorpusIndex: the model's answers written ahead of time, or None

        self.budget, self.factor, self.min_prob = budget, factor, min_prob
        self.depth, self.max_match, self.cache_tokens, self.cold = depth, min(max_match, depth - 1), cache_tokens, cold
        self.memory = memory if memory is not None else DraftMemory()
        self.local: SuffixTrie | None = None
        self._fed = 0  # tokens of the request fed into the local trie
        self._corpus_hint = (0, -1)
        self._prompt_len = 0
        self._last: DecodeState | None = None  # the running request (its output goes to the global cache at the next start)
        self._expected, self._nodes = 0.0, 0  # the last proposal's unscaled estimate and size (update's record)
        self._lookup = NgramDrafter(3, 1)  # its glance: prompt lookup over the request

    @property
    def cache(self) -> SuffixCache:
        key = ("suffix-cache", self.depth, self.cache_tokens)
        return self.memory.get(key, lambda: SuffixCache(self.depth, self.cache_tokens), text=True)

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
        self._corpus_hint = (0, -1)  # (the corpus match's length, tokens fed then): none yet
        self._prompt_len = state.tokens.shape[1] - 1  # the first generated token is already committed
        self._fed = 0
        self._lookup.start(state)
        self.catch_up(state)

    def catch_up(self, state: DecodeState) -> None:
        """Extend this request's suffix trie with the tokens committed since the last call (the hybrid calls it too)."""
        seq = state.tokens[0, self._fed :].tolist()
        self.local.extend(seq)
        self._fed += len(seq)

    def draft(self, context: list[int], k: int, budget: int | None = None) -> tuple[list[int], list[int], list[float], int]:
        """(tokens, parents, path probabilities, match length) of the best of the local and global trees and the
        corpus's (the larger expected accepted length wins)."""
        cap = self.max_nodes(k) if budget is None else budget
        best = ([], [], [], 0)
        if k <= 0 or cap <= 0:
            return best
        local = self.local.match_open(self.max_match) if self.local is not None else (None, 0)
        found = [local, self.cache.trie.match(context, self.max_match)]
        for node, m in found:
            if node is None:
                continue
            n = draft_size(m, self.factor, cap)
            toks, pars, probs = best_first(node, min(k, self.depth - node.depth), n, self.min_prob)
            if sum(probs) > sum(best[2]):
                best = (toks, pars, probs, m)
        if self.corpus is not None:
            # a match now is at most the last one plus the tokens fed since: a shorter search, the same match
            m_prev, fed_prev = self._corpus_hint
            bound = min(self.max_match, m_prev + self._fed - fed_prev) if 0 <= fed_prev <= self._fed else self.max_match
            found = self.corpus.tree(context, min(k, self.depth), cap, bound, self.min_prob, self.factor)
            self._corpus_hint = (found[3], self._fed)
            if sum(found[2]) > sum(best[2]):
                best = found
        return best

    @property
    def record(self) -> list[float]:
        """[drafts accepted, drafts its estimates expected] over its verified trees, in the decoder's memory (warm
        across requests)."""
        return self.memory.get("suffix-record", lambda: [0.0, 0.0])

    def propose(self, state: DecodeState, k: int) -> Proposal:
        """A tree of the continuations of the best match. Its estimates (continuation frequencies) expect more than the
        target accepts: on the 13 Spec-Bench categories here, trees (2.8 nodes on average) whose first node had a
        frequency of 0.9-1 expected 2.67 accepted drafts and had 1.17. So the tree carries them scaled by the
        drafter's record (``Proposal.expected``), which k=auto judges it by. The verified prefix is still chosen on the
        frequencies: a request with a fixed k (a seeded one) drafts the same trees whatever the record holds, and so
        draws the same tokens (a prefix chosen on the scaled estimates measured 1.083x AR against 1.059x, but a seeded
        request's repeats then differed in the soak)."""
        self.catch_up(state)
        self._expected = 0.0
        tokens, parents, probs, _ = self.draft(state.tokens[0, -self.max_match :].tolist(), k)
        if self.chooser is not None:  # best-first order: every prefix is a tree
            b = self.chooser.prefix(probs)
            tokens, parents, probs = tokens[:b], parents[:b], probs[:b]
        if not tokens:
            return Proposal.empty(1, state.tokens.device)
        scale = record_scale(*self.record)
        self._expected, self._nodes = sum(probs), len(tokens)
        ids = torch.tensor([tokens], dtype=torch.long, device=state.tokens.device)
        return Proposal(tokens=ids, tree=Tree.from_parents([-1] + parents), expected=sum(min(1.0, scale * p) for p in probs))

    def glance(self, state: DecodeState, k: int) -> Proposal:
        """Prompt lookup's chain over the request (the continuation of its longest earlier 1-3-gram, in constant time a
        step): most of what the local tree's match would offer, without the tries' 0.4 ms. It leaves the record alone."""
        self._expected = 0.0
        return self._lookup.propose(state, k)

    def lookahead(self, state: DecodeState, k: int) -> list[int]:
        return self._lookup.propose(state, k).host if k > 0 else []

    def update(self, state: DecodeState, num_accepted: int) -> None:
        """Learn the scale from a tree the target verified (k=auto may drop a proposal unverified: it says nothing)."""
        if self._expected > 0 and state.last_logits is not None and state.last_logits.shape[1] == self._nodes + 1:
            record = self.record
            record[0] += num_accepted
            record[1] += self._expected
        self._expected = 0.0

    def finish(self) -> None:
        """Hand the running request's output to the global cache now (``start`` does it for the previous one)."""
        if self._last is not None:
            self.cache.add(self._last.tokens[0, self._prompt_len :].tolist())
            self._last = None
