"""The lossless rules: pure, batched, no cache and no I/O.

Both verifiers take the k drafted tokens and the target's k+1 next-token
distributions (for the pending token and after each draft) and return how many
drafts are accepted and the tokens to commit: the accepted drafts followed by
one token from the target (a correction where a draft was rejected, a bonus
where all were accepted). So every target forward commits between 1 and k+1
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding import accel
from decoding.sampling import sample_from


@dataclass
class Verdict:
    num_accepted: torch.Tensor  # [B] int64, m in 0..k
    tokens: torch.Tensor  # [B, k+1]; tokens[b, :m+1] are committed, the rest is undefined
    path: torch.Tensor | None = None  # trees: [B, D+1] node indices of the accepted path, path[b, 0] = 0 (the root)


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor | None, argmax: torch.Tensor | None = None) -> Verdict:
    """Greedy rule: accept the longest prefix of drafts equal to the target's argmax.

    draft_tokens [B, k] (padding -1: never accepted), target_logits [B, k+1, V] (or their ``argmax`` [B, k+1]).

    >>> logits = torch.tensor([[[0., 5, 0], [0, 0, 5], [5, 0, 0]]])   # argmax 1, 2, 0
    >>> v = verify_greedy(torch.tensor([[1, 0]]), logits)
    >>> v.num_accepted.tolist(), v.tokens[0, :2].tolist()              # 1 accepted, then target's 2
    ([1], [1, 2])
    """
    target_tokens = target_logits.argmax(-1) if argmax is None else argmax  # [B, k+1]
    k = draft_tokens.shape[1]
    match = draft_tokens == target_tokens[:, :k]  # [B, k]
    num_accepted = match.long().cumprod(-1).sum(-1)  # [B]
    # accepted drafts equal the argmax, so the argmax row is already the committed sequence
    return Verdict(num_accepted=num_accepted, tokens=target_tokens)


def verify_speculative(
    draft_tokens: torch.Tensor,  # [B, k]  x_1..x_k drawn from q (padding beyond a row's drafts: any id, see ``drafts``)
    draft_probs: torch.Tensor | None,  # [B, k, V] q_i(.), or None for a deterministic drafter (q = one-hot)
    target_probs: torch.Tensor,  # [B, k+1, V] p_i(.), warped exactly like q
    u_accept: torch.Tensor,  # [B, k] uniforms r_i in [0, 1)
    u_sample: torch.Tensor,  # [B] uniform for the correction / bonus draw
    drafts: torch.Tensor | None = None,  # [B] each row's real drafts j_b <= k (None: all k)
    has_q: torch.Tensor | None = None,  # [B] bool: the row's drafts come with q (else one-hot), when draft_probs is given
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023), every row at once.

    Accept draft x_i while r_i <= p_i(x_i) / q_i(x_i). At the first rejection j,
    draw from the residual norm(max(0, p_j - q_j)); if all k are accepted, draw
    the bonus token from p_{k+1}. The committed tokens are distributed exactly
    as tokens sampled one by one from p.

    For a deterministic drafter (n-gram, greedy drafts) q_i is one-hot at x_i,
    so acceptance is r_i <= p_i(x_i) and the residual is p_i with x_i removed.
    No value is read back to the host: rows whose draw is not a residual draw select p with ``torch.where``.

    >>> p = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])          # p_1 likes 0 and 1 equally; then 2
    >>> v = verify_speculative(torch.tensor([[1]]), None, p, torch.tensor([[0.4]]), torch.tensor([0.0]))
    >>> v.num_accepted.tolist(), v.tokens.tolist()                      # 0.4 <= 0.5: accepted, then the bonus 2
    ([1], [[1, 2]])
    """
    bsz, k = draft_tokens.shape
    rows = torch.arange(bsz, device=draft_tokens.device)
    x = draft_tokens.clamp(min=0)
    p_x = target_probs[:, :k].gather(-1, x.unsqueeze(-1)).squeeze(-1)  # [B, k]
    q_x = torch.ones_like(p_x)
    if draft_probs is not None:
        q_given = draft_probs.gather(-1, x.unsqueeze(-1)).squeeze(-1)
        q_x = q_given if has_q is None else torch.where(has_q[:, None], q_given, q_x)
    accepted = u_accept * q_x <= p_x  # r <= p/q without dividing by q
    if drafts is not None:
        accepted &= torch.arange(k, device=x.device)[None, :] < drafts[:, None]
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # [B] = m

    p_m = target_probs[rows, num_accepted]  # [B, V] target distribution where the draw happens
    if k > 0:
        real = torch.full_like(num_accepted, k) if drafts is None else drafts
        rejected = num_accepted < real  # rows whose draw is a residual draw
        j = num_accepted.clamp(max=k - 1)
        one_hot = torch.zeros_like(p_m).scatter_(-1, x[rows, j].unsqueeze(-1), 1.0)
        if draft_probs is None:
            q_m = one_hot
        else:
            q_m = draft_probs[rows, j] if has_q is None else torch.where(has_q[:, None], draft_probs[rows, j], one_hot)
        residual = (p_m - q_m).clamp_(min=0.0)
        mass = residual.sum(-1, keepdim=True)
        # mass == 0 only when p == q, where rejection has probability 0; fall back to p for safety
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_m)
        p_m = torch.where(rejected.unsqueeze(-1), residual, p_m)
    drawn = sample_from(p_m, u_sample)  # [B]

    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(bsz, 1)], dim=1)  # [B, k+1]
    tokens.scatter_(1, num_accepted[:, None], drawn[:, None])
    return Verdict(num_accepted=num_accepted, tokens=tokens)


