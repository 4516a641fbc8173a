"""Drafting with a model, shared by every model-based drafter: a chain (one token a forward) or a token tree
(static Sequoia shapes, DySpec's best-first growth, EAGLE-2's levels)."""

from __future__ import annotations

import torch

from decoding.drafters.base import DecodeState
from decoding.model.adapter import KVCache, ModelAdapter
from decoding.model.fast_layers import Placement
from decoding.sampling import choose, warp
from decoding.trees.shapes import Dynamic, Tree


def draft_chain(step, first_logits, k, state, threshold, feed_last):
    """Draft up to k tokens autoregressively; shared by every model-based drafter.

    ``step(token [B], i, need_logits) -> logits [B, V] | None`` feeds draft i
    (0-based) and returns the next-token logits when asked for them. Drafting stops early when the top-1 probability of
    the next draft falls below ``threshold`` for every row (Kangaroo's double
    early exit). ``threshold`` may instead be a stop rule (:class:`StopRule`: SpecDec++'s acceptance-prediction head,
    EAD's entropy switch), which decides after each draft's logits whether to stop, beside its own confidence
    threshold. With ``feed_last`` the final draft is fed too (its logits are
    not needed, but its state is), else it is not.
    Returns (tokens [B, j], probs [B, j, V] or None, number of drafts fed).
    """
    rule = threshold if isinstance(threshold, StopRule) else None
    threshold = rule.confidence_threshold if rule is not None else threshold
    tokens, probs = [], []
    logits, fed = first_logits, 0
    for i in range(k):
        tok, q, conf = choose(logits, state.sampling, state.generator)
        if threshold > 0 and bool((conf < threshold).all()):
            break
        stop = rule is not None and rule.stop(logits, i)  # one host read per draft, as the confidence threshold
        if stop and not rule.keeps_last:
            break
        tokens.append(tok)
        if q is not None:
            probs.append(q)
        last = stop or i == k - 1
        if last and not feed_last:
            break
        logits = step(tok, i, not last)
        fed += 1
        if last:
            break
    bsz = first_logits.shape[0]
    out = torch.stack(tokens, 1) if tokens else torch.zeros(bsz, 0, dtype=torch.long, device=first_logits.device)
    return out, (torch.stack(probs, 1) if probs else None), fed


class StopRule:
    """When to stop drafting a chain, decided from each draft's logits (``draft_chain``'s ``threshold``).

    ``stop(logits [B, V], i)`` is asked for draft i (0-based, i = 0 starts a new chain) once its logits exist; True
    ends the chain: with ``keeps_last`` draft i is still proposed (SpecDec++: the draft that crossed the threshold is
    verified too, it costs no extra draft forward), else it is not (EAD: that position is the large model's). The
    rule's own ``confidence_threshold`` (Kangaroo's) applies before it. A rule may keep state across a chain and, where
    it says so, across steps (``reset`` starts a generation). Implementations: ``decoding.drafters.stop_head``.
    """

    keeps_last = True
    confidence_threshold = 0.0

    def stop(self, logits: torch.Tensor, i: int) -> bool:
        raise NotImplementedError

    def reset(self) -> None:
        """A new generation starts (rules with state across steps forget it)."""


def candidates(logits: torch.Tensor, n: int, state: DecodeState, stochastic: bool):
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


