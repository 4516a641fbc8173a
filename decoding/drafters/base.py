"""The drafter interface: propose k tokens, then learn from the verdict.

The interface is deliberately narrow (after transformers' candidate generators): ``start`` once per generation,
``propose`` before each target forward, ``update`` after the verdict. A drafter that ran the target's own first
layers on the proposed tokens (self-speculation) hands back their hidden states so verification continues from that
layer instead of recomputing it.

Shapes keep the batch dimension; the loop hands each drafter one sequence (B = 1) and batches the target's
verification across sequences (``decoding.loop``). The drafters live beside this module, one module each
(``ngram``, ``draft_model``, ``early_exit``, ``eagle``, ...); what model-based ones share (drafting a chain or a
tree with a model) is ``decoding.drafters.drafting``.
"""

from __future__ import annotations

import torch

from decoding.builders import builds
from decoding.model.adapter import KVCache, ModelAdapter
from decoding.sampling import SamplingParams
from decoding.trees.shapes import Tree

PROBE_EVERY = 8  # idle steps before a stopped drafter (a row's, a source's) tries again, doubling while it finds nothing


class ProposeGate:
    """Whether a model-free drafter whose proposals take measurable time should propose at a step at all. Its proposal
    comes before the width is chosen, so its seconds are paid at every step, drafted or not: suffix decoding's tries
    and corpus took about 0.4 ms a step on this CPU, a tenth of a 4 ms step, in categories where its drafts barely
    paid for their own verification (summarization, 2026-11-28).

    Over its recent proposals (decayed by ``decay``: about the last thirty) it weighs what they saved, ``accepted x a
    plain step`` less the verification they added, against the seconds they took. Once ``judge`` proposals are in and
    they saved less, the row stops proposing; after ``probe_every`` idle steps it proposes once (a probe) and goes on
    if the record then pays, else waits twice as long (up to ``most`` steps: drafts that pay come in bursts, and a
    wait of 128 steps missed them). A drafter whose proposals cost under ``CHEAP`` of a plain step (prompt lookup's
    0.02 ms) always proposes. Side by side over one first turn of each Spec-Bench category x 3 passes
    (2026-11-28), a memory of ten proposals and waits up to 128 took suffix from 0.940x to 0.989x AR and the hybrid
    from 0.961x to 0.969x, losing 10% on math; this rule, suffix 0.935x -> 0.981x, hybrid 0.940x -> 0.971x.

    Where the drafter can glance (``Drafter.glance``: prompt lookup's chain, nearly free), the alternative to a full
    proposal is the glance, not nothing: the loop counts as saved only what the proposal saved beyond what the glance
    would have (``Batch._gates``), and while the gate is shut the drafter glances; the steps it glances are idle ones
    (the glance's own savings say nothing of the full proposal's), so only a probe turns the full proposals back on.

    >>> g = ProposeGate()
    >>> for _ in range(16):
    ...     g.observe(True, saved=0.0001, spent=0.0004, plain_s=0.004)   # drafts that pay less than they cost
    >>> g.proposes
    False
    >>> for _ in range(PROBE_EVERY):
    ...     g.observe(False, 0.0, 0.0, 0.004)
    >>> g.proposes                                                        # a probe
    True
    >>> g.observe(True, saved=0.012, spent=0.0004, plain_s=0.004); g.proposes   # three tokens accepted: on again
    True
    """

    CHEAP = 0.02

    def __init__(self, decay: float = 0.97, judge: int = 16, most: int = 32):
        self.decay, self.judge, self.most = decay, judge, most
        self.saved = self.spent = 0.0
        self.n, self.on, self.idle, self.probe_every = 0, True, 0, PROBE_EVERY

    @property
    def proposes(self) -> bool:
        return self.on or self.idle >= self.probe_every

    def observe(self, proposed: bool, saved: float, spent: float, plain_s: float) -> None:
        """One step of the row: whether it proposed, the seconds its drafts saved (negative: their verification cost
        more than their tokens), the seconds the proposal took, and a plain step's seconds."""
        if not proposed:
            self.idle += 1
            return
        probe = not self.on
        self.saved, self.spent = self.decay * self.saved + saved, self.decay * self.spent + spent
        self.n += 1
        cheap = self.spent * (1 - self.decay) < self.CHEAP * plain_s  # about one proposal's seconds, decayed mean
        if self.n < self.judge or cheap or self.saved >= self.spent:
            if probe:
                self.probe_every = PROBE_EVERY
            self.on = True
            return
        if probe:
            self.probe_every = min(self.most, 2 * self.probe_every)
        self.on, self.idle = False, 0


