"""The two-sided runtime: speculative decoding with the draft model and the target model on two sides.

The draft model and the target model each live behind a *side* that owns the
model's KV cache and answers one request at a time (``VerifySide.verify``,
``DraftSide.draft``). A *schedule* is a pure state machine: it says what each
side must do next (``requests()``) and folds both answers into committed
tokens (``join()``). Nothing here knows whether a side is a local object or a
Ray actor; ``actors/`` runs the same schedules with each side in its own
worker, and ``generate_two_sided`` with ``LocalExecutor`` runs them in process
(one action after the other), which is how the tests drive them. Two
schedules: ``SequentialSchedule`` (``"sps"``) and ``PearlSchedule`` (``"pearl"``).

What is the loop's is the loop's (``decoding/loop/``): its invariant (the
target cache holds every committed token but the last one, "pending"), its
context check (``check_context``), its prefill (``prefill``, ``fill``), its
verification rule (``verify``, ``committed_by``) and its output (``Output``:
the commit rule that cuts after EOS and stops at max_new_tokens or when
``on_step`` says so, and the stats record). This module adds only what two
sides need: the messages between them, the sides, and the schedules.

PEARL (Liu et al. 2024, "Parallel Speculative Decoding with Adaptive Draft
Length"), as scheduled here. ``D`` is the list of drafted tokens that follow
``pending`` and have not been verified yet; the mode is ``pre-verify`` when
``D`` is empty and ``post-verify`` otherwise. Every round both sides work at
the same time:

- target: one forward over ``[pending, D]`` and the verdict on ``D``
  (pre-verify: just ``[pending]``, which yields the distribution that checks
  the first new draft);
- draft: extends ``committed + D`` by ``gamma`` new drafts ``X``, assuming all
  of ``D`` is accepted.

Join: if a token of ``D`` is rejected, commit the accepted prefix plus the
target's correction and throw ``X`` away (the draft rolls back; next round is
pre-verify). If all of ``D`` is accepted, the target's distribution after
``D`` checks ``X[0]`` (greedy: equal to the argmax; sampling: the
speculative-sampling rule with one draft). Accepted: commit ``D + [X[0]]`` and
``X[1:]`` becomes the next ``D`` (post-verify: the draft keeps drafting while
the target verifies). Rejected: commit ``D`` and the target's token; next
round is pre-verify.

So a draft run lasts as long as its tokens keep being accepted (PEARL's
adaptive draft length: segments of ``gamma`` are chained while the target
agrees, and cut at the first rejection), and a rejected first draft costs a
one-token target forward that ran in parallel with the drafting.

Worked example (greedy, gamma=3, target continues a b c d e f ...):

>>> t = _ScriptedTarget("abcdefgh")
>>> d = _ScriptedDraft(["bcx", "zzz", "efg"])   # what the draft proposes at each call
>>> out = generate_two_sided(LocalExecutor(t, d), [[0]], schedule="pearl", k=3, max_new_tokens=8)
>>> "".join(map(chr, out.token_ids))   # 'a' comes from the prefill
'abcdefgh'
>>> [r.mode for r in out.rounds]   # b accepted -> c ok, x rejected (zzz dropped) -> e ok -> f g ok
['pre-verify', 'post-verify', 'pre-verify', 'post-verify']

The sequential schedule (``schedule="sps"``) is ordinary SpS split over the
same two sides: the draft drafts k tokens, then the target verifies them; the
Ray executor chains the two calls so the drafts go straight from the draft
worker to the target worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from decoding.drafters.base import DecodeState, Drafter, Proposal
from decoding.drafters.draft_model import DraftModelDrafter
from decoding.drafters.ngram import SuffixIndex
from decoding.loop.goodput import Acceptance, RoundGate, RowPlan, best_rate, lookup_plan
from decoding.loop.metrics import StepRecord
from decoding.loop.output import Generation, Output, StepCallback
from decoding.loop.prefill import check_context, fill, prefill
from decoding.loop.step import committed_by, verify
from decoding.loop.verify import verify_speculative
from decoding.methods import TWO_SIDED_SCHEDULES as SCHEDULES
from decoding.model.adapter import KVCache, ModelAdapter
from decoding.model.costs import CostModel
from decoding.sampling import GREEDY, SamplingParams, warp

# ---- the messages between a schedule and the two sides --------------------------------------


@dataclass
class KVBlock:
    """The target's exact keys and values of positions start .. start + t - 1, every layer (``KVCache.export``)."""

    start: int
    keys: torch.Tensor  # [L, 1, H, t, D]
    values: torch.Tensor


