"""Tree size for the host it runs on: how much a verification costs by node count, and the tree that pays best.

A token tree of T nodes costs one target forward over T positions. On a GPU that is nearly flat up to dozens
of nodes; on a CPU it is not (SmolLM2 bfloat16 on this 2-core host: +11% to +31% for 8 nodes over one, +60% to
+93% for 32, depending on the day). So the size is chosen per host, from the one measured cost of the target's
forward that ``k=auto`` reads too (``decoding.model.costs.forward_costs``: one row up to 64 tokens, measured once and
cached, then followed by the steps the loop runs). ``TreeChooser`` picks, among Sequoia trees for the drafter's
measured per-rank acceptance, the size with the most expected tokens per second:

    tokens/s(b) = expected_accepted(acceptance, tree_b) / cost(b + 1 nodes)

>>> acceptance = [0.4, 0.1, 0.05, 0.03]
>>> TreeChooser({1: 1.0, 64: 1.05}).choose(acceptance, depth=6).size - 1        # nearly flat (a GPU): go big
63
>>> cpu = TreeChooser({1: 1.0, 8: 1.1, 16: 1.3, 32: 2.0, 64: 4.0})              # a CPU: cost grows with nodes
>>> cpu.cost(12)                                                              # linear between measured sizes
1.2
>>> cpu.choose(acceptance, depth=6).size - 1
8
"""

from __future__ import annotations

from decoding.model.adapter import ModelAdapter
from decoding.model.costs import CostModel, forward_costs
from decoding.trees.shapes import Tree, expected_accepted, sequoia_tree

BUDGETS = (2, 4, 6, 8, 12, 16, 24, 32, 48, 63)  # draft-node budgets the chooser considers


class TreeChooser:
    """Picks the tree size (and Sequoia shape) with the most expected committed tokens per second of verification.

    ``costs``: the target's :class:`~decoding.model.costs.CostModel` (one row's cost by tokens: a live model, as the
    loop refreshes it), or a fixed curve {nodes: seconds}.
    """

    def __init__(self, costs: CostModel | dict[int, float], budgets=BUDGETS, max_budget: int | None = None):
        if not costs:
            raise ValueError("no verification costs")
        self.model = costs if isinstance(costs, CostModel) else CostModel({(1, int(t)): float(s) for t, s in costs.items()})
        self.sizes = sorted(t for r, t in self.model.table if r == 1) or [1]
        top = max_budget if max_budget is not None else max(self.sizes) - 1
        self.budgets = tuple(b for b in budgets if 1 <= b <= top) or (max(1, top),)
        self.max_budget = max(self.budgets)
        self.last: dict = {}

    def cost(self, nodes: int) -> float:
        """Seconds of verifying ``nodes`` tokens in one row (interpolated between measured sizes)."""
        return round(self.model(1, max(1, nodes)), 12)

    def rate(self, acceptance, budget: int, depth: int) -> tuple[float, Tree]:
        tree = sequoia_tree(tuple(acceptance), budget, depth)
        return expected_accepted(acceptance, tree.paths()) / self.cost(tree.size), tree

    def prefix(self, probs) -> int:
        """How many of ``probs`` (nodes ranked by acceptance estimate, every prefix a tree) to verify: the b that
        maximises (1 + sum of the first b) / cost(b + 1), 0 when drafting does not pay.

        >>> TreeChooser({1: 1.0, 2: 1.1, 3: 1.2, 4: 2.0}).prefix([0.9, 0.5, 0.4])   # the 3rd node costs more than it brings
        2
        """
        best, best_rate, expected = 0, 1.0 / self.cost(1), 1.0
        for b, p in enumerate(probs[: self.max_budget], 1):
            expected += p
            rate = expected / self.cost(b + 1)
            if rate > best_rate:
                best, best_rate = b, rate
        return best

    def choose(self, acceptance, depth: int) -> Tree:
        best = max((self.rate(acceptance, b, depth) + (b,) for b in self.budgets), key=lambda r: r[0])
        self.last = {"budget": best[2], "tokens_per_cost": best[0], "nodes": best[1].size - 1}
        return best[1]


def chooser_for(cfg, target) -> TreeChooser | None:
    """``tree_fit=measured``: a chooser over the measured cost of the config's target's forward (``forward_costs``:
    the one k=auto reads, measured once and cached); None for ``tree_fit=budget``. ``cfg`` a ``SpecConfig``,
    ``target`` a loaded model."""
    if cfg.tree_fit != "measured":
        return None
    return TreeChooser(forward_costs(ModelAdapter(target.model), cfg.model, cfg.dtype))
