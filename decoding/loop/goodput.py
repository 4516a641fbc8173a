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

import math
from dataclasses import dataclass, field

from decoding.drafters.base import PROBE_EVERY, ProposeGate  # noqa: F401 (one gate: the loop's per row, the hybrid's per source)
from decoding.model.costs import CostModel

PROBE_ALPHA = 0.8  # the acceptance a probe hopes for: it probes only where drafts at that rate would pay
PROBE_DRAFTS = 2  # drafts of a probe (a row whose drafting stopped paying, trying again: Acceptance.due)
PROBE_MAX = 128  # the longest wait between a stopped row's probes (PROBE_EVERY: the first; doubling while it finds nothing)
# a model drafter's shared record (Acceptance.of_drafter): its memory per drafted step, its weight in a row's estimate,
# the standard errors of hope it adds while its evidence is thin; and the memory of a row's own drafted steps beside it
# (tests/decoding/loop/test_goodput.py simulates the choice)
POOL_DECAY, POOL_WEIGHT, POOL_HOPE, POOLED_ROW_DECAY = 0.995, 12.0, 2.5, 0.99


def expected_committed(alpha: float, j: int) -> float:
    """1 + alpha + ... + alpha^j: tokens one step commits with j drafts, each accepted with probability alpha.

    >>> expected_committed(0.5, 2)
    1.75
    >>> expected_committed(0.0, 5)
    1.0
    """
    if alpha >= 1.0:
        return j + 1.0
    return (1.0 - alpha ** (j + 1)) / (1.0 - alpha)  # the geometric sum, closed (the width choice calls it R x W times a step)


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

    def __init__(self, prior: float = 0.5, weight: float = 2.0, decay: float = 0.9, pool: Acceptance | None = None):
        if pool is not None:  # the drafter's record is the prior (worth POOL_WEIGHT observations, see alpha)
            weight = 0.0
        self.hits, self.misses, self.decay, self.pool = prior * weight, (1 - prior) * weight, decay, pool
        self.idle, self.probe_every = 0, PROBE_EVERY

    @classmethod
    def of_drafter(cls, model_free: bool) -> Acceptance:
        """A new row's estimate. A model drafter's acceptance is mostly the drafter's (how well it knows the target),
        so its rows share one long record (the ``pool``, carried to later requests by :meth:`carried`), and a row's
        own drafted steps move its estimate off that record only as far as their number warrants: past
        ``POOL_WEIGHT`` of them they weigh more, and the row keeps about a hundred (``POOLED_ROW_DECAY``). A
        model-free drafter's acceptance is mostly the text's (whether it repeats itself), so its rows learn alone,
        from the prior.

        Why: one row alone, stopping when its estimate from ten steps dipped under what pays, learned nothing more but
        from its probes, and each rejected probe doubled the wait. The eagle head, whose drafts pay at an acceptance of
        0.3 where 0.22 breaks even on this CPU, so drafted on 1% of its steps. And a row's memory must be long: with
        twenty steps against a record worth sixteen, a request unlike the earlier ones (a long document to summarise
        after chats) could never move its estimate more than halfway from the record, and drafted at a loss to its
        end. Idle steps age nothing: a row that stopped learns from its probes.

        >>> first = Acceptance.of_drafter(model_free=False)
        >>> for _ in range(200):
        ...     first.observe(drafted=1, accepted=int(_ % 10 < 3))  # the drafter's record: 0.3
        >>> row = first.carried()                                   # the next request
        >>> for _ in range(6):
        ...     row.observe(drafted=1, accepted=0)                  # six unlucky steps in a row
        >>> 0.2 < row.alpha < row.pool.alpha < 0.35                 # its own steps pull it down, but not to 0.1
        True
        >>> for _ in range(60):
        ...     row.observe(drafted=1, accepted=int(_ % 10 == 0))   # this request's drafts: 0.1
        >>> row.alpha < 0.16                                        # its own steps now outweigh the record
        True
        """
        if model_free:
            return cls()
        return cls(decay=POOLED_ROW_DECAY, pool=cls(decay=POOL_DECAY))

    def carried(self, weight: float = 4.0) -> Acceptance:
        """A new row's estimate that starts from this one's (a later request of the same decoder and drafter). Without
        it every request starts at 0.5 and a drafter that does not pay relearns so in each, drafting its first steps at
        a loss. A pooled row's successor shares its drafter's record, and its probe wait (a model drafter's probe
        costs about a step). Another row's successor starts from its acceptance, worth ``weight`` observations, and
        probes soon (a model-free drafter's probe is nearly free, and its acceptance depends more on the prompt).

        >>> old = Acceptance()
        >>> for _ in range(10):
        ...     old.observe(drafted=2, accepted=0)
        >>> round(old.carried().alpha, 2) == round(old.alpha, 2) < 0.1
        True
        >>> pooled = Acceptance.of_drafter(model_free=False)
        >>> pooled.carried().pool is pooled.pool
        True
        """
        if self.pool is not None:
            new = Acceptance(decay=self.decay, pool=self.pool)
            new.probe_every = self.probe_every
            return new
        return Acceptance(prior=self.alpha, weight=weight, decay=self.decay)

    @property
    def alpha(self) -> float:
        if self.pool is None:
            return self.hits / (self.hits + self.misses)
        return (self.hits + POOL_WEIGHT * self.pool.hopeful) / (self.hits + self.misses + POOL_WEIGHT)

    @property
    def hopeful(self) -> float:
        """The estimate plus ``POOL_HOPE`` standard errors of its evidence: rows that stop when an estimate from few
        steps dips below what pays learn nothing more (but for rare probes), so an estimate must be sure before it
        stops them. With 200 drafted steps behind it (its memory) the hope is 0.05 at an acceptance of 0.3."""
        seen = self.hits + self.misses
        return min(1.0, self.alpha + POOL_HOPE * (self.alpha * (1 - self.alpha) / seen) ** 0.5)

    @property
    def due(self) -> bool:
        """Idle long enough to probe: draft a little to learn whether drafting pays again."""
        return self.idle >= self.probe_every

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:  # no evidence (a pooled row's stays: its text did not change; its probes tell it more)
            self.idle += 1
            return
        if self.pool is not None:  # the record learns from drafted steps only (its idle count and probe wait go unused)
            self.pool.observe(drafted, accepted)
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
    A run of drafting rounds that lost more than ``PROBE_SHARE`` of the plain time of that wait (a draft catching up on
    a long prompt) waits longer, until its loss is that share. One gate may serve a decoder's successive generations
    (``ActorDecoder``): what it learnt, the wait included, carries over.

    >>> g = RoundGate()
    >>> g.drafts, g.observe(False, 1, 0.010), g.drafts        # the first round measures a plain one
    (False, None, True)
    >>> for _ in range(4):
    ...     g.observe(True, 2, 0.030)                         # 2 tokens in 30 ms: 67 tokens/s against 100
    >>> g.drafts, g.probe_every                               # they lost 40 ms: the probe waits 32 x 40 ms of plain rounds
    (False, 128)
    >>> for _ in range(128):
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
        self.lost = 0.0  # seconds the current run of drafting rounds took beyond what plain rounds would have

    @property
    def drafts(self) -> bool:
        return self.plain_s is not None and self.on

    @property
    def rate(self) -> float:
        """Committed tokens per second over the current run of drafting rounds (0 before any)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def until_probe(self) -> int:
        """Plain tokens to go before drafting is tried again (``PROBE_EVERY`` before the first plain measurement)."""
        return PROBE_EVERY if self.plain_s is None or self.on else max(1, self.probe_every - self.idle)

    def observe(self, drafted: bool, tokens: int, seconds: float) -> None:
        """One round: whether it verified or drafted anything, the tokens it committed, its wall seconds. A round that
        drafts nothing may commit several tokens (the target side alone, ``VerifySide.run``): it counts as that many
        plain rounds of its seconds per token."""
        if not drafted:
            each = seconds / max(tokens, 1)
            self.plain_s = each if self.plain_s is None else self.decay * self.plain_s + (1 - self.decay) * each
            self.idle += 0 if self.on else max(tokens, 1)
            if not self.on and self.idle >= self.probe_every:
                self.on, self.probing, self.rounds_on, self.tokens, self.seconds, self.lost = True, True, 0, 0.0, 0.0, 0.0
            return
        self.tokens, self.seconds = self.decay * self.tokens + tokens, self.decay * self.seconds + seconds
        self.rounds_on += 1
        if self.plain_s is None:
            return
        self.lost += seconds - tokens * self.plain_s
        if self.rounds_on < self.judge:
            return
        if self.rate * self.plain_s >= 1.0:  # drafting commits at least a plain round's token per plain round's time
            self.probe_every, self.probing, self.lost = PROBE_EVERY if self.probing else self.probe_every, False, 0.0
            return
        # the next probe waits until this one's loss is at most PROBE_SHARE of the plain time waited: a draft that
        # must catch up on a long prompt when it first drafts lost seconds at once (the draft worker's prefill deferred)
        wait = math.ceil(max(0.0, self.lost) / (PROBE_SHARE * self.plain_s))
        self.probe_every = max(min(PROBE_MAX, 2 * self.probe_every) if self.probing else self.probe_every, wait)
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
        # decayed sums over catch-ups [seconds beyond a proposal's own, tokens fed]; one list shared by the rows that
        # carry this one's evidence (``carried``): what catching up costs a token is the drafter's, not the row's, and
        # the rows of a batch start together, so each would otherwise begin without it (a batch's rows carried the last
        # row made, which had seen none: at 8 rows every request's first proposals caught up on their prompts untried)
        self.catch = [0.0, 0.0]

    def observe(self, j: int, seconds: float) -> None:
        if j <= 0:
            return
        d = self.decay
        self.n, self.sj, self.sjj = self.n * d + 1, self.sj * d + j, self.sjj * d + j * j
        self.ss, self.sjs = self.ss * d + seconds, self.sjs * d + j * seconds

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A proposal after plain steps (a request's first, a probe) fed its drafter ``tokens`` committed while it did
        not draft (a prompt, at a request's first), and took ``seconds`` more than a proposal of its length costs.

        Recorded only once a draft's own cost is known, and at most one draft's cost a token (a block of tokens costs
        less a token than a forward of one). A drafter's first proposal pays one-off costs too (its kernels' first
        calls, weights packed on first use), and a record that says catching up costs too much is never measured
        again: no row catches up, so none re-measures it. In the README's bench run of 2026-11-27 (19:14) EAGLE
        drafted on no step of 42 prompts after its warm-up request, where the runs before and after it drafted on
        55-75% of their steps (this, or the probe rule of the time: which one was not caught).

        >>> c = DraftCost()
        >>> c.observe_catch_up(300, 2.0)                # a first proposal, one-off costs and all: not recorded
        >>> c.catch_up(100) is None
        True
        >>> c.observe(1, 0.001)
        >>> c.observe_catch_up(300, 2.0); round(c.catch_up(100), 3)   # at most a draft's cost a token
        0.1
        """
        if tokens > 0 and self.n > 0:
            seconds = min(max(0.0, seconds), tokens * self(1))
            c = self.catch
            c[0], c[1] = c[0] * self.decay + seconds, c[1] * self.decay + tokens

    def catch_up(self, tokens: int) -> float | None:
        """Seconds to feed the drafter ``tokens`` it has not seen, from the catch-ups measured (None: none yet).

        >>> c = DraftCost()
        >>> c.catch_up(100) is None
        True
        >>> c.observe(1, 0.001)
        >>> c.observe_catch_up(700, 0.035); c.observe_catch_up(20, 0.002)
        >>> round(c.catch_up(100), 4)
        0.0052
        """
        seconds, fed = self.catch
        return tokens * seconds / fed if fed > 0 else None

    def carried(self) -> DraftCost:
        """A new row's cost model that starts with this one's evidence (a later request of the same drafter: a probe
        then knows what drafting cost before, catch-up included, instead of assuming it free)."""
        new = DraftCost(self.decay)
        new.n, new.sj, new.sjj, new.ss, new.sjs = self.n, self.sj, self.sjj, self.ss, self.sjs
        new.catch = self.catch  # shared, see __init__
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