@dataclass
class VerifyRequest:
    start: int  # cache slot of the pending token (committed length - 1)
    ids: list[int]  # [pending, d_1 .. d_j]
    probs: torch.Tensor | None = None  # [1, j, V] q rows of d_1..d_j (sampling with a model draft only)
    want_p: bool = False  # return the warped p after d_j when all j are accepted (PEARL sampling)
    want_kv: bool = False  # return the KV the cache keeps of this forward (a draft side that reads the target's cache)


@dataclass
class VerifyResult:
    num_accepted: int  # m of the j drafts in the request (plus any chained from a DraftResult)
    tokens: list[int]  # the m + 1 tokens the verdict commits: accepted drafts, then the target's token
    drafted: int  # j
    p_last: torch.Tensor | None = None  # [1, V] warped target distribution after d_j (only all-accepted + want_p)
    compute_s: float = 0.0
    draft_compute_s: float = 0.0  # when the drafts came chained from the draft side (sequential schedule)
    kv: KVBlock | None = None  # want_kv: the KV of pending + the m accepted drafts


@dataclass
class RunRequest:
    """The target side decodes alone (k=auto found that the draft side's drafts do not pay): up to ``budget`` tokens
    after the pending one at cache slot ``start``, ending after a ``stop`` token. Each step verifies prompt lookup's
    chain over the committed text (up to ``lookup`` drafts; 0: plain steps) where it is worth its width."""

    start: int
    pending: int
    budget: int
    stop: tuple[int, ...] = ()
    lookup: int = 0
    threads: int | None = None  # torch threads for the run (the resting draft worker's cores too, on one CPU node)


@dataclass
class RunResult:
    tokens: list[int]  # every token the run committed (the last one is the new pending token)
    steps: list[StepRecord]  # one per target forward
    compute_s: float = 0.0


@dataclass
class DraftRequest:
    keep: int  # how many tokens of the draft side's sequence are still valid
    append: list[int]  # tokens that follow them (committed by the last verdict)
    k: int  # drafts to propose after keep + append (0 = only sync)
    kv: KVBlock | None = None  # the target's exact KV of tokens committed by the last verdict (hierarchical draft sides)


@dataclass
class DraftResult:
    tokens: list[int]  # x_1 .. x_j, j <= k
    probs: torch.Tensor | None = None  # [1, j, V] q rows (sampling only)
    compute_s: float = 0.0


# ---- the two sides: thin owners of a model adapter and its cache ---------------------------


