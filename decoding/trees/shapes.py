"""Token trees as data: many candidate continuations verified in one target forward.

A tree is a list of paths (Medusa style): each path is a sequence of child
ranks from the root, ``[0, 1]`` = "the second most likely token after the most
likely one". Node 0 is the root, the pending token (its KV is not yet in the
target cache); the other nodes follow sorted by depth, then by path, so every
parent comes before its children and siblings are in rank order. From the
parents alone everything a forward needs is computed once: depths (position
offsets), the ancestor-or-self attention mask, and the retrieval indices of
the root-to-leaf paths.

>>> t = Tree.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
>>> t.parents.tolist(), t.depth.tolist()
([-1, 0, 0, 1, 1, 3], [0, 1, 1, 2, 2, 3])
>>> t.mask.int().tolist()          # row i: the nodes node i attends to (its ancestors and itself)
[[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 0, 1, 0, 1]]
>>> t.retrieve_indices().tolist()  # node indices of each root-to-leaf path, padded with -1
[[0, 2, -1, -1], [0, 1, 4, -1], [0, 1, 3, 5]]
>>> chain(3).parents.tolist()
[-1, 0, 1, 2]

Shapes: ``static`` (user-given paths), ``sequoia`` (:func:`sequoia_paths`, the
tree maximising the expected accepted length for a measured per-rank
acceptance vector and a node budget, Sequoia's dynamic programme) and
``dyspec`` (built at run time by the drafter, greedy best-first expansion by
the draft's path probability under a budget; see ``decoding.drafters.drafting``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch

from decoding.treespec import TreeError, parse_acceptance, parse_paths, validate_paths  # noqa: F401 (the trees' own names)

if TYPE_CHECKING:
    from decoding.config import SpecConfig

# Per-rank acceptance used by ``sequoia`` when no ``tree_acceptance`` is given: P(the rank-r draft token is the one the
# target accepts). A generic, steeply falling profile, not a measurement: measure your drafter's vector with
# ``python -m jobs.bench_trees --calibrate`` and pass it as ``tree_acceptance``.
DEFAULT_ACCEPTANCE = (0.55, 0.12, 0.05, 0.03, 0.02, 0.015, 0.01, 0.01)


# The trees made from parent lists, by shape (oldest first): a model-free drafter's proposals repeat a few shapes
# (chains of 1-8, small trees), and each new Tree built its ancestor mask again (0.2 ms a proposal on this CPU,
# 2026-11-29). A Tree is immutable, so one object serves every proposal of its shape.
MADE_TREES = 1024


class Kept:
    """Values made once per key and kept, at most ``most`` of them (the least recently used dropped), safe across a
    server's threads: the trees made from parent lists and the Sequoia templates.

    >>> kept = Kept(2); kept.keep("a", 1), kept.keep("b", 2), kept.get("a"), kept.keep("c", 3), kept.get("b")
    (1, 2, 1, 3, None)
    """

    def __init__(self, most: int):
        self.most, self._items, self._lock = most, OrderedDict(), threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key):
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def keep(self, key, value):
        """``value`` kept under ``key``, or the one another thread kept there first (which is returned)."""
        with self._lock:
            value = self._items.setdefault(key, value)
            self._items.move_to_end(key)
            while len(self._items) > self.most:
                self._items.popitem(last=False)
            return value


_MADE = Kept(MADE_TREES)


@dataclass(frozen=True, eq=False)
class Tree:
    """A token tree over T nodes; node 0 is the root (the pending token).

    ``parents`` [T] int64 with ``parents[0] = -1``, every parent index smaller than its child's.
    """

    parents: torch.Tensor  # [T]

    @classmethod
    def from_parents(cls, parents: Sequence[int]) -> Tree:
        """A tree from its parent list (node order must be topological: parent < child).

        >>> Tree.from_parents([-1, 0, 0, 2]).depth.tolist()
        [0, 1, 1, 2]
        """
        key = (cls, tuple(int(p) for p in parents))
        tree = _MADE.get(key)
        if tree is not None:  # a shape made before: its mask, depths and device copies are built already
            return tree
        parents = key[1]
        if not parents or parents[0] != -1:
            raise TreeError("node 0 is the root: its parent must be -1")
        for i, p in enumerate(parents[1:], 1):
            if not 0 <= p < i:
                raise TreeError(f"node {i} has parent {p}: parents must come before their children")
        return _MADE.keep(key, cls(torch.tensor(parents, dtype=torch.long, device="cpu")))  # host data, moved where used

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> Tree:
        """A tree from Medusa-style rank paths; the root is implicit (see the module doctest)."""
        norm = sorted({tuple(int(r) for r in p) for p in validate_paths(paths)}, key=lambda p: (len(p), p))
        index = {(): 0}
        parents = [-1]
        for p in norm:
            index[p] = len(parents)
            parents.append(index[p[:-1]])
        return cls.from_parents(parents)

    @property
    def size(self) -> int:
        return self.parents.shape[0]

    @cached_property
    def parent_list(self) -> list[int]:
        """``parents`` as host ints (read once per tree)."""
        return self.parents.tolist()

    @cached_property
    def depth_list(self) -> list[int]:
        """``depth`` as host ints."""
        return self.depth.tolist()

    def on(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(parents, depth, mask) on ``device``, copied there once per tree and device."""
        key = str(device)
        cache = self.__dict__.setdefault("_on", {})
        if key not in cache:
            cache[key] = tuple(x.to(device) for x in (self.parents, self.depth, self.mask))
        return cache[key]

    @cached_property
    def depth(self) -> torch.Tensor:  # [T] position offset of each node from the root
        d = [0] * self.size
        for i, p in enumerate(self.parents.tolist()[1:], 1):
            d[i] = d[p] + 1
        return torch.tensor(d, dtype=torch.long, device=self.parents.device)

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @cached_property
    def mask(self) -> torch.Tensor:  # [T, T] bool, True where column j is an ancestor of row i or i itself
        return tree_mask(self.parents)

    @cached_property
    def rank(self) -> torch.Tensor:  # [T] position among siblings (0 = first child); 0 for the root
        seen: dict[int, int] = {}
        out = [0] * self.size
        for i, p in enumerate(self.parents.tolist()[1:], 1):
            out[i] = seen.get(p, 0)
            seen[p] = out[i] + 1
        return torch.tensor(out, dtype=torch.long, device=self.parents.device)

    def children(self, node: int) -> list[int]:
        return (self.parents == node).nonzero().flatten().tolist()

    def paths(self) -> list[list[int]]:
        """The rank path of every non-root node, in node order (inverse of ``from_paths`` for its trees)."""
        out: list[list[int]] = [[]]
        rank = self.rank.tolist()
        for i, p in enumerate(self.parents.tolist()[1:], 1):
            out.append(out[p] + [rank[i]])
        return out[1:]

    def retrieve_indices(self) -> torch.Tensor:
        """[L, D+1] node indices of the root-to-leaf paths (leaves in node order), padded with -1."""
        is_parent = torch.zeros(self.size, dtype=torch.bool, device=self.parents.device)
        is_parent[self.parents[1:]] = True
        leaves = (~is_parent).nonzero().flatten().tolist()
        out = torch.full((len(leaves), self.max_depth + 1), -1, dtype=torch.long, device=self.parents.device)
        for row, leaf in enumerate(leaves):
            path = self.mask[leaf].nonzero().flatten()  # ancestors in node order = in depth order
            out[row, : path.numel()] = path
        return out

    def positions(self, start: int) -> torch.Tensor:
        """[T] rotary positions of the nodes when the root sits at position ``start``."""
        return start + self.depth

    def prune(self, max_depth: int) -> Tree:
        """The subtree of nodes at depth <= max_depth (nodes keep their order).

        >>> Tree.from_paths([[0], [1], [0, 0]]).prune(1).parents.tolist()
        [-1, 0, 0]
        """
        keep = (self.depth <= max_depth).nonzero().flatten().tolist()
        if len(keep) == self.size:
            return self
        new = {old: i for i, old in enumerate(keep)}
        return Tree.from_parents([-1] + [new[int(self.parents[i])] for i in keep[1:]])


