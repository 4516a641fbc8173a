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
# tokens per row the start-up calibration times. The int4 kernel of this kind of CPU works on 4 rows of a matrix at a
# time: SmolLM2's forward costs 8.7 ms at 1 token, 11.4-12.4 at 2-4, 15.2-16.2 at 5-8, 21.7 at 9; the ends of those
# steps are measured, so k=auto sees that a fourth or an eighth token costs little more than the one before it
CALIBRATION_WIDTHS = (1, 2, 3, 4, 5, 8, 9)  # 42 points x 2 forwards at 32 rows: about 7 s for SmolLM2-135M on 2 cores
CALIBRATION_FORMAT = "m3"  # how a grid is measured: the fastest of 3 timings a point, monotone in width (measure)
GPU_WIDTHS = (17, 33, 65)  # also measured on a GPU, where verifying 64 tokens costs about what one does
PROBE_EVERY, PROBE_MAX = 8, 128  # idle steps before a row that stopped drafting tries again (doubling while it finds nothing)


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

    Starts at ``prior`` (worth ``weight`` observations) and decays old evidence by ``decay`` per step. A row that stopped
    drafting (it did not pay) learns nothing more, so it probes: once it has been idle ``probe_every`` steps it is
    :attr:`due` a short draft. A probe costs what a drafting step costs (a model drafter's catch-up over every token
    since it last drafted, a wider verification), so a probe with a rejected draft doubles the wait (up to
    ``PROBE_MAX``): one accepted draft of two is about what a drafter that does not pay gets (the early-exit adapter's
    probes on this CPU accepted something in 1 of 6, yet reset the wait each time under the old rule). A step whose
    drafts were all accepted, probe or not, resets it.

    >>> a = Acceptance()
    >>> for _ in range(20):
    ...     a.observe(drafted=4, accepted=4)
    >>> a.alpha > 0.9
    True
    >>> for _ in range(PROBE_EVERY):
    ...     a.observe(drafted=0, accepted=0)            # nothing proposed: no evidence, but idle
    >>> a.due, round(a.alpha, 3) > 0.9
    (True, True)
    >>> a.observe(drafted=2, accepted=1); a.probe_every == 2 * PROBE_EVERY   # the probe lost a draft: wait longer
    True
    >>> a.observe(drafted=3, accepted=3); a.probe_every == PROBE_EVERY       # all accepted: probe soon again if it stops
    True
    """

    def __init__(self, prior: float = 0.5, weight: float = 2.0, decay: float = 0.9):
        self.hits, self.misses, self.decay = prior * weight, (1 - prior) * weight, decay
        self.idle, self.probe_every = 0, PROBE_EVERY

    def carried(self, weight: float = 4.0, wait: bool = False) -> Acceptance:
        """A new row's estimate that starts from this one's (a later request of the same decoder and drafter): its
        acceptance worth ``weight`` observations, instead of the prior. Without it every request starts at 0.5 and a
        drafter that does not pay relearns so in each, drafting its first steps at a loss. ``wait``: its probe wait
        too (a model drafter's probe costs about a step; a model-free drafter's is nearly free and its acceptance
        depends more on the prompt, so it starts probing soon).

        >>> old = Acceptance()
        >>> for _ in range(10):
        ...     old.observe(drafted=2, accepted=0)
        >>> round(old.carried().alpha, 2) == round(old.alpha, 2) < 0.1
        True
        """
        new = Acceptance(prior=self.alpha, weight=weight, decay=self.decay)
        new.probe_every = self.probe_every if wait else PROBE_EVERY
        return new

    @property
    def alpha(self) -> float:
        return self.hits / (self.hits + self.misses)

    @property
    def due(self) -> bool:
        """Idle long enough to probe: draft a little to learn whether drafting pays again."""
        return self.idle >= self.probe_every

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            self.idle += 1
            return
        if accepted >= drafted:
            self.probe_every = PROBE_EVERY
        elif self.due:  # a probe that lost a draft
            self.probe_every = min(PROBE_MAX, 2 * self.probe_every)
        self.idle = 0
        self.hits = self.hits * self.decay + accepted
        self.misses = self.misses * self.decay + (1 if accepted < drafted else 0)


class RoundGate:
    """Whether a two-sided schedule (``decoding.schedules.two_sided``) drafts in its next round, from what its rounds
    measured: committed tokens per second over the rounds that drafted, against the seconds of a round that drafts
    nothing (it commits one token). A round's wall time holds everything it paid: both sides' compute, the transport
    between workers, a drafter's catch-up. Two sides working at once (PEARL) make the per-step goodput model of
    :func:`choose_width` moot: the rate itself is what is compared.

    The first round drafts nothing, to measure that cost; drafting then starts and stops after ``judge`` rounds where
    its rate is below one token per plain round. Stopped, the gate probes: after ``probe_every`` plain rounds it drafts
    ``judge`` rounds again; a probe that does not pay doubles the wait (up to ``PROBE_MAX``), one that pays resets it.

    >>> g = RoundGate()
    >>> g.drafts, g.observe(False, 1, 0.010), g.drafts        # the first round measures a plain one
    (False, None, True)
    >>> for _ in range(4):
    ...     g.observe(True, 2, 0.030)                         # 2 tokens in 30 ms: 67 tokens/s against 100
    >>> g.drafts
    False
    >>> for _ in range(PROBE_EVERY):
    ...     g.observe(False, 1, 0.010)
    >>> g.drafts                                              # a probe
    True
    >>> for _ in range(4):
    ...     g.observe(True, 4, 0.030)                         # now 133 tokens/s: it pays, drafting stays on
    >>> g.drafts, g.probe_every == PROBE_EVERY
    (True, True)
    """

    def __init__(self, judge: int = 4, decay: float = 0.8):
        self.judge, self.decay = judge, decay
        self.plain_s: float | None = None  # seconds of a round that drafts nothing (decayed mean)
        self.tokens = self.seconds = 0.0  # decayed sums over the drafting rounds of the current run
        self.on, self.rounds_on, self.idle, self.probe_every, self.probing = True, 0, 0, PROBE_EVERY, False

    @property
    def drafts(self) -> bool:
        return self.plain_s is not None and self.on

    @property
    def rate(self) -> float:
        """Committed tokens per second over the current run of drafting rounds (0 before any)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def observe(self, drafted: bool, tokens: int, seconds: float) -> None:
        """One round: whether it verified or drafted anything, the tokens it committed, its wall seconds."""
        if not drafted:
            self.plain_s = seconds if self.plain_s is None else self.decay * self.plain_s + (1 - self.decay) * seconds
            self.idle += not self.on
            if not self.on and self.idle >= self.probe_every:
                self.on, self.probing, self.rounds_on, self.tokens, self.seconds = True, True, 0, 0.0, 0.0
            return
        self.tokens, self.seconds = self.decay * self.tokens + tokens, self.decay * self.seconds + seconds
        self.rounds_on += 1
        if self.rounds_on < self.judge or self.plain_s is None:
            return
        if self.rate * self.plain_s >= 1.0:  # drafting commits at least a plain round's token per plain round's time
            self.probe_every, self.probing = PROBE_EVERY if self.probing else self.probe_every, False
            return
        self.probe_every = min(PROBE_MAX, 2 * self.probe_every) if self.probing else self.probe_every
        self.on, self.probing, self.idle = False, False, 0