def draft_tree(
    step,
    root_logits: torch.Tensor,
    shape: Tree | Dynamic,
    k: int,
    state: DecodeState,
    feed_last: bool,
    path_probs: list | None = None,
    order: list | None = None,
):
    """Grow a token tree of drafts; shared by every model-based tree drafter (the tree analogue of ``draft_chain``).

    ``step(tokens [B, t], lo, hi, tree) -> logits [B, t, V]`` feeds nodes lo..hi-1 of ``tree`` (a contiguous
    block after every node already fed) and returns their next-token logits. Node 0 is the pending token whose
    logits are ``root_logits`` [B, V]. The tree's depth is at most k.

    * ``Tree`` (static, Sequoia): one draft forward per depth level over all nodes of that level; a node of rank
      r is its parent's r-th candidate (``candidates``); candidates of probability 0 are pruned with their subtree.
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
    grow = _Growth(step)
    if isinstance(shape, Tree):
        _grow_static(grow, root_logits, shape.prune(k), state, feed_last)
    elif shape.width > 0:
        return draft_levels(grow.feed, grow.add, grow.parents, grow.toks, root_logits, shape, k, state, feed_last, path_probs, order)
    else:
        path_p = _grow_best_first(grow, root_logits, shape, k, state, feed_last)
        if path_probs is not None:
            path_probs[:] = path_p
    if order is not None:
        order[:] = list(range(len(grow.parents)))
    bsz = root_logits.shape[0]
    out = torch.stack(grow.toks, 1) if grow.toks else torch.zeros(bsz, 0, dtype=torch.long, device=root_logits.device)
    return out, (torch.stack(grow.probs, 1) if grow.probs else None), Tree.from_parents(grow.parents), grow.fed


class _Growth:
    """A tree being drafted: node i's parent, token [B] and q row [B, V]; ``feed`` runs the draft on a block of nodes."""

    def __init__(self, step):
        self.step = step
        self.parents, self.toks, self.probs = [-1], [], []
        self.fed = 0  # nodes 1..fed went through the draft

    def feed(self, lo: int, hi: int) -> dict:
        """Feed nodes lo..hi-1; their next-token logits [B, V] by node."""
        tree = Tree.from_parents(self.parents)
        logits = self.step(torch.stack(self.toks[lo - 1 : hi - 1], 1), lo, hi, tree)  # [B, hi-lo, V]
        self.fed = hi - 1
        return {lo + i: logits[:, i] for i in range(hi - lo)}

    def add(self, parent: int, tok: torch.Tensor, q) -> int:
        self.parents.append(parent)
        self.toks.append(tok)
        if q is not None:
            self.probs.append(q)
        return len(self.parents) - 1


def _grow_static(grow: _Growth, root_logits, shape: Tree, state: DecodeState, feed_last: bool) -> None:
    """A static (Sequoia) template: the template's nodes ("slots") become drafted nodes where their parent was drafted
    and their rank is a valid candidate; one draft forward per depth level."""
    slot_parent, slot_rank, slot_depth = shape.parent_list, shape.rank.tolist(), shape.depth_list
    children_of_slot = [0] * shape.size
    for parent_slot in slot_parent[1:]:
        children_of_slot[parent_slot] += 1
    node_of_slot, logits_of_node, candidates_of_node = {0: 0}, {0: root_logits}, {}
    for level in range(1, shape.max_depth + 1):
        lo = len(grow.parents)
        for slot in (i for i in range(shape.size) if slot_depth[i] == level):
            parent = node_of_slot.get(slot_parent[slot])
            if parent is None or parent not in logits_of_node:
                continue
            if parent not in candidates_of_node:
                n_children = children_of_slot[slot_parent[slot]]
                candidates_of_node[parent] = candidates(logits_of_node[parent], n_children, state, stochastic=True)
            cand_tokens, cand_q, _, cand_valid = candidates_of_node[parent]
            if bool(cand_valid[slot_rank[slot]]):
                node_of_slot[slot] = grow.add(parent, cand_tokens[:, slot_rank[slot]], cand_q)
        hi = len(grow.parents)
        if hi == lo:
            break
        next_level = (slot for slot in range(shape.size) if slot_depth[slot] == level + 1)
        grows = any(node_of_slot.get(slot_parent[child], -1) >= lo for child in next_level)
        if grows or feed_last:
            logits_of_node.update(grow.feed(lo, hi))


def _grow_best_first(grow: _Growth, root_logits, shape: Dynamic, k: int, state: DecodeState, feed_last: bool) -> list[float]:
    """DySpec's best-first growth by path probability up to the budget (see ``draft_tree``); returns each node's path
    probability, in node order."""
    import heapq

    budget, depth, path_p = (shape.budget if k > 0 else 0), [0], [1.0]
    heap: list = []  # (-path score, parent node, rank, candidate tokens [B, n], candidate scores [n])

    def offer(node, logits):
        if depth[node] < k:
            cand_tokens, _, cand_scores, cand_valid = candidates(logits, min(shape.max_rank, budget), state, stochastic=False)
            n_valid = int(cand_valid.sum())
            if n_valid:
                neg_path_p = -path_p[node] * float(cand_scores[0])  # the path probability through the best candidate
                heapq.heappush(heap, (neg_path_p, node, 0, cand_tokens[:, :n_valid], cand_scores[:n_valid]))

    offer(0, root_logits)
    while len(grow.parents) - 1 < budget:
        unfed = [i for i in range(grow.fed + 1, len(grow.parents)) if depth[i] < k]
        bound = max((path_p[i] for i in unfed), default=0.0)
        if not heap or -heap[0][0] < bound:
            if not unfed:
                break
            for node, logits in grow.feed(grow.fed + 1, len(grow.parents)).items():
                offer(node, logits)
            continue
        neg_path_p, parent, rank, cand_tokens, cand_scores = heapq.heappop(heap)
        grow.add(parent, cand_tokens[:, rank], None)
        depth.append(depth[parent] + 1)
        path_p.append(-neg_path_p)
        if rank + 1 < cand_tokens.shape[1]:  # the parent's next candidate takes its place in the queue
            heapq.heappush(heap, (-path_p[parent] * float(cand_scores[rank + 1]), parent, rank + 1, cand_tokens, cand_scores))
    if feed_last and grow.fed < len(grow.parents) - 1:
        grow.feed(grow.fed + 1, len(grow.parents))
    return path_p