def best_rate(plan: RowPlan, cost: CostModel, rows: int = 1) -> tuple[float, int]:
    """(the most expected committed tokens per second ``plan``'s row gets, the width that gets it), a step of ``rows``
    rows at that width costing it its share: what k=auto weighs two proposals of one row by (a model drafter's own,
    prompt lookup's).

    >>> cost = CostModel({(1, 1): 0.010, (1, 2): 0.011, (1, 3): 0.012})
    >>> best_rate(RowPlan(avail=0), cost), best_rate(RowPlan(avail=2, alpha=0.8), cost)
    ((100.0, 1), (203.33333333333331, 3))
    """
    best = (0.0, 1)
    for width in range(1, plan.avail + 2):
        gain, j = _row_gain(plan, width)
        rate = gain / max(cost(rows, width) / rows + _drafting(plan, j), 1e-9)
        if rate > best[0] * 1.0001:  # ties go to the narrower step
            best = (rate, width)
    return best


def lookup_plan(avail: int, acceptance: Acceptance, clock: Acceptance, cost: CostModel, rows: int, rival: float, may_probe=True):
    """The plan of a looked-up chain of ``avail`` drafts (prompt lookup's, beside a model drafter or a target alone),
    accepted at ``acceptance`` (its match length's): itself where it is worth more than ``rival`` tokens a second (what
    the row would do otherwise, :func:`best_rate`); a probe of ``PROBE_DRAFTS`` at ``PROBE_ALPHA`` where its ``clock``
    (the chains' own acceptance, which sees the idle steps) is due and ``may_probe``; else None, an idle step.

    >>> cost = CostModel({(1, 1): 0.010, (1, 2): 0.011, (1, 3): 0.012})
    >>> plain = best_rate(RowPlan(avail=0), cost)[0]
    >>> lookup_plan(2, Acceptance(prior=0.8), Acceptance(), cost, 1, plain).avail     # worth it: drafted
    2
    >>> lookup_plan(2, Acceptance(prior=0.01), Acceptance(), cost, 1, plain) is None  # not worth it, no probe due
    True
    """
    look = RowPlan(avail=avail, alpha=acceptance.alpha)
    if best_rate(look, cost, rows)[0] > rival:
        return look
    if not may_probe or not clock.due:
        clock.observe(0, 0)
        return None
    return RowPlan(avail=min(avail, PROBE_DRAFTS), alpha=max(look.alpha, PROBE_ALPHA))


