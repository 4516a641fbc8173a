"""The one decoding loop. Every method is this loop with a drafter and a verifier.

Invariant between steps, per sequence: the target cache holds every committed
token but the last one ("pending"); a step feeds [pending, drafts...] to the
target, the verifier commits m accepted drafts plus one target token, and the
cache length moves to cover pending + the m accepted drafts. AR is the same
loop with a drafter that proposes nothing.

The loop runs a batch of sequences (:class:`Batch`): each its own prompt
length, position, cache row, drafter, sampling, generator and finish; they
join (:meth:`Batch.add`; their prompts are prefilled in fixed chunks between
the other rows' steps, :class:`Prefill`) and leave (finished, stopped or
cancelled) between steps, which is continuous batching. One step
(:func:`verify_step`) runs a single target forward over every row's
``[pending, drafts]``, padded to the widest row, with each row reading only
its own cache slots, then verifies and commits row by row with the row's own
rule and generator. A row's tokens never depend on which other rows share
its step (greedy float32: identical to running alone). ``generate`` is a batch
of one, and with one row the step makes exactly the calls a plain loop would.

The two-sided runtime (``decoding.schedules.two_sided``: PEARL, SpS and TriForce with
the draft and the target on two sides) uses this module's pieces rather than
copies of them: the context check (``check_context``), the prefill
(``prefill``, ``fill``), the verification rule (``verify``, ``committed_by``)
and the output (``Output``: the commit rule and the stats record).

How many drafts a row offers is the row's ``k`` (fixed), or, with
``adaptive=True``, chosen per step from its measured acceptance and the
measured cost of the forward (``decoding.loop.goodput``): long drafts at low load,
none at high load.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decoding.drafters.base import DecodeState, Drafter, Proposal
from decoding.loop.goodput import Acceptance, CostModel, RowPlan, choose_width
from decoding.loop.metrics import GenerationStats, StepRecord, summarize
from decoding.loop.verify import Verdict, commit_unverified, verify_greedy, verify_speculative, verify_tree_greedy, verify_tree_speculative
from decoding.model.adapter import KVCache, ModelAdapter
from decoding.sampling import SamplingParams, warp

GREEDY = SamplingParams()


class ContextTooLong(ValueError):
    pass


class NotBatchable(ValueError):
    """A drafter that runs one sequence at a time (it keeps the target cache for itself) was put in a batch."""


@dataclass
class Generation:
    token_ids: list[int]  # the new tokens
    finish_reason: str  # "stop" (EOS), "length", or what the caller's on_step returned
    stats: GenerationStats
    steps: list[StepRecord] = field(default_factory=list)


def verify(proposal: Proposal, logits: torch.Tensor, sampling: SamplingParams, generator) -> Verdict:
    """Dispatch to the greedy or the speculative-sampling rule (or, for unverified drafts, EAD's lossy commit).
    logits: [B, j+1, V]."""
    if proposal.unverified:
        if sampling.greedy:
            return commit_unverified(proposal.tokens, None, logits, None)
        u_sample = torch.rand(logits.shape[0], generator=generator, device=logits.device)
        return commit_unverified(proposal.tokens, warp(logits, sampling), logits, u_sample)
    if sampling.greedy:
        return verify_greedy(proposal.tokens, logits)
    bsz, j = proposal.tokens.shape
    target_probs = warp(logits, sampling)
    u_accept = torch.rand(bsz, j, generator=generator, device=logits.device)
    u_sample = torch.rand(bsz, generator=generator, device=logits.device)
    return verify_speculative(proposal.tokens, proposal.probs, target_probs, u_accept, u_sample)


def verify_tree(proposal: Proposal, logits: torch.Tensor, sampling: SamplingParams, generator, pending: torch.Tensor) -> Verdict:
    """The tree rules: greedy (longest matching path) or recursive rejection sampling. logits: [B, T, V], pending [B, 1]."""
    tree = proposal.tree
    nodes = torch.cat([pending, proposal.tokens], dim=1)  # [B, T]
    if sampling.greedy:
        dev = logits.device
        return verify_tree_greedy(nodes, tree.parents.to(dev), tree.mask.to(dev), tree.depth.to(dev), logits)
    bsz, t = nodes.shape
    q = None if proposal.probs is None else torch.cat([proposal.probs[:, :1], proposal.probs], dim=1)  # [B, T, V], row 0 unused
    u_accept = torch.rand(bsz, t, generator=generator, device=logits.device)
    u_sample = torch.rand(bsz, generator=generator, device=logits.device)
    return verify_tree_speculative(nodes, tree.parents, q, warp(logits, sampling), u_accept, u_sample)


def check_context(prompt_len: int, max_new_tokens: int, max_context: int) -> None:
    """Raise ``ContextTooLong`` when the prompt and the new tokens cannot fit the model's context."""
    if prompt_len + max_new_tokens > max_context:
        raise ContextTooLong(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of {max_context}"
        )


PREFILL_CHUNK = 256  # prompt tokens per prefill forward (see Prefill)


class Prefill:
    """A prompt run into a cache in chunks of ``PREFILL_CHUNK`` tokens, one forward per chunk.

    The chunks are the same whoever runs them (one sequence alone, a batch that interleaves them with other
    rows' decoding steps, the two-sided runtime): chunk c is always positions [c * PREFILL_CHUNK, (c + 1) *
    PREFILL_CHUNK) over the chunks before it, so the cache's bits and the first token never depend on what else
    ran. ``features``: the layers whose hidden states to keep (``ModelAdapter.forward``'s ``captured``).

    >>> # p = Prefill(prompt, ()); while p.remaining: p.run_chunk(target, cache)
    >>> # hidden, features = p.result()     # [1, T, H], None
    """

    def __init__(self, prompt: torch.Tensor, features=()):  # prompt [1, T]
        self.prompt = prompt
        self.done = 0
        self.hidden: list[torch.Tensor] = []
        self.features: dict[int, list[torch.Tensor]] = {layer: [] for layer in features}

    @property
    def remaining(self) -> int:
        return self.prompt.shape[1] - self.done

    def next_chunk(self) -> int:
        """Tokens the next :meth:`run_chunk` feeds."""
        return min(PREFILL_CHUNK, self.remaining)

    def run_chunk(self, model: ModelAdapter, cache: KVCache) -> None:
        """Feed the next chunk; the cache then holds the prompt up to its end."""
        begin, end = self.done, self.done + self.next_chunk()
        captured = dict.fromkeys(self.features) if self.features else None
        self.hidden.append(model.forward(cache, begin, input_ids=self.prompt[:, begin:end], captured=captured))
        for layer, parts in self.features.items():
            parts.append(captured[layer])
        self.done = end
        cache.rollback(end)

    def result(self) -> tuple[torch.Tensor, dict | None]:
        """The prompt's hidden states [1, T, H] and, per feature layer, its hidden states after that layer."""
        cat = lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)  # noqa: E731
        return cat(self.hidden), ({layer: cat(parts) for layer, parts in self.features.items()} or None)


