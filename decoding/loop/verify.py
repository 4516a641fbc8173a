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


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Greedy rule: accept the longest prefix of drafts equal to the target's argmax.

    draft_tokens [B, k], target_logits [B, k+1, V].

    >>> logits = torch.tensor([[[0., 5, 0], [0, 0, 5], [5, 0, 0]]])   # argmax 1, 2, 0
    >>> v = verify_greedy(torch.tensor([[1, 0]]), logits)
    >>> v.num_accepted.tolist(), v.tokens[0, :2].tolist()              # 1 accepted, then target's 2
    ([1], [1, 2])
    """
    target_tokens = target_logits.argmax(-1)  # [B, k+1]
    k = draft_tokens.shape[1]
    match = draft_tokens == target_tokens[:, :k]  # [B, k]
    num_accepted = match.long().cumprod(-1).sum(-1)  # [B]
    # accepted drafts equal the argmax, so the argmax row is already the committed sequence
    return Verdict(num_accepted=num_accepted, tokens=target_tokens)


def verify_speculative(
    draft_tokens: torch.Tensor,  # [B, k]  x_1..x_k drawn from q
    draft_probs: torch.Tensor | None,  # [B, k, V] q_i(.), or None for a deterministic drafter (q = one-hot)
    target_probs: torch.Tensor,  # [B, k+1, V] p_i(.), warped exactly like q
    u_accept: torch.Tensor,  # [B, k] uniforms r_i in [0, 1)
    u_sample: torch.Tensor,  # [B] uniform for the correction / bonus draw
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

    Accept draft x_i while r_i <= p_i(x_i) / q_i(x_i). At the first rejection j,
    draw from the residual norm(max(0, p_j - q_j)); if all k are accepted, draw
    the bonus token from p_{k+1}. The committed tokens are distributed exactly
    as tokens sampled one by one from p.

    For a deterministic drafter (n-gram, greedy drafts) q_i is one-hot at x_i,
    so acceptance is r_i <= p_i(x_i) and the residual is p_i with x_i removed.
    """
    bsz, k = draft_tokens.shape
    rows = torch.arange(bsz, device=draft_tokens.device)
    p_x = target_probs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, k]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    accepted = u_accept * q_x <= p_x  # r <= p/q without dividing by q
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # [B] = m

    p_m = target_probs[rows, num_accepted]  # [B, V] target distribution where the draw happens
    rejected = num_accepted < k  # rows whose draw is a residual draw
    if k > 0 and bool(rejected.any()):
        j = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_m = torch.zeros_like(p_m).scatter_(-1, draft_tokens[rows, j].unsqueeze(-1), 1.0)
        else:
            q_m = draft_probs[rows, j]
        residual = (p_m - q_m).clamp_(min=0.0)
        mass = residual.sum(-1, keepdim=True)
        # mass == 0 only when p == q, where rejection has probability 0; fall back to p for safety
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_m)
        p_m = torch.where(rejected.unsqueeze(-1), residual, p_m)
    drawn = sample_from(p_m, u_sample)  # [B]

    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(bsz, 1)], dim=1)  # [B, k+1]
    tokens[rows, num_accepted] = drawn
    return Verdict(num_accepted=num_accepted, tokens=tokens)


def commit_unverified(
    draft_tokens: torch.Tensor,  # [B, j] committed as they are
    target_probs: torch.Tensor | None,  # [B, j+1, V] warped p; None = greedy
    target_logits: torch.Tensor,  # [B, j+1, V]
    u_sample: torch.Tensor | None,  # [B] uniform for the target's token (sampling)
) -> Verdict:
    """No verification (EAD, lossy by design): every draft is committed, then the target's own token after the last one
    (its argmax, or a draw from p with ``u_sample``). Not a lossless rule: the output follows the drafter wherever it
    drafted.

    >>> logits = torch.tensor([[[0., 5, 0], [0, 0, 5], [5, 0, 0]]])   # the target would say 1, 2, 0
    >>> v = commit_unverified(torch.tensor([[2, 2]]), None, logits, None)
    >>> v.num_accepted.tolist(), v.tokens.tolist()                    # both drafts kept, then the target's 0
    ([2], [[2, 2, 0]])
    """
    bsz, j = draft_tokens.shape
    last = target_logits[:, j].argmax(-1) if target_probs is None else sample_from(target_probs[:, j], u_sample)  # [B]
    tokens = torch.cat([draft_tokens, last[:, None]], dim=1)
    return Verdict(num_accepted=torch.full((bsz,), j, dtype=torch.long, device=draft_tokens.device), tokens=tokens)


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
    >>> from decoding.trees.trees import tree_mask
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


def _path_to(mask_rows: torch.Tensor, best: torch.Tensor, depth: torch.Tensor):
    """Node indices of root..best for each row, padded with 0: ([B, D+1], m [B])."""
    bsz = best.shape[0]
    rows = mask_rows[torch.arange(bsz, device=best.device), best]  # [B, T] ancestors-or-self of best
    m = depth.expand(rows.shape)[torch.arange(bsz, device=best.device), best]  # [B]
    width = int(depth.max()) + 1
    # ancestors in node order are in depth order: a stable sort puts them first
    order = torch.sort((~rows).to(torch.int8), dim=-1, stable=True).indices[:, :width]
    keep = torch.arange(width, device=best.device).unsqueeze(0) <= m.unsqueeze(1)
    return torch.where(keep, order, 0), m