def draft_levels(feed, add, parents, toks, root_logits, shape: Dynamic, k: int, state: DecodeState, feed_last: bool, path_probs, order):
    """``draft_tree`` for ``Dynamic(width=w)``: EAGLE-2's level-by-level growth. Each level takes the w most probable
    children (by path probability) of the nodes of the level before, which were fed together in one forward; then
    all drafted nodes are ranked by path probability (a child never above its parent; ties: shallower first) and the
    best ``budget`` form the tree, in that order. The reranked nodes are not where they were fed, so ``fed`` is 0."""
    width, path_p, depth = shape.width, [1.0], [0]
    level, logits_of = [0], {0: root_logits}
    for d in range(1, k + 1):
        cands = []
        for node in level:
            tokens, _, scores, valid = candidates(logits_of[node], min(width, shape.max_rank), state, stochastic=False)
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


def tree_forward(adapter: ModelAdapter, cache: KVCache, root_slot: int, tree: Tree, lo: int, hi: int, **kw) -> torch.Tensor:
    """Run ``adapter`` on tree nodes lo..hi-1 (their KV at slots root_slot+lo..) with the tree's mask and positions."""
    bsz = (kw.get("input_ids") if kw.get("input_ids") is not None else kw["hidden"]).shape[0]
    positions = tree.positions(root_slot)[lo:hi].to(adapter.device).unsqueeze(0).expand(bsz, -1)
    return adapter.forward(cache, root_slot + lo, positions=positions, tree_mask=tree.mask[lo:hi, :hi], **kw)


def max_nodes_of(shape: Tree | Dynamic | None, k: int) -> int:
    """The most draft nodes a proposal of this shape writes into a cache (level-wise trees draft ``width`` nodes per
    level before they keep the best ``budget``)."""
    if isinstance(shape, Tree):
        return shape.size - 1
    if isinstance(shape, Dynamic):
        return max(shape.budget, shape.width * k)
    return k


# ---- draft loops as functions of device tensors (one CUDA graph each: decoding.model.graphs.LoopGraphs) ---------------
#
# The loops above decide on the host as they go (thresholds, the heap of best-first growth, Python lists of nodes).
# Greedy chains and EAGLE-2's level trees need no such decision: every step is a fixed shape, so the whole loop (each
# draft forward, the head, the arg-max, the level's top-k and the final reranking) is one function of device tensors
# that a drafter captures once per shape and replays, and the host reads the result once.


def draft_loops(adapter: ModelAdapter, wanted: bool | None):
    """A drafter's ``LoopGraphs`` (its adapter's), or None: by default on a CUDA device; ``True`` on the CPU runs the same
    loops on static buffers (what the tests check against the eager loops)."""
    on = adapter.device.type == "cuda" if wanted is None else wanted
    return adapter.loop_graphs() if on else None


def loop_applies(drafter, state: DecodeState) -> bool:
    """Whether ``drafter`` (with ``loops``, ``cache`` and ``threshold``) may replay its draft loop this step: greedy
    drafts with no stopping rule (a threshold or stop head decides on the host), over a plain cache."""
    plain = getattr(drafter.cache, "plain", False) and hasattr(drafter.cache, "k_all")
    stops = not isinstance(drafter.threshold, (int, float)) or drafter.threshold > 0
    return drafter.loops is not None and state.sampling.greedy and plain and not stops


def one_token_place(slot: torch.Tensor, end: int) -> Placement:
    """Row b's one token written at ``slot[b]`` ([B] device tensor), seeing every slot below it and itself."""
    return Placement(slot[:, None], slot, end)


def block_place(first: torch.Tensor, width: int, end: int) -> Placement:
    """Row b's ``width`` tokens written at ``first[b] ..`` ([B] device tensor), causal: a catch-up block in a loop.

    >>> block_place(torch.tensor([3]), 2, 8).slots.tolist()
    [[3, 4]]
    """
    return Placement(first[:, None] + torch.arange(width, device=first.device), first, end)