def fill(model: ModelAdapter, cache: KVCache, prompt: torch.Tensor, captured: dict | None = None) -> torch.Tensor:
    """Run the prompt [1, T] into an empty ``cache`` (in :class:`Prefill`'s chunks), which then holds exactly the prompt;
    returns the hidden states [1, T, H] (and fills ``captured``, see ``ModelAdapter.forward``)."""
    run = Prefill(prompt, tuple(captured) if captured else ())
    while run.remaining:
        run.run_chunk(model, cache)
    h, features = run.result()
    if captured is not None:
        captured.update(features or {})
    return h


def first_token(target: ModelAdapter, hidden: torch.Tensor, sampling: SamplingParams, generator) -> torch.Tensor:
    """The first new token [1, 1] after a prompt whose last hidden state is ``hidden`` [1, 1, H], by the loop's rule."""
    return verify(Proposal.empty(1, hidden.device), target.logits(hidden), sampling, generator).tokens[:, :1]


def prefill(
    target: ModelAdapter, cache: KVCache, prompt: torch.Tensor, sampling: SamplingParams, generator, captured: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill ``cache`` with the prompt [1, T] and draw the first new token with the loop's rule.

    Returns (first token [1, 1], the prompt's hidden states [1, T, H]). Afterwards the cache holds the prompt
    and the first token is pending: the loop's invariant. ``captured``: see ``ModelAdapter.forward``.
    """
    h = fill(target, cache, prompt, captured)
    return first_token(target, h[:, -1:], sampling, generator), h


def committed_by(verdict: Verdict) -> tuple[int, list[int]]:
    """(m, the m + 1 tokens the verdict commits: the accepted drafts, then the target's token) of a one-row verdict."""
    m = int(verdict.num_accepted[0])
    return m, verdict.tokens[0, : m + 1].tolist()


@dataclass
class StepResult:
    proposal: Proposal
    num_accepted: int  # m
    committed: list[int]  # the m accepted drafts and the target's token
    logits: torch.Tensor  # [1, j+1, V] the target's logits that judged the proposal
    record: StepRecord


def propose(state: DecodeState, drafter: Drafter, k: int) -> tuple[Proposal, float]:
    """The drafter's proposal of up to k drafts (none for k = 0) and the seconds it took."""
    t0 = time.perf_counter()
    proposal = drafter.propose(state, k) if k > 0 else Proposal.empty(state.tokens.shape[0], state.tokens.device)
    return proposal, time.perf_counter() - t0


def truncate(proposal: Proposal, j: int) -> Proposal:
    """The first j drafts of a chain proposal (a drafter's state stays valid: it learns m <= j in ``update``)."""
    if proposal.tokens.shape[1] <= j:
        return proposal
    return Proposal(
        tokens=proposal.tokens[:, :j],
        probs=None if proposal.probs is None else proposal.probs[:, :j],
        hidden=None if proposal.hidden is None else proposal.hidden[:, : j + 1],
        layer=proposal.layer,
    )


def verify_step(
    states: list[DecodeState],
    drafters: list[Drafter],
    proposals: list[Proposal],
    draft_s: list[float],
    batch_cache: KVCache | None = None,
) -> list[StepResult]:
    """Run the target once over every row's [pending, drafts], verify and commit each row.

    One row: the forward runs on the row's own cache exactly as a single-sequence loop would (a drafter's
    hidden states are continued from its layer; trees pass their mask). Several rows: ``batch_cache`` is the
    view of the rows' shared cache (row b of it is ``states[b].target_cache``); the rows are padded to the
    widest and each writes at and reads up to its own length. Mutates each state (tokens grow by m+1, the
    cache covers pending and the m accepted drafts) and tells each drafter its verdict.
    """
    t1 = time.perf_counter()
    rows = len(states)
    lengths = [s.tokens.shape[1] for s in states]
    widths = [1 + p.tokens.shape[1] for p in proposals]
    layers = sorted({layer for d in drafters for layer in d.feature_layers})
    captured = dict.fromkeys(layers) if layers else None
    if rows == 1:
        h, logits = _forward_one(states[0], proposals[0], captured)
        hs, logit_rows = [h], [logits]
    else:
        hs, logit_rows = _forward_rows(states, proposals, lengths, widths, batch_cache, captured)
    verify_s = time.perf_counter() - t1
    results = []
    for b in range(rows):
        state, proposal, n = states[b], proposals[b], lengths[b]
        tokens = state.tokens
        if proposal.tree is not None:
            verdict = verify_tree(proposal, logit_rows[b], state.sampling, state.generator, tokens[:, -1:])
        else:
            verdict = verify(proposal, logit_rows[b], state.sampling, state.generator)
        m, committed = committed_by(verdict)
        state.tokens = torch.cat([tokens, torch.tensor([committed], dtype=tokens.dtype, device=tokens.device)], dim=1)
        state.accepted_path = None
        state.target_hidden = hs[b][:, : m + 1]  # [1, m+1, H] pending + accepted drafts
        kept = slice(0, m + 1)
        if proposal.tree is not None:  # the accepted branch becomes the committed prefix: slots n-1+path -> n-1..n-1+m
            path = verdict.path[0, : m + 1]
            state.target_cache.compact(n - 1, path + (n - 1))
            state.accepted_path = path.tolist()
            state.target_hidden = hs[b][:, path]
            kept = path
        if drafters[b].feature_layers:  # [1, m+1, H] per layer the drafter reads, of the positions kept
            state.target_features = {layer: captured[layer][b : b + 1, : widths[b]][:, kept] for layer in drafters[b].feature_layers}
        state.target_cache.rollback(n + m)
        state.last_logits = logit_rows[b]  # [1, t, V] every fed position's logits, rejected ones included (Token Recycling)
        drafters[b].update(state, m)
        record = StepRecord(drafted=widths[b] - 1, accepted=m, draft_s=draft_s[b], verify_s=verify_s, rows=rows)
        results.append(StepResult(proposal, m, committed, logit_rows[b], record))
    return results


def _forward_one(state: DecodeState, proposal: Proposal, captured: dict | None = None):
    target, cache, tokens = state.target, state.target_cache, state.tokens
    bsz, n = tokens.shape
    tree = {}
    if proposal.tree is not None:  # one forward over [pending, nodes] with the tree mask; positions = n-1 + depth
        positions = proposal.tree.positions(n - 1).to(target.device).unsqueeze(0).expand(bsz, -1)
        tree = dict(positions=positions, tree_mask=proposal.tree.mask)
    if proposal.hidden is not None:
        if captured and min(captured) <= proposal.layer:
            raise ValueError(f"a drafter that continues from layer {proposal.layer} cannot be asked for layers {sorted(captured)}")
        h = target.forward(cache, n - 1, hidden=proposal.hidden, first=proposal.layer, captured=captured, **tree)
    else:
        h = target.forward(cache, n - 1, input_ids=torch.cat([tokens[:, -1:], proposal.tokens], dim=1), captured=captured, **tree)
    return h, target.logits(h)


def _forward_rows(states, proposals, lengths, widths, batch_cache, captured=None):
    """One padded forward over ragged rows; returns per-row hidden [1, t_b, H] and logits [1, t_b, V].

    A drafter's hidden states (self-speculation) are not continued here: every row enters at layer 0 (the
    row's shallow KV is rewritten by the full forward), so rows of different drafters share the forward.
    """
    target = states[0].target
    rows, width = len(states), max(widths)
    device = target.device
    ids = torch.zeros(rows, width, dtype=torch.long, device=device)
    starts = torch.tensor([n - 1 for n in lengths], dtype=torch.long, device=device)
    positions = starts[:, None] + torch.arange(width, device=device)
    trees = any(p.tree is not None for p in proposals)
    mask = torch.ones(width, width, dtype=torch.bool, device=device).tril().repeat(rows, 1, 1) if trees else None
    for b, (state, proposal) in enumerate(zip(states, proposals, strict=True)):
        t = widths[b]
        ids[b, 0] = state.tokens[0, -1]
        ids[b, 1:t] = proposal.tokens[0]
        if proposal.tree is not None:
            positions[b, :t] = proposal.tree.positions(lengths[b] - 1).to(device)
            mask[b, :t, :t] = proposal.tree.mask.to(device)
    if batch_cache is None:
        raise ValueError("several rows need their shared cache (batch_cache)")
    h = target.forward(batch_cache, starts, input_ids=ids, positions=positions, tree_mask=mask, captured=captured)
    if all(t == width for t in widths):
        logits = target.logits(h)
        return [h[b : b + 1] for b in range(rows)], [logits[b : b + 1] for b in range(rows)]
    valid = torch.cat([h[b, :t] for b, t in enumerate(widths)])  # [sum t_b, H]: no LM head on padding
    logits = target.logits(valid[None])[0].split(widths)
    return [h[b : b + 1, :t] for b, t in enumerate(widths)], [lg[None] for lg in logits]


def speculative_step(state: DecodeState, drafter: Drafter, k: int) -> StepResult:
    """One step for one sequence: propose up to k drafts, run the target on [pending, drafts], verify, commit.

    A drafter that speculates itself (TriForce's middle level) calls it on its own state with its own inner drafter.
    """
    proposal, seconds = propose(state, drafter, k)
    return verify_step([state], [drafter], [proposal], [seconds])[0]


# ---- sequences and the batch ---------------------------------------------------------------


StepCallback = Callable[[list[int]], "str | None"]


class Output:
    """What one generation has committed, its limits and how it ended: the commit rule and the stats record.

    Shared by the loop's :class:`Sequence` and the two-sided runtime (``decoding.schedules.two_sided``). ``commit`` takes
    a step's tokens, cuts them after the first EOS, ends the generation at ``max_new_tokens`` (a step never
    brings more than ``remaining`` tokens: drafts are capped at ``remaining - 1``) and hands the tokens to
    ``on_step``, whose returned string (if any) ends it with that finish reason.

    >>> out = Output(max_new_tokens=8, eos_token_ids=[2])
    >>> out.commit([5]); out.commit([6, 2, 7]); out.new, out.finish_reason
    ([5, 6, 2], 'stop')
    """

    def __init__(self, max_new_tokens: int, eos_token_ids: tuple[int, ...] | list[int] = (), on_step: StepCallback | None = None):
        self.max_new_tokens = max_new_tokens
        self.eos = {int(e) for e in eos_token_ids}
        self.on_step = on_step
        self.new: list[int] = []
        self.steps: list[StepRecord] = []
        self.finish_reason: str | None = None
        self.t_start = self.prefill_s = self.wall_s = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        """Tokens that may still be committed."""
        return self.max_new_tokens - len(self.new)

    def commit(self, tokens: list[int]) -> None:
        """Append a step's tokens (cut after EOS; at the limit the generation ends) and hand them to ``on_step``."""
        for i, tok in enumerate(tokens):
            if tok in self.eos:
                tokens, self.finish_reason = tokens[: i + 1], "stop"
                break
        self.new.extend(tokens)
        if self.finish_reason is None and len(self.new) >= self.max_new_tokens:
            self.finish_reason = "length"
        if self.on_step:
            reason = self.on_step(tokens)
            if reason is not None and self.finish_reason is None:
                self.finish_reason = str(reason)

    def cancel(self, reason: str = "cancelled") -> None:
        """End the generation before its next step (call between steps, from the thread that runs it)."""
        if self.finish_reason is None:
            self.finish_reason = reason

    def result(self) -> Generation:
        stats = summarize(len(self.new), self.wall_s, self.prefill_s, self.steps)
        return Generation(token_ids=list(self.new), finish_reason=self.finish_reason or "length", stats=stats, steps=self.steps)


class Sequence(Output):
    """One request in the batch: its prompt, drafter, draft length, sampling, generator, limits and output.

    ``on_step(tokens)`` receives each step's newly committed tokens (after EOS trimming, so streaming sees
    exactly the output); returning a string ends the sequence after those tokens with that finish reason
    (a stop sequence, a cancelled client), with exact stats. ``k`` is the most drafts per step; with
    ``adaptive`` the loop chooses 0..k per step (see ``decoding.loop.goodput``).
    """

    def __init__(
        self,
        prompt_ids: torch.Tensor,  # [1, T]
        *,
        drafter: Drafter | None = None,
        k: int = 4,
        adaptive: bool = False,
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
        self.k, self.adaptive = k, adaptive
        self.sampling, self.generator = sampling, generator
        self.tag = tag
        self.state: DecodeState | None = None
        self.acceptance = Acceptance()
        self.fill: Prefill | None = None  # its prompt's prefill while it joins a batch
        self.error: Exception | None = None  # why it could not start (its drafter failed to), if so

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.shape[1]

    @property
    def max_len(self) -> int:
        """Cache slots this sequence may need: prompt, new tokens and one step's drafts."""
        return self.prompt_len + self.max_new_tokens + self.drafter.max_nodes(self.k) + 1

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
    output is what it would be alone (the chunks do not depend on the batch). The prompt being filled holds the
    cache row after the decoding rows.

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
        if not getattr(seq.drafter, "batchable", True) and (len(self) or self.max_rows > 1):
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
                seq.fill = Prefill(seq.prompt_ids.to(self.target.device), seq.drafter.feature_layers)
            n = seq.fill.next_chunk()
            if used and self.prefill_budget is not None and used + n > self.prefill_budget:
                break
            seq.fill.run_chunk(self.target, self.cache.row(len(self.rows)))
            used += n
            if seq.fill.remaining == 0:
                self.joining.pop(0)
                if self._start(seq):
                    self.rows.append(seq)
                else:
                    ended.append(seq)
        return ended

    def _start(self, seq: Sequence) -> bool:
        """A filled prompt: draw its first token and start its drafter; False when it ended there."""
        target, view = self.target, self.cache.row(len(self.rows))
        h, features = seq.fill.result()
        view.rollback(seq.prompt_len)
        first = first_token(target, h[:, -1:], seq.sampling, seq.generator)
        tokens = torch.cat([seq.fill.prompt, first], dim=1)
        seq.fill = None
        seq.state = DecodeState(tokens, target, view, seq.sampling, seq.generator, seq.max_len, target_hidden=h, target_features=features)
        seq.prefill_s = time.perf_counter() - seq.t_start
        seq.commit([int(first[0, 0])])
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

    def _filling(self) -> Sequence | None:
        """The joining sequence whose prompt is partly in the cache (in the row after the decoding rows), if any."""
        return self.joining[0] if self.joining and self.joining[0].fill is not None else None

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
        filling = self._filling()
        used = len(self.rows) + (filling is not None)
        if cache is not None and used:
            top = max([s.state.target_cache.length for s in self.rows] + ([filling.fill.done] if filling else []))
            for dst, src in zip(grown.k + grown.v, cache.k + cache.v, strict=True):
                dst[:used, :, :top] = src[:used, :, :top]
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
        filling = self._filling()
        if filling is not None:  # the prompt being filled follows the decoding rows down
            self._move(len(self.rows) + 1, len(self.rows), filling.fill.done)

    def _move(self, src: int, dst: int, length: int) -> None:
        for buf in self.cache.k + self.cache.v:
            buf[dst, :, :length] = buf[src, :, :length]

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
        done += self._prefill()
        if not self.rows:
            return done
        rows = self.rows
        proposals, seconds, budgets = self._proposals(rows)
        width = 1 + max(p.tokens.shape[1] for p in proposals)
        results = verify_step(
            [s.state for s in rows], [s.drafter for s in rows], proposals, seconds, self._batch_view() if len(rows) > 1 else None
        )
        if self.cost is not None:
            self.cost.observe(len(rows), width, results[0].record.verify_s)
        for seq, res, budget in zip(list(rows), results, budgets, strict=True):
            res.record.k = budget
            seq.acceptance.observe(res.record.drafted, res.num_accepted)
            seq.steps.append(res.record)
            seq.commit(res.committed)
            if seq.finished:
                self._leave(seq)
                done.append(seq)
        return done

    def _proposals(self, rows: list[Sequence]) -> tuple[list[Proposal], list[float], list[int]]:
        """Each row's drafts for this step (with the seconds they took and the draft budget the row had): its
        fixed k, or what the goodput choice of width leaves it."""
        caps = [s.step_k() for s in rows]
        if self.cost is None or not any(s.adaptive for s in rows):
            pairs = [propose(s.state, s.drafter, k) for s, k in zip(rows, caps, strict=True)]
            return [p for p, _ in pairs], [t for _, t in pairs], caps
        return self._adaptive_proposals(rows, caps)

    def _adaptive_proposals(self, rows: list[Sequence], caps: list[int]):
        """Model-free drafters propose first (their proposals are nearly free); then the width is chosen from
        what every row offers; model-based drafters then draft only up to it, and longer chains are cut."""
        early = {}
        plans = []
        for s, cap in zip(rows, caps, strict=True):
            model_free = getattr(s.drafter, "model_free", False)
            if model_free and cap > 0:
                early[id(s)] = propose(s.state, s.drafter, cap)
                p = early[id(s)][0]
                avail = p.tokens.shape[1]
                tree_gain = _tree_gain(s) if p.tree is not None else None
            else:
                avail, tree_gain = cap, (_tree_gain(s) if getattr(s.drafter, "tree", None) is not None and cap > 0 else None)
                if tree_gain is not None:
                    avail = s.drafter.max_nodes(cap)
            draft_cost = 0.0 if model_free else _draft_cost(s)
            plans.append(RowPlan(avail=avail, alpha=s.acceptance.alpha, fixed=not s.adaptive, draft_cost=draft_cost, tree_gain=tree_gain))
        width = choose_width(plans, self.cost, self.max_step_tokens)
        pairs, budgets = [], []
        for s, cap, plan in zip(rows, caps, plans, strict=True):
            budget = cap if not s.adaptive else min(cap, width - 1)
            budgets.append(budget)
            if id(s) in early:
                p, t = early[id(s)]
                if p.tree is not None:
                    p = p if p.tokens.shape[1] <= width - 1 or not s.adaptive else Proposal.empty(1, p.tokens.device)
                else:
                    p = truncate(p, budget)
                pairs.append((p, t))
            elif plan.tree_gain is not None and s.adaptive:
                pairs.append(propose(s.state, s.drafter, cap if plan.avail <= width - 1 else 0))
            else:
                pairs.append(propose(s.state, s.drafter, budget))
        return [p for p, _ in pairs], [t for _, t in pairs], budgets

    def run(self) -> None:
        while len(self):
            self.step()


def _tree_gain(seq: Sequence) -> float:
    """Expected accepted drafts of a whole tree: the mean over this sequence's tree steps so far (prior 1)."""
    tree_steps = [r for r in seq.steps if r.drafted > 0]
    return (sum(r.accepted for r in tree_steps) + 1.0) / (len(tree_steps) + 1.0)


def _draft_cost(seq: Sequence) -> float:
    """Seconds per drafted token of this sequence's drafter so far (0 until it has drafted)."""
    drafted = sum(r.drafted for r in seq.steps)
    return sum(r.draft_s for r in seq.steps) / drafted if drafted else 0.0


def generate(
    target: ModelAdapter,
    prompt_ids: torch.Tensor,  # [1, T]
    *,
    drafter: Drafter | None = None,
    k: int = 4,
    sampling: SamplingParams = GREEDY,
    max_new_tokens: int = 128,
    eos_token_ids: tuple[int, ...] | list[int] = (),
    generator: torch.Generator | None = None,
    on_step: StepCallback | None = None,
    adaptive: bool = False,
    cost: CostModel | None = None,
) -> Generation:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``; stop after an EOS token (a batch of one).

    ``on_step`` receives each step's newly committed tokens (for streaming); returning a string stops the
    generation with that finish reason.
    """
    if prompt_ids.shape[0] != 1:
        raise ValueError(f"generate runs one sequence, got a batch of {prompt_ids.shape[0]}; use Batch for several")
    seq = Sequence(
        prompt_ids,
        drafter=drafter,
        k=k,
        adaptive=adaptive,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos_token_ids,
        generator=generator,
        on_step=on_step,
    )
    batch = Batch(target, max_rows=1, cost=cost)
    batch.add(seq)
    batch.run()
    if seq.error is not None:  # its drafter failed to start
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
