"""The hybrid model-free drafter: prompt lookup, suffix decoding and Token Recycling merged into one tree per step.

Each source proposes a tree with an estimate of each node's chance to be accepted (its path probability):

* recycling: the product of the measured per-rank acceptance along the node's path (``recycling.RankStats``);
* suffix: the empirical continuation frequencies of the longest match (``suffix.best_first``);
* prompt lookup (``NgramDrafter.lookup_tree``): ``NGRAM_PRIOR ** depth``, halved per earlier sibling;
* a trained feature head (``eagle``, optional), run only where the copying sources expect little
  (``HEAD_WHEN``): its draft path probabilities.

Every source's estimates are calibrated by how well they predicted so far, node by node given the parent: a
node's conditional estimate (its path estimate over its parent's) is multiplied by the source's accepted nodes + 2
over its predicted conditional mass + 2, counted over the nodes whose parent the target accepted (a node under a
rejected parent says nothing about its own estimate), and the calibrated path estimate is the product along the
path. Prompt lookup and suffix decoding are calibrated per length of the match their tree grew from
(:func:`match_label`): a copy after one matching token is a guess, after eight nearly certain. One scale per source
let the guesses, the many, set it (on a QA prompt: suffix's estimates scaled by 0.09, prompt lookup's by 0.16), so
long matches ranked below recycling's candidates and the hybrid ran at 0.86x AR where prompt lookup alone ran at
1.31x; and a whole-path scale could not fit prompt lookup's depth profile (``NGRAM_PRIOR ** depth``). The trees
are merged into one trie (a node proposed by several sources keeps the best estimate); the nodes are ranked by
estimate (a child never outranks its parent, so every prefix of the ranking is a tree) and the step keeps the
prefix of b nodes that maximises expected tokens per second, (1 + sum of the b estimates) / cost(b + 1), with
``hardware.TreeChooser``'s measured verification cost (or exactly ``budget`` nodes without one). So a category
where one source is strong gets that source's long draft, and none is left with nothing to draft. The tree carries
the sum of its kept estimates (``Proposal.expected``, scaled by the record of its verified trees,
:meth:`HybridDrafter.tree_scale`), and k=auto judges the tree by it: judged by the record of
its size instead, the hybrid's trees (a long copy one step, a guess of the same size the next) averaged out below
what pays, and on 13 Spec-Bench prompts it drafted on 7% of its steps at 0.96x AR, where with its own estimate it
drafted on 75% at 1.22x (in-process, alternated with suffix at 1.36x and AR, two passes).

>>> merged = merge_trees([([5, 6], [0, 1], [0.9, 0.8], "suffix"), ([5, 7], [0, 0], [0.4, 0.3], "recycling")])
>>> [(tokens, parent, round(p, 2), sorted(src)) for tokens, parent, p, src in merged]
[(5, 0, 0.9, ['recycling', 'suffix']), (6, 1, 0.8, ['suffix']), (7, 0, 0.3, ['recycling'])]
"""

from __future__ import annotations

import time

import torch

from decoding.drafters.base import DecodeState, Drafter, Proposal, ProposeGate
from decoding.drafters.ngram import NgramDrafter
from decoding.drafters.recycling import RecyclingDrafter, verified_nodes
from decoding.drafters.suffix import SuffixDrafter, record_scale
from decoding.trees.shapes import Tree

NGRAM_PRIOR = 0.6  # prompt lookup's per-token acceptance before any is measured
# With a trained head (``decoding.drafters.eagle``) the hybrid drafts with it where copying offers little: when no
# model-free source expects this many accepted tokens from its whole tree (scaled estimates summed; a 3-token prompt
# lookup match expects 0.6 + 0.36 + 0.22 before calibration). Copying costs nothing; the head costs small forwards.
HEAD_WHEN = 1.0
# The sources that propose only while the nodes they alone proposed pay for their seconds (a ProposeGate each,
# HybridDrafter.judge): recycling's table, its top-k after every step and its Sequoia templates. Suffix decoding is
# not gated: the nodes it shares with prompt lookup credit neither, so judged by its own nodes it shut where it paid
# (math, 4 first turns: 306 steps -> 387 with both gated, 312 with recycling alone; 2026-11-29).
GATED = ("recycling",)