def verify_tree_greedy(node_tokens, parents, mask, depth, target_logits: torch.Tensor, accept=None) -> Verdict:
    """Greedy rule on a tree: commit the longest root-to-node path matching the target's argmax, then the argmax there.

    node_tokens [B, T], parents [T], mask [T, T], depth [T], target_logits [B, T, V].

    >>> from decoding.trees.trees import Tree
    >>> tree = Tree.from_paths([[0], [1], [1, 0]])                          # nodes: root, a, b, b's child
    >>> tokens = torch.tensor([[9, 4, 5, 6]])
    >>> argmax = torch.tensor([[5, 0, 6, 1]])                               # the target wants 5, then 6, then 1
    >>> logits = torch.nn.functional.one_hot(argmax, 10).float()
    >>> v = verify_tree_greedy(tokens, tree.parents, tree.mask, tree.depth, logits)
    >>> v.num_accepted.tolist(), v.path.tolist(), v.tokens.tolist()
    ([2], [[0, 2, 3]], [[5, 6, 1]])
    """
    g = target_logits.argmax(-1)  # [B, T]
    if accept is not None:
        best = accept(node_tokens, parents, mask, depth, g)
    else:  # the Triton kernel where kernels.install() registered it and it applies (CUDA)
        best = accel.dispatch("greedy_tree_accept", greedy_tree_accept, node_tokens, parents, mask, depth, g)
    path, m = _path_to(mask.expand(g.shape[0], *mask.shape[-2:]), best, depth)
    tokens = torch.cat([node_tokens.gather(1, path[:, 1:]), g.new_zeros(g.shape[0], 1)], dim=1)  # [B, D+1]
    rows = torch.arange(g.shape[0], device=g.device)
    tokens[rows, m] = g[rows, best]  # the target's token after the last accepted node
    return Verdict(num_accepted=m, tokens=tokens, path=path)


def verify_tree_speculative(
    node_tokens: torch.Tensor,  # [B, T] node 0 = pending token
    parents: torch.Tensor,  # [T]
    draft_probs: torch.Tensor | None,  # [B, T, V] q the node was drawn from (its parent's draft distribution); None = deterministic
    target_probs: torch.Tensor,  # [B, T, V] p at each node, warped like q
    u_accept: torch.Tensor,  # [B, T] one uniform per node (used when the node is tried)
    u_sample: torch.Tensor,  # [B] uniform for the final draw
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
    a leaf) one token is drawn from the current p and the step ends.

    >>> p = torch.tensor([[[0.2, 0.5, 0.3], [1.0, 0, 0], [1.0, 0, 0]]])   # at the root the target likes token 1
    >>> v = verify_tree_speculative(torch.tensor([[0, 2, 1]]), torch.tensor([-1, 0, 0]), None, p,
    ...                             torch.tensor([[0.0, 0.9, 0.5]]), torch.tensor([0.0]))
    >>> v.num_accepted.tolist(), v.path.tolist(), v.tokens[0, :2].tolist()   # 2 rejected (0.9 > 0.3); 1: 0.5 <= 0.5/0.7
    ([1], [[0, 2]], [1, 0])
    """
    bsz, t = node_tokens.shape
    plist = parents.tolist()
    children: list[list[int]] = [[] for _ in range(t)]
    for i, par in enumerate(plist[1:], 1):
        children[par].append(i)
    paths, drawn = [], []
    for b in range(bsz):
        cur, path = 0, [0]
        p = target_probs[b, 0]
        while children[cur]:
            kids = children[cur]
            q = None if draft_probs is None else draft_probs[b, kids[0]].clone()
            nxt = None
            for c in kids:
                x = int(node_tokens[b, c])
                qx = 1.0 if q is None else q[x]
                if qx > 0 and u_accept[b, c] * qx <= p[x]:
                    nxt = c
                    break
                if q is None:  # residual of a one-hot draft: p without x
                    residual = p.clone()
                    residual[x] = 0.0
                else:
                    residual = (p - q).clamp_(min=0.0)
                    q[x] = 0.0
                    q = q / q.sum().clamp(min=1e-30)
                mass = residual.sum()
                # mass 0 only where p == q (rejection has probability 0): keep p for safety, as verify_speculative does
                p = residual / mass if mass > 0 else p
            if nxt is None:
                break
            cur = nxt
            path.append(cur)
            p = target_probs[b, cur]
        paths.append(path)
        drawn.append(p)
    depth = max(len(pth) for pth in paths)
    path_t = torch.tensor([pth + [0] * (depth - len(pth)) for pth in paths], dtype=torch.long, device=node_tokens.device)
    m = torch.tensor([len(pth) - 1 for pth in paths], dtype=torch.long, device=node_tokens.device)
    last = sample_from(torch.stack(drawn), u_sample)  # [B]
    tokens = torch.cat([node_tokens.gather(1, path_t[:, 1:]), node_tokens.new_zeros(bsz, 1)], dim=1)
    tokens[torch.arange(bsz, device=tokens.device), m] = last
    return Verdict(num_accepted=m, tokens=tokens, path=path_t)