@dataclass(frozen=True)
class Dynamic:
    """A tree the drafter grows per step by the draft's path probability, up to ``budget`` draft nodes (the step's
    draft length is the depth limit). ``max_rank``: the most children a node may get.

    ``width`` 0 (``tree=dyspec``, DySpec): best-first, each candidate popped in order of path probability (a node's
    children are scored once it is fed, so a narrow draft feeds about one node per forward). ``width`` > 0
    (``tree=levels``, EAGLE-2's dynamic tree): level by level, the ``width`` most probable children of the level
    before are fed in one forward; at the end every drafted node is reranked by path probability and the best
    ``budget`` kept, so a tree of depth D costs D-1 draft forwards."""

    budget: int
    max_rank: int = 8
    width: int = 0


def tree_mask(parents: torch.Tensor) -> torch.Tensor:
    """The ancestor-or-self mask of a parent list by pointer jumping: [..., T] -> [..., T, T] bool.

    The torch reference of ``kernels.tree_verify``'s mask build.

    >>> tree_mask(torch.tensor([-1, 0, 1, 0])).int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
    """
    t = parents.shape[-1]
    eye = torch.eye(t, dtype=torch.bool, device=parents.device).expand(*parents.shape[:-1], t, t)
    mask = eye.clone()
    cur = parents.clone()
    for _ in range(t - 1):  # at most depth T-1; stops early once every chain reached the root
        alive = cur >= 0
        if not bool(alive.any()):
            break
        mask |= alive.unsqueeze(-1) & (torch.nn.functional.one_hot(cur.clamp(min=0), t).bool())
        cur = torch.where(alive, parents.gather(-1, cur.clamp(min=0)), cur)
    return mask


