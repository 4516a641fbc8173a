"""One decoding step of every row: its inputs built once as device tensors, one forward, verification on the
device, one read back to the host.

Invariant between steps, per sequence: the target cache holds every committed token but the last one
("pending"); a step feeds [pending, drafts...] to the target, the verifier commits m accepted drafts plus one
target token, and the cache length moves to cover pending + the m accepted drafts. AR is the same step with a
drafter that proposes nothing.

A step of R rows is one :class:`Step`, built by the batch's :class:`Workspace` from what the host already knows
(each row's length, its pending token and a model-free drafter's drafts as host ints, tree shapes) and what the
drafters left on the device (a model's drafts, their probabilities, an early exit's hidden states):

* ``ids`` / ``positions`` [R, W]: [pending, drafts] per row, padded to the widest row W; the rotary positions
  (a chain: consecutive; a tree: root + node depth);
* ``place``: where each token's KV goes and what each query sees (``fast_layers.Placement``: write slots [R, W],
  the committed prefix [R], a tree's block mask [R, W, W]);
* ``nodes`` [R, W] the tokens the verifier judges (-1 at padding), ``drafts`` [R] each row's j, ``logit_rows``
  [R, W] where each position's logits sit in the forward's output (the LM head runs on real positions only);
* per-row sampling parameters (temperature, top-k, top-p) and pre-drawn uniforms [R, W] (each row draws from its
  own generator exactly the j + 1 it needs, so its tokens never depend on the other rows).

The host-known part goes to the device in one copy from a pinned staging buffer; the buffers are allocated once
and keep their addresses from step to step. The forward is one function of the step (``ModelAdapter.forward`` with
its placement). Verification runs for all rows at once on the device (``decoding.loop.verify``: greedy and
rejection sampling, chains and trees), and its verdicts (accepted counts, tokens, tree paths) come back in ONE
host read (:meth:`Workspace.read`). Everything after it (EOS, stops, rollback, drafters' bookkeeping) reads that.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from decoding.drafters.base import DecodeState, Drafter, Proposal
from decoding.loop.metrics import StepRecord
from decoding.loop.verify import (
    Verdict,
    children_table,
    commit_unverified,
    verify_greedy,
    verify_speculative,
    verify_tree_greedy,
    verify_tree_speculative,
)
from decoding.model.adapter import KVCache
from decoding.model.fast_layers import Placement
from decoding.sampling import SamplingParams, warp, warp_rows
from decoding.timing import Clock

# int64 planes of the staging buffer, [R, W] each, then [R] vectors
PLANES = ("ids", "positions", "slots", "nodes", "logit_rows", "parents", "depth", "valid")
VECTORS = ("prefix", "drafts", "top_k")


@dataclass
class Step:
    """The device tensors of one step of R rows, W tokens each (see the module docstring), and their host twins."""

    ids: torch.Tensor  # [R, W]
    positions: torch.Tensor  # [R, W]
    place: Placement
    nodes: torch.Tensor  # [R, W] pending + drafts, -1 at padding
    drafts: torch.Tensor  # [R] j per row
    logit_rows: torch.Tensor  # [R, W] row of each position in the flat logits
    valid: torch.Tensor | None  # [N] flat indices (b * W + i) of the real positions; None: every position is real
    widths: list[int]  # t_b = j_b + 1
    lengths: list[int]  # n_b: committed tokens before the step
    offsets: list[int]  # where row b's logits begin in the flat logits
    trees: bool  # some row drafted a tree (every row is then verified as one: chains as chain-shaped trees)
    parents: torch.Tensor | None = None  # [R, W] trees: node parents (-1 root), padding 0
    depth: torch.Tensor | None = None  # [R, W] trees: node depths, padding -1
    max_depth: int = 0
    greedy: torch.Tensor | None = None  # [R] bool, when some row samples
    temperature: torch.Tensor | None = None  # [R]
    top_k: torch.Tensor | None = None  # [R] (None: no row uses it)
    top_p: torch.Tensor | None = None  # [R] (None: no row uses it)
    uniforms: torch.Tensor | None = None  # [R, W]: r_1..r_j then the draw's uniform, per sampled row
    q: torch.Tensor | None = None  # [R, W, V] the draft's q at each node (chains: q_i at node i), rows that have one
    has_q: torch.Tensor | None = None  # [R] bool
    unverified: torch.Tensor | None = None  # [R] bool: rows whose drafts are committed unverified (EAD, lossy)

    @property
    def rows(self) -> int:
        return self.ids.shape[0]

    @property
    def width(self) -> int:
        return self.ids.shape[1]


class Workspace:
    """A batch's step buffers on its device, allocated once (grown when a step needs more rows or tokens), and their
    host staging: a step fills the staging (numpy views, no tensor operation), copies it to the device in one
    transfer, and reads its verdicts back through one pinned buffer."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.capacity = (0, 0)
        self.clock = Clock(self.device)

    def ensure(self, rows: int, width: int) -> None:
        if rows <= self.capacity[0] and width <= self.capacity[1]:
            return
        rows, width = max(rows, self.capacity[0]), max(width, self.capacity[1], 8)
        size = len(PLANES) * rows * width + len(VECTORS) * rows
        self.host = torch.zeros(size, dtype=torch.long, device="cpu", pin_memory=self.cuda)
        self.dev = self.host if not self.cuda else torch.zeros(size, dtype=torch.long, device=self.device)
        self.host_f = torch.zeros(2 * rows, dtype=torch.float32, device="cpu", pin_memory=self.cuda)  # temperature, top_p
        self.dev_f = self.host_f if not self.cuda else torch.zeros(2 * rows, dtype=torch.float32, device=self.device)
        self.host_b = torch.zeros(rows * width * width + rows, dtype=torch.bool, device="cpu", pin_memory=self.cuda)  # tree blocks, greedy
        self.dev_b = self.host_b if not self.cuda else torch.zeros_like(self.host_b, device=self.device)
        self.uniforms = torch.zeros(rows * width, dtype=torch.float32, device=self.device)
        self.np, self.np_f, self.np_b = self.host.numpy(), self.host_f.numpy(), self.host_b.numpy()
        self.readback = torch.zeros(rows * (4 * width + 2), dtype=torch.long, device="cpu", pin_memory=self.cuda)
        self.capacity = (rows, width)

    def _plane(self, flat, index: int, rows: int, width: int):
        cap_r, cap_w = self.capacity
        begin = index * cap_r * cap_w
        return flat[begin : begin + rows * width].reshape(rows, width)

    def _vector(self, flat, index: int, rows: int):
        cap_r, cap_w = self.capacity
        begin = len(PLANES) * cap_r * cap_w + index * cap_r
        return flat[begin : begin + rows]

    def build(self, states: list[DecodeState], proposals: list[Proposal]) -> Step:
        """The step of these rows: host inputs staged and copied in one transfer, device drafts written after it."""
        rows, widths, lengths = len(states), [1 + p.size for p in proposals], [s.length for s in states]
        width = max(widths)
        self.ensure(rows, width)
        trees = any(p.tree is not None for p in proposals)
        sampled = [not s.sampling.greedy for s in states]
        ragged = any(w != width for w in widths)
        offsets = self._stage_rows(states, proposals, lengths, widths, width, trees, ragged)
        if trees:
            self._stage_blocks(proposals, widths, width)
        if any(sampled):
            self.np_f[:rows] = [s.sampling.temperature if s.sampling.temperature > 0 else 1.0 for s in states]
            self.np_f[self.capacity[0] : self.capacity[0] + rows] = [s.sampling.top_p for s in states]
            greedy_at = self.capacity[0] * self.capacity[1] * self.capacity[1]
            self.np_b[greedy_at : greedy_at + rows] = [not x for x in sampled]
        if self.cuda:  # the host's part of the step, in one transfer
            self.dev.copy_(self.host, non_blocking=True)
            if trees or any(sampled):
                self.dev_b.copy_(self.host_b, non_blocking=True)
                self.dev_f.copy_(self.host_f, non_blocking=True)
        dev = {name: self._plane(self.dev, i, rows, width) for i, name in enumerate(PLANES)}
        dvec = {name: self._vector(self.dev, i, rows) for i, name in enumerate(VECTORS)}
        for b, (proposal, t) in enumerate(zip(proposals, widths, strict=True)):
            if proposal.host is None and t > 1:  # a model's drafts, already on the device
                dev["ids"][b, 1:t] = proposal.tokens[0]
                dev["nodes"][b, 1:t] = proposal.tokens[0]
        block = self.dev_b[: rows * width * width].view(rows, width, width) if trees else None
        end = max(lengths) - 1 + width
        place = Placement(dev["slots"], dvec["prefix"], end, block, start=lengths[0] - 1 if rows == 1 else None)
        step = Step(
            ids=dev["ids"],
            positions=dev["positions"],
            place=place,
            nodes=dev["nodes"],
            drafts=dvec["drafts"],
            logit_rows=dev["logit_rows"],
            valid=dev["valid"].reshape(-1)[: sum(widths)] if ragged else None,  # real positions: the head skips padding
            widths=widths,
            lengths=lengths,
            offsets=offsets,
            trees=trees,
        )
        if trees:
            step.parents, step.depth = dev["parents"], dev["depth"]
            step.max_depth = max(p.tree.max_depth if p.tree is not None else p.size for p in proposals)
        if any(sampled):
            self._sampling(step, states, proposals, sampled, dvec)
        if any(p.unverified for p in proposals):
            flags = [p.unverified for p in proposals]
            step.unverified = torch.as_tensor(flags, dtype=torch.bool, device="cpu").to(self.device, non_blocking=True)
        return step

    def _stage_rows(self, states, proposals, lengths, widths, width: int, trees: bool, ragged: bool) -> list[int]:
        """Fill the host staging planes (numpy: no tensor operation): every row's chain layout at once, then a row's
        own drafts and tree where it has them; returns where each row's logits begin."""
        rows = len(states)
        np_ = {name: self._plane(self.np, i, rows, width) for i, name in enumerate(PLANES)}
        vec = {name: self._vector(self.np, i, rows) for i, name in enumerate(VECTORS)}
        n, t, at = np.asarray(lengths)[:, None], np.asarray(widths)[:, None], np.arange(width)[None, :]
        starts = np.cumsum(t[:, 0]) - t[:, 0] if ragged else np.arange(rows) * width
        if ragged:  # the real positions, row after row: row b's t_b of its width
            total = int(t.sum())
            np_["valid"].reshape(-1)[:total] = np.arange(total) + np.repeat(np.arange(rows) * width - starts, t[:, 0])
        ids, nodes, pos, slots = np_["ids"], np_["nodes"], np_["positions"], np_["slots"]
        ids[:, 0] = nodes[:, 0] = [s.history[-1] for s in states]
        ids[:, 1:] = 0
        nodes[:, 1:] = -1
        pos[:] = n - 1 + at
        # the scratch slot: padding never lands on a position
        slots[:] = np.where(at < t, pos, np.asarray([s.target_cache.max_len for s in states])[:, None])
        np_["logit_rows"][:] = starts[:, None] + np.minimum(at, t - 1)
        vec["prefix"][:], vec["drafts"][:] = n[:, 0] - 1, t[:, 0] - 1
        vec["top_k"][:] = [s.sampling.top_k for s in states]
        for b, (proposal, tb) in enumerate(zip(proposals, widths, strict=True)):
            if proposal.host is not None and tb > 1:
                ids[b, 1:tb] = nodes[b, 1:tb] = proposal.host
            if proposal.tree is not None:
                pos[b, :tb] = [lengths[b] - 1 + d for d in proposal.tree.depth_list]
            if trees:
                np_["parents"][b, :tb] = proposal.tree.parent_list if proposal.tree is not None else [-1, *range(tb - 1)]
                np_["parents"][b, tb:] = 0
                np_["depth"][b, :tb] = proposal.tree.depth_list if proposal.tree is not None else range(tb)
                np_["depth"][b, tb:] = -1
        return starts.tolist()

    def _stage_blocks(self, proposals, widths, width: int) -> None:
        """Each row's block mask: its tree's ancestor mask, a chain's causal one; padding sees itself only."""
        blk = self.np_b[: len(proposals) * width * width].reshape(len(proposals), width, width)
        blk[:] = False
        for b, (proposal, t) in enumerate(zip(proposals, widths, strict=True)):
            if proposal.tree is not None:
                blk[b, :t, :t] = proposal.tree.mask.numpy()
            else:
                for i in range(t):
                    blk[b, i, : i + 1] = True
            for i in range(t, width):
                blk[b, i, i] = True

    def _sampling(self, step: Step, states, proposals, sampled, dvec) -> None:
        rows, width = step.rows, step.width
        cap = self.capacity[0]
        greedy_at = self.capacity[0] * self.capacity[1] * self.capacity[1]
        step.greedy = self.dev_b[greedy_at : greedy_at + rows]
        step.temperature = self.dev_f[:rows]
        if any(s.sampling.top_k for s in states):
            step.top_k = dvec["top_k"]
        if any(s.sampling.top_p < 1.0 for s in states):
            step.top_p = self.dev_f[cap : cap + rows]
        uniforms = self.uniforms[: rows * width].view(rows, width)
        for b, (state, t) in enumerate(zip(states, step.widths, strict=True)):
            if sampled[b]:
                uniforms[b, :t].uniform_(generator=state.generator)
        step.uniforms = uniforms
        if any(p.probs is not None for p in proposals):
            first = next(p.probs for p in proposals if p.probs is not None)
            q = first.new_zeros(rows, width, first.shape[-1])
            for b, p in enumerate(proposals):
                if p.probs is not None:  # node i was drawn from q_i (a chain's q_i, a tree node's parent's q): row 0 unused
                    q[b, 1 : step.widths[b]] = p.probs[0]
            step.q = q
            has = [p.probs is not None for p in proposals]
            step.has_q = torch.as_tensor(has, dtype=torch.bool, device="cpu").to(self.device, non_blocking=True) if not all(has) else None

    def read(self, packed: torch.Tensor) -> list[list[int]]:
        """The step's one host read: ``packed`` [R, C] int64 back as host ints (a pinned, non-blocking copy and one
        wait on a GPU)."""
        if not self.cuda:
            return packed.tolist()
        out = self.readback[: packed.numel()].view(packed.shape)
        out.copy_(packed, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return out.tolist()


def verify_rows(step: Step, logits: torch.Tensor) -> Verdict:
    """Every row's verdict at once, on the device: logits [N, V] (real positions only when ``step.valid``, else
    [R * W, V]). Greedy rows take the longest prefix (or tree path) matching the target's argmax; sampled rows the
    rejection rule with their own parameters and uniforms. Chains as chains; with any tree in the step, every row
    as a tree (a chain is a chain-shaped tree). Rows whose drafts are unverified (EAD) commit them all."""
    argmax = logits.argmax(-1)[step.logit_rows]  # [R, W]
    rows, width = step.rows, step.width
    if step.trees:
        greedy = verify_tree_greedy(step.nodes, step.parents, step.place.block, step.depth, None, max_depth=step.max_depth, argmax=argmax)
    else:
        greedy = verify_greedy(step.nodes[:, 1:], None, argmax=argmax)
    probs = None
    if step.greedy is not None:
        probs = warp_rows(logits[step.logit_rows.reshape(-1)].view(rows, width, -1), step.temperature, step.top_k, step.top_p)
        verdict = _select(step.greedy, greedy, _sampled(step, probs))
    else:
        verdict = greedy
    if step.unverified is not None:  # EAD: every draft committed, then the target's token (argmax, or drawn)
        u_sample = None if step.uniforms is None else step.uniforms.gather(1, step.drafts[:, None])[:, 0]
        lossy = commit_unverified(step.nodes[:, 1:], None, None, None, step.drafts, argmax=argmax)
        if probs is not None:
            lossy = _select(step.greedy, lossy, commit_unverified(step.nodes[:, 1:], probs, None, u_sample, step.drafts))
        verdict = _select(~step.unverified, verdict, lossy)
    return verdict


def _sampled(step: Step, probs: torch.Tensor) -> Verdict:
    """The rejection rule of every sampled row. A chain keeps the chain rule in a step with trees: its uniforms are then
    read the same way whatever shares its step, so a seeded row draws the same tokens alone and beside a tree."""
    u = step.uniforms
    u_sample = u.gather(1, step.drafts[:, None])[:, 0]
    q = None if step.q is None else step.q[:, 1:]
    chains = verify_speculative(step.nodes[:, 1:], q, probs, u[:, : step.width - 1], u_sample, step.drafts, step.has_q)
    if not step.trees:
        return chains
    trees = verify_tree_speculative(step.nodes, _children(step, step.width), step.q, probs, u, u_sample, step.max_depth, step.has_q)
    return _select(_chain_rows(step), chains, trees)


def _chain_rows(step: Step) -> torch.Tensor:
    """[R] bool: rows whose drafts form a chain (each node's parent the node before it, up to the row's own drafts)."""
    idx = torch.arange(1, step.width, device=step.parents.device)
    return ((step.parents[:, 1:] == idx - 1) | (idx > step.drafts[:, None])).all(1)


def _select(keep: torch.Tensor, a: Verdict, b: Verdict) -> Verdict:
    """Row b's verdict from ``a`` where ``keep[b]``, else from ``b`` (both over the same rows; a chain's path, where
    the other is a tree's, is its positions in order)."""
    width = min(a.tokens.shape[1], b.tokens.shape[1])
    tokens = torch.where(keep[:, None], a.tokens[:, :width], b.tokens[:, :width])
    path = None
    if a.path is not None or b.path is not None:
        chain = torch.arange(width, device=tokens.device).expand(tokens.shape[0], width)
        pa, pb = (chain if v.path is None else v.path[:, :width] for v in (a, b))
        path = torch.where(keep[:, None], pa, pb)
    return Verdict(torch.where(keep, a.num_accepted, b.num_accepted), tokens, path)


def _children(step: Step, width: int) -> torch.Tensor:
    """[R, W, C] each node's children in draw order (-1 past the last), built on the host from the step's trees."""
    parents = step.parents.tolist() if not step.parents.is_cuda else step.parents.cpu().tolist()
    tables = [children_table([-1, *p[1:t]]) + [[] for _ in range(width - t)] for p, t in zip(parents, step.widths, strict=True)]
    most = max(1, max(len(c) for table in tables for c in table))
    flat = [[c + [-1] * (most - len(c)) for c in table] for table in tables]
    return torch.as_tensor(flat, dtype=torch.long, device="cpu").to(step.nodes.device, non_blocking=True)


@dataclass
class StepResult:
    proposal: Proposal
    num_accepted: int  # m
    committed: list[int]  # the m accepted drafts and the target's token
    logits: torch.Tensor  # [1, j+1, V] the target's logits that judged the proposal
    record: StepRecord


def verify_step(
    states: list[DecodeState],
    drafters: list[Drafter],
    proposals: list[Proposal],
    draft_s: list,
    batch_cache: KVCache | None = None,
    workspace: Workspace | None = None,
) -> list[StepResult]:
    """Run the target once over every row's [pending, drafts], verify every row on the device, commit each row.

    One row: the forward runs on the row's own cache exactly as a single-sequence loop would (a drafter's
    hidden states are continued from its layer; trees pass their mask). Several rows: ``batch_cache`` is the
    view of the rows' shared cache (row b of it is ``states[b].target_cache``); the rows are padded to the
    widest and each writes at and reads up to its own length. Mutates each state (tokens grow by m+1, the
    cache covers pending and the m accepted drafts) and tells each drafter its verdict. ``draft_s``: each row's
    drafting time, seconds or a pair of :class:`Clock` marks (read after the step's one synchronisation).
    """
    target = states[0].target
    ws = workspace or Workspace(target.device)
    clock = ws.clock
    t1 = clock.mark()
    rows = len(states)
    step = ws.build(states, proposals)
    if target.graphs is not None:  # indexed writes even for one row: the static form its graphs replay
        step.place.start = None
    layers = sorted({layer for d in drafters for layer in d.feature_layers})
    captured = dict.fromkeys(layers) if layers else None
    cache = states[0].target_cache if rows == 1 else batch_cache
    if cache is None:
        raise ValueError("several rows need their shared cache (batch_cache)")
    proposal = proposals[0]
    if not getattr(cache, "plain", False):  # a sparse view (TriForce's middle level): its adapter places by position
        start, tree = step.lengths[0] - 1, proposal.tree
        kw = dict(positions=step.positions, captured=captured, tree_mask=None if tree is None else tree.mask)
        if proposal.hidden is not None:
            h = target.forward(cache, start, hidden=proposal.hidden, first=proposal.layer, **kw)
        else:
            h = target.forward(cache, start, input_ids=step.ids, **kw)
    elif rows == 1 and proposal.hidden is not None:  # continue from the drafter's layer (self-speculation)
        if captured and min(captured) <= proposal.layer:
            raise ValueError(f"a drafter that continues from layer {proposal.layer} cannot be asked for layers {sorted(captured)}")
        h = target.forward(
            cache, None, hidden=proposal.hidden, first=proposal.layer, positions=step.positions, captured=captured, place=step.place
        )
    else:
        h = target.forward(cache, None, input_ids=step.ids, positions=step.positions, captured=captured, place=step.place)
    flat_h = h.reshape(-1, h.shape[-1])
    logits = target.logits((flat_h if step.valid is None else flat_h[step.valid])[None])[0]  # [N, V]
    verdict = verify_rows(step, logits)
    parts = [verdict.num_accepted[:, None], verdict.tokens]
    if verdict.path is not None:
        parts.append(verdict.path)
    packed = torch.cat(parts, 1)
    host = ws.read(packed)  # the step's one host read
    t2 = clock.mark()
    verify_s = clock.seconds(t1, t2)
    return [
        _commit_row(b, states[b], drafters[b], proposals[b], step, h, logits, verdict, host, captured, draft_s[b], verify_s, clock)
        for b in range(rows)
    ]


def _commit_row(b, state, drafter, proposal, step: Step, h, logits, verdict: Verdict, host, captured, draft_s, verify_s, clock):
    """Row b's verdict applied: its tokens committed (device and host), its cache rolled back to cover pending + the m
    accepted drafts (a tree's accepted branch moved into place), its drafter told; all from the step's one read."""
    n, t = step.lengths[b], step.widths[b]
    depth = verdict.tokens.shape[1]
    m = host[b][0]
    committed = host[b][1 : m + 2]
    if drafter.reads_tokens or not state.defer(committed):  # the verdict's row's ids, on the device now or when read
        state.commit(verdict.tokens[b : b + 1, : m + 1], committed)
    state.accepted_path = None
    row_h = h[b : b + 1]
    state.target_hidden = row_h[:, : m + 1]  # [1, m+1, H] pending + accepted drafts
    kept = slice(0, m + 1)
    if proposal.tree is not None:  # the accepted branch becomes the committed prefix: slots n-1+path -> n-1..n-1+m
        path = host[b][1 + depth : 2 + depth + m]
        state.target_cache.compact(n - 1, [i + n - 1 for i in path])
        state.accepted_path = path
        kept = verdict.path[b, : m + 1]
        state.target_hidden = row_h[:, kept]
    if drafter.feature_layers:  # [1, m+1, H] per layer the drafter reads, of the positions kept
        state.target_features = {layer: captured[layer][b : b + 1, :t][:, kept] for layer in drafter.feature_layers}
    state.target_cache.rollback(n + m)
    off = step.offsets[b]
    state.last_logits = logits[off : off + t][None]  # [1, t, V] every fed position's logits (Token Recycling)
    drafter.update(state, m)
    seconds = draft_s if isinstance(draft_s, float | int) else clock.seconds(*draft_s)
    caught = getattr(drafter, "caught_up", None)
    if caught is not None:
        drafter.caught_up = None
    catch_s = None if caught is None or isinstance(draft_s, float | int) else clock.seconds(draft_s[0], caught)
    record = StepRecord(drafted=t - 1, accepted=m, draft_s=seconds, verify_s=verify_s, rows=step.rows, catch_up_s=catch_s)
    return StepResult(proposal, m, committed, state.last_logits, record)


def propose(state: DecodeState, drafter: Drafter, k: int, clock: Clock | None = None, glance: bool = False) -> tuple[Proposal, object]:
    """The drafter's proposal of up to k drafts (none for k = 0; ``glance``: its lookup's, ``Drafter.glance``) and
    when it ran: seconds, or a pair of ``clock`` marks (on a GPU, read after the step's synchronisation)."""
    begin = clock.mark() if clock is not None else time.perf_counter()
    if k <= 0:
        proposal = Proposal.empty(state.rows, state.device)
    else:
        proposal = drafter.glance(state, k) if glance else drafter.propose(state, k)
    if clock is None:
        return proposal, time.perf_counter() - begin
    return proposal, (begin, clock.mark())


def truncate(proposal: Proposal, j: int) -> Proposal:
    """The first j drafts of a chain proposal (a drafter's state stays valid: it learns m <= j in ``update``)."""
    if proposal.size <= j:
        return proposal
    if proposal.host is not None:
        return Proposal(host=proposal.host[:j], device=proposal.device, kind=proposal.kind)
    return Proposal(
        tokens=proposal.tokens[:, :j],
        probs=None if proposal.probs is None else proposal.probs[:, :j],
        hidden=None if proposal.hidden is None else proposal.hidden[:, : j + 1],
        layer=proposal.layer,
        kind=proposal.kind,
    )


def speculative_step(state: DecodeState, drafter: Drafter, k: int) -> StepResult:
    """One step for one sequence: propose up to k drafts, run the target on [pending, drafts], verify, commit.

    A drafter that speculates itself (TriForce's middle level) calls it on its own state with its own inner drafter.
    """
    proposal, seconds = propose(state, drafter, k)
    return verify_step([state], [drafter], [proposal], [seconds])[0]


# ---- one row's rule outside a step (the prefill's first token, the two-sided runtime) ---------------------------


def verify(proposal: Proposal, logits: torch.Tensor, sampling: SamplingParams, generator) -> Verdict:
    """The greedy or the speculative-sampling rule for a chain (or, for unverified drafts, EAD's lossy commit):
    logits [B, j+1, V]."""
    if proposal.unverified:
        if sampling.greedy:
            return commit_unverified(proposal.tokens, None, logits, None)
        u_sample = torch.rand(logits.shape[0], generator=generator, device=logits.device)
        return commit_unverified(proposal.tokens, warp(logits, sampling), logits, u_sample)
    if sampling.greedy:
        return verify_greedy(proposal.tokens, logits)
    bsz, j = proposal.tokens.shape
    u = torch.rand(bsz, j + 1, generator=generator, device=logits.device)
    return verify_speculative(proposal.tokens, proposal.probs, warp(logits, sampling), u[:, :j], u[:, j])


def committed_by(verdict: Verdict) -> tuple[int, list[int]]:
    """(m, the m + 1 tokens the verdict commits: the accepted drafts, then the target's token) of a one-row verdict,
    in one read."""
    row = torch.cat([verdict.num_accepted[:1], verdict.tokens[0]]).tolist()
    return row[0], row[1 : row[0] + 2]