class TreeGain:
    """Expected accepted drafts of a whole tree, by its size (1, 2-3, 4-7, 8-15, 16-31, 32+ nodes): the mean over a
    row's tree steps of that size, from a prior of one accepted draft (worth ``weight`` steps), so a size not seen yet
    is tried.

    A model-free drafter's trees differ in worth by size: a suffix tree grows with its match length. On this CPU over
    coding, translation, summarization and stem, suffix's one-node trees had 0.08-0.26 of their draft accepted while
    each cost a third of a step more to verify, and its trees of 3-4 nodes 2.6 accepted; one mean over all of them
    made k=auto draft the losing ones too.

    >>> g = TreeGain()
    >>> for _ in range(20):
    ...     g.observe(1, 0); g.observe(4, 3)
    >>> round(g(1), 2), round(g(4), 2), g(16)    # each size by its own record; an unseen size by the prior
    (0.09, 2.82, 1.0)
    """

    def __init__(self, weight: float = 2.0):
        self.weight = weight
        self.by_size: dict[int, list[float]] = {}  # bucket -> [steps, accepted drafts]

    @staticmethod
    def bucket(size: int) -> int:
        return min(max(size, 1).bit_length(), 6)

    def __call__(self, size: int) -> float:
        n, acc = self.by_size.get(self.bucket(size), (0.0, 0.0))
        return (acc + self.weight) / (n + self.weight)

    def observe(self, size: int, accepted: int) -> None:
        entry = self.by_size.setdefault(self.bucket(size), [0.0, 0.0])
        entry[0], entry[1] = entry[0] + 1, entry[1] + accepted

    def carried(self, most: float = 8.0) -> TreeGain:
        """A new row's record that starts from this one's, each size worth at most ``most`` steps."""
        new = TreeGain(self.weight)
        for b, (n, acc) in self.by_size.items():
            s = min(1.0, most / n)
            new.by_size[b] = [n * s, acc * s]
        return new


