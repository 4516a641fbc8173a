"""Drafters: propose k tokens, then learn from the verdict.

The interface is deliberately narrow (after transformers' candidate
generators): ``start`` once per generation, ``propose`` before each target
forward, ``update`` after the verdict. A drafter that ran the target's own
first layers on the proposed tokens (self-speculation) hands back their hidden
states so verification continues from that layer instead of recomputing it.

Shapes keep the batch dimension; the loop hands each drafter one sequence (B = 1) and batches the
target's verification across sequences (``decoding.loop.loop.Batch``).

The builders of ``ar``, ``ngram``, ``early-exit``, ``sps`` and ``pearl`` (``decoding.builders``) are at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.builders import builds
from decoding.errors import ConfigError
from decoding.model.adapter import KVCache, ModelAdapter
from decoding.model.models import load_model
from decoding.sampling import SamplingParams, choose, warp
from decoding.trees.trees import Dynamic, Tree, tree_shape


@dataclass
class DecodeState:
    """What a drafter may read. The last committed token is pending: its KV is not yet in the target cache."""

    tokens: torch.Tensor  # [B, n] prompt + generated tokens
    target: ModelAdapter
    target_cache: KVCache
    sampling: SamplingParams
    generator: torch.Generator | None
    max_len: int  # cache capacity a drafter should allocate
    accepted_path: list[int] | None = None  # trees: node indices of the last step's accepted path (root 0 first)
    # [B, c, H] the target's last-layer (pre-norm) hidden states of the c positions its last forward kept in the
    # cache, ending at position n-2 (the prompt after prefill, pending + accepted drafts after a step)
    target_hidden: torch.Tensor | None = None
    # [B, T, V] the target's logits of the last verification, one row per fed position [pending, drafts...] (tree nodes
    # in node order), rejected ones included; set by the loop before ``update`` (Token Recycling reads it)
    last_logits: torch.Tensor | None = None
    # {layer l: [B, c, H]} the target's hidden states after l layers at the positions of ``target_hidden``, for the
    # layers the drafter names in ``feature_layers`` (a feature-level drafter fuses several depths)
    target_features: dict | None = None


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, j] drafted tokens, 0 <= j <= k
    probs: torch.Tensor | None = None  # [B, j, V] warped draft distributions; None = deterministic drafts
    hidden: torch.Tensor | None = None  # [B, j+1, H] target hidden after `layer` layers for [pending, drafts]
    layer: int = 0
    tree: Tree | None = None  # the drafts are nodes 1..j of this tree (node 0 = pending); None = a chain

    @staticmethod
    def empty(batch: int, device=None) -> Proposal:
        return Proposal(tokens=torch.zeros(batch, 0, dtype=torch.long, device=device))


class Drafter:
    """Base class: the no-op drafter proposes nothing (that is the AR baseline)."""

    name = "none"
    model_free = False  # proposing costs (next to) nothing: k=auto lets it propose first, then cuts the proposal
    batchable = True  # False: it keeps the target cache for itself and decodes one sequence at a time
    feature_layers: tuple[int, ...] = ()  # target layers whose hidden states it reads (``DecodeState.target_features``)

    def start(self, state: DecodeState) -> None:
        pass

    def propose(self, state: DecodeState, k: int) -> Proposal:
        return Proposal.empty(state.tokens.shape[0], state.tokens.device)

    def update(self, state: DecodeState, num_accepted: int) -> None:
        pass

    def max_nodes(self, k: int) -> int:
        """The most drafts one proposal may hold (the loop sizes the caches with it)."""
        return k

    def truncate(self, length: int) -> None:
        """An outer level cut the committed tokens back to their first ``length``: forget state beyond them.

        Only drafters used inside another drafter's speculative steps (TriForce's bottom level) see this.
        """


def _draft_chain(step, first_logits, k, state, threshold, feed_last):
    """Draft up to k tokens autoregressively; shared by every model-based drafter.

    ``step(token [B], i, need_logits) -> logits [B, V] | None`` feeds draft i
    (0-based) and returns the next-token logits when asked for them. Drafting stops early when the top-1 probability of
    the next draft falls below ``threshold`` for every row (Kangaroo's double
    early exit). With ``feed_last`` the final draft is fed too (its logits are
    not needed, but its state is), else it is not.
    Returns (tokens [B, j], probs [B, j, V] or None, number of drafts fed).
    """
    tokens, probs = [], []
    logits, fed = first_logits, 0
    for i in range(k):
        tok, q, conf = choose(logits, state.sampling, state.generator)
        if threshold > 0 and bool((conf < threshold).all()):
            break
        tokens.append(tok)
        if q is not None:
            probs.append(q)
        if i == k - 1 and not feed_last:
            break
        logits = step(tok, i, i < k - 1)
        fed += 1
    bsz = first_logits.shape[0]
    out = torch.stack(tokens, 1) if tokens else torch.zeros(bsz, 0, dtype=torch.long, device=first_logits.device)
    return out, (torch.stack(probs, 1) if probs else None), fed


def _candidates(logits: torch.Tensor, n: int, state: DecodeState, stochastic: bool):
    """The n candidate children of a node from its draft logits [B, V].

    Greedy: the top-n tokens (deterministic). Sampling with ``stochastic``: n draws without replacement from the
    warped q, in draw order (Gumbel top-n, which is successive sampling without replacement). Sampling otherwise:
    the top-n tokens of q (deterministic; verified with one-hot q).
    Returns (tokens [B, n], q [B, V] or None, score [n] = q of each candidate in row 0, valid [n] bool).
    """
    if state.sampling.greedy:
        q = logits.float().softmax(-1)
        score, tok = q.topk(n, dim=-1)
        return tok, None, score[0], score[0] >= 0
    q = warp(logits, state.sampling)
    if stochastic:
        u = torch.rand(q.shape, generator=state.generator, device=q.device).clamp_(min=1e-20)
        tok = (q.log() - (-u.log()).log()).topk(n, dim=-1).indices  # log q + Gumbel noise
    else:
        tok = q.topk(n, dim=-1).indices
    score = q.gather(-1, tok)[0]
    return tok, (q if stochastic else None), score, score > 0


def _draft_tree(
    step,
    root_logits: torch.Tensor,
    shape: Tree | Dynamic,
    k: int,
    state: DecodeState,
    feed_last: bool,
    path_probs: list | None = None,
    order: list | None = None,
):
    """Grow a token tree of drafts; shared by every model-based tree drafter (the tree analogue of ``_draft_chain``).

    ``step(tokens [B, t], lo, hi, tree) -> logits [B, t, V]`` feeds nodes lo..hi-1 of ``tree`` (a contiguous
    block after every node already fed) and returns their next-token logits. Node 0 is the pending token whose
    logits are ``root_logits`` [B, V]. The tree's depth is at most k.

    * ``Tree`` (static, Sequoia): one draft forward per depth level over all nodes of that level; a node of rank
      r is its parent's r-th candidate (``_candidates``); candidates of probability 0 are pruned with their subtree.
      Under sampling the candidates are drawn without replacement, so the verifier must update q.
    * ``Dynamic`` (DySpec): best-first expansion by path probability (product of the draft's candidate
      probabilities from the root) up to ``budget`` nodes. A child of a node not yet fed cannot score more than
      that node's path probability, so candidates are popped while they beat every unfed node; then all unfed
      nodes go through one forward. The tree equals sequential best-first expansion. Its shape depends on the
      candidates' own probabilities, so the candidates are deterministic (top ranks; one-hot q in verification),
      which keeps sampling lossless.

    With ``feed_last`` every node is fed (early exit needs all their hidden states), else the deepest ones are not.
    Returns (tokens [B, j], probs [B, j, V] or None, tree over j+1 nodes, fed: nodes 1..fed were fed). For a
    ``Dynamic`` shape ``path_probs`` (a list) receives each node's path probability, in node order (non-increasing:
    every prefix of the nodes is a tree). ``order`` (a list) receives, per returned node (the root first), the index it
    had while drafting: level-wise trees rerank their nodes, and a drafter that kept per-node state in drafting order
    (early exit's hidden states) gathers it by this.
    """
    parents, toks, probs = [-1], [], []  # the drafted tree so far: node i's parent, token [B] and q row [B, V]
    fed = 0

    def feed(lo, hi):
        nonlocal fed
        tree = Tree.from_parents(parents)
        logits = step(torch.stack(toks[lo - 1 : hi - 1], 1), lo, hi, tree)  # [B, hi-lo, V]
        fed = hi - 1
        return {lo + i: logits[:, i] for i in range(hi - lo)}

    def add(parent, tok, q):
        parents.append(parent)
        toks.append(tok)
        if q is not None:
            probs.append(q)
        return len(parents) - 1

    if isinstance(shape, Tree):
        # the template's nodes ("slots") become drafted nodes where their parent was drafted and their rank is valid
        shape = shape.prune(k)
        slot_parent, slot_rank, slot_depth = shape.parents.tolist(), shape.rank.tolist(), shape.depth.tolist()
        children_of_slot = [0] * shape.size
        for parent_slot in slot_parent[1:]:
            children_of_slot[parent_slot] += 1
        node_of_slot, logits_of_node, candidates_of_node = {0: 0}, {0: root_logits}, {}
        for level in range(1, shape.max_depth + 1):
            lo = len(parents)
            for slot in (i for i in range(shape.size) if slot_depth[i] == level):
                parent = node_of_slot.get(slot_parent[slot])
                if parent is None or parent not in logits_of_node:
                    continue
                if parent not in candidates_of_node:
                    n_children = children_of_slot[slot_parent[slot]]
                    candidates_of_node[parent] = _candidates(logits_of_node[parent], n_children, state, stochastic=True)
                cand_tokens, cand_q, _, cand_valid = candidates_of_node[parent]
                if bool(cand_valid[slot_rank[slot]]):
                    node_of_slot[slot] = add(parent, cand_tokens[:, slot_rank[slot]], cand_q)
            hi = len(parents)
            if hi == lo:
                break
            next_level = (slot for slot in range(shape.size) if slot_depth[slot] == level + 1)
            grows = any(node_of_slot.get(slot_parent[child], -1) >= lo for child in next_level)
            if grows or feed_last:
                logits_of_node.update(feed(lo, hi))
    elif shape.width > 0:
        return _draft_levels(feed, add, parents, toks, root_logits, shape, k, state, feed_last, path_probs, order)
    else:
        import heapq

        budget, depth, path_p = (shape.budget if k > 0 else 0), [0], [1.0]
        heap: list = []  # (-path score, parent node, rank, candidate tokens [B, n], candidate scores [n])

        def offer(node, logits):
            if depth[node] < k:
                cand_tokens, _, cand_scores, cand_valid = _candidates(logits, min(shape.max_rank, budget), state, stochastic=False)
                n_valid = int(cand_valid.sum())
                if n_valid:
                    neg_path_p = -path_p[node] * float(cand_scores[0])  # the path probability through the best candidate
                    heapq.heappush(heap, (neg_path_p, node, 0, cand_tokens[:, :n_valid], cand_scores[:n_valid]))

        offer(0, root_logits)
        while len(parents) - 1 < budget:
            unfed = [i for i in range(fed + 1, len(parents)) if depth[i] < k]
            bound = max((path_p[i] for i in unfed), default=0.0)
            if not heap or -heap[0][0] < bound:
                if not unfed:
                    break
                for node, logits in feed(fed + 1, len(parents)).items():
                    offer(node, logits)
                continue
            neg_path_p, parent, rank, cand_tokens, cand_scores = heapq.heappop(heap)
            add(parent, cand_tokens[:, rank], None)
            depth.append(depth[parent] + 1)
            path_p.append(-neg_path_p)
            if rank + 1 < cand_tokens.shape[1]:  # the parent's next candidate takes its place in the queue
                heapq.heappush(heap, (-path_p[parent] * float(cand_scores[rank + 1]), parent, rank + 1, cand_tokens, cand_scores))
        if feed_last and fed < len(parents) - 1:
            feed(fed + 1, len(parents))
        if path_probs is not None:
            path_probs[:] = path_p
    if order is not None:
        order[:] = list(range(len(parents)))
    bsz = root_logits.shape[0]
    out = torch.stack(toks, 1) if toks else torch.zeros(bsz, 0, dtype=torch.long, device=root_logits.device)
    return out, (torch.stack(probs, 1) if probs else None), Tree.from_parents(parents), fed


def _draft_levels(feed, add, parents, toks, root_logits, shape: Dynamic, k: int, state: DecodeState, feed_last: bool, path_probs, order):
    """``_draft_tree`` for ``Dynamic(width=w)``: EAGLE-2's level-by-level growth. Each level takes the w most probable
    children (by path probability) of the nodes of the level before, which were fed together in one forward; then
    all drafted nodes are ranked by path probability (a child never above its parent; ties: shallower first) and the
    best ``budget`` form the tree, in that order. The reranked nodes are not where they were fed, so ``fed`` is 0."""
    width, path_p, depth = shape.width, [1.0], [0]
    level, logits_of = [0], {0: root_logits}
    for d in range(1, k + 1):
        cands = []
        for node in level:
            tokens, _, scores, valid = _candidates(logits_of[node], min(width, shape.max_rank), state, stochastic=False)
            cands += [(path_p[node] * float(scores[r]), node, tokens[:, r]) for r in range(int(valid.sum()))]
        if not cands:
            break
        cands.sort(key=lambda c: -c[0])
        level = []
        for p, parent, tok in cands[:width]:
            level.append(add(parent, tok, None))
            path_p.append(p)
            depth.append(d)
        if d < k or feed_last:
            logits_of.update(feed(level[0], level[-1] + 1))
    kept = sorted(range(1, len(parents)), key=lambda i: (-path_p[i], depth[i]))[: shape.budget if k > 0 else 0]
    new_index = {0: 0, **{old: i + 1 for i, old in enumerate(kept)}}
    kept_parents = [-1] + [new_index[parents[i]] for i in kept]
    if path_probs is not None:
        path_probs[:] = [1.0] + [path_p[i] for i in kept]
    if order is not None:
        order[:] = [0] + kept
    bsz = root_logits.shape[0]
    out = torch.stack([toks[i - 1] for i in kept], 1) if kept else torch.zeros(bsz, 0, dtype=torch.long, device=root_logits.device)
    return out, None, Tree.from_parents(kept_parents), 0


def _tree_forward(adapter: ModelAdapter, cache: KVCache, root_slot: int, tree: Tree, lo: int, hi: int, **kw) -> torch.Tensor:
    """Run ``adapter`` on tree nodes lo..hi-1 (their KV at slots root_slot+lo..) with the tree's mask and positions."""
    bsz = (kw.get("input_ids") if kw.get("input_ids") is not None else kw["hidden"]).shape[0]
    positions = tree.positions(root_slot)[lo:hi].to(adapter.device).unsqueeze(0).expand(bsz, -1)
    return adapter.forward(cache, root_slot + lo, positions=positions, tree_mask=tree.mask[lo:hi, :hi], **kw)


class DraftModelDrafter(Drafter):
    """SpS: a separate (smaller) model with its own cache drafts k tokens.

    The draft cache lags the committed tokens by whatever the last verdict
    added; ``propose`` first catches up on those tokens in one forward.
    """

    name = "sps"

    def __init__(self, adapter: ModelAdapter, confidence_threshold: float = 0.0, tree: Tree | Dynamic | None = None):
        self.adapter = adapter
        self.threshold = confidence_threshold
        self.tree = tree  # None: draft a chain; else the shape of the tree to draft
        self.cache: KVCache | None = None
        self._base = 0  # committed length when drafting started
        self._fed = 0  # drafts fed into the draft cache (trees: nodes 1.._fed)

    def max_nodes(self, k: int) -> int:
        return max_nodes_of(self.tree, k)

    def start(self, state: DecodeState) -> None:
        self.cache = self.adapter.new_cache(state.tokens.shape[0], state.max_len)

    def propose(self, state: DecodeState, k: int) -> Proposal:
        n = state.tokens.shape[1]
        cache, a = self.cache, self.adapter
        h = a.forward(cache, cache.length, input_ids=state.tokens[:, cache.length : n])
        self._base = n

        if self.tree is not None:

            def tree_step(toks, lo, hi, tree):
                return a.logits(_tree_forward(a, cache, n - 1, tree, lo, hi, input_ids=toks))

            tokens, probs, tree, self._fed = _draft_tree(tree_step, a.logits(h[:, -1:])[:, -1], self.tree, k, state, feed_last=False)
            return Proposal(tokens=tokens, probs=probs, tree=tree)

        def step(tok, i, need_logits):
            return a.logits(a.forward(cache, n + i, input_ids=tok[:, None]))[:, -1]

        tokens, probs, self._fed = _draft_chain(step, a.logits(h[:, -1:])[:, -1], k, state, self.threshold, feed_last=False)
        return Proposal(tokens=tokens, probs=probs)

    def update(self, state: DecodeState, num_accepted: int) -> None:
        if self.tree is not None and state.accepted_path is not None:
            # the accepted nodes that were fed sit at tree slots: move them behind the committed prefix
            fed = [i for i in state.accepted_path[1:] if i <= self._fed]
            self.cache.compact(self._base, torch.tensor(fed, dtype=torch.long, device=self.adapter.device) + self._base - 1)
            self.cache.rollback(self._base + len(fed))
            return
        # valid draft KV: the committed prefix plus the fed drafts that were accepted
        self.cache.rollback(self._base + min(num_accepted, self._fed))

    def truncate(self, length: int) -> None:
        if self.cache is not None and self.cache.length > length:
            self.cache.rollback(length)


def max_nodes_of(shape: Tree | Dynamic | None, k: int) -> int:
    """The most draft nodes a proposal of this shape writes into a cache (level-wise trees draft ``width`` nodes per
    level before they keep the best ``budget``)."""
    if isinstance(shape, Tree):
        return shape.size - 1
    if isinstance(shape, Dynamic):
        return max(shape.budget, shape.width * k)
    return k


class EarlyExitDrafter(Drafter):
    """Self-speculation: the target's first ``exit_layer`` layers plus its norm and head draft.

    The shallow layers write straight into the target's cache, so verification
    runs only layers [exit_layer, N) on the drafted tokens' saved hidden states.
    """

    name = "early-exit"

    def __init__(self, exit_layer: int, confidence_threshold: float = 0.0, tree: Tree | Dynamic | None = None):
        self.exit_layer = exit_layer
        self.threshold = confidence_threshold
        self.tree = tree

    def max_nodes(self, k: int) -> int:
        return max_nodes_of(self.tree, k)

    def propose(self, state: DecodeState, k: int) -> Proposal:
        t, cache, L = state.target, state.target_cache, self.exit_layer
        n = state.tokens.shape[1]
        hiddens = [t.forward(cache, n - 1, input_ids=state.tokens[:, -1:], last=L)]
        if self.tree is not None:  # the shallow layers write the nodes' KV at tree slots of the target cache

            def tree_step(toks, lo, hi, tree):
                hiddens.append(_tree_forward(t, cache, n - 1, tree, lo, hi, input_ids=toks, last=L))
                return t.logits(hiddens[-1])

            order: list[int] = []
            tokens, probs, tree, _ = _draft_tree(tree_step, t.logits(hiddens[0])[:, -1], self.tree, k, state, feed_last=True, order=order)
            hidden = torch.cat(hiddens, 1)[:, order]  # drafting order -> the tree's node order
            if order != list(range(len(order))):  # the shallow layers' keys at the tree slots follow the same order
                cache.compact(n - 1, torch.tensor(order, dtype=torch.long, device=hidden.device) + (n - 1))
            return Proposal(tokens=tokens, probs=probs, hidden=hidden, layer=L, tree=tree)

        def step(tok, i, need_logits):
            hiddens.append(t.forward(cache, n + i, input_ids=tok[:, None], last=L))
            return self.exit_logits(state, hiddens[-1], n + i, need_logits)

        first = self.exit_logits(state, hiddens[0], n - 1, True)
        tokens, probs, _ = _draft_chain(step, first, k, state, self.threshold, feed_last=True)
        return Proposal(tokens=tokens, probs=probs, hidden=torch.cat(hiddens, 1), layer=L)

    def exit_logits(self, state: DecodeState, hidden: torch.Tensor, slot: int, need_logits: bool) -> torch.Tensor | None:
        """Next-token logits [B, V] from the exit layer's hidden [B, 1, H] at cache slot ``slot`` (Kangaroo adds an adapter)."""
        return state.target.logits(hidden)[:, -1] if need_logits else None


class NgramDrafter(Drafter):
    """Prompt lookup: copy what followed the latest earlier occurrence of the current suffix.

    Tries suffix lengths ``ngram_max`` down to ``ngram_min``.

    >>> d = NgramDrafter(ngram_max=2, ngram_min=1)
    >>> d.lookup(torch.tensor([5, 6, 7, 8, 5, 6]), k=3).tolist()   # suffix [5, 6] seen at 0, followed by 7 8 5
    [7, 8, 5]
    >>> d.lookup(torch.tensor([1, 2, 3]), k=3).tolist()
    []
    """

    name = "ngram"
    model_free = True

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1, tree_budget: int | None = None):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.tree_budget = tree_budget  # None: one continuation (a chain); else a trie of up to this many nodes

    def max_nodes(self, k: int) -> int:
        return k if self.tree_budget is None else self.tree_budget

    def lookup_tree(self, seq: torch.Tensor, k: int, budget: int) -> tuple[list[int], list[int]]:
        """Several continuations (up to k tokens each) merged into a trie of at most ``budget`` nodes.

        Continuations of longer suffix matches come first, then the more recent ones. Returns (tokens, parents)
        of the nodes in insertion order; parents index [pending, nodes...] (0 = the pending token).

        >>> d = NgramDrafter(ngram_max=1, ngram_min=1)
        >>> d.lookup_tree(torch.tensor([5, 6, 7, 5, 8, 9, 5]), k=2, budget=4)   # after 5: "8 9" (latest) and "6 7"
        ([8, 9, 6, 7], [0, 1, 0, 3])
        """
        n = seq.shape[0]
        tokens, parents, child = [], [], {}  # child[(node, token)] = node
        for size in range(min(self.ngram_max, n - 1), self.ngram_min - 1, -1):
            windows = seq[: n - 1].unfold(0, size, 1)
            for hit in (windows == seq[n - size :]).all(-1).nonzero().flatten().flip(0).tolist():
                node = 0
                for tok in seq[hit + size : hit + size + k].tolist():
                    if (node, tok) not in child:
                        if len(tokens) >= budget:
                            return tokens, parents
                        tokens.append(tok)
                        parents.append(node)
                        child[(node, tok)] = len(tokens)
                    node = child[(node, tok)]
        return tokens, parents

    def lookup(self, seq: torch.Tensor, k: int) -> torch.Tensor:  # seq [n] -> [j]
        n = seq.shape[0]
        for size in range(min(self.ngram_max, n - 1), self.ngram_min - 1, -1):
            suffix = seq[n - size :]
            windows = seq[: n - 1].unfold(0, size, 1)  # every window that has at least one token after it
            hits = (windows == suffix).all(-1).nonzero()
            if hits.numel():
                begin = int(hits[-1]) + size
                return seq[begin : begin + k]
        return seq[:0]

    def propose(self, state: DecodeState, k: int) -> Proposal:
        if self.tree_budget is not None and k > 0:
            if state.tokens.shape[0] != 1:
                raise ValueError("n-gram trees run batch size 1")
            tokens, parents = self.lookup_tree(state.tokens[0], k, self.tree_budget)
            ids = torch.tensor([tokens], dtype=torch.long, device=state.tokens.device)
            return Proposal(tokens=ids, tree=Tree.from_parents([-1] + parents))
        rows = [self.lookup(row, k) for row in state.tokens]
        j = min(r.shape[0] for r in rows)
        return Proposal(tokens=torch.stack([r[:j] for r in rows]))


