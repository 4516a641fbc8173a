"""The batch: sequences decoding together, rows joining and leaving between steps (continuous batching).

Every method is this loop with a drafter and a verifier: the batch asks each row's drafter for its drafts, runs one
step for all rows (``decoding.loop.step``: one structure of device tensors, one forward, verification on the
device, one host read) and commits each row's tokens. A row's tokens never depend on which other rows share its
step (greedy float32: identical to running alone). A generation alone is a batch of one.

How many drafts a row offers is the row's ``k`` (fixed), or, with ``adaptive=True``, chosen per step from its
measured acceptance and the measured cost of the forward (``decoding.loop.goodput``): long drafts at low load,
none at high load.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from decoding.drafters.base import DecodeState, Drafter, Proposal
from decoding.drafters.ngram import NgramDrafter
from decoding.loop.goodput import (
    PROBE_ALPHA,
    PROBE_DRAFTS,
    Acceptance,
    DraftCost,
    ProposeGate,
    RowPlan,
    TreeGain,
    best_rate,
    catch_up_pays,
    choose_width,
    lookup_plan,
    probe_allowed,
)
from decoding.loop.output import Generation, Output, StepCallback
from decoding.loop.prefill import PREFILL_CHUNK, Prefill, check_context, chunk_of, first_token
from decoding.loop.step import Workspace, propose, truncate, verify_step
from decoding.model.adapter import KVCache, ModelAdapter
from decoding.model.costs import CostModel
from decoding.model.graphs import capture_seconds
from decoding.sampling import GREEDY, SamplingParams

_PHASES = {"prefill_s": 0.0, "decode_s": 0.0, "steps": 0}  # every batch of this process together (batch_phases)


def batch_phases() -> dict:
    """Wall seconds every :class:`Batch` of this process has spent so far filling prompts (``prefill_s``: chunks and
    first tokens) and in decoding steps (``decode_s``, ``steps`` of them: drafts, the forward, verification,
    commits), read on the host. Each phase ends in a host read on a GPU (a prompt's first token; a step's accepted
    counts), so its GPU time lands in it, but for a prefill chunk that does not finish its prompt, whose time lands
    in the next read. ``specray bench-device`` takes differences of it around a batch: where the batched sweep's time
    goes."""
    return dict(_PHASES)


class NotBatchable(ValueError):
    """A drafter that runs one sequence at a time (it keeps the target cache for itself) was put in a batch."""


class Sequence(Output):
    """One request in the batch: its prompt, drafter, draft length, sampling, generator, limits and output.

    ``on_step(tokens)`` receives each step's newly committed tokens (after EOS trimming, so streaming sees
    exactly the output); returning a string ends the sequence after those tokens with that finish reason
    (a stop sequence, a cancelled client), with exact stats. ``k`` is the most drafts per step; with
    ``adaptive`` the loop chooses 0..k per step (see ``decoding.loop.goodput``), and with ``glance`` also falls
    back on prompt lookup's chain where the drafter's own drafts do not pay (:meth:`Batch._look`; a model-free
    drafter's ``Drafter.glance``).
    """

    def __init__(
        self,
        prompt_ids: torch.Tensor,  # [1, T]
        *,
        drafter: Drafter | None = None,
        k: int = 4,
        adaptive: bool = False,
        glance: bool = True,
        sampling: SamplingParams = GREEDY,
        max_new_tokens: int = 128,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        generator: torch.Generator | None = None,
        on_step: StepCallback | None = None,
        tag=None,
    ):
        if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
            raise ValueError(f"a sequence is one row of prompt ids [1, T], got shape {tuple(prompt_ids.shape)}")
        if prompt_ids.shape[1] < 1:
            raise ValueError("empty prompt")
        super().__init__(max_new_tokens, eos_token_ids, on_step)
        self.prompt_ids = prompt_ids
        self.drafter = drafter or Drafter()
        self.k, self.adaptive, self.glance = k, adaptive, glance
        self.sampling, self.generator = sampling, generator
        self.tag = tag
        self.state: DecodeState | None = None
        self.acceptance = Acceptance.of_drafter(self.drafter.model_free)  # SpecDecoder may carry an earlier request's
        self.acceptance_of: dict[int, Acceptance] = {}  # per kind of proposal (Proposal.kind), where its drafter says
        self.draft_cost = DraftCost()  # what its drafter's proposals cost, by length
        self.captured_s = 0.0  # seconds its drafter's last proposal spent capturing CUDA graphs (once per shape)
        self.tree_gain = TreeGain()  # accepted drafts of its whole trees, by tree size
        self.gate = ProposeGate()  # whether its model-free drafter proposes at all this step
        self.glanced = False  # the gate held its proposal back this step: its drafter only glanced (Drafter.glance)
        self.lookahead: list[int] = []  # what its glance would have offered at a step it proposed in full
        self.lookup: NgramDrafter | None = None  # a model drafter's row: prompt lookup over its text (Batch._look)
        self.looked = False  # this step drafts prompt lookup's chain, not its model drafter's (which rests)
        self.look_acceptance = Acceptance()  # its looked-up chains' (the probe's clock: Batch._look)
        self.declined = False  # its model drafter proposed nothing at its last step with a budget (DEL's own choice)
        self.drafted_own = False  # its drafter's own drafts were verified at its last step (a proposal right after
        # them costs a step's drafting; after plain or looked-up steps it also catches up on what they committed)
        self.fill: Prefill | None = None  # its prompt's prefill while it joins a batch
        self.unfed = prompt_ids.shape[1]  # tokens committed since its drafter last proposed (a model drafter catches up)
        self.error: Exception | None = None  # why it could not start (its drafter failed to), if so

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.shape[1]

    @property
    def fed_next(self) -> int:
        """Positions its model drafter's next catch-up feeds: the unfed ones, or the last ``Drafter.context`` of them."""
        context = self.drafter.context
        return self.unfed if context is None else min(self.unfed, context)

    @property
    def max_len(self) -> int:
        """Cache slots this sequence may need: prompt, new tokens and one step's drafts."""
        return self.prompt_len + self.max_new_tokens + self.drafter.max_nodes(self.k) + 1

    def kind_acceptance(self, kind: int) -> Acceptance:
        """The acceptance of this row's proposals of one kind (``Proposal.kind``), from the usual prior: a kind not
        seen yet is tried, whatever the others did."""
        if kind not in self.acceptance_of:
            self.acceptance_of[kind] = Acceptance()
        return self.acceptance_of[kind]

    def step_k(self) -> int:
        """Never draft more than can be committed: m + 1 <= remaining."""
        return max(0, min(self.k, self.max_new_tokens - len(self.new) - 1))


class Batch:
    """Sequences decoding together: rows join and leave between steps (continuous batching).

    The rows share one position-addressed KV cache, rows 0..R-1 of it in use; each sequence's state sees its
    own row through a one-row view with its own length. A leaving row's place is taken by the last row (its KV
    is copied once); the cache grows (rows or slots) when a joining sequence needs more.

    Joining is chunked prefill (as in Sarathi-Serve and vLLM): :meth:`add` queues a sequence, and each
    :meth:`step` first runs chunks of the queued prompts (:class:`Prefill`'s fixed chunks, in arrival order,
    whole chunks while they fit in ``prefill_budget`` prompt tokens, at least one), then one decoding step of
    every row. A sequence whose prompt is filled commits its first token and decodes from that same step, so a
    long prompt costs the other rows a bounded delay per step instead of its whole prefill at once; its own
    output is what it would be alone (the chunks do not depend on the batch). The prompt being filled goes into a
    one-row staging cache, the same storage for every joining sequence (on a GPU its chunks replay the same few
    graphs, whichever row it joins at), and is copied into its row of the batch cache when it starts decoding.

    ``max_rows`` caps the batch, joining sequences included (:meth:`add` refuses beyond it: the caller queues);
    ``max_step_tokens`` caps rows x width of one step for adaptive rows; ``cost`` is the forward-cost model
    adaptive rows need (``CostModel.measure(target)``); without one, adaptive rows draft their full k.
    ``prefill_budget``: prompt tokens prefilled per step (None: every queued prompt at once).

    >>> # batch = Batch(target, max_rows=16, cost=CostModel.measure(target))
    >>> # batch.add(Sequence(ids, drafter=NgramDrafter(), k=8, adaptive=True)); batch.add(...)
    >>> # while len(batch): done = batch.step()    # finished sequences leave; .result() has tokens and stats
    """

    def __init__(
        self,
        target: ModelAdapter,
        *,
        max_rows: int = 16,
        max_step_tokens: int | None = None,
        cost: CostModel | None = None,
        prefill_budget: int | None = PREFILL_CHUNK,
    ):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if prefill_budget is not None and prefill_budget < 1:
            raise ValueError(f"prefill_budget must be >= 1 or None, got {prefill_budget}")
        self.target = target
        self.max_rows, self.max_step_tokens, self.cost = max_rows, max_step_tokens, cost
        self.prefill_budget = prefill_budget
        self.rows: list[Sequence] = []  # decoding, in cache rows 0..R-1
        self.joining: list[Sequence] = []  # queued or being prefilled (only the first may have begun), in order
        self.cache: KVCache | None = None
        self.workspace = Workspace(target.device)  # the step's device buffers, allocated once
        self._staging: KVCache | None = None  # where a joining prompt is filled (see the class docstring)
        self._view: tuple[int, KVCache] | None = None  # (rows, view of rows 0..rows-1)

    def __len__(self) -> int:
        """Sequences in the batch: decoding and joining."""
        return len(self.rows) + len(self.joining)

    @property
    def full(self) -> bool:
        return len(self) >= self.max_rows

    # ---- joining and leaving ----------------------------------------------------------
    def check(self, seq: Sequence) -> None:
        """Raise ``ContextTooLong`` / ``NotBatchable`` for a sequence this batch cannot take (before any work)."""
        check_context(seq.prompt_len, seq.max_new_tokens, self.target.max_context)
        if not seq.drafter.batchable and (len(self) or self.max_rows > 1):
            raise NotBatchable(f"{seq.drafter.name} decodes one sequence at a time; run it in a batch of max_rows=1")

    def add(self, seq: Sequence) -> Sequence:
        """Queue ``seq``: the next steps prefill its prompt (see the class docstring), commit its first token and decode it.

        A sequence that ends at its first token (EOS, max_new_tokens 1), or whose drafter fails to start (its
        ``error``), comes back finished from the step that filled it and takes no row.
        """
        if self.full:
            raise RuntimeError(f"the batch is full ({self.max_rows} rows)")
        self.check(seq)
        seq.t_start = time.perf_counter()
        self.joining.append(seq)
        return seq

    def _prefill(self) -> list[Sequence]:
        """Run whole prefill chunks of the joining sequences, in order, within the budget (at least one chunk);
        a sequence whose prompt is filled starts decoding. Returns those that ended at once."""
        ended, used = [], 0
        while self.joining:
            seq = self.joining[0]
            if seq.fill is None:
                self._reserve(len(self.rows) + 1, seq.max_len)
                seq.fill = Prefill(seq.prompt_ids.to(self.target.device), seq.drafter.feature_layers, chunk_of(self.target))
            n = seq.fill.next_chunk()
            if used and self.prefill_budget is not None and used + n > self.prefill_budget:
                break
            seq.fill.run_chunk(self.target, self._staging_for(seq.prompt_len))
            used += n
            if seq.fill.remaining == 0:
                self.joining.pop(0)
                if self._start(seq):
                    self.rows.append(seq)
                else:
                    ended.append(seq)
        return ended

    def _staging_for(self, slots: int) -> KVCache:
        """The one-row cache joining prompts are filled in, holding at least ``slots`` positions (grown when not)."""
        if self._staging is None or self._staging.max_len < slots:
            self._staging = self.target.new_cache(1, slots)
        return self._staging

    def _start(self, seq: Sequence) -> bool:
        """A filled prompt: its KV into the next free row, draw its first token and start its drafter; False when it
        ended there."""
        target, row, n = self.target, len(self.rows), seq.prompt_len
        for dst, src in ((self.cache.k_all, self._staging.k_all), (self.cache.v_all, self._staging.v_all)):
            dst[:, row, :, :n] = src[:, 0, :, :n]
        view = self.cache.row(row)
        h, features = seq.fill.result()
        view.rollback(n)
        first = first_token(target, h[:, -1:], seq.sampling, seq.generator)
        tokens = torch.cat([seq.fill.prompt, first], dim=1)
        seq.fill = None
        first_id = int(first[0, 0])
        history = seq.prompt_ids[0].tolist() + [first_id]
        seq.state = DecodeState(
            tokens, target, view, seq.sampling, seq.generator, seq.max_len, target_hidden=h, target_features=features, history=history
        )
        seq.state.reserve(seq.max_len)
        seq.prefill_s = time.perf_counter() - seq.t_start
        seq.commit([first_id])
        if not seq.finished:
            try:
                seq.drafter.start(seq.state)
            except Exception as e:  # noqa: BLE001 - it fails alone, the caller reports its error
                seq.error = e
                seq.cancel("error")
        if seq.finished:
            seq.wall_s = time.perf_counter() - seq.t_start
            return False
        return True

    def _reserve(self, rows: int, slots: int) -> None:
        """Make the cache hold ``rows`` rows of ``slots`` positions (grown, with the rows in use copied over)."""
        cache = self.cache
        if cache is not None and cache.batch >= rows and cache.max_len >= slots:
            return
        if cache is None:
            new_rows, new_len = (1 if self.max_rows == 1 else min(self.max_rows, max(rows, 4))), slots
        else:
            new_rows = cache.batch if cache.batch >= rows else min(self.max_rows, max(rows, 2 * cache.batch))
            new_len = cache.max_len if cache.max_len >= slots else max(slots, cache.max_len + cache.max_len // 2)
        grown = self.target.new_cache(new_rows, new_len)
        used = len(self.rows)
        if cache is not None and used:
            top = max(s.state.target_cache.length for s in self.rows)
            for dst, src in ((grown.k_all, cache.k_all), (grown.v_all, cache.v_all)):
                dst[:, :used, :, :top] = src[:, :used, :, :top]
            for i, seq in enumerate(self.rows):
                view = grown.row(i)
                view.length = seq.state.target_cache.length
                seq.state.target_cache = view
        self.cache, self._view = grown, None

    def _leave(self, seq: Sequence) -> None:
        seq.wall_s = time.perf_counter() - seq.t_start
        if seq in self.joining:  # not decoding yet: a prompt being filled only leaves its row free (the last one in use)
            self.joining.remove(seq)
            seq.fill = None
            return
        i = self.rows.index(seq)
        last = self.rows.pop()
        if last is not seq:  # the last row moves into the freed row
            self._move(len(self.rows), i, last.state.target_cache.length)
            view = self.cache.row(i)
            view.length = last.state.target_cache.length
            last.state.target_cache = view
            self.rows[i] = last

    def _move(self, src: int, dst: int, length: int) -> None:
        for buf in (self.cache.k_all, self.cache.v_all):
            buf[:, dst, :, :length] = buf[:, src, :, :length]

    def _batch_view(self) -> KVCache:
        rows = len(self.rows)
        if self._view is None or self._view[0] != rows:
            self._view = (rows, self.cache.rows(0, rows))
        return self._view[1]

    # ---- one step --------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Prefill chunks of joining sequences, then one step for every row; returns the sequences that finished
        (they have left the batch)."""
        done = [s for s in self.rows + self.joining if s.finished]  # cancelled between steps
        for seq in done:
            self._leave(seq)
        begin = time.perf_counter()
        done += self._prefill()
        filled = time.perf_counter()
        _PHASES["prefill_s"] += filled - begin
        if not self.rows:
            return done
        done += self._decode()
        _PHASES["decode_s"] += time.perf_counter() - filled
        _PHASES["steps"] += 1
        return done

    def _decode(self) -> list[Sequence]:
        """One decoding step of every row: drafts, one forward, verification, commits; returns the rows that finished
        (they have left the batch)."""
        done, rows = [], self.rows
        proposals, seconds, budgets = self._proposals(rows)
        width = 1 + max(p.size for p in proposals)
        results = verify_step(
            [s.state for s in rows],
            [s.drafter for s in rows],
            proposals,
            seconds,
            self._batch_view() if len(rows) > 1 else None,
            self.workspace,
        )
        if self.cost is not None:
            self.cost.observe(len(rows), width, results[0].record.verify_s)
            self._gates(rows, results, width)
        for seq, res, budget in zip(list(rows), results, budgets, strict=True):
            res.record.k = budget
            res.record.looked = seq.looked and res.record.drafted > 0  # the width choice may have cut the chain to nothing
            own = 0 if seq.looked else res.record.drafted  # the drafter's own drafts (a looked-up chain is not)
            seq.acceptance.observe(own, res.num_accepted)
            if seq.looked:
                seq.look_acceptance.observe(res.record.drafted, res.num_accepted)
            elif budget:
                seq.declined = not own
            if res.proposal.kind is not None and res.record.drafted:
                seq.kind_acceptance(res.proposal.kind).observe(res.record.drafted, res.num_accepted)
            if not seq.looked:
                self._learn_cost(seq, res.record, own)
            seq.drafted_own = own > 0
            seq.unfed = len(res.committed) + (0 if own else seq.unfed)
            if res.proposal.tree is not None and res.record.drafted:
                seq.tree_gain.observe(res.proposal.size, res.num_accepted)
            seq.steps.append(res.record)
            seq.commit(res.committed)
            if seq.finished:
                self._leave(seq)
                done.append(seq)
        return done

    @staticmethod
    def _learn_cost(seq: Sequence, record, drafted: int) -> None:
        """What ``seq``'s drafter's proposal of ``drafted`` tokens cost (``record.draft_s``) tells its draft cost."""
        # a proposal's CUDA graph captures happen once per shape: what a draft costs from now on leaves them out;
        # and only a proposal that follows a drafting step tells what drafting step after step costs: the first
        # after plain steps (a probe, a request's first) also fed the drafter everything they committed (a model
        # drafter's lazy catch-up: 3-9 ms for EAGLE's head here, against 1 ms a step while it drafts)
        own = record.draft_s - seq.captured_s
        if seq.drafted_own:
            seq.draft_cost.observe(drafted, max(0.0, own))
        elif drafted and record.catch_up_s is not None:  # the drafter marked where its catch-up ended
            seq.draft_cost.observe(drafted, max(0.0, own - record.catch_up_s))
            seq.draft_cost.observe_catch_up(seq.fed_next, record.catch_up_s)
        elif drafted:  # what catching up on the tokens of plain steps (or the prompt) cost beyond it
            seq.draft_cost.observe_catch_up(seq.fed_next, own - seq.draft_cost(drafted))

    def _proposals(self, rows: list[Sequence]) -> tuple[list[Proposal], list[float], list[int]]:
        """Each row's drafts for this step (with the seconds they took and the draft budget the row had): its
        fixed k, or what the goodput choice of width leaves it."""
        caps = [s.step_k() for s in rows]
        if self.cost is None or not any(s.adaptive for s in rows):
            pairs = [self._propose(s, k) for s, k in zip(rows, caps, strict=True)]
            return [p for p, _ in pairs], [t for _, t in pairs], caps
        return self._adaptive_proposals(rows, caps)

    def _adaptive_proposals(self, rows: list[Sequence], caps: list[int]):
        """Model-free drafters propose first (their proposals are nearly free); then the width is chosen from
        what every row offers; model-based drafters then draft only up to it, and longer chains are cut."""
        early = {}
        plans = []
        for s, cap in zip(rows, caps, strict=True):
            model_free = s.drafter.model_free
            s.glanced = model_free and cap > 0 and s.adaptive and not s.gate.proposes  # its proposals cost more than they save
            s.looked = False
            if model_free and cap > 0:
                early[id(s)] = self._propose(s, cap if s.glance or not s.glanced else 0, glance=s.glanced)
                s.lookahead = [] if s.glanced or not s.adaptive else s.drafter.lookahead(s.state, cap)
                p = early[id(s)][0]
                avail, alpha = p.size, (s.acceptance.alpha if p.kind is None else s.kind_acceptance(p.kind).alpha)
                # a tree's accepted drafts: the drafter's own estimate where it gives one (the hybrid's, calibrated per
                # source: its trees' worth does not follow their size), else the record of its trees of that size
                tree_gain = (s.tree_gain(p.size) if p.expected is None else p.expected) if p.tree is not None else None
            else:
                avail, alpha, tree_gain = cap, s.acceptance.alpha, None
                if s.drafter.tree is not None and cap > 0:
                    avail = s.drafter.max_nodes(cap)
                    tree_gain = s.tree_gain(avail)
            draft_cost = 0.0 if model_free else s.draft_cost
            plan = RowPlan(avail=avail, alpha=alpha, fixed=not s.adaptive, draft_cost=draft_cost, tree_gain=tree_gain)
            looks = not model_free and s.glance and s.adaptive and cap > 0 and self._chains_may_pay(len(rows), cap)
            plans.append(self._look(s, cap, plan, early) if looks else plan)
        width = choose_width(plans, self.cost, self.max_step_tokens)
        due = [s.adaptive and s.acceptance.due and plan.avail > 0 and not s.looked for s, plan in zip(rows, plans, strict=True)]
        if any(due) and width == 1:  # probe only where drafts would pay if they were accepted again, not under load
            hopeful = [dataclasses.replace(p, alpha=max(p.alpha, PROBE_ALPHA)) if d else p for p, d in zip(plans, due, strict=True)]
            pays = choose_width(hopeful, self.cost, self.max_step_tokens) > 1  # one choice for every due row (not one each)
            due = [d and pays for d in due]
        pairs, budgets = [], []
        for s, cap, plan, probe in zip(rows, caps, plans, due, strict=True):
            budget = cap if not s.adaptive else min(cap, width - 1)
            probing = budget == 0 and cap > 0 and probe
            if probing:
                budget = min(cap, PROBE_DRAFTS)  # drafting stopped paying a while ago: try a little, to know again
            own_model = not (s.drafter.model_free or s.looked)
            blocked = bool(budget) and s.adaptive and own_model and not self._catches_up(s, plan, budget, probing)
            budget = 0 if blocked else budget
            if probing and budget:
                width = max(width, budget + 1)
            budgets.append(budget)
            if id(s) in early:
                p, t = early[id(s)]
                if p.tree is not None:
                    p = p if p.size <= width - 1 or not s.adaptive else Proposal.empty(1, p.device)
                else:
                    p = truncate(p, budget)
                pairs.append((p, t))
            elif plan.tree_gain is not None and s.adaptive:
                whole = not blocked and (plan.avail <= width - 1 or (budget > 0 and s.acceptance.due))
                pairs.append(self._propose(s, cap if whole else 0))
            else:
                pairs.append(self._propose(s, budget))
        return [p for p, _ in pairs], [t for _, t in pairs], budgets

    def _chains_may_pay(self, rows: int, cap: int) -> bool:
        """Whether a chain of up to ``cap`` drafts accepted at ``PROBE_ALPHA`` would pay in a step of ``rows`` rows: under
        load a wider step costs more than such drafts bring, and the rows' lookups (0.05 ms a row with their weighing)
        are not made at all."""
        return best_rate(RowPlan(avail=cap, alpha=PROBE_ALPHA), self.cost, rows)[1] > 1

    def _look(self, seq: Sequence, cap: int, plan: RowPlan, early: dict) -> RowPlan:
        """A model drafter's row under k=auto: prompt lookup's chain over its text (0.02 ms a step, host ints) where it
        is worth more tokens a second than what the drafter would do this step (``plan``: its drafts at its
        acceptance and draft cost; a plain step where its catch-up would not pay or it declined its last budget, as
        DEL does while its exits agree too little), judged by the row's acceptance of chains of that match length
        (``Proposal.kind``). The row then drafts the chain (``seq.looked``) and the drafter rests, catching up on
        what it missed when it next drafts. A chain that loses even to a plain step is probed as a row's drafts are
        (``seq.look_acceptance``: after idle steps, two drafts), so an estimate that fell is learnt again.
        Copying is what a model drafter drafts worst and prompt lookup best: on this CPU's 13 Spec-Bench categories
        prompt lookup ran at 1.17x AR (mean of categories) where the model drafters, whose drafts rarely pay here, ran
        at 0.97-0.98x (README run 20261129T151646-554f). ``glance=false`` turns it off (the drafter alone)."""
        if seq.lookup is None:
            seq.lookup = NgramDrafter(3, 1)
            seq.lookup.start(seq.state)
        pair = propose(seq.state, seq.lookup, cap, self.workspace.clock)
        chain = pair[0]
        if not chain.size:
            return plan
        rows = len(self.rows)
        own, width = best_rate(plan, self.cost, rows)
        if seq.declined or (width > 1 and not self._catches_up(seq, plan, width - 1, False)):
            own, width = best_rate(RowPlan(avail=0), self.cost, rows)
        look = lookup_plan(chain.size, seq.kind_acceptance(chain.kind), seq.look_acceptance, self.cost, rows, own, width == 1)
        if look is None:
            return plan
        seq.looked, early[id(seq)] = True, pair
        return look

    def _gates(self, rows: list[Sequence], results: list, width: int) -> None:
        """Tell each adaptive model-free row's :class:`ProposeGate` what its proposal saved and cost this step (no
        proposal: an idle step). In a batch of R rows a row's token is worth its share of a plain step, cost(R, 1) / R,
        and the rows that drafted share the step's widening. Under load the width is 1 whatever a row offers, so its
        proposals save nothing and the gate stops them (suffix decoding's 0.3-0.5 ms a row, paid at every step of 8
        rows, cost 13% of batched AR's decoding rate on this CPU where no step drafted; 2026-11-29)."""
        gated = [seq.drafter.model_free and seq.adaptive for seq in rows]
        if not any(gated):
            return
        n = len(rows)
        plain = self.cost(n, 1) / n
        drafting = sum(1 for r in results if r.record.drafted) or 1
        wider = (self.cost(n, width) - self.cost(n, 1)) / drafting
        for seq, res, gate in zip(rows, results, gated, strict=True):
            if not gate:
                continue
            saved = res.num_accepted * plain - wider if res.record.drafted else 0.0
            if seq.glanced:  # the gate held its proposal back and the drafter glanced: an idle step
                seq.gate.observe(False, 0.0, 0.0, plain)
            else:  # what it saved beyond what its glance would have
                saved -= self._glance_saved(seq.lookahead, res.committed, width, n, drafting)
                seq.gate.observe(res.record.draft_s > 0.0, saved, res.record.draft_s, plain)
            seq.lookahead = []

    def _glance_saved(self, chain: list[int], committed: list[int], width: int, rows: int, drafting: int) -> float:
        """What a row's glance (``chain``, :meth:`Drafter.lookahead`) would have saved at a step where it proposed in
        full: the chain's first tokens that the step committed, each a plain step, less the width of the chain as the
        step's width allowed it; never below nothing (k=auto would not have drafted it). So the gate keeps a full
        proposal only where it saves more than prompt lookup's chain, which costs 0.02 ms. Side by side in one process
        (52 Spec-Bench first turns, 2026-11-29): suffix 1.104x -> 1.123x AR, the hybrid 1.080x -> 1.096x (worst
        category 0.945x -> 0.974x); where glances that saved also reopened the gate, the hybrid gained less."""
        m = min(len(chain), width - 1)
        hits = next((i for i, (a, b) in enumerate(zip(chain[:m], committed, strict=False)) if a != b), min(m, len(committed)))
        if hits == 0:
            return 0.0
        plain = self.cost(rows, 1) / rows
        return max(0.0, hits * plain - (self.cost(rows, m + 1) - self.cost(rows, 1)) / drafting)

    def _catches_up(self, seq: Sequence, plan: RowPlan, budget: int, probing: bool) -> bool:
        """Whether ``seq``'s model drafter should catch up on the tokens it has not seen (``Sequence.unfed``) to draft
        ``budget`` tokens now: a probe only where all it costs fits ``goodput.probe_allowed`` (a share of the plain
        steps the row waited; in a batch of R rows its share of them, cost(R, 1) / R, against the widening all R rows
        pay: with one-row costs, probes at 8 rows on this CPU widened the whole batch to 3 tokens, 15 of them costing
        EAGLE 9% of batched AR's decoding rate with no draft accepted, 2026-11-29), a draft only where drafting saves
        that much over the tokens that remain (``goodput.catch_up_pays``). Nothing is known before its first catch-up:
        it drafts, and measures (a probe still pays for its drafts and its width)."""
        seconds = seq.draft_cost.catch_up(seq.fed_next)
        if probing:  # the widening is the whole batch's: every row pays the probe's width (a catch-up not measured yet: 0)
            rows = len(self.rows)
            plain = self.cost(rows, 1)
            wider = self.cost(rows, budget + 1) - plain
            return probe_allowed((seconds or 0.0) + seq.draft_cost(budget) + wider, plain / rows, seq.acceptance.idle)
        if seconds is None:
            return True
        width = plan.avail + 1 if plan.tree_gain is not None else budget + 1  # a tree is drafted whole
        return catch_up_pays(plan, self.cost, width, seq.remaining, seconds, len(self.rows))

    def _propose(self, seq: Sequence, k: int, glance: bool = False) -> tuple[Proposal, object]:
        """``seq``'s drafter's proposal of up to ``k`` drafts (``glance``: its lookup's) and when it ran
        (``step.propose``), noting the seconds it spent capturing CUDA graphs (``seq.captured_s``)."""
        before = capture_seconds()
        pair = propose(seq.state, seq.drafter, k, self.workspace.clock, glance)
        seq.captured_s = capture_seconds() - before
        return pair

    def run(self) -> None:
        while len(self):
            self.step()


def run_alone(target: ModelAdapter, seq: Sequence, cost: CostModel | None = None) -> Generation:
    """``seq`` in a batch of its own, to its end (a drafter that failed to start raises its error here)."""
    batch = Batch(target, max_rows=1, cost=cost)
    batch.add(seq)
    batch.run()
    if seq.error is not None:
        raise seq.error
    return seq.result()


def generate_many(
    target: ModelAdapter,
    sequences: list[Sequence],
    *,
    max_rows: int = 16,
    max_step_tokens: int | None = None,
    cost: CostModel | None = None,
) -> list[Generation]:
    """Run ``sequences`` through one batch of up to ``max_rows`` rows, joining as rows free up (in order)."""
    batch = Batch(target, max_rows=max_rows, max_step_tokens=max_step_tokens, cost=cost)
    for seq in sequences:
        batch.check(seq)
    waiting = list(sequences)
    while waiting or len(batch):
        while waiting and not batch.full:
            batch.add(waiting.pop(0))
        batch.step()
    return [s.result() for s in sequences]