@contextmanager
def torch_threads(threads: int | None):
    """torch's intra-op threads set to ``threads`` inside (None: unchanged), restored after."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if threads:
            torch.set_num_threads(before)


class VerifySide:
    """The target model and its cache: prefills and verifies with the loop's own rule (``decoding.loop.step.verify``)."""

    def __init__(self, adapter: ModelAdapter, sampling: SamplingParams = GREEDY, cost: Callable[[], CostModel] | None = None):
        """``cost``: the target's forward cost by width (``decoding.model.costs.forward_costs``), asked for at the first
        run that may look up; without it a run's steps are plain."""
        self.adapter = adapter
        self.sampling = sampling
        self.cache: KVCache | None = None
        self.generator = torch.Generator(device=adapter.device)
        self.history: list[int] = []  # the committed tokens, prompt first (the last one: pending, not in the cache)
        self._cost_of = cost
        self._index: SuffixIndex | None = None  # prompt lookup over ``history`` (runs)
        self.acceptance_of: dict[int, Acceptance] = {}  # looked-up chains' acceptance by match length, kept across requests
        self.look_clock = Acceptance()  # the chains' probe clock

    def prefill(
        self, prompt: list[int], max_len: int, seed: int = 0, sampling: SamplingParams | None = None, threads: int | None = None
    ) -> tuple[int, float]:
        """Fill the cache with the prompt; return (first new token, compute seconds). Starts a generation. ``threads``:
        torch threads for it (the draft side's cores too, where it defers its own prefill) and for the runs after it, whose
        forward costs are measured at the first prefill on them."""
        t0 = time.perf_counter()
        a = self.adapter
        self.generator.manual_seed(seed)
        self.sampling = sampling or self.sampling
        ids = torch.tensor([prompt], dtype=torch.long, device=a.device)
        self.cache = a.new_cache(1, max_len)
        with torch_threads(threads):
            first, _ = prefill(a, self.cache, ids, self.sampling, self.generator)
            if self._cost_of is not None:  # measured (once a process) here, not inside a run whose time k=auto weighs
                self._cost_of()
        self.history, self._index = list(prompt), None
        return int(first[0, 0]), time.perf_counter() - t0

    def verify(self, req: VerifyRequest, chained: DraftResult | None = None) -> VerifyResult:
        """One forward over [pending, drafts] at ``req.start``; the cache keeps pending + accepted drafts.

        ``chained``: drafts handed over directly by the draft side (sequential
        schedule); they are appended to ``req.ids`` and their q rows used.
        """
        t0 = time.perf_counter()
        a, dev = self.adapter, self.adapter.device
        ids, probs = list(req.ids), req.probs
        if chained is not None and chained.tokens:
            ids += chained.tokens
            probs = chained.probs
        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)  # [1, j+1]
        logits = a.logits(a.forward(self.cache, req.start, input_ids=input_ids))  # [1, j+1, V]
        proposal = Proposal(tokens=input_ids[:, 1:], probs=None if probs is None else probs.to(dev))
        m, tokens = committed_by(verify(proposal, logits, self.sampling, self.generator))
        j = len(ids) - 1
        self.cache.rollback(req.start + 1 + m)
        p_last = None
        if req.want_p and m == j and not self.sampling.greedy:
            p_last = warp(logits[:, -1], self.sampling).cpu()
        kv = KVBlock(req.start, *self.cache.export(req.start, req.start + 1 + m)) if req.want_kv else None
        self.history[req.start :] = ids[:1] + tokens
        return VerifyResult(
            num_accepted=m,
            tokens=tokens,
            drafted=j,
            p_last=p_last,
            compute_s=time.perf_counter() - t0,
            draft_compute_s=chained.compute_s if chained is not None else 0.0,
            kv=kv,
        )

    def run(self, req: RunRequest) -> RunResult:
        """Decode alone from ``req.pending``: verify steps (:meth:`verify`) of the looked-up chain where it pays, else of
        the pending token alone, until ``req.budget`` tokens are committed or a stop token is. Spares the transport of
        a round a token while the draft side rests: on this CPU a plain round over two workers cost 8.9 ms, 2.1 of them
        transport, for one token."""
        t0 = time.perf_counter()
        with torch_threads(req.threads):
            cost = self._cost_of() if req.lookup and self._cost_of is not None else None  # at the run's threads
            tokens, steps = self._run(req, cost)
        return RunResult(tokens, steps, time.perf_counter() - t0)

    def _run(self, req: RunRequest, cost: CostModel | None) -> tuple[list[int], list[StepRecord]]:
        start, pending, tokens, steps = req.start, req.pending, [], []
        self.history[start:] = [pending]  # each verify keeps it so: the committed text, pending last
        while len(tokens) < req.budget and not (tokens and tokens[-1] in req.stop):
            chain = self._chain(min(req.lookup, req.budget - len(tokens) - 1), cost)
            res = self.verify(VerifyRequest(start, [pending, *chain]))
            if chain:
                self.look_clock.observe(res.drafted, res.num_accepted)
                self.acceptance_of[self._index.matched].observe(res.drafted, res.num_accepted)
            steps.append(StepRecord(res.drafted, res.num_accepted, 0.0, res.compute_s, looked=bool(chain)))
            cut = next((i + 1 for i, t in enumerate(res.tokens) if t in req.stop), len(res.tokens))
            tokens += res.tokens[:cut]
            start, pending = start + len(res.tokens), res.tokens[-1]
        return tokens, steps

    def _chain(self, cap: int, cost: CostModel | None) -> list[int]:
        """Prompt lookup's chain after the pending token (the last of ``history``), cut to the width that pays at its match length's
        acceptance (``goodput.lookup_plan``); [] where no chain pays, or no ``cost`` says what one would cost."""
        if cap <= 0 or cost is None:
            return []
        seq = self.history  # the committed text, pending last (``_run`` and ``verify`` keep it so)
        if self._index is None or self._index.length > len(seq):
            self._index = SuffixIndex(1, 3)
        self._index.extend(seq)
        chain = self._index.continuation(seq, cap)
        if not chain:
            return []
        acceptance = self.acceptance_of.setdefault(self._index.matched, Acceptance())
        plan = lookup_plan(len(chain), acceptance, self.look_clock, cost, 1, best_rate(RowPlan(avail=0), cost)[0])
        return [] if plan is None else chain[: best_rate(plan, cost)[1] - 1]