PROBE_SHARE = 1 / 32  # of the plain steps a row waited, the share its model drafter's probe may cost


def probe_allowed(seconds: float, plain_s: float, idle: int) -> bool:
    """Whether a model drafter's probe may run now, costing ``seconds`` in all (catching up on the tokens the row
    committed since it last drafted, its drafts, the wider verification): at most ``PROBE_SHARE`` of the ``idle``
    plain steps the row waited, so probes cost at most about 3% of a row whose drafting does not pay. A row that
    stopped drafting learns only from its probes, and a probe's catch-up grows with the wait, so the wait grows until
    the probe fits (a drafter whose catch-up costs more than a 32nd of a plain step a token never probes: it would
    not pay if it drafted). The rule before, a catch-up of up to a plain step's worth, counted neither the drafts nor
    the verification: SpS's probes after 8 plain steps cost 6-9 ms each here, two plain steps, and it ran at 0.92x AR
    on coding, reasoning, writing and stem while drafting on a tenth of its steps (2026-11-28).

    >>> probe_allowed(0.001, 0.004, idle=8), probe_allowed(0.006, 0.004, idle=8)
    (True, False)
    >>> probe_allowed(0.006, 0.004, idle=48)
    True
    """
    return seconds <= plain_s * idle * PROBE_SHARE