class DecodeState:
    """What a drafter may read. The last committed token is pending: its KV is not yet in the target cache.

    The committed tokens are kept twice: ``tokens`` [B, n] on the target's device (a view of a buffer the loop
    fills in place, so a step allocates nothing for them) and ``history``, the same ids as host ints (row 0), which
    the loop extends from the one host read of a step; a model-free drafter looks them up there without reading
    the device. Code outside the loop that assigns ``tokens`` gets a ``history`` read back once from it.

    A one-row state defers the device half of a commit (:meth:`defer`): the ids wait in ``history`` and are written to
    the buffer, in one copy, when something reads ``tokens``. A batch of AR or model-free rows then spends no device
    operation a row on them (on a GPU, a launch each: the per-row host cost bounds a batched step there).
    """

    def __init__(
        self,
        tokens: torch.Tensor,  # [B, n] prompt + generated tokens
        target: ModelAdapter,
        target_cache: KVCache,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        max_len: int,  # cache capacity a drafter should allocate
        accepted_path: list[int] | None = None,
        target_hidden: torch.Tensor | None = None,
        last_logits: torch.Tensor | None = None,
        target_features: dict | None = None,
        history: list[int] | None = None,
    ):
        self.target, self.target_cache, self.sampling, self.generator, self.max_len = target, target_cache, sampling, generator, max_len
        self._buffer: torch.Tensor | None = None
        self._tokens = tokens
        self._history = history
        self._owed = 0  # the last ids of ``history`` not yet written to the buffer (:meth:`defer`)
        # trees: node indices of the last step's accepted path (root 0 first)
        self.accepted_path = accepted_path
        # [B, c, H] the target's last-layer (pre-norm) hidden states of the c positions its last forward kept in the
        # cache, ending at position n-2 (the prompt after prefill, pending + accepted drafts after a step)
        self.target_hidden = target_hidden
        # [B, T, V] the target's logits of the last verification, one row per fed position [pending, drafts...] (tree
        # nodes in node order), rejected ones included; set by the loop before ``update`` (Token Recycling reads it)
        self.last_logits = last_logits
        # {layer l: [B, c, H]} the target's hidden states after l layers at the positions of ``target_hidden``, for
        # the layers the drafter names in ``feature_layers`` (a feature-level drafter fuses several depths)
        self.target_features = target_features

    @property
    def tokens(self) -> torch.Tensor:
        if self._owed:
            self._settle()
        return self._tokens

    @tokens.setter
    def tokens(self, value: torch.Tensor) -> None:  # set from outside the loop: the buffer no longer holds them
        self._tokens, self._buffer, self._owed = value, None, 0

    @property
    def length(self) -> int:
        """n: committed tokens."""
        return self._tokens.shape[1] + self._owed

    @property
    def rows(self) -> int:
        """B (no device operation)."""
        return self._tokens.shape[0]

    @property
    def device(self) -> torch.device:
        return self._tokens.device

    @property
    def history(self) -> list[int]:
        """The committed token ids of row 0 as host ints (read back from ``tokens`` only when someone assigned them)."""
        if self._history is None or len(self._history) != self.length:
            self._history = self.tokens[0].tolist()
        return self._history

    def reserve(self, capacity: int) -> None:
        """Keep ``tokens`` in a buffer of ``capacity`` positions, so that :meth:`commit` writes in place."""
        n = self.tokens.shape[1]
        buffer = self.tokens.new_zeros(self.tokens.shape[0], max(capacity, n))
        buffer[:, :n] = self.tokens
        self._buffer, self._tokens = buffer, buffer[:, :n]

    def defer(self, host: list[int]) -> bool:
        """Commit ``host`` (row 0's ids, the only row) on the host alone, its device copy owed until ``tokens`` is read;
        False, with nothing done, where it cannot be (several rows, or no buffer with room): :meth:`commit` then."""
        if self._buffer is None or self._tokens.shape[0] != 1 or self.length + len(host) > self._buffer.shape[1]:
            return False
        history = self.history
        history.extend(host)
        self._owed += len(host)
        return True

    def _settle(self) -> None:
        """Write the owed ids into the buffer, in one copy."""
        n, owed = self._tokens.shape[1], self._owed
        self._owed = 0
        ids = torch.tensor(self._history[n : n + owed], dtype=self._tokens.dtype)
        self._buffer[0, n : n + owed] = ids.to(self._buffer.device, non_blocking=False)
        self._tokens = self._buffer[:, : n + owed]

    def commit(self, tokens: torch.Tensor, host: list[int]) -> None:
        """Append a step's committed tokens: ``tokens`` [B, c] on the device and the same ids as host ints."""
        n, c = self.tokens.shape[1], tokens.shape[1]
        history = self.history
        if self._buffer is not None and n + c <= self._buffer.shape[1]:
            self._buffer[:, n : n + c] = tokens
            self._tokens = self._buffer[:, : n + c]
        else:
            self.tokens = torch.cat([self.tokens, tokens], dim=1)
        history.extend(host)
        self._history = history


