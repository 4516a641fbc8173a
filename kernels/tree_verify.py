"""Greedy tree verification as one Triton program per batch row.

The torch reference is :func:`decoding.loop.verify.greedy_tree_accept` (what the decoding code runs on CPU): a node
is ok when its token equals the target's argmax at its parent, accepted when every ancestor-or-self is ok; the
answer is the deepest accepted node. The kernel loads the row's T node tokens, parents, depths and the [T, T]
ancestor mask into one block (T <= 1024 nodes), so the whole verdict is a handful of vector ops and one argmax.

``kernels.install()`` registers it for ``decoding.loop.verify.verify_tree_greedy``, which then runs it where
:func:`kernels.use_kernel` says so (CUDA tensors, or the CPU interpreter under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

_kernel = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def greedy_tree_accept_kernel(
        tok_ptr, par_ptr, mask_ptr, depth_ptr, g_ptr, out_ptr,
        T, s_tok, s_par, s_mask, s_depth, s_g,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        valid = i < T
        tok = tl.load(tok_ptr + b * s_tok + i, mask=valid, other=0)
        par = tl.load(par_ptr + b * s_par + i, mask=valid, other=-1)
        at_parent = tl.load(g_ptr + b * s_g + tl.maximum(par, 0), mask=valid, other=-1)
        ok = (tok == at_parent) | (par < 0)  # [BLOCK]
        both = valid[:, None] & valid[None, :]
        anc = tl.load(mask_ptr + b * s_mask + i[:, None] * T + i[None, :], mask=both, other=0)  # [BLOCK, BLOCK]
        bad = tl.sum(((anc != 0) & (ok[None, :] == 0)).to(tl.int32), axis=1)  # not-ok ancestors-or-self per node
        depth = tl.load(depth_ptr + b * s_depth + i, mask=valid, other=0)
        score = tl.where((bad == 0) & valid, depth, -1)
        tl.store(out_ptr + b, tl.argmax(score, axis=0, tie_break_left=True))

    return greedy_tree_accept_kernel


def greedy_tree_accept_triton(node_tokens, parents, mask, depth, target_argmax) -> torch.Tensor:
    """The kernel itself (no dispatch): same arguments and result as the reference, [B] int64."""
    import triton

    global _kernel
    if _kernel is None:
        _kernel = _build()
    bsz, t = node_tokens.shape
    tok = node_tokens.contiguous()
    g = target_argmax.contiguous()
    par = parents.contiguous() if parents.dim() == 2 else parents.contiguous()[None]
    dep = depth.contiguous() if depth.dim() == 2 else depth.contiguous()[None]
    m = (mask if mask.dim() == 3 else mask[None]).to(torch.int8).contiguous()
    out = torch.empty(bsz, dtype=torch.int64, device=tok.device)
    stride = lambda x: x.stride(0) if x.shape[0] > 1 else 0  # noqa: E731 - a shared [T] row broadcasts over the batch
    strides = (tok.stride(0), stride(par), stride(m), stride(dep), g.stride(0))
    _kernel[(bsz,)](tok, par, m, dep, g, out, t, *strides, BLOCK=triton.next_power_of_2(t))
    return out