def commit_unverified(
    draft_tokens: torch.Tensor,  # [B, k] committed as they are (padding past a row's drafts: any id)
    target_probs: torch.Tensor | None,  # [B, k+1, V] warped p; None = greedy
    target_logits: torch.Tensor | None,  # [B, k+1, V] (or their ``argmax`` [B, k+1])
    u_sample: torch.Tensor | None,  # [B] uniform for the target's token (sampling)
    drafts: torch.Tensor | None = None,  # [B] each row's j (None: all k)
    argmax: torch.Tensor | None = None,
) -> Verdict:
    """No verification (EAD, lossy by design): every draft is committed, then the target's own token after the last one
    (its argmax, or a draw from p with ``u_sample``). Not a lossless rule: the output follows the drafter wherever it
    drafted.

    >>> logits = torch.tensor([[[0., 5, 0], [0, 0, 5], [5, 0, 0]]])   # the target would say 1, 2, 0
    >>> v = commit_unverified(torch.tensor([[2, 2]]), None, logits, None)
    >>> v.num_accepted.tolist(), v.tokens.tolist()                    # both drafts kept, then the target's 0
    ([2], [[2, 2, 0]])
    """
    bsz, k = draft_tokens.shape
    rows = torch.arange(bsz, device=draft_tokens.device)
    j = torch.full((bsz,), k, dtype=torch.long, device=draft_tokens.device) if drafts is None else drafts
    if target_probs is None:
        g = target_logits.argmax(-1) if argmax is None else argmax
        last = g[rows, j]
    else:
        last = sample_from(target_probs[rows, j], u_sample)  # [B]
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(bsz, 1)], dim=1)
    tokens.scatter_(1, j[:, None], last[:, None])
    return Verdict(num_accepted=j, tokens=tokens)


# ---- trees -----------------------------------------------------------------------------------
# A tree proposal is T nodes in topological order: node 0 is the pending token (the root), parents[i] < i.
# target_*[:, i] is the target's next-token distribution after node i (i.e. at node i, for i's children).


def greedy_tree_accept(
    node_tokens: torch.Tensor,  # [B, T] node 0 = pending token
    parents: torch.Tensor,  # [B, T] (or [T]) parents[..., 0] = -1
    mask: torch.Tensor,  # [B, T, T] (or [T, T]) ancestor-or-self
    depth: torch.Tensor,  # [B, T] (or [T])
    target_argmax: torch.Tensor,  # [B, T] the target's argmax at every node
) -> torch.Tensor:
    """The deepest node whose whole path matches the target's argmax: [B] node index (the torch reference of
    ``kernels.tree_verify.greedy_tree_accept_triton``).

    A node is ok when its token is the target's argmax at its parent; it is accepted when it and all its
    ancestors are ok. Siblings are distinct tokens, so at most one node per depth is accepted.

    >>> tokens = torch.tensor([[9, 4, 5, 6]]); parents = torch.tensor([-1, 0, 0, 2])   # 4 and 5 under the root, 6 under 5
    >>> from decoding.trees.shapes import tree_mask
    >>> greedy_tree_accept(tokens, parents, tree_mask(parents), torch.tensor([0, 1, 1, 2]), torch.tensor([[5, 0, 6, 1]])).tolist()
    [3]
    """
    bsz, t = node_tokens.shape
    parents = parents.expand(bsz, t)
    at_parent = target_argmax.gather(-1, parents.clamp(min=0))  # [B, T] the argmax where each node was predicted
    ok = (node_tokens == at_parent) | (parents < 0)  # [B, T]
    accepted = (~mask.expand(bsz, t, t) | ok.unsqueeze(1)).all(-1)  # [B, T] every ancestor-or-self ok
    score = torch.where(accepted, depth.expand(bsz, t), -1)
    return score.argmax(-1)  # first maximum: the unique deepest accepted node