def chain(k: int) -> Tree:
    """The degenerate tree: k drafts in a row."""
    return Tree.from_parents(list(range(-1, k)))


def sequoia_paths(acceptance: Sequence[float], budget: int, max_depth: int) -> list[list[int]]:
    """Sequoia's dynamic programme: the tree of at most ``budget`` draft nodes and depth ``max_depth`` that
    maximises the expected number of tokens committed per step, ``sum over nodes of prod acceptance[rank]``
    along the node's path (the root, the target's own token, counts 1).

    ``acceptance[r]``: probability that the rank-r candidate is the one the target accepts at a node.
    c(d, n) = best value of a tree of <= n nodes (root included) and depth <= d:
    c(d, n) = 1 + g(d, 0, n - 1),  g(d, r, n) = max(0, max_m acceptance[r] * c(d-1, m) + g(d, r+1, n-m)).

    >>> sequoia_paths([0.8, 0.1], budget=3, max_depth=3)   # a strong top-1 draft: a chain
    [[0], [0, 0], [0, 0, 0]]
    >>> sequoia_paths([0.4, 0.3], budget=3, max_depth=3)   # a flat profile: go wide
    [[0], [1], [0, 0]]
    >>> expected_accepted([0.4, 0.3], [[0], [1], [0, 0]])
    1.86
    """
    if budget < 1 or max_depth < 1:
        raise TreeError(f"budget and max_depth must be >= 1, got {budget}, {max_depth}")
    acc = np.asarray(list(acceptance)[:budget], dtype=np.float64)
    K, N = len(acc), budget + 1
    # over (n, m): child r gets m of n nodes (1 <= m <= n), the later children n - m; vectorised over both, the programme
    # of a 48-node budget costs milliseconds instead of Python's quarter second (once per request and depth)
    n_of, m_of = np.arange(N + 1)[:, None], np.arange(N + 1)[None, :]
    valid = (m_of >= 1) & (m_of <= n_of)
    rest = np.where(valid, n_of - m_of, 0)
    c = np.ones((max_depth + 1, N + 1))  # c[0][n] = 1: the root alone
    choice = np.zeros((max_depth + 1, K + 1, N + 1), dtype=np.int64)  # [d, r, n] -> m nodes given to child r (0 = stop)
    for d in range(1, max_depth + 1):
        g = np.zeros((K + 1, N + 1))
        for r in range(K - 1, -1, -1):
            v = np.where(valid, acc[r] * c[d - 1][None, :] + g[r + 1][rest], -np.inf)
            # the smallest m within 1e-12 of the best, where the best is worth more than stopping
            ok = valid & (v > 1e-12) & (v >= v.max(axis=1, keepdims=True) - 1e-12)
            arg = np.where(ok.any(axis=1), ok.argmax(axis=1), 0)
            g[r] = np.where(arg > 0, np.take_along_axis(v, arg[:, None], axis=1)[:, 0], 0.0)
            choice[d, r] = arg
        c[d, 1:] = 1.0 + g[0, :N]
    choice = choice.tolist()

    def build(d, n, prefix, out):
        r, left = 0, n - 1
        while d > 0 and r < K and left > 0 and choice[d][r][left]:
            m = choice[d][r][left]
            out.append(prefix + [r])
            build(d - 1, m, prefix + [r], out)
            r, left = r + 1, left - m
        return out

    return sorted(build(max_depth, N, [], []), key=lambda p: (len(p), p))


