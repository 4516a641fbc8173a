"""Token Recycling (Luo et al., "Turning Trash into Treasure", ACL 2025): draft from the target's own past candidates.

Every verification computes the target's logits at every fed position, accepted or not. Token Recycling keeps,
for every token ``t``, the top-``width`` next tokens the target proposed the last time ``t`` was fed (an
adjacency matrix ``[V, width]``, int32: 1.5 MB for SmolLM2's 49k vocabulary at width 8) and drafts a tree by
breadth-first expansion over a tree template: a template node of rank ``r`` under a drafted node holding token
``t`` drafts ``adjacency[t, r]``. No model and no training; the matrix warms up across requests.

The template is Sequoia's optimal tree (``trees.sequoia_paths``) for the per-rank acceptance this drafter has
measured so far (a prior until then), of the size that maximises expected tokens per second under the measured
cost of a verification by node count (``decoding.trees.hardware``), so the tree fits the host it runs on.

>>> adj = AdjacencyMatrix(vocab=6, width=2)
>>> adj.observe(torch.tensor([1, 3]), torch.tensor([[0., 0, 5, 4, 0, 0], [0, 0, 0, 0, 1, 9]]))
>>> adj.table[1].tolist(), adj.table[3].tolist(), adj.table[0].tolist()   # after 1: 2 then 3; after 3: 5 then 4
([2, 3], [5, 4], [-1, -1])
>>> tree = Tree.from_paths([[0], [1], [0, 0], [0, 1]])      # expand from token 1: 2 and 3, then 2's candidates (unknown)
>>> adj.expand(1, tree)
([2, 3], [0, 0], [0, 1])
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from decoding.drafters.base import DecodeState, Drafter, Proposal
from decoding.trees.shapes import Tree, sequoia_tree

# Per-rank acceptance of recycled candidates before any is measured: P(the rank-r candidate is the target's next
# token). Measured on SmolLM2-135M bfloat16 over a few Spec-Bench prompts (top-1 ~0.4); the drafter replaces it with
# its own counts as soon as it has some.
PRIOR_ACCEPTANCE = (0.40, 0.10, 0.05, 0.03, 0.02, 0.015, 0.01, 0.01)
RETEMPLATE = 0.02  # how far the per-rank acceptance moves before a depth's tree template is chosen again


class AdjacencyMatrix:
    """``table[t]``: the target's top-``width`` next tokens after token t (-1 = never seen), refreshed by ``observe``."""

    def __init__(self, vocab: int, width: int = 8):
        self.vocab, self.width = vocab, width
        self.table = torch.full((vocab, width), -1, dtype=torch.int32)  # [V, width]

    def reset(self) -> None:
        self.table.fill_(-1)

    def observe(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Refresh the rows of ``tokens`` [T] from the target's next-token ``logits`` [T, V] after each of them."""
        top = logits.topk(self.width, dim=-1).indices.to(torch.int32)  # [T, width]
        self.table[tokens.to(self.table.device).long()] = top.to(self.table.device)

    def expand(self, root: int, template: Tree) -> tuple[list[int], list[int], list[int]]:
        """Breadth-first expansion of ``template`` from ``root``: (tokens, parents, ranks) of the drafted nodes.

        A template node whose parent was not drafted, or whose candidate is unknown (-1), is dropped with its
        subtree. ``parents`` index [root, drafted...] (0 = the root); nodes come level by level.
        """
        tparents, trank, levels = _levels(template)
        drafted = {0: 0}  # template node -> drafted node
        node_tok = [root]
        tokens, parents, ranks = [], [], []
        for level in levels:
            live = [s for s in level if tparents[s] in drafted]
            if not live:
                break
            # the table's rows read through numpy (a view of the same memory): a level costs microseconds, where
            # torch's indexing cost ~50 us a level, a third of the hybrid's proposal
            cand = self.table.numpy()[[node_tok[drafted[tparents[s]]] for s in live], [trank[s] for s in live]].tolist()
            for s, tok in zip(live, cand, strict=True):
                if tok < 0:
                    continue
                tokens.append(tok)
                parents.append(drafted[tparents[s]])
                ranks.append(trank[s])
                node_tok.append(tok)
                drafted[s] = len(node_tok) - 1
        return tokens, parents, ranks


_LEVELS: dict[int, tuple] = {}


def _levels(template: Tree):
    """(parents, ranks, node indices per depth 1..D) of a template, computed once per template object."""
    key = id(template)
    hit = _LEVELS.get(key)
    if hit is not None and hit[0] is template:
        return hit[1]
    depth = template.depth.tolist()
    levels = [[i for i in range(1, template.size) if depth[i] == d] for d in range(1, template.max_depth + 1)]
    out = (template.parents.tolist(), template.rank.tolist(), levels)
    if len(_LEVELS) > 256:
        _LEVELS.clear()
    _LEVELS[key] = (template, out)
    return out


@dataclass
class RankStats:
    """Per-rank acceptance of tree drafts, counted from verdicts: at every node of the accepted path that had children,
    which rank (if any) was accepted. ``acceptance()`` is Sequoia's per-rank vector."""

    width: int
    visits: int = 0
    accepted: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.accepted = self.accepted or [0] * self.width

    def record(self, parents: list[int], ranks: list[int], path: list[int]) -> None:
        """``parents``/``ranks`` of nodes 1..T-1 (node 0 the root); ``path``: accepted node indices, root first."""
        has_kids = set(parents)
        for i, node in enumerate(path):
            if node not in has_kids:
                break
            self.visits += 1
            if i + 1 < len(path):
                r = ranks[path[i + 1] - 1]
                if r < self.width:
                    self.accepted[r] += 1

    def acceptance(self, prior=PRIOR_ACCEPTANCE, weight: float = 20.0) -> list[float]:
        """The measured vector, shrunk towards ``prior`` with ``weight`` pseudo-visits (so few counts move it little)."""
        prior = list(prior)[: self.width] + [0.0] * max(0, self.width - len(prior))
        return [(a + weight * p) / (self.visits + weight) for a, p in zip(self.accepted, prior, strict=True)]

    def reset(self) -> None:
        self.visits, self.accepted = 0, [0] * self.width


class RecyclingDrafter(Drafter):
    """Token Recycling: a tree from the adjacency matrix, refreshed from every verification's logits.

    ``memory`` (a ``DraftMemory``) holds the matrix and the acceptance counts so they outlive a request (the
    decoder owns it); ``cold`` empties them at every ``start`` (fair per-prompt benchmarks). ``chooser``
    (``hardware.TreeChooser``) picks the template for the measured acceptance and verification cost; without
    one the template is Sequoia's tree of ``budget`` nodes.
    """

    reads_tokens = True  # it reads ``state.tokens`` at its steps

    name = "recycling"
    model_free = True

    def __init__(
        self, vocab: int, width: int = 8, budget: int = 16, memory=None, cold: bool = False, chooser=None, fixed: Tree | None = None
    ):
        from decoding.drafters.draft_memory import DraftMemory

        self.vocab, self.width, self.budget, self.cold, self.chooser = vocab, width, budget, cold, chooser
        self.fixed = fixed  # a fixed template (e.g. the paper's) instead of the chosen Sequoia tree
        if fixed is not None:
            self.chooser, self.budget = None, fixed.size - 1
        self.memory = memory if memory is not None else DraftMemory()
        self._templates: dict[int, tuple[tuple, Tree]] = {}  # draft depth -> (the acceptance it was chosen for, template)
        self._nodes: list[int] = []
        self._parents: list[int] = []
        self._ranks: list[int] = []

    @property
    def adjacency(self) -> AdjacencyMatrix:
        return self.memory.get(("adjacency", self.vocab, self.width), lambda: AdjacencyMatrix(self.vocab, self.width), text=True)

    @property
    def stats(self) -> RankStats:
        return self.memory.get(("recycling-ranks", self.width), lambda: RankStats(self.width))

    def max_nodes(self, k: int) -> int:
        return self.chooser.max_budget if self.chooser is not None else self.budget

    def start(self, state: DecodeState) -> None:
        if state.tokens.shape[0] != 1:
            raise ValueError("recycling drafts trees for batch size 1")
        if self.cold:
            self.adjacency.reset()
            self.stats.reset()

    def template_for(self, k: int) -> Tree:
        """The tree template for draft depth k: chosen again only once the acceptance it uses has moved by
        ``RETEMPLATE`` at some rank since. k=auto changes the depth from step to step, and choosing costs a Sequoia
        programme per budget (0.8 ms on this CPU): chosen afresh at every request and depth, it cost the hybrid 0.25 ms
        a proposal (2026-11-29)."""
        acc = self.stats.acceptance()
        chosen = self._templates.get(k)
        template = chosen[1] if chosen is not None and max(abs(a - b) for a, b in zip(acc, chosen[0], strict=True)) < RETEMPLATE else None
        if template is None:
            if self.fixed is not None:
                template = self.fixed.prune(k)
            elif self.chooser is not None:
                template = self.chooser.choose(acc, k)
            else:
                template = sequoia_tree(tuple(acc), self.budget, k)
            self._templates[k] = (tuple(acc), template)
        return template

    def draft(self, root: int, k: int) -> tuple[list[int], list[int], list[int]]:
        """(tokens, parents, ranks) of a tree of depth <= k from ``root``."""
        if k <= 0:
            return [], [], []
        return self.adjacency.expand(root, self.template_for(k))

    def propose(self, state: DecodeState, k: int) -> Proposal:
        root = int(state.tokens[0, -1])
        tokens, parents, ranks = self.draft(root, k)
        self._nodes, self._parents, self._ranks = [root] + tokens, parents, ranks
        if not tokens:
            return Proposal.empty(1, state.tokens.device)
        ids = torch.tensor([tokens], dtype=torch.long, device=state.tokens.device)
        return Proposal(tokens=ids, tree=Tree.from_parents([-1] + parents))

    def observe(self, node_tokens: list[int], logits: torch.Tensor) -> None:
        """Refresh the matrix from one verification: ``logits`` [T, V] after each of ``node_tokens`` [T]."""
        t = min(len(node_tokens), logits.shape[0])
        self.adjacency.observe(torch.tensor(node_tokens[:t], dtype=torch.long), logits[:t])

    def update(self, state: DecodeState, num_accepted: int) -> None:
        if state.last_logits is not None:
            self.observe(verified_nodes(state, num_accepted, self._nodes), state.last_logits[0])
        self._nodes = []
        if self._parents:
            path = state.accepted_path if state.accepted_path is not None else list(range(num_accepted + 1))
            self.stats.record(self._parents, self._ranks, path)
        self._parents, self._ranks = [], []  # a step without a proposal (k = 0) must not reuse them


def verified_nodes(state: DecodeState, num_accepted: int, proposed: list[int]) -> list[int]:
    """The tokens whose next-token logits ``state.last_logits`` holds: the proposal's [root, nodes...], or the root alone
    when the step drafted nothing (the loop skips ``propose`` at k = 0, so ``proposed`` may be stale)."""
    rows = state.last_logits.shape[1]
    if len(proposed) == rows:
        return proposed
    return [int(state.tokens[0, -(num_accepted + 2)])] if rows == 1 else []