class Proposal:
    """A drafter's drafts for one step: a chain, or nodes 1..j of a token tree (node 0 = the pending token).

    ``tokens`` [B, j] on the device, or ``host`` (row 0's drafts as host ints, from a model-free drafter that looked
    them up on the host: the loop's step uploads them with its own inputs, in its one copy; ``tokens`` is made from
    them only for code that asks).
    """

    __slots__ = ("_tokens", "probs", "hidden", "layer", "tree", "host", "device", "unverified", "kind", "expected")

    def __init__(
        self,
        tokens=None,
        probs=None,
        hidden=None,
        layer: int = 0,
        tree: Tree | None = None,
        host=None,
        device=None,
        unverified=False,
        kind: int | None = None,
        expected: float | None = None,
    ):
        if tokens is None and host is None:
            raise ValueError("a proposal needs its tokens, on the device or the host")
        self._tokens = tokens  # [B, j] drafted tokens, 0 <= j <= k
        self.probs = probs  # [B, j, V] warped draft distributions; None = deterministic drafts
        self.hidden = hidden  # [B, j+1, H] target hidden after `layer` layers for [pending, drafts]
        self.layer = layer
        self.tree = tree  # the drafts are nodes 1..j of this tree (node 0 = pending); None = a chain
        self.host = None if host is None else list(host)
        self.device = tokens.device if tokens is not None else device
        # the drafts are committed without verification (EAD, lossy): the target's forward over them only catches its
        # cache up and adds its own token after them (``decoding.loop.verify.commit_unverified``)
        self.unverified = unverified
        # the drafter's own class of confidence in these drafts (prompt lookup: the size of the n-gram it matched):
        # k=auto keeps a row's acceptance apart per kind, where one mean would let weak drafts ride on strong ones
        self.kind = kind
        # the drafter's own calibrated estimate of the drafts the target will accept (the hybrid's, from how well each
        # source predicted so far): k=auto weighs a model-free tree by it instead of by its size's record
        self.expected = expected

    @property
    def tokens(self) -> torch.Tensor:
        if self._tokens is None:
            self._tokens = torch.tensor([self.host], dtype=torch.long, device=self.device)
        return self._tokens

    @property
    def size(self) -> int:
        """j: the drafts (known on the host, whichever side holds them)."""
        return len(self.host) if self.host is not None else self._tokens.shape[1]

    @staticmethod
    def empty(batch: int = 1, device=None) -> Proposal:
        return Proposal(host=[], device=device) if batch == 1 else Proposal(torch.zeros(batch, 0, dtype=torch.long, device=device))


class Drafter:
    """Base class: the no-op drafter proposes nothing (that is the AR baseline).

    What the loop reads of a drafter is declared here: ``name``, ``model_free``, ``batchable``,
    ``feature_layers``, ``tree`` (the shape it drafts, None for chains), ``context`` and :meth:`max_nodes`.
    """

    name = "none"
    model_free = False  # proposing costs (next to) nothing: k=auto lets it propose first, then cuts the proposal
    batchable = True  # False: it keeps the target cache for itself and decodes one sequence at a time
    feature_layers: tuple[int, ...] = ()  # target layers whose hidden states it reads (``DecodeState.target_features``)
    tree = None  # the token-tree shape it drafts (decoding.trees: Tree or Dynamic); None: chains
    # the most unfed positions a model drafter's catch-up feeds (its cache starts afresh at the last ones; None: all of
    # them): what k=auto's catch-up cost counts (decoding.drafters.eagle)
    context: int | None = None
    # a model drafter's mark (decoding.timing.mark) of when its latest proposal had fed the committed tokens it lacked,
    # before its drafts: k=auto learns what catching up costs a token and what a draft costs apart, from any step
    # (None: not measured; a catch-up and chain run as one graph; the loop resets it at each step)
    caught_up = None
    # whether it reads ``state.tokens`` (the device copy of the committed ids) at its steps: where it does not, a
    # one-row state defers that copy (``DecodeState.defer``); where it does, the loop writes the ids each step (reading
    # them owed would upload them, on a GPU a synchronisation). A drafter that reads them unflagged stays correct.
    reads_tokens = False

    def start(self, state: DecodeState) -> None:
        pass

    def propose(self, state: DecodeState, k: int) -> Proposal:
        return Proposal.empty(state.rows, state.device)

    def glance(self, state: DecodeState, k: int) -> Proposal:
        """A proposal at a lookup's cost, for the steps where k=auto's propose gate holds a model-free drafter's full
        proposal back (``ProposeGate``: it saves no more than the glance would, or less than it costs). None here; suffix
        decoding and the hybrid glance with prompt lookup (0.02 ms a step), which catches the copying that starts after
        their gate shut."""
        return Proposal.empty(state.rows, state.device)

    def lookahead(self, state: DecodeState, k: int) -> list[int]:
        """The chain :meth:`glance` would offer now, as host ints, proposing nothing: k=auto weighs a full proposal
        against it (``Batch._gates``). Nothing here."""
        return []

    def update(self, state: DecodeState, num_accepted: int) -> None:
        pass

    def max_nodes(self, k: int) -> int:
        """The most drafts one proposal may hold (the loop sizes the caches with it)."""
        return k

    def truncate(self, length: int) -> None:
        """An outer level cut the committed tokens back to their first ``length``: forget state beyond them.

        Only drafters used inside another drafter's speculative steps (TriForce's bottom level) see this.
        """


@builds("ar")
def _no_drafter(cfg, target, device, memory) -> None:
    return None