class DraftSide:
    """A drafter and the token sequence its state was built from; answers ``DraftRequest``s.

    ``drafter``: a ``DraftModelDrafter`` (PEARL, two-actor SpS), or a drafter
    that reads the target and its cache, TriForce's middle level; ``target``
    is then this side's copy of the target model, whose cache the side fills
    with the prompt and afterwards with the exact KV the verifier ships in each
    request (``DraftRequest.kv``), so the middle level sees what it would in one
    process without running the full target itself.

    Drafts are kept provisionally (the drafter keeps every fed draft) so that a
    chained draft run (PEARL post-verify) continues without refeeding; a
    request's ``keep`` then cuts the sequence back to what the verdict kept.
    """

    def __init__(self, drafter: Drafter, sampling: SamplingParams = GREEDY, target: ModelAdapter | None = None):
        self.drafter, self.target = drafter, target
        self.device = (target or drafter.adapter).device
        self.state: DecodeState | None = None
        self.tokens: list[int] = []  # the sequence behind the drafter's state: committed + provisional drafts
        self.started = False
        self.generator = torch.Generator(device=self.device)
        self.sampling = sampling

    @classmethod
    def of_model(cls, adapter: ModelAdapter, sampling: SamplingParams = GREEDY, confidence_threshold: float = 0.0) -> DraftSide:
        """The plain draft side: a draft model (or the target's first layers) with its own cache."""
        return cls(DraftModelDrafter(adapter, confidence_threshold), sampling)

    def prefill(self, prompt: list[int], max_len: int, seed: int = 0, sampling: SamplingParams | None = None, defer: bool = False) -> float:
        """Start a generation. ``defer``: a draft model fills nothing now (the target prefills on the cores of both
        sides) and catches up on the prompt in its first draft request; a side over the target fills its cache now."""
        t0 = time.perf_counter()
        self.generator.manual_seed(seed)
        self.sampling = sampling or self.sampling
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        self.state = DecodeState(ids, self.target, None, self.sampling, self.generator, max_len)
        self.tokens = list(prompt)
        if self.target is not None:
            # this side's full cache of the prompt; the drafter starts at the first request, which brings the pending token
            self.state.target_cache = self.target.new_cache(1, max_len)
            fill(self.target, self.state.target_cache, ids)
            self.started = False
        elif defer:  # a draft model, later: its first request starts it over the whole prompt
            self.started = False
        else:  # a draft model: prefill its cache now, beside the target's prefill
            self.drafter.start(self.state)
            fill(self.drafter.adapter, self.drafter.cache, ids)
            self.started = True
        return time.perf_counter() - t0

    def draft(self, req: DraftRequest) -> DraftResult:
        t0 = time.perf_counter()
        if req.keep > len(self.tokens):
            raise ValueError(f"keep={req.keep} beyond the draft sequence of {len(self.tokens)} tokens")
        if req.kv is not None and self.state.target_cache is not None:
            self.state.target_cache.write(req.kv.start, req.kv.keys, req.kv.values)
        seq = self.tokens[: req.keep] + list(req.append)
        self.tokens = seq
        self.state.tokens = torch.tensor([seq], dtype=torch.long, device=self.device)
        if not self.started:
            self.drafter.start(self.state)
            self.started = True
        # state past `keep` belongs to rejected drafts; at least the last token must be (re)fed to get logits
        self.drafter.truncate(min(req.keep, len(seq) - 1))
        if req.k <= 0:
            return DraftResult(tokens=[], compute_s=time.perf_counter() - t0)
        proposal = self.drafter.propose(self.state, req.k)
        drafts = proposal.tokens[0].tolist()
        self.tokens = seq + drafts
        # as if every draft were committed: the drafter keeps all it fed; the next request's `keep` cuts back
        self.state.tokens = torch.tensor([self.tokens], dtype=torch.long, device=self.device)
        self.drafter.update(self.state, len(drafts))
        probs = None if proposal.probs is None else proposal.probs.cpu()
        return DraftResult(tokens=drafts, probs=probs, compute_s=time.perf_counter() - t0)

    def level_stats(self) -> dict:
        """A hierarchical drafter's lower levels in the latest generation (``TriForceDrafter.level_stats``); else {}."""
        return self.drafter.level_stats() if hasattr(self.drafter, "level_stats") and self.started else {}