def match_label(source: str, length: int) -> str:
    """The calibration key of a copying source's tree grown from a match of ``length`` tokens: lengths 1, 2-3, 4-7
    and 8+ are calibrated apart.

    >>> match_label("suffix", 1), match_label("suffix", 5), match_label("ngram", 30)
    ('suffix:1', 'suffix:4', 'ngram:8')
    """
    return f"{source}:{1 << (min(max(length, 1), 8).bit_length() - 1)}"


def source_of(label: str) -> str:
    """The source a calibration key belongs to: ``source_of("suffix:4") == "suffix"``."""
    return label.split(":", 1)[0]


def merge_trees(trees) -> list[tuple[int, int, float, set]]:
    """Merge trees given as (tokens, parents, probs, source) into one trie, nodes ranked by estimate.

    Returns (token, parent, prob, sources) per node, parents indexing [root, nodes...] in the returned order.
    """
    nodes: dict[tuple, list] = {}  # token path -> [prob, sources]
    for tokens, parents, probs, source in trees:
        paths = [()]
        for tok, par, p in zip(tokens, parents, probs, strict=True):
            path = paths[par] + (tok,)
            paths.append(path)
            entry = nodes.setdefault(path, [0.0, set()])
            entry[0] = max(entry[0], p)
            entry[1].add(source)
    # a child's estimate never exceeds its parent's within a source, hence within the merge; ties: shallower first
    order = sorted(nodes, key=lambda path: (-nodes[path][0], len(path)))
    index = {(): 0}
    out = []
    for path in order:
        if path[:-1] not in index:  # unreachable for monotone estimates; kept safe
            continue
        index[path] = len(out) + 1
        out.append((path[-1], index[path[:-1]], nodes[path][0], nodes[path][1]))
    return out


