"""Triton kernel for TriForce's chunk relevance scores (the retrieval cache's selection).

Torch reference: :func:`decoding.model.kv_views.chunk_scores_reference`. For each
batch row b, KV head h and chunk c of ``chunk_size`` consecutive keys::

    score[b, h, c] = mean_{i in chunk c} k[b, h, i] . sum_{g in group(h), t} q[b, g, t]

(grouped-query attention: the query heads of KV head h are h*G .. h*G+G-1). One
program handles one (b, h) pair and ``BLOCK_C`` chunks: it sums the group's
queries once, then reads each chunk's keys a single time, so the whole key
cache is streamed once and no [chunks, D] mean tensor is materialised.
``decoding.model.kv_views.chunk_scores`` dispatches here on CUDA tensors, or on CPU
under ``TRITON_INTERPRET=1`` (set before triton is imported).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # collected by pytest's doctest run on machines without triton; nothing here is usable then
    triton = None


def _chunk_scores_kernel(
    q_ptr,  # [B, Hkv, R, D] contiguous: R = G * Tq query rows per KV head
    k_ptr,  # [B, Hkv, N, D] (strides given)
    out_ptr,  # [B, Hkv, C] float32
    R,
    C,
    stride_kb,
    stride_kh,
    stride_kn,
    D: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    H: tl.constexpr,
):
    bh = tl.program_id(0)
    cb = tl.program_id(1)
    b = bh // H
    h = bh % H
    d = tl.arange(0, BLOCK_D)
    dmask = d < D

    q_sum = tl.zeros([BLOCK_D], dtype=tl.float32)
    q_base = q_ptr + bh * R * D
    for r in range(0, R):
        q_sum += tl.load(q_base + r * D + d, mask=dmask, other=0.0).to(tl.float32)

    i = tl.arange(0, BLOCK_CHUNK)
    imask = i < CHUNK
    k_base = k_ptr + b * stride_kb + h * stride_kh
    for j in range(0, BLOCK_C):
        c = cb * BLOCK_C + j
        if c < C:
            rows = c * CHUNK + i
            keys = tl.load(k_base + rows[:, None] * stride_kn + d[None, :], mask=imask[:, None] & dmask[None, :], other=0.0)
            mean = tl.sum(keys.to(tl.float32), axis=0) / CHUNK  # [BLOCK_D]
            tl.store(out_ptr + bh * C + c, tl.sum(mean * q_sum, axis=0))


if triton is not None:
    _chunk_scores_kernel = triton.jit(_chunk_scores_kernel)


def chunk_scores_triton(query: torch.Tensor, keys: torch.Tensor, chunk_size: int, block_c: int = 16) -> torch.Tensor:
    """Same contract as ``decoding.model.kv_views.chunk_scores_reference``: query [B, Hq, Tq, D], keys [B, Hkv, N, D]
    (N a multiple of ``chunk_size``, last dim contiguous) -> [B, Hkv, N // chunk_size] float32."""
    bsz, hq, tq, dim = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    if hq % hkv or n % chunk_size or keys.stride(-1) != 1:
        raise ValueError(f"bad shapes: query {tuple(query.shape)}, keys {tuple(keys.shape)} (stride {keys.stride()}), chunk {chunk_size}")
    chunks = n // chunk_size
    q = query.reshape(bsz, hkv, (hq // hkv) * tq, dim).contiguous()  # [B, Hkv, R, D]
    out = torch.empty(bsz, hkv, chunks, dtype=torch.float32, device=keys.device)
    if chunks == 0:
        return out
    grid = (bsz * hkv, triton.cdiv(chunks, block_c))
    _chunk_scores_kernel[grid](
        q,
        keys,
        out,
        q.shape[2],
        chunks,
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        D=dim,
        CHUNK=chunk_size,
        BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_CHUNK=triton.next_power_of_2(chunk_size),
        BLOCK_C=block_c,
        H=hkv,
    )
    return out