# ---- the builders of the methods these drafters draft for (decoding.builders) -------------------------------------
def model_depth(target) -> int:
    """The number of decoder layers of a loaded target (``decoding.model.models.LoadedModel``)."""
    return len(ModelAdapter(target.model).layers)


def draft_model_adapter(cfg, target, device) -> ModelAdapter:
    """The adapter of the separate ``draft_model``, on ``device``; it must share the target's tokenizer."""
    draft = load_model(cfg.draft_model, cfg.dtype, device, cfg.quant)
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ConfigError("draft_model", f"{cfg.draft_model!r} does not share the target's tokenizer")
    return ModelAdapter(draft.model.to(device))


def first_layers_adapter(cfg, target) -> ModelAdapter:
    """The adapter of the target's first ``draft_layers`` layers (plus its final norm and LM head)."""
    depth = model_depth(target)
    if cfg.draft_layers >= depth:
        raise ConfigError("draft_layers", f"must be below the model's {depth} layers, got {cfg.draft_layers}")
    return ModelAdapter(target.model, num_layers=cfg.draft_layers)


@builds("ar")
def _no_drafter(cfg, target, device, memory) -> None:
    return None


@builds("ngram")
def _ngram_drafter(cfg, target, device, memory) -> Drafter:
    shape = tree_shape(cfg)
    return NgramDrafter(cfg.ngram_max, cfg.ngram_min, tree_budget=None if shape is None else max_nodes_of(shape, cfg.k))