class DraftCost:
    """Seconds a drafter spends on a proposal of j drafts: ``a + b * j`` for j > 0 (nothing when it does not draft),
    fitted by least squares on its recent proposals (older ones decayed). ``a`` is what a proposal costs whatever its
    length: catching up on the tokens accepted since it last drafted (a draft cache, feature capture: done lazily, in
    one forward, when it next drafts) and its first forward; ``b`` each further draft. With one length seen so far
    the cost is proportional to j.

    >>> c = DraftCost()
    >>> for j, s in [(1, 0.03), (3, 0.05), (1, 0.03), (3, 0.05)]:
    ...     c.observe(j, s)
    >>> round(c(0), 3), round(c(1), 3), round(c(2), 3), round(c(5), 3)
    (0.0, 0.03, 0.04, 0.07)
    """

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.n = self.sj = self.sjj = self.ss = self.sjs = 0.0

    def observe(self, j: int, seconds: float) -> None:
        if j <= 0:
            return
        d = self.decay
        self.n, self.sj, self.sjj = self.n * d + 1, self.sj * d + j, self.sjj * d + j * j
        self.ss, self.sjs = self.ss * d + seconds, self.sjs * d + j * seconds

    def carried(self) -> DraftCost:
        """A new row's cost model that starts with this one's evidence (a later request of the same drafter: a probe
        then knows what drafting cost before, catch-up included, instead of assuming it free)."""
        new = DraftCost(self.decay)
        new.n, new.sj, new.sjj, new.ss, new.sjs = self.n, self.sj, self.sjj, self.ss, self.sjs
        return new

    def __call__(self, j: int) -> float:
        if j <= 0 or self.n == 0:
            return 0.0
        mean_j, mean_s = self.sj / self.n, self.ss / self.n
        var = self.sjj / self.n - mean_j * mean_j
        if var < 1e-9:
            return mean_s * j / mean_j
        b = max(0.0, (self.sjs / self.n - mean_j * mean_s) / var)
        a = max(0.0, mean_s - b * mean_j)
        return a + b * j