def _path_to(mask_rows: torch.Tensor, best: torch.Tensor, depth: torch.Tensor, max_depth: int):
    """Node indices of root..best for each row, padded with 0: ([B, D+1], m [B]); ``max_depth`` D from the host."""
    bsz = best.shape[0]
    rows = mask_rows[torch.arange(bsz, device=best.device), best]  # [B, T] ancestors-or-self of best
    m = depth.expand(rows.shape)[torch.arange(bsz, device=best.device), best]  # [B]
    width = max_depth + 1
    # ancestors in node order are in depth order: a stable sort puts them first
    order = torch.sort((~rows).to(torch.int8), dim=-1, stable=True).indices[:, :width]
    keep = torch.arange(width, device=best.device).unsqueeze(0) <= m.unsqueeze(1)
    return torch.where(keep, order, 0), m


def verify_tree_greedy(node_tokens, parents, mask, depth, target_logits, accept=None, max_depth: int | None = None, argmax=None) -> Verdict:
    """Greedy rule on a tree: commit the longest root-to-node path matching the target's argmax, then the argmax there.

    node_tokens [B, T] (padding nodes -1: never accepted), parents [T] or [B, T], mask [T, T] or [B, T, T], depth
    [T] or [B, T], target_logits [B, T, V] (or their ``argmax`` [B, T]); ``max_depth``: the deepest node's depth
    (host; default: read from ``depth``, which stops the host).

    >>> from decoding.trees.shapes import Tree
    >>> tree = Tree.from_paths([[0], [1], [1, 0]])                          # nodes: root, a, b, b's child
    >>> tokens = torch.tensor([[9, 4, 5, 6]])
    >>> argmax = torch.tensor([[5, 0, 6, 1]])                               # the target wants 5, then 6, then 1
    >>> logits = torch.nn.functional.one_hot(argmax, 10).float()
    >>> v = verify_tree_greedy(tokens, tree.parents, tree.mask, tree.depth, logits)
    >>> v.num_accepted.tolist(), v.path.tolist(), v.tokens.tolist()
    ([2], [[0, 2, 3]], [[5, 6, 1]])
    """
    g = target_logits.argmax(-1) if argmax is None else argmax  # [B, T]
    if accept is not None:
        best = accept(node_tokens, parents, mask, depth, g)
    else:  # the Triton kernel where kernels.install() registered it and it applies (CUDA)
        best = accel.dispatch("greedy_tree_accept", greedy_tree_accept, node_tokens, parents, mask, depth, g)
    max_depth = int(depth.max()) if max_depth is None else max_depth
    path, m = _path_to(mask.expand(g.shape[0], *mask.shape[-2:]), best, depth, max_depth)
    tokens = torch.cat([node_tokens.gather(1, path[:, 1:]), g.new_zeros(g.shape[0], 1)], dim=1)  # [B, D+1]
    rows = torch.arange(g.shape[0], device=g.device)
    tokens[rows, m] = g[rows, best]  # the target's token after the last accepted node
    return Verdict(num_accepted=m, tokens=tokens, path=path)


def children_table(parents: list[int]) -> list[list[int]]:
    """Each node's children in node order (the order they were drawn in): the host's view of a tree's parents.

    >>> children_table([-1, 0, 0, 2])
    [[1, 2], [], [3], []]
    """
    children: list[list[int]] = [[] for _ in parents]
    for i, par in enumerate(parents[1:], 1):
        children[par].append(i)
    return children