def catch_up_pays(plan: RowPlan, cost: CostModel, width: int, remaining: int, catch_up_s: float, rows: int = 1) -> bool:
    """Whether a model drafter that has not seen its row's last tokens (a request's prompt, the tokens of plain steps)
    should catch up on them, in ``catch_up_s`` seconds, to draft ``width - 1`` tokens now: only if drafting at the
    row's acceptance would save that much over the ``remaining`` tokens. On this CPU the distilled draft's first
    proposal on a 769-token prompt took 48 ms, five plain steps, where drafting at its acceptance saved 0.1 ms a token:
    it lost 5% of the request before its drafts had a chance, and then it did not draft. EAGLE's head, saving about
    0.8 ms a token at its acceptance, catches up on the same prompt in 31 ms and drafts. In a batch of ``rows`` a
    token costs a row's share of the step, and every row pays the wider step: at 8 rows here, where a step of 3 tokens
    costs 2.3 plain ones, the distilled draft's first proposals of each request (its catch-up on the prompt, judged
    with one-row costs) cost about 10% of batched AR's decoding rate (2026-11-29).

    >>> cost = CostModel({(1, 1): 0.010, (1, 2): 0.011})
    >>> eagle = RowPlan(avail=1, alpha=0.33, draft_cost=0.0017)
    >>> catch_up_pays(eagle, cost, 2, 128, 0.031), catch_up_pays(eagle, cost, 2, 20, 0.031)
    (True, False)
    >>> catch_up_pays(RowPlan(avail=1, alpha=0.33, draft_cost=0.0026), cost, 2, 128, 0.048)
    False
    >>> busy = CostModel({(1, 1): 0.010, (1, 2): 0.011, (8, 1): 0.014, (8, 2): 0.024})
    >>> catch_up_pays(eagle, busy, 2, 128, 0.031), catch_up_pays(eagle, busy, 2, 128, 0.031, rows=8)
    (True, False)
    """
    gain, j = _row_gain(plan, width)
    if j <= 0:
        return True
    # seconds a token, drafting against plain steps; in a batch of ``rows`` a row's token costs its share of the step
    saved = cost(rows, 1) / rows - (cost(rows, j + 1) / rows + _drafting(plan, j)) / gain
    return saved * remaining >= catch_up_s


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