class CostModel:
    """Seconds of one target forward over R rows of T tokens each.

    ``table`` holds measured points {(R, T): seconds}; other sizes are interpolated linearly in R and in T
    between the nearest measured ones (and extrapolated in proportion beyond them). :meth:`observe` folds in
    the time of real steps, so the model's level follows the machine (other load, longer contexts) as it runs.

    >>> c = CostModel({(1, 1): 1.0, (1, 3): 2.0, (3, 1): 3.0, (3, 3): 5.0})
    >>> c(2, 2)
    2.75
    """

    FRESH = 4  # a wider step within this many steps of a plain one corrects its shape (observe)

    def __init__(self, table: dict[tuple[int, int], float], smoothing: float = 0.2):
        if not table:
            raise ValueError("a cost model needs at least one measured point")
        self.table = dict(table)
        self.smoothing = smoothing
        self.rows = sorted({r for r, _ in table})
        self.widths = sorted({t for _, t in table})
        self.scale = 1.0  # observed / measured level (see observe)
        self.residual: dict[tuple[int, int], float] = {}  # (rows, width > 1) -> observed / predicted shape (see observe)
        self.since_plain = self.FRESH + 1  # steps since the last plain one (none yet)

    def __call__(self, rows: int, width: int) -> float:
        return self._interp(rows, width) * self.scale * self.residual.get((rows, width), 1.0)

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
        """Fold in a real step. Every step moves the level (a moving average of observed / predicted): a longer
        context makes every width dearer, and a row that drafts at every step must not leave it stale. A wider step
        that comes within ``FRESH`` steps of a plain one (the level then is that of its context) also corrects the
        shape at its own size: how much more than a plain step it costs, as measured at start-up, which a calibration
        over a short context can get wrong (on this CPU a 128-token calibration put 8 tokens at 1.78x a plain step,
        where verifying them in generation cost 1.99x). A size whose cost was underestimated gets drafted, observed
        and corrected; one whose cost was overestimated is not drafted again, so one slow step (the collector,
        another process) moves a shape by at most 2%.

        >>> c = CostModel({(1, 1): 1.0, (1, 3): 2.0})
        >>> for _ in range(100):
        ...     c.observe(1, 1, 0.5); c.observe(1, 3, 1.5)
        >>> round(c(1, 1), 3), round(c(1, 3), 3), round(c(1, 2), 3)   # width 2 never seen: the calibrated shape
        (0.5, 1.5, 0.75)
        >>> d = CostModel({(1, 1): 1.0, (1, 2): 1.1})
        >>> for seconds in [1.1 * 1.01**i for i in range(40)]:      # drafting at every step while the context grows
        ...     d.observe(1, 2, seconds)
        >>> round(d(1, 2) / d(1, 1), 3), round(d(1, 2), 2)         # the growth went to the level, not to the shape
        (1.1, 1.56)
        """
        key = (rows, width)
        base, shape = self._interp(rows, width), self.residual.get(key, 1.0)
        self.scale += self.smoothing * (seconds / max(base * shape, 1e-12) - self.scale)
        self.since_plain = 0 if width <= 1 else self.since_plain + 1
        if width > 1 and self.since_plain <= self.FRESH:
            ratio = min(max(seconds / max(base * self.scale, 1e-12), shape * 0.9), shape * 1.1)
            self.residual[key] = shape + self.smoothing * (ratio - shape)

    def to_dict(self) -> dict:
        return {"points": [[r, t, s] for (r, t), s in sorted(self.table.items())]}

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        return cls({(int(r), int(t)): float(s) for r, t, s in data["points"]})

    @classmethod
    def measure(
        cls, target, rows=CALIBRATION_ROWS, widths=CALIBRATION_WIDTHS, context: int = 128, repeats: int = 3, max_rows: int | None = None
    ) -> CostModel:
        """Time ``target`` (a ``ModelAdapter``) on every (rows, width) of the grid over a ``context``-token cache.

        Each point is the fastest of ``repeats`` timed forwards after one warm-up (the least disturbed by other work),
        and no point costs more than a wider one of its rows (:func:`monotone`). One timing a point put two tokens at
        1.16x a plain step on this CPU, where they cost 1.08x over 30 timings; :meth:`observe` corrects an
        underestimate as soon as the width is drafted, but never an overestimate (a width it does not try).
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
        return cls(monotone(table))


def monotone(table: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """Measured forward costs with no width dearer than a wider one of the same rows (each point the least of itself
    and every wider point): a timing's noise only ever adds, so the lower reading is the truer one.

    >>> monotone({(1, 1): 1.0, (1, 2): 1.6, (1, 3): 1.3, (1, 4): 1.5})
    {(1, 1): 1.0, (1, 2): 1.3, (1, 3): 1.3, (1, 4): 1.5}
    """
    out = dict(table)
    for (r, t), seconds in table.items():
        out[(r, t)] = min([seconds] + [s for (r2, t2), s in table.items() if r2 == r and t2 > t])
    return out


@dataclass
class RowPlan:
    """What the width choice needs to know about one row."""

    avail: int  # drafts the row can offer this step (a model-free drafter's proposal length, or its cap)
    alpha: float = 0.5  # per-token acceptance estimate
    fixed: bool = False  # the row's draft length is set by its config (k fixed): the width must fit it
    draft_cost: object = 0.0  # seconds of drafting j tokens: a DraftCost (model-based drafters), or seconds per token
    tree_gain: float | None = None  # trees: expected accepted drafts of the whole tree (it is drafted whole or not at all)
    extra: dict = field(default_factory=dict)


def _row_gain(plan: RowPlan, width: int) -> tuple[float, int]:
    """(expected committed tokens, drafts fed) of a row in a step of ``width`` tokens per row."""
    if plan.tree_gain is not None:
        return (1.0 + plan.tree_gain, plan.avail) if plan.avail <= width - 1 else (1.0, 0)
    j = min(width - 1, plan.avail)
    return expected_committed(plan.alpha, j), j


def _drafting(plan: RowPlan, j: int) -> float:
    return plan.draft_cost(j) if callable(plan.draft_cost) else plan.draft_cost * j


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
        seconds = cost(rows, width) + sum(_drafting(p, j) for p, (_, j) in zip(plans, gains, strict=True))
        rate = sum(g for g, _ in gains) / max(seconds, 1e-9)
        if rate > best_rate * 1.0001:  # ties go to the narrower step
            best, best_rate = width, rate
    return best