def greedy_chain_loop(logits_of, feed, root: torch.Tensor, slot: torch.Tensor, k: int) -> torch.Tensor:
    """``draft_chain``'s greedy chain with no host read: k drafts [B, k] (indices into the logits' columns).

    ``logits_of(h [B, 1, H]) -> [B, V]`` is the draft head; ``feed(h, token [B], slot [B]) -> h`` runs the draft
    forward on one token per row written at ``slot`` (draft i at ``slot + i``). Draft i is the arg-max of the
    softmax, as ``sampling.choose`` picks greedy drafts; the last draft is not fed.
    """
    h, tokens = root, []
    for i in range(k):
        tok = logits_of(h).float().softmax(-1).max(-1).indices
        tokens.append(tok)
        if i < k - 1:
            h = feed(h, tok, slot + i)
    return torch.stack(tokens, 1)


def level_sizes(width: int, max_rank: int, k: int) -> list[int]:
    """Nodes per level of ``draft_levels``' growth for greedy drafts (every candidate valid): level 1 holds the root's
    ``min(width, max_rank)`` best children, each later level ``width`` of its parents' candidates (fewer while the
    level before offers fewer).

    >>> level_sizes(8, 8, 4), level_sizes(4, 2, 4)
    ([8, 8, 8, 8], [2, 4, 4, 4])
    """
    c = min(width, max_rank)
    sizes = [c] if k > 0 else []
    while len(sizes) < k:
        sizes.append(min(width, c * sizes[-1]))
    return sizes


def greedy_levels_loop(logits_of, feed, root: torch.Tensor, root_slot: torch.Tensor, shape: Dynamic, k: int, end: int):
    """``draft_levels``' EAGLE-2 tree for one row under greedy drafting, with no host read.

    ``logits_of(h [1, t, H]) -> [t, V]``; ``feed(h_parents [1, t, H], tokens [t], place, positions [1, t]) -> h
    [1, t, H]`` runs the draft forward on one level's nodes. Node i (1..N, in drafting order: level by level, each
    level by path probability) sits at slot ``root_slot + i`` at position ``root_slot + depth``, attending to the
    committed prefix and its own ancestors. Returns (tokens [1, budget] as column indices, parents [budget] indexing
    [pending, kept nodes...], path probabilities [budget]): every drafted node reranked by path probability, a child
    never before its parent (a stable sort of nodes in level order: ties keep the shallower first), the best
    ``budget`` kept.
    """
    sizes = level_sizes(shape.width, shape.max_rank, k)
    c, total = min(shape.width, shape.max_rank), sum(sizes)
    device = root.device
    path = torch.ones(1 + total, device=device)
    parent = torch.zeros(1 + total, dtype=torch.long, device=device)
    token = torch.zeros(1 + total, dtype=torch.long, device=device)
    ancestors = torch.eye(1 + total, dtype=torch.bool, device=device)  # each node's own bit; its ancestors' added below
    outputs = root.new_zeros(1 + total, root.shape[-1])
    outputs[0] = root[0, -1]
    logits, lo_prev, hi_prev, lo = logits_of(root[:, -1:]), 0, 1, 1
    for d, size in enumerate(sizes, start=1):
        score, cand = logits.float().softmax(-1).topk(c, dim=-1)  # [parents of the level, c]
        joint = (path[lo_prev:hi_prev, None] * score).flatten()
        best, pick = joint.topk(size)
        hi = lo + size
        path[lo:hi], token[lo:hi] = best, cand.flatten()[pick]
        parent[lo:hi] = lo_prev + torch.div(pick, c, rounding_mode="floor")
        ancestors[lo:hi] |= ancestors[parent[lo:hi]]
        if d < len(sizes):
            slots = (root_slot + torch.arange(lo, hi, device=device))[None]
            place = Placement(slots, root_slot, end, ancestors[None, lo:hi])
            h = feed(outputs[parent[lo:hi]][None], token[lo:hi], place, (root_slot + d).expand(1, size))
            outputs[lo:hi] = h[0]
            logits = logits_of(h)
        lo_prev, hi_prev, lo = lo, hi, hi
    keep = min(shape.budget, total) if k > 0 else 0
    order = torch.sort(path[1:], descending=True, stable=True).indices[:keep] + 1
    new_index = torch.zeros(1 + total, dtype=torch.long, device=device)
    new_index[order] = torch.arange(1, keep + 1, device=device)
    return token[order][None], new_index[parent[order]], path[order]