def verify_tree_speculative(
    node_tokens: torch.Tensor,  # [B, T] node 0 = pending token
    children: torch.Tensor,  # [B, T, C] each node's children in draw order, -1 past the last (``children_table``)
    draft_probs: torch.Tensor | None,  # [B, T, V] q the node was drawn from (its parent's draft distribution); None = deterministic
    target_probs: torch.Tensor,  # [B, T, V] p at each node, warped like q
    u_accept: torch.Tensor,  # [B, T] one uniform per node (used when the node is tried)
    u_sample: torch.Tensor,  # [B] uniform for the final draw
    max_depth: int,  # D: the deepest node's depth (host)
    has_q: torch.Tensor | None = None,  # [B] bool: rows whose drafts come with q (the others one-hot), with draft_probs
) -> Verdict:
    """Recursive rejection sampling over a tree (SpecInfer, Miao et al. 2024; Recursive Speculative Decoding,
    Jeon et al. 2024, for drafts sampled without replacement). Lossless: the committed tokens follow p.

    At the current node (starting at the root) with target distribution p, try its children x_1, x_2, ... in
    order (the order they were drawn in):

    * drafts sampled without replacement from q (``draft_probs`` given): accept x_i when r_i * q(x_i) <= p(x_i);
      on rejection p <- norm(max(0, p - q)) and q <- norm(q with x_i removed), the distribution x_{i+1} was drawn from;
    * deterministic drafts (``draft_probs`` None, q one-hot): accept x_i when r_i <= p(x_i); on rejection
      p <- norm(p with x_i removed).

    An accepted child becomes the current node with its own p; when every child is rejected (or the node is
    a leaf) one token is drawn from the current p and the step ends. Every row at once: D levels of C tries,
    each a few tensor operations over the rows, and nothing read back to the host.

    >>> p = torch.tensor([[[0.2, 0.5, 0.3], [1.0, 0, 0], [1.0, 0, 0]]])   # at the root the target likes token 1
    >>> kids = torch.tensor([[[1, 2], [-1, -1], [-1, -1]]])
    >>> v = verify_tree_speculative(torch.tensor([[0, 2, 1]]), kids, None, p, torch.tensor([[0.0, 0.9, 0.5]]), torch.tensor([0.0]), 1)
    >>> v.num_accepted.tolist(), v.path.tolist(), v.tokens[0, :2].tolist()   # 2 rejected (0.9 > 0.3); 1: 0.5 <= 0.5/0.7
    ([1], [[0, 2]], [1, 0])
    """
    bsz, t = node_tokens.shape
    rows = torch.arange(bsz, device=node_tokens.device)
    cur = torch.zeros(bsz, dtype=torch.long, device=node_tokens.device)
    p = target_probs[:, 0]
    q = None if draft_probs is None else draft_probs[rows, children[:, 0, 0].clamp(min=0)]
    alive = torch.ones(bsz, dtype=torch.bool, device=node_tokens.device)
    path = torch.zeros(bsz, max_depth + 1, dtype=torch.long, device=node_tokens.device)
    m = torch.zeros(bsz, dtype=torch.long, device=node_tokens.device)
    for d in range(max_depth):
        moved = torch.zeros_like(alive)
        nxt = torch.zeros_like(cur)
        for r in range(children.shape[2]):
            child = children[rows, cur, r]
            tried = alive & ~moved & (child >= 0)
            c = child.clamp(min=0)
            x = node_tokens[rows, c].clamp(min=0)
            p_x = p.gather(1, x[:, None])[:, 0]
            q_x = torch.ones_like(p_x) if q is None else q.gather(1, x[:, None])[:, 0]
            if has_q is not None:
                q_x = torch.where(has_q, q_x, 1.0)
            accept = tried & (q_x > 0) & (u_accept[rows, c] * q_x <= p_x)
            reject = tried & ~accept
            residual = p.scatter(1, x[:, None], 0.0)  # residual of a one-hot draft: p without x
            if q is not None:
                given = (p - q).clamp(min=0.0)
                residual = given if has_q is None else torch.where(has_q[:, None], given, residual)
                q_left = q.scatter(1, x[:, None], 0.0)
                q = torch.where(reject[:, None], q_left / q_left.sum(-1, keepdim=True).clamp(min=1e-30), q)
            mass = residual.sum(-1, keepdim=True)
            # mass 0 only where p == q (rejection has probability 0): keep p for safety, as verify_speculative does
            residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)
            p = torch.where(reject[:, None], residual, p)
            nxt = torch.where(accept, c, nxt)
            moved |= accept
        alive &= moved
        cur = torch.where(moved, nxt, cur)
        m += moved.long()
        path[:, d + 1] = torch.where(moved, nxt, 0)
        p = torch.where(moved[:, None], target_probs[rows, cur], p)
        if q is not None:
            q = torch.where(moved[:, None], draft_probs[rows, children[rows, cur, 0].clamp(min=0)], q)
    last = sample_from(p, u_sample)  # [B]
    tokens = torch.cat([node_tokens.gather(1, path[:, 1:]), node_tokens.new_zeros(bsz, 1)], dim=1)
    tokens.scatter_(1, m[:, None], last[:, None])
    return Verdict(num_accepted=m, tokens=tokens, path=path)
