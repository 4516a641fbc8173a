"""Goodput-adaptive draft length: how many tokens a batch should draft this step.

A step feeds every row ``[pending, drafts]`` padded to one width ``T`` and
commits, per row, the accepted drafts plus one target token. With a per-token
acceptance estimate ``alpha`` (drafts accepted independently, each with
probability alpha, until the first rejection) a row offering ``j`` drafts
commits on average ``1 + alpha + ... + alpha^j`` tokens. The step costs one
target forward of ``R`` rows by ``T`` tokens, measured (:class:`CostModel`),
plus what the model-based drafters spend. The width is the one that maximises

    goodput(T) = sum over rows of E[committed | min(T - 1, j_row)] / cost(R, T)

(expected committed tokens per second; SmartSpec, Liu et al. 2024, chooses one
draft length per batch by the same quantity). At low load a wider step costs
little more than ``T = 1`` and drafts pay; at high load the forward is compute
bound, ``cost(R, T)`` grows with ``R * T`` and ``T = 1`` (no speculation) wins
by itself. Rows decide for themselves within the width: a row offers only the
drafts it has (prompt lookup may find none) and its own acceptance weights
them, so one row's drafts never cost another row its place.

>>> cost = CostModel({(1, 1): 0.050, (1, 2): 0.052, (1, 4): 0.056, (16, 1): 0.15, (16, 2): 0.29, (16, 4): 0.58})
>>> choose_width([RowPlan(avail=3, alpha=0.7)], cost)          # one row, good drafts: draft them
4
>>> choose_width([RowPlan(avail=3, alpha=0.7)] * 16, cost)     # sixteen rows: the forward is compute bound
1
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

import torch

from decoding.timing import synchronize

# the grid the start-up calibration measures (rows x tokens per row)
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32)
CALIBRATION_WIDTHS = (1, 2, 3, 5, 9)  # 30 points x 2 forwards: about 5 s for SmolLM2-135M on 2 cores
GPU_WIDTHS = (17, 33, 65)  # also measured on a GPU, where verifying 64 tokens costs about what one does


def expected_committed(alpha: float, j: int) -> float:
    """1 + alpha + ... + alpha^j: tokens one step commits with j drafts, each accepted with probability alpha.

    >>> expected_committed(0.5, 2)
    1.75
    >>> expected_committed(0.0, 5)
    1.0
    """
    return sum(alpha**i for i in range(j + 1))


class Acceptance:
    """A row's per-token acceptance estimate: accepted drafts / (accepted drafts + rejections), recent steps weighted more.

    Starts at ``prior`` (worth ``weight`` observations) and decays old evidence by ``decay`` per step.

    >>> a = Acceptance()
    >>> for _ in range(20):
    ...     a.observe(drafted=4, accepted=4)
    >>> a.alpha > 0.9
    True
    >>> a.observe(drafted=0, accepted=0); round(a.alpha, 3) == round(a.alpha, 3)   # nothing proposed: no evidence
    True
    """

    def __init__(self, prior: float = 0.5, weight: float = 2.0, decay: float = 0.9):
        self.hits, self.misses, self.decay = prior * weight, (1 - prior) * weight, decay

    @property
    def alpha(self) -> float:
        return self.hits / (self.hits + self.misses)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.hits = self.hits * self.decay + accepted
        self.misses = self.misses * self.decay + (1 if accepted < drafted else 0)


class CostModel:
    """Seconds of one target forward over R rows of T tokens each.

    ``table`` holds measured points {(R, T): seconds}; other sizes are interpolated linearly in R and in T
    between the nearest measured ones (and extrapolated in proportion beyond them). :meth:`observe` folds in
    the time of real steps, so the model's level follows the machine (other load, longer contexts) as it runs.

    >>> c = CostModel({(1, 1): 1.0, (1, 3): 2.0, (3, 1): 3.0, (3, 3): 5.0})
    >>> c(2, 2)
    2.75
    """

    def __init__(self, table: dict[tuple[int, int], float], smoothing: float = 0.2):
        if not table:
            raise ValueError("a cost model needs at least one measured point")
        self.table = dict(table)
        self.smoothing = smoothing
        self.rows = sorted({r for r, _ in table})
        self.widths = sorted({t for _, t in table})
        self.scale = 1.0  # observed / measured level (see observe)

    def __call__(self, rows: int, width: int) -> float:
        return self._interp(rows, width) * self.scale

    def _interp(self, rows: int, width: int) -> float:
        def along(points, x, value):
            i = bisect.bisect_left(points, x)
            if i < len(points) and points[i] == x:
                return value(points[i])
            lo, hi = (points[i - 1], points[i]) if 0 < i < len(points) else ((points[-1], None) if i else (None, points[0]))
            if hi is None:
                return value(lo) * x / lo
            if lo is None:
                return value(hi) * x / hi if x > 0 else value(hi)
            w = (x - lo) / (hi - lo)
            return value(lo) * (1 - w) + value(hi) * w

        def at_rows(r):
            return along(self.widths, width, lambda t: self._point(r, t))

        return along(self.rows, rows, at_rows)

    def _point(self, rows: int, width: int) -> float:
        if (rows, width) in self.table:
            return self.table[(rows, width)]
        # an incomplete grid: the nearest measured point, scaled by tokens
        (r, t), s = min(self.table.items(), key=lambda kv: abs(kv[0][0] - rows) + abs(kv[0][1] - width))
        return s * (rows * width) / (r * t)

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """Fold in a real step: the measured shape (how cost grows with rows and tokens) is kept and its level
        follows the machine (a moving average of observed / predicted), so sizes a batch has not tried yet are
        never compared with a stale level.

        >>> c = CostModel({(1, 1): 1.0, (1, 3): 2.0})
        >>> for _ in range(50):
        ...     c.observe(1, 1, 0.5)
        >>> round(c(1, 1), 3), round(c(1, 3), 3)
        (0.5, 1.0)
        """
        ratio = seconds / max(self._interp(rows, width), 1e-12)
        self.scale = self.scale * (1 - self.smoothing) + ratio * self.smoothing

    def to_dict(self) -> dict:
        return {"points": [[r, t, s] for (r, t), s in sorted(self.table.items())]}

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        return cls({(int(r), int(t)): float(s) for r, t, s in data["points"]})

    @classmethod
    def measure(
        cls, target, rows=CALIBRATION_ROWS, widths=CALIBRATION_WIDTHS, context: int = 128, repeats: int = 1, max_rows: int | None = None
    ) -> CostModel:
        """Time ``target`` (a ``ModelAdapter``) on every (rows, width) of the grid over a ``context``-token cache.

        Each point is the fastest of ``repeats`` timed forwards after one warm-up (the least disturbed by other work).
        """
        rows = [r for r in rows if max_rows is None or r <= max_rows] or [1]
        if widths is CALIBRATION_WIDTHS and torch.device(target.device).type == "cuda":
            widths = CALIBRATION_WIDTHS + GPU_WIDTHS  # where wide steps cost no more than narrow ones: measure them
        table = {}
        vocab = min(int(target.vocab_size), 1000)
        gen = torch.Generator().manual_seed(0)
        for r in rows:
            cache = target.new_cache(r, context + max(widths))
            ids = torch.randint(0, vocab, (r, context), generator=gen, device="cpu").to(target.device)
            target.forward(cache, 0, input_ids=ids)
            starts = [context] * r
            for t in widths:
                step = torch.randint(0, vocab, (r, t), generator=gen, device="cpu").to(target.device)
                best = float("inf")
                for i in range(repeats + 1):
                    synchronize(target.device)  # nothing of the previous forward in this one's time
                    t0 = time.perf_counter()
                    target.logits(target.forward(cache, starts if r > 1 else context, input_ids=step))
                    synchronize(target.device)  # the device's time, not the time to queue its work
                    if i:
                        best = min(best, time.perf_counter() - t0)
                table[(r, t)] = best
        return cls(table)


@dataclass
class RowPlan:
    """What the width choice needs to know about one row."""

    avail: int  # drafts the row can offer this step (a model-free drafter's proposal length, or its cap)
    alpha: float = 0.5  # per-token acceptance estimate
    fixed: bool = False  # the row's draft length is set by its config (k fixed): the width must fit it
    draft_cost: float = 0.0  # seconds per drafted token (model-based drafters; 0 for model-free ones)
    tree_gain: float | None = None  # trees: expected accepted drafts of the whole tree (it is drafted whole or not at all)
    extra: dict = field(default_factory=dict)


def _row_gain(plan: RowPlan, width: int) -> tuple[float, int]:
    """(expected committed tokens, drafts fed) of a row in a step of ``width`` tokens per row."""
    if plan.tree_gain is not None:
        return (1.0 + plan.tree_gain, plan.avail) if plan.avail <= width - 1 else (1.0, 0)
    j = min(width - 1, plan.avail)
    return expected_committed(plan.alpha, j), j


def choose_width(plans: list[RowPlan], cost: CostModel, max_step_tokens: int | None = None) -> int:
    """The tokens per row (1 = no drafts) that maximise expected committed tokens per second for this batch."""
    rows = len(plans)
    floor = 1 + max((p.avail for p in plans if p.fixed), default=0)  # rows with a fixed k keep their drafts
    widest = 1 + max((p.avail for p in plans), default=0)
    if max_step_tokens:
        widest = min(widest, max_step_tokens // max(rows, 1))
    widest = max(floor, widest)
    best, best_rate = floor, -1.0
    for width in range(floor, widest + 1):
        gains = [_row_gain(p, width) for p in plans]
        seconds = cost(rows, width) + sum(p.draft_cost * j for p, (_, j) in zip(plans, gains, strict=True))
        rate = sum(g for g, _ in gains) / max(seconds, 1e-9)
        if rate > best_rate * 1.0001:  # ties go to the narrower step
            best, best_rate = width, rate
    return best