# ---- schedules: pure state machines ---------------------------------------------------------


@dataclass
class RoundRecord:
    """Timing of one round as the driver saw it (``wall_s``) and as each side measured its compute."""

    mode: str  # "pre-verify" | "post-verify" | "sequential"
    wall_s: float
    target_s: float
    draft_s: float
    parallel: bool

    @property
    def overhead_s(self) -> float:
        """Driver round trip minus compute: what the transport (RPC, serialisation) costs."""
        compute = max(self.target_s, self.draft_s) if self.parallel else self.target_s + self.draft_s
        return max(0.0, self.wall_s - compute)


RUN_WIDTHS = (1, 2, 3, 4, 5)  # the widths a target worker times for its runs' lookups (``forward_costs``: seconds, once)
RUN_TOKENS = 16  # the most tokens the target side decodes alone in one call: what a stream receives at once (~0.1 s here)


class Schedule:
    """What both schedules keep besides the loop's ``Output``: the committed length, the pending token, the draft
    side's next sync and the round records. ``out`` commits (EOS, max_new_tokens, ``on_step``) and records steps."""

    parallel = False

    def __init__(self, out: Output, prompt_len: int, k: int, sampling=GREEDY, generator=None, ship_kv=False, gate=None):
        """``out`` holds the prefill's first token, already committed. ``gate``: a :class:`RoundGate` that says, round
        by round, whether drafting pays (k=auto); None drafts ``k`` every round."""
        self.out = out
        self.k = k
        self.gate: RoundGate | None = gate
        self.ship_kv = ship_kv  # pass the target's KV of each verdict's tokens on to the draft side (TriForce over actors)
        self.kv: KVBlock | None = None  # the latest verdict's KV, for the next draft request
        self.sampling = sampling
        self.generator = generator
        self.n = prompt_len + len(out.new)  # committed length; token n-1 is pending
        self.pending = out.new[-1]
        self.draft_keep, self.draft_append = prompt_len, list(out.new)  # the draft side's next sync
        self.rounds: list[RoundRecord] = []

    @property
    def finished(self) -> bool:
        return self.out.finished

    @property
    def settled(self) -> bool:
        """No drafts wait for their verdict (PEARL's post-verify holds some)."""
        return True

    def _gamma(self, most: int) -> int:
        """Drafts to ask for this round: ``k``, within ``most`` (what can still be committed), none while the gate
        says drafting does not pay."""
        return 0 if self.gate is not None and not self.gate.drafts else max(0, min(self.k, most))

    def run_request(self, stop: tuple[int, ...], lookup: int, threads: int | None = None) -> RunRequest | None:
        """Where the gate says drafting does not pay, a run of the target side alone (the draft side rests and catches
        up when it next drafts) up to the gate's next probe, at most ``RUN_TOKENS``; else None (a round). Not where the
        draft side reads each verdict's KV (TriForce over actors), nor with drafts still to verify (PEARL)."""
        gate = self.gate
        if gate is None or gate.drafts or self.ship_kv or not self.settled:
            return None
        budget = min(RUN_TOKENS, gate.until_probe, self.out.remaining)
        return RunRequest(self.n - 1, self.pending, budget, stop, lookup, threads)

    def join_run(self, r: RunResult) -> list[int]:
        """Fold a run: its tokens are committed; the draft side gets them with its next request."""
        self.out.steps.extend(r.steps)
        committed = self._commit(r.tokens)
        self.draft_append = self.draft_append + committed
        return committed

    def _requests(self, ids: list[int], k: int, probs=None, want_p=False) -> tuple[VerifyRequest, DraftRequest]:
        treq = VerifyRequest(start=self.n - 1, ids=ids, probs=probs, want_p=want_p, want_kv=self.ship_kv)
        return treq, DraftRequest(keep=self.draft_keep, append=self.draft_append, k=k, kv=self.kv)

    def _commit(self, tokens: list[int]) -> list[int]:
        """Commit a round's tokens through the loop's rule; returns what was committed."""
        before = len(self.out.new)
        self.out.commit(tokens)
        committed = self.out.new[before:]
        self.n += len(committed)
        if committed:
            self.pending = committed[-1]
        return committed