class HybridDrafter(Drafter):
    reads_tokens = True  # it reads ``state.tokens`` at its steps
    name = "hybrid"

    def __init__(
        self,
        recycling: RecyclingDrafter,
        suffix: SuffixDrafter,
        ngram: NgramDrafter | None = None,
        budget: int = 16,
        chooser=None,
        head=None,
    ):
        self.recycling, self.suffix = recycling, suffix
        self.head = head  # an EagleDrafter, or None
        self.feature_layers = head.feature_layers if head is not None else ()
        self.model_free = head is None  # with a head, proposing costs forwards: k=auto must count them
        self.ngram = ngram or NgramDrafter(3, 1)
        self.budget, self.chooser = budget, chooser
        self._nodes: list[int] = []
        self._parents: list[int] = []
        self._sources: list[set] = []
        self._raw: list[dict] = []  # per node: source -> its unscaled estimate
        self._ranks: list[int | None] = []  # per node: its rank among recycling's candidates (None: not recycled)
        self._rank_of: dict = {}
        self._glanced = False  # the latest proposal was a glance (prompt lookup alone)
        self._expected = 0.0  # the latest tree's summed calibrated estimates (the record's)
        self._spent: dict[str, float] | None = None  # per gated source that proposed this step, its seconds (None: no full proposal)
        self.last_choice: dict = {}

    @property
    def context(self) -> int | None:
        """The head's (its catch-ups are the hybrid's)."""
        return self.head.context if self.head is not None else None

    @property
    def calibration(self) -> dict:
        """Per source (a copying source per match length, :func:`match_label`): [accepted nodes, predicted mass],
        shared with the decoder's memory (warm across requests)."""
        return self.recycling.memory.get("hybrid-calibration", dict)

    @property
    def record(self) -> list[float]:
        """[drafts accepted, drafts its estimates expected] over its verified trees (warm across requests, as suffix
        decoding's): what k=auto's choice of trees leaves of the estimates, see :meth:`tree_scale`."""
        return self.recycling.memory.get("hybrid-record", lambda: [0.0, 0.0])

    def tree_scale(self) -> float:
        """What a tree's summed estimates are worth to k=auto. The sources' calibration holds node by node, but k=auto
        verifies the trees whose estimates came out high, so the trees it chose expected more than the target took: on
        4 humanities prompts here, trees expecting 0.74 drafts had 0.60 accepted and those expecting 1.22 had 0.66
        (2026-11-29). The record of the verified trees (accepted + 2 over expected + 2) scales ``Proposal.expected`` and
        the estimates the tree's size is chosen on."""
        return record_scale(*self.record)

    def scale(self, label: str) -> float:
        return record_scale(*self.calibration.get(label, (0.0, 0.0)))

    def max_nodes(self, k: int) -> int:
        return self.chooser.max_budget if self.chooser is not None else self.budget

    def start(self, state: DecodeState) -> None:
        self.recycling.start(state)
        self.suffix.start(state)
        self.ngram.start(state)
        if self.head is not None:
            self.head.start(state)
        if self.recycling.cold:
            self.calibration.clear()
            self.record[:] = [0.0, 0.0]
            self.gates.clear()
        self._spent = None

    @property
    def gates(self) -> dict[str, ProposeGate]:
        """Per gated source, whether it proposes (:meth:`judge`), shared with the decoder's memory: warm across
        requests as the calibration is, so a source that did not pay is not judged again over 16 proposals per request."""
        gates = self.recycling.memory.get("hybrid-gates", dict)
        for source in GATED:
            gates.setdefault(source, ProposeGate())
        return gates

    def runs(self, source: str) -> bool:
        """Whether a gated source proposes this step: while its nodes pay for its seconds, and now and then to know
        again (always without a measured verification cost, ``tree_fit=budget``)."""
        return source not in GATED or self.chooser is None or self.gates[source].proposes

    def candidates(self, state: DecodeState, k: int) -> list[tuple[list[int], list[int], list[float], str]]:
        seq = state.tokens[0]
        root = int(seq[-1])
        cap = self.max_nodes(k)
        out = []
        for size in range(self.ngram.ngram_max, self.ngram.ngram_min - 1, -1):  # each match length its own tree
            toks, pars = self.ngram.lookup_tree(seq, k, cap, sizes=(size,))
            if toks:
                out.append((toks, pars, _lookup_estimates(pars), match_label("ngram", size)))
        self.suffix.catch_up(state)
        toks, pars, probs, matched = self.suffix.draft(seq[-self.suffix.max_match :].tolist(), k, cap)
        if toks:
            out.append((toks, pars, probs, match_label("suffix", matched)))
        self._spent, self._rank_of = {}, {}
        if not self.runs("recycling"):
            return out
        t = time.perf_counter()
        toks, pars, ranks = self.recycling.draft(root, k)
        self._spent["recycling"] = time.perf_counter() - t
        if toks:
            acc = self.recycling.stats.acceptance()
            probs, paths = [], [()]
            for tok, p, r in zip(toks, pars, ranks, strict=True):
                probs.append((probs[p - 1] if p else 1.0) * (acc[r] if r < len(acc) else 0.0))
                paths.append(paths[p] + (tok,))
                self._rank_of[paths[-1]] = r
            out.append((toks, pars, probs, "recycling"))
        return out

    def propose(self, state: DecodeState, k: int) -> Proposal:
        self._glanced = False
        return self._tree(state, k, self.candidates(state, k) if k > 0 else [])

    def glance(self, state: DecodeState, k: int) -> Proposal:
        """Prompt lookup's chain alone, as prompt lookup proposes it (``NgramDrafter.propose``: constant time a step,
        where the tries, the recycling table and the merge take 0.2-1 ms); k=auto weighs it as it weighs prompt lookup's
        chains, by the row's acceptance of its match length (``Proposal.kind``), and may cut it. Made a one-branch tree
        with the hybrid's calibrated estimate, it was verified as a tree, whole or not at all: side by side (52 first
        turns, one process, 2026-11-29) the hybrid ran at 1.077x AR with that glance and 1.102x with this one, worst
        category 0.977x -> 1.000x. The recycling table is not fed after a glance (its top-k over the vocabulary, 0.15 ms
        a step): it proposes nothing while the gate is shut, and it is warm across requests."""
        self._glanced, self._spent, self._expected = True, None, 0.0
        self._nodes, self._parents, self._sources, self._raw, self._ranks = [state.history[-1]], [], [], [], []
        return self.ngram.propose(state, k) if k > 0 else Proposal.empty(1, state.tokens.device)

    def lookahead(self, state: DecodeState, k: int) -> list[int]:
        return self.ngram.propose(state, k).host if k > 0 else []

    def _tree(self, state: DecodeState, k: int, trees: list) -> Proposal:
        """The merged, calibrated tree of the sources' ``trees`` (the head's too where they expect little), cut where more
        nodes stop paying; what each kept node's sources estimated is kept for ``update``."""
        self._nodes, self._parents, self._sources, self._raw, self._ranks = [state.history[-1]], [], [], [], []
        self._expected = 0.0
        if k <= 0:
            return Proposal.empty(1, state.tokens.device)
        raw = [(toks, pars, conditionals(pars, probs), src) for toks, pars, probs, src in trees]
        scaled = [(toks, pars, self.estimates(pars, cond, src), src) for toks, pars, cond, src in raw]
        if self.head is not None and max((sum(probs) for *_, probs, _ in scaled), default=0.0) < HEAD_WHEN:
            toks, pars, probs = self.head.draft_tree(state, k)
            if toks:
                cond = conditionals(pars, probs)
                raw.append((toks, pars, cond, "eagle"))
                scaled.append((toks, pars, self.estimates(pars, cond, "eagle"), "eagle"))
        merged = merge_trees(scaled)
        raw_of = {}
        for toks, pars, cond, src in raw:  # the unscaled conditional estimate of every (path, source), for calibration
            paths = [()]
            for tok, par, p in zip(toks, pars, cond, strict=True):
                paths.append(paths[par] + (tok,))
                raw_of[(paths[-1], src)] = p
        scale = self.tree_scale()  # what the verified trees were worth: the size that pays is chosen on it too
        b = self.pick_size([min(1.0, scale * p) for _, _, p, _ in merged])
        merged = merged[:b]
        paths = [()]
        for tok, par, _, src in merged:
            paths.append(paths[par] + (tok,))
            self._nodes.append(tok)
            self._parents.append(par)
            self._sources.append(src)
            self._raw.append({s: raw_of.get((paths[-1], s), 0.0) for s in src})
            self._ranks.append(self._rank_of.get(paths[-1]))
        self.last_choice = {"nodes": b, "sources": sorted({source_of(s) for src in self._sources for s in src})}
        if not merged:
            return Proposal.empty(1, state.tokens.device)
        ids = torch.tensor([self._nodes[1:]], dtype=torch.long, device=state.tokens.device)
        self._expected = sum(p for _, _, p, _ in merged)
        return Proposal(tokens=ids, tree=Tree.from_parents([-1] + self._parents), expected=scale * self._expected)

    def estimates(self, parents: list[int], cond: list[float], label: str) -> list[float]:
        """Calibrated path estimates of one source's tree: the product along each node's path of its conditional
        estimates, each rescaled by the label's record (capped at 1)."""
        scale, out = self.scale(label), []
        for par, c in zip(parents, cond, strict=True):
            out.append((out[par - 1] if par else 1.0) * min(1.0, scale * c))
        return out

    def pick_size(self, probs: list[float]) -> int:
        """How many of the ranked nodes to verify: the most expected tokens per second (exactly the budget without a chooser)."""
        return self.chooser.prefix(probs) if self.chooser is not None else min(len(probs), self.budget)

    def update(self, state: DecodeState, num_accepted: int) -> None:
        if self.head is not None:
            self.head.update(state, num_accepted)
        if state.last_logits is not None and not self._glanced and self.runs("recycling"):
            t = time.perf_counter()
            self.recycling.observe(verified_nodes(state, num_accepted, self._nodes), state.last_logits[0])
            if self._spent is not None and "recycling" in self._spent:
                self._spent["recycling"] += time.perf_counter() - t
        verified = state.last_logits is not None and state.last_logits.shape[1] == len(self._nodes)
        self._nodes = []
        if self._parents and verified:  # a tree k=auto dropped unverified tested none of its estimates
            self._record(state, num_accepted)
            record = self.record
            record[0] += num_accepted
            record[1] += self._expected
        if self._spent is not None:  # a full proposal: each gated source proposed or was held back
            self.judge(state, num_accepted if self._parents and verified else None)
        self._parents, self._sources, self._raw, self._ranks = [], [], [], []  # a step without a proposal must not reuse them
        self._spent = None

    def judge(self, state: DecodeState, num_accepted: int | None) -> None:
        """Tell each gated source's :class:`ProposeGate` what it cost and saved this step: its seconds, and the
        accepted nodes that it alone had proposed, each worth a plain step, less the verification its own nodes added
        (``num_accepted`` None: no tree was verified, nothing saved). A source the gate held back had an idle step.
        Side by side in one process (52 Spec-Bench first turns, 2026-11-29), the hybrid with recycling removed ran at
        1.101x AR and with it 1.057x: its table and Sequoia templates cost more than its nodes saved, in every category;
        with this gate 1.067x against 1.035x ungated (better in 12 of the 13, the worst 0.970x against 0.943x)."""
        if self.chooser is None:
            return
        plain, nodes = self.chooser.cost(1), len(self._parents)
        on_path = set(state.accepted_path if state.accepted_path is not None else range((num_accepted or 0) + 1))
        for source, gate in self.gates.items():
            if source not in self._spent:
                gate.observe(False, 0.0, 0.0, plain)
                continue
            saved = 0.0
            if num_accepted is not None:
                alone = [i for i, src in enumerate(self._sources, 1) if {source_of(s) for s in src} == {source}]
                width = self.chooser.cost(nodes + 1) - self.chooser.cost(nodes + 1 - len(alone))
                saved = sum(i in on_path for i in alone) * plain - width
            gate.observe(True, saved, self._spent[source], plain)

    def _record(self, state: DecodeState, num_accepted: int) -> None:
        path = state.accepted_path if state.accepted_path is not None else list(range(num_accepted + 1))
        cal, on_path = self.calibration, set(path)  # node 0 (the root) is on it; a node i >= 1 on it was accepted
        for i, raw in enumerate(self._raw, 1):
            if self._parents[i - 1] not in on_path:  # its parent was rejected: nothing said about this node's estimate
                continue
            for src, p in raw.items():
                entry = cal.setdefault(src, [0.0, 0.0])
                entry[1] += p
                entry[0] += i in on_path
        # recycling's per-rank acceptance, learnt at the accepted path's nodes where recycling proposed children
        stats, recycled_parents = self.recycling.stats, {p for p, r in zip(self._parents, self._ranks, strict=True) if r is not None}
        for j, node in enumerate(path):
            if node not in recycled_parents:
                break
            stats.visits += 1
            r = self._ranks[path[j + 1] - 1] if j + 1 < len(path) else None
            if r is not None and r < stats.width:
                stats.accepted[r] += 1


def _lookup_estimates(parents: list[int]) -> list[float]:
    """Prompt lookup's node estimates before calibration: ``NGRAM_PRIOR ** depth``, halved per earlier sibling, never
    above the parent's.

    >>> [round(p, 3) for p in _lookup_estimates([0, 1, 0])]   # a chain of two and a second first token
    [0.6, 0.36, 0.3]
    """
    probs, depth, kids = [], [0], {}
    for p in parents:
        rank = kids.get(p, 0)
        kids[p] = rank + 1
        depth.append(depth[p] + 1)
        probs.append(min(NGRAM_PRIOR ** depth[-1] * 0.5**rank, probs[p - 1] if p else 1.0))
    return probs


def conditionals(parents: list[int], probs: list[float]) -> list[float]:
    """Each node's estimate given its parent accepted: its path estimate over its parent's (the root's is 1).

    >>> conditionals([0, 1, 0], [0.5, 0.25, 0.2])
    [0.5, 0.5, 0.2]
    """
    out = []
    for par, p in zip(parents, probs, strict=True):
        above = probs[par - 1] if par else 1.0
        out.append(p / above if above > 0 else 0.0)
    return out
