"""Tree size for the host it runs on: how much a verification costs by node count, and the tree that pays best.

A token tree of T nodes costs one target forward over T positions. On a GPU that is nearly flat up to dozens
of nodes; on a CPU it is not (SmolLM2 bfloat16 on this 2-core host: +11% to +31% for 8 nodes over one, +60% to
+93% for 32, depending on the day). So the size is chosen per host: ``measure_verify_cost`` times forwards of
1..64 positions after a short context (a few seconds), ``verify_costs`` caches the result per model, dtype,
thread count and forward implementation (``ModelAdapter.implementation``) under ``$SPECRAY_HOME/calibration/``,
and ``TreeChooser`` picks, among Sequoia trees for the drafter's measured per-rank acceptance, the size with the
most expected tokens per second:

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

import json
import os
import re
import time
from pathlib import Path

import torch

from decoding.model.adapter import ModelAdapter
from decoding.paths import specray_home
from decoding.timing import device_name, synchronize
from decoding.trees.shapes import Tree, expected_accepted, sequoia_tree

# verification widths timed (nodes, the root included); 5 and 9 too: on this kind of CPU the int4 kernel's cost rises
# in steps of 4 rows (see decoding.loop.goodput.CALIBRATION_WIDTHS), and a 5-node tree costs what an 8-node one does
SIZES = (1, 2, 4, 5, 8, 9, 12, 16, 24, 32, 48, 64)
BUDGETS = (2, 4, 6, 8, 12, 16, 24, 32, 48, 63)  # draft-node budgets the chooser considers


def measure_verify_cost(adapter, sizes=SIZES, context: int = 256, repeats: int = 5, seed: int = 0) -> dict[int, float]:
    """Seconds of one verification forward (layers + LM head) over T positions after ``context`` tokens.

    A shared host only ever adds time, so each size keeps its fastest of ``repeats`` runs, and a size that still
    came out slower than a larger one (a busy moment) takes the larger one's time: the curve never decreases.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab = adapter.vocab_size
    cache = adapter.new_cache(1, context + max(sizes))
    # drawn on the host (the generator is a CPU one), then moved: the ids are the same whatever the device
    adapter.forward(cache, 0, input_ids=torch.randint(vocab, (1, context), generator=gen).to(adapter.device))
    ids = torch.randint(vocab, (1, max(sizes)), generator=gen).to(adapter.device)
    adapter.logits(adapter.forward(cache, context, input_ids=ids[:, :8]))  # warm-up
    times: dict[int, list[float]] = {t: [] for t in sizes}
    for _ in range(repeats):  # sizes interleaved, so a slow moment of a shared host spreads over all of them
        for t in sizes:
            synchronize(adapter.device)
            t0 = time.perf_counter()
            adapter.logits(adapter.forward(cache, context, input_ids=ids[:, :t]))
            synchronize(adapter.device)  # the device's time, not the time to queue its work
            times[t].append(time.perf_counter() - t0)
    return monotone({t: min(v) for t, v in times.items()})


def monotone(costs: dict[int, float]) -> dict[int, float]:
    """Each size's cost capped by every larger size's (a running minimum from the largest size down).

    >>> monotone({1: 0.5, 2: 1.2, 4: 0.9, 8: 1.0})
    {1: 0.5, 2: 0.9, 4: 0.9, 8: 1.0}
    """
    out, low = {}, float("inf")
    for t in sorted(costs, reverse=True):
        low = min(low, costs[t])
        out[t] = low
    return dict(sorted(out.items()))


def calibration_path(model: str, dtype: str, threads: int, device: str = "cpu", implementation: str = "layers") -> Path:
    """Where a verification-cost curve is kept: per model, dtype, device name (``decoding.timing.device_name``: the
    GPU's model), threads and forward implementation."""
    grid = "s" + ".".join(map(str, SIZES))  # a new set of sizes is measured anew
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{model}-{dtype}-{device}-t{threads}-{implementation}-{grid}").strip("_")
    return specray_home() / "calibration" / f"verify-cost-{name}.json"


def verify_costs(adapter, model: str, dtype: str, threads: int | None = None, refresh: bool = False) -> dict[int, float]:
    """The cached verification cost curve of this model, dtype, device, thread count and forward implementation
    (measured on first use)."""
    threads = threads or torch.get_num_threads()
    path = calibration_path(model, dtype, threads, device_name(adapter.device), adapter.implementation)
    if path.is_file() and not refresh:
        try:
            data = json.loads(path.read_text())
            return {int(t): float(s) for t, s in data["seconds"].items()}
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache is measured again
    costs = measure_verify_cost(adapter)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"model": model, "dtype": dtype, "threads": threads, "seconds": costs, "measured": time.time()}))
    os.replace(tmp, path)
    return costs


class TreeChooser:
    """Picks the tree size (and Sequoia shape) with the most expected committed tokens per second of verification."""

    def __init__(self, costs: dict[int, float], budgets=BUDGETS, max_budget: int | None = None):
        if not costs:
            raise ValueError("no verification costs")
        self.sizes = sorted(costs)
        self.costs = costs
        top = max_budget if max_budget is not None else max(self.sizes) - 1
        self.budgets = tuple(b for b in budgets if 1 <= b <= top) or (max(1, top),)
        self.max_budget = max(self.budgets)
        self.last: dict = {}

    def cost(self, nodes: int) -> float:
        s = self.sizes
        if nodes <= s[0]:
            return self.costs[s[0]]
        for lo, hi in zip(s, s[1:], strict=False):
            if nodes <= hi:
                w = (nodes - lo) / (hi - lo)
                return round(self.costs[lo] * (1 - w) + self.costs[hi] * w, 12)
        lo, hi = s[-2], s[-1]  # extrapolate the last segment
        return self.costs[hi] + (nodes - hi) * (self.costs[hi] - self.costs[lo]) / (hi - lo)

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
    """``tree_fit=measured``: a chooser over this host's verification cost curve for the config's target (measured
    once, then cached); None for ``tree_fit=budget``. ``cfg`` a ``SpecConfig``, ``target`` a loaded model."""
    if cfg.tree_fit != "measured":
        return None
    adapter = ModelAdapter(target.model)
    return TreeChooser(verify_costs(adapter, cfg.model, cfg.dtype, torch.get_num_threads()))