class SequentialSchedule(Schedule):
    """SpS over two sides: draft k, then verify them (the draft result is chained into the target request)."""

    mode = "sequential"

    def requests(self) -> tuple[VerifyRequest, DraftRequest]:
        return self._requests([self.pending], self._gamma(self.out.remaining - 1))  # never more than can be committed

    def join(self, t: VerifyResult, d: DraftResult | None = None) -> list[int]:
        m, n_before, self.kv = t.num_accepted, self.n, t.kv
        self.out.steps.append(StepRecord(drafted=t.drafted, accepted=m, draft_s=t.draft_compute_s, verify_s=t.compute_s))
        # the draft sequence was committed + drafts; its first n_before + m tokens survive the verdict
        self.draft_keep, self.draft_append = n_before + m, [t.tokens[m]]
        return self._commit(t.tokens)


class PearlSchedule(Schedule):
    """PEARL's pre-verify / post-verify schedule (see the module docstring); ``k`` is PEARL's gamma."""

    parallel = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.unverified: list[int] = []  # D
        self.unverified_q: torch.Tensor | None = None  # [1, |D|, V] (sampling)
        self.counts = {"pre_verify_rounds": 0, "post_verify_rounds": 0, "first_draft_checks": 0, "first_draft_accepted": 0}

    @property
    def mode(self) -> str:
        return "post-verify" if self.unverified else "pre-verify"

    @property
    def settled(self) -> bool:
        return not self.unverified

    def requests(self) -> tuple[VerifyRequest, DraftRequest]:
        j = len(self.unverified)
        # this round commits at most j + 1 tokens; drafts past what can ever be committed are wasted work
        gamma = self._gamma(self.out.remaining - j - 1)
        return self._requests([self.pending, *self.unverified], gamma, self.unverified_q, not self.sampling.greedy and gamma > 0)

    def join(self, t: VerifyResult, d: DraftResult) -> list[int]:
        D, j, m, n_before, self.kv = self.unverified, len(self.unverified), t.num_accepted, self.n, t.kv
        self.counts["post_verify_rounds" if j else "pre_verify_rounds"] += 1
        self.out.steps.append(StepRecord(drafted=j, accepted=m, draft_s=d.compute_s, verify_s=t.compute_s))
        X = d.tokens
        self.unverified, self.unverified_q = [], None
        if m < j or not X:
            # a draft in D was rejected (or nothing new was drafted): the verdict stands, X is discarded
            self.draft_keep, self.draft_append = n_before + m, [t.tokens[m]]
            return self._commit(t.tokens)
        # all of D accepted: the target's distribution after D checks the first new draft X[0]
        self.counts["first_draft_checks"] += 1
        ok, token = self._check_first(X[0], t, d)
        if ok:
            self.counts["first_draft_accepted"] += 1
            self.unverified = X[1:]
            self.unverified_q = None if d.probs is None else d.probs[:, 1:]
            self.draft_keep, self.draft_append = n_before + j + len(X), []
        else:
            self.draft_keep, self.draft_append = n_before + j, [token]
        committed = self._commit([*D, token])
        if self.finished:
            self.unverified, self.unverified_q = [], None
        return committed

    def _check_first(self, x1: int, t: VerifyResult, d: DraftResult) -> tuple[bool, int]:
        """Verify one draft against the target's distribution after D: (accepted, token to commit)."""
        if self.sampling.greedy:
            target_token = t.tokens[-1]  # the argmax after D
            return x1 == target_token, target_token
        p = t.p_last.unsqueeze(1)  # [1, 1, V]
        q = None if d.probs is None else d.probs[:, :1]  # [1, 1, V]
        u_accept = torch.rand(1, 1, generator=self.generator)
        u_sample = torch.rand(1, generator=self.generator)
        # the rule wants k+1 target rows; the row after x1 is never used (no bonus draw after x1 here)
        verdict = verify_speculative(torch.tensor([[x1]]), q, torch.cat([p, p], 1), u_accept, u_sample)
        accepted = int(verdict.num_accepted[0]) == 1
        return accepted, x1 if accepted else int(verdict.tokens[0, 0])


# ---- executors and the driver loop ------------------------------------------------------------


@dataclass
class TwoSidedGeneration(Generation):
    rounds: list[RoundRecord] = field(default_factory=list)
    schedule_counts: dict = field(default_factory=dict)  # rounds without drafts; PEARL: rounds per mode, first-draft checks