SEQUOIA_KEPT = 4096  # templates kept (least recently used dropped): one is a few hundred bytes
_SEQUOIA = Kept(SEQUOIA_KEPT)
ACCEPTANCE_GRAIN = 0.05  # the acceptance profile a template is chosen for, rounded to this


def rounded(acceptance) -> tuple:
    """An acceptance profile rounded to :data:`ACCEPTANCE_GRAIN`: the templates' cache key.

    >>> rounded([0.812, 0.33, 0.0])
    (0.8, 0.35, 0.0)
    """
    return tuple(round(round(a / ACCEPTANCE_GRAIN) * ACCEPTANCE_GRAIN, 4) for a in acceptance)


def sequoia_tree(acceptance: tuple, budget: int, depth: int) -> Tree:
    """:func:`sequoia_paths` as a ``Tree`` for a :func:`rounded` profile, kept for the last :data:`SEQUOIA_KEPT`
    (acceptance, budget, depth) asked for. The drafters that choose a template per request ask again and again for
    nearly the same acceptance: one programme of 16 nodes costs about 13 ms on this CPU in Python, and a choice
    among 10 budgets asks for 10."""
    acceptance = rounded(acceptance)
    key = (acceptance, budget, depth)
    tree = _SEQUOIA.get(key)
    return tree if tree is not None else _SEQUOIA.keep(key, Tree.from_paths(sequoia_paths(list(acceptance), budget, depth)))


def expected_accepted(acceptance: Sequence[float], paths: Sequence[Sequence[int]]) -> float:
    """Expected tokens committed per step of a tree under a per-rank acceptance vector (root included)."""
    total = 1.0
    for p in paths:
        v = 1.0
        for r in p:
            v *= acceptance[r] if r < len(acceptance) else 0.0
        total += v
    return round(total, 6)


LEVEL_WIDTH = 8  # tree=levels: nodes fed per level (EAGLE-2's top-k)


@lru_cache(maxsize=64)
def build_shape(tree: str, k: int, paths: str = "", budget: int = 16, acceptance: str = "") -> Tree | Dynamic | None:
    """The tree shape a config describes: a ``Tree`` (static, sequoia), ``Dynamic`` (dyspec) or None (chain).

    >>> build_shape("sequoia", k=4, budget=6, acceptance="[0.5, 0.3]").size
    7
    """
    if tree == "static":
        return Tree.from_paths(parse_paths(paths))
    if tree == "sequoia":
        acc = parse_acceptance(acceptance) if acceptance else list(DEFAULT_ACCEPTANCE)
        return Tree.from_paths(sequoia_paths(acc, budget, k))
    if tree == "dyspec":
        return Dynamic(budget)
    if tree == "levels":
        return Dynamic(budget, width=LEVEL_WIDTH)
    return None


def tree_shape(cfg: SpecConfig) -> Tree | Dynamic | None:
    """The tree shape of a config: a ``Tree`` (static, sequoia), ``Dynamic`` (dyspec) or None (chain)."""
    return build_shape(cfg.tree, cfg.k, cfg.tree_paths, cfg.tree_budget, cfg.tree_acceptance)