class LocalExecutor:
    """Runs both sides in this process, one action after the other (tests, and the reference for the actors)."""

    def __init__(self, target, draft):
        self.target, self.draft = target, draft

    def prefill(self, prompt: list[int], max_len: int, seed: int, sampling: SamplingParams = GREEDY, threads: int | None = None) -> int:
        """Both sides' prefills; ``threads``: the target's on them, the draft model's deferred to its first draft."""
        self.draft.prefill(prompt, max_len, seed + 1, sampling, defer=threads is not None)
        return self.target.prefill(prompt, max_len, seed, sampling, threads)[0]

    def run(self, req: RunRequest) -> RunResult:
        return self.target.run(req)

    def step(self, treq: VerifyRequest, dreq: DraftRequest, parallel: bool) -> tuple[VerifyResult, DraftResult | None]:
        if parallel:
            return self.target.verify(treq), self.draft.draft(dreq)
        return self.target.verify(treq, self.draft.draft(dreq)), None


def make_schedule(name: str, *args, **kwargs) -> Schedule:
    if name == "pearl":
        return PearlSchedule(*args, **kwargs)
    if name == "sps":
        return SequentialSchedule(*args, **kwargs)
    raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")


def _run_alone(executor, sched: Schedule, run: RunRequest, alone: dict) -> None:
    """One run of the target side alone: its tokens committed, its time told to the gate, counted in ``alone``."""
    t0 = time.perf_counter()
    r = executor.run(run)
    wall = time.perf_counter() - t0
    committed = sched.join_run(r)
    alone["calls"], alone["tokens"] = alone["calls"] + 1, alone["tokens"] + len(committed)
    alone["looked_up"] += sum(step.accepted for step in r.steps)
    sched.gate.observe(False, len(committed), wall)
    sched.rounds.append(RoundRecord("alone", wall, r.compute_s, 0.0, False))


def generate_two_sided(
    executor,
    prompt_ids,  # [1, T] tensor or nested list
    *,
    schedule: str = "pearl",
    k: int = 4,
    sampling: SamplingParams = GREEDY,
    max_new_tokens: int = 128,
    eos_token_ids=(),
    seed: int = 0,
    max_context: int | None = None,
    on_step: StepCallback | None = None,
    ship_kv: bool = False,
    adaptive: bool = False,
    runs: bool = True,
    glance: bool = True,
    run_threads: int | None = None,
    gate: RoundGate | None = None,
) -> TwoSidedGeneration:
    """Generate with a two-sided schedule; ``executor`` runs the requests (``LocalExecutor`` or an actor executor).

    ``on_step`` receives each round's committed tokens, as in the loop: returning a string stops the generation
    with that finish reason. ``ship_kv``: the draft side reads the target's cache (TriForce's middle level): each
    verdict's KV goes to it. ``adaptive``: k=auto, a :class:`RoundGate` turns drafting off in the rounds where it does
    not pay and probes now and then whether it pays again (``k`` stays the draft length while it drafts); ``gate``: the
    one to use, carrying what earlier generations learnt (a new one if None). ``runs``:
    there, the target side decodes alone for several tokens a call (:meth:`VerifySide.run`; False: one plain round a
    token, both sides called), verifying prompt lookup's chains of up to ``k`` drafts where they pay (``glance``), on
    ``run_threads`` torch threads (None: the side's own). ``run_threads`` also prefills the target on them, the draft
    model then catching up on the prompt when it first drafts (both sides share those cores).

    Seeds: target side ``seed``, draft side ``seed + 1``, the schedule's own
    draws (PEARL's first-draft check) ``seed + 2``.
    """
    prompt = torch.as_tensor(prompt_ids).tolist()
    if len(prompt) != 1:
        raise ValueError(f"two-sided schedules run batch size 1 for now, got {len(prompt)}")
    prompt = prompt[0]
    if not prompt:
        raise ValueError("empty prompt")
    if max_context is not None:
        check_context(len(prompt), max_new_tokens, max_context)
    max_len = len(prompt) + max_new_tokens + 2 * k + 2  # PEARL's draft runs up to 2k past the committed tokens
    out = Output(max_new_tokens, eos_token_ids, on_step)
    out.t_start = time.perf_counter()
    run_threads = None if ship_kv else run_threads  # a draft side over the target's KV fills its cache with the prompt now
    first = executor.prefill(prompt, max_len, seed, sampling, run_threads)
    out.prefill_s = time.perf_counter() - out.t_start
    out.commit([first])
    gen = torch.Generator().manual_seed(seed + 2)
    sched = make_schedule(schedule, out, len(prompt), k, sampling, gen, ship_kv, (gate or RoundGate()) if adaptive else None)
    plain = 0  # rounds that neither drafted nor verified a draft (k=auto found drafting did not pay)
    alone = {"calls": 0, "tokens": 0, "looked_up": 0}  # the target side's runs alone: calls, tokens, accepted lookups
    stop, lookup = tuple(eos_token_ids), (k if glance else 0)
    while not out.finished:
        run = sched.run_request(stop, lookup, run_threads) if runs else None
        if run is not None:
            _run_alone(executor, sched, run, alone)
            continue
        mode = sched.mode
        treq, dreq = sched.requests()
        t0 = time.perf_counter()
        t, d = executor.step(treq, dreq, sched.parallel)
        wall = time.perf_counter() - t0
        committed = sched.join(t, d)
        drafted = len(treq.ids) > 1 or dreq.k > 0
        plain += not drafted
        if sched.gate is not None:
            sched.gate.observe(drafted, len(committed), wall)
        draft_s = d.compute_s if d is not None else t.draft_compute_s
        sched.rounds.append(RoundRecord(mode, wall, t.compute_s, draft_s, sched.parallel))
    out.wall_s = time.perf_counter() - out.t_start
    g = out.result()
    counts = dict(getattr(sched, "counts", {}), plain_rounds=plain, alone=alone)
    return TwoSidedGeneration(g.token_ids, g.finish_reason, g.stats, g.steps, rounds=sched.rounds, schedule_counts=counts)


def round_summary(rounds: list[RoundRecord]) -> dict:
    """Mean per-round figures in milliseconds: driver round trip, each side's compute, transport overhead."""
    if not rounds:
        return {"rounds": 0}
    n = len(rounds)
    return {
        "rounds": n,
        "round_ms": 1e3 * sum(r.wall_s for r in rounds) / n,
        "target_compute_ms": 1e3 * sum(r.target_s for r in rounds) / n,
        "draft_compute_ms": 1e3 * sum(r.draft_s for r in rounds) / n,
        "overhead_ms": 1e3 * sum(r.overhead_s for r in rounds) / n,
    }


# ---- scripted sides for the doctest and unit tests --------------------------------------------


@dataclass
class _ScriptedTarget:
    """A target whose greedy continuation is a fixed string (token = ord(char)); verifies by comparison."""

    text: str
    calls: list = field(default_factory=list)
    prompt_len: int = 0

    def _at(self, i: int) -> int:  # the target's token at generated position i
        return ord(self.text[i]) if i < len(self.text) else ord("$")

    def prefill(self, prompt, max_len, seed=0, sampling=None, threads=None):
        self.prompt_len = len(prompt)
        return self._at(0), 0.0

    def verify(self, req: VerifyRequest, chained: DraftResult | None = None) -> VerifyResult:
        ids = list(req.ids) + (chained.tokens if chained else [])
        self.calls.append(ids)
        pos = req.start + 1 - self.prompt_len  # generated index of the first draft
        drafts, m = ids[1:], 0
        while m < len(drafts) and drafts[m] == self._at(pos + m):
            m += 1
        return VerifyResult(num_accepted=m, tokens=drafts[:m] + [self._at(pos + m)], drafted=len(drafts))

    def run(self, req: RunRequest) -> RunResult:
        self.calls.append(("run", req.budget))
        pos = req.start + 1 - self.prompt_len
        tokens = []
        while len(tokens) < req.budget and not (tokens and tokens[-1] in req.stop):
            tokens.append(self._at(pos + len(tokens)))
        return RunResult(tokens, [StepRecord(0, 0, 0.0, 0.0) for _ in tokens])


@dataclass
class _ScriptedDraft:
    """A draft that returns scripted strings, one per call that asks for drafts; records its requests."""

    script: list
    calls: list = field(default_factory=list)

    def prefill(self, prompt, max_len, seed=0, sampling=None, defer=False):
        return 0.0

    def draft(self, req: DraftRequest) -> DraftResult:
        self.calls.append(req)
        if req.k <= 0:
            return DraftResult(tokens=[])
        text = self.script.pop(0) if self.script else ""
        return DraftResult(tokens=[ord(c) for c in text[: req.k]])
