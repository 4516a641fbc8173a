"""CPU kernels for the shipped model (AVX512-BF16): its 4-bit linears, its 8-bit LM head, RMSNorm and attention.

The bundled SmolLM2 runs its decoder layers as 4-bit groups and its LM head as 8-bit ones (``decoding.model.quant``).
torch's int4 kernel widens each weight to float32 and multiplies it by one input row at a time: it is bound by the
widening at one row and by float32 multiply-adds past it, and it runs the 8-bit head as two 4-bit halves (twice
the work). ``int4_mm`` widens 4-bit values to bfloat16 with two bit operations (``0x4300 | u`` is the bfloat16 value
``128 + u`` exactly), multiplies pairs of them by pairs of inputs in one instruction (VDPBF16PS: exact products,
float32 sums), and applies the offset and each group's scale and zero once per group; ``int8_mm`` runs the head's
8-bit values in one pass (``kernels/cpu_int4.cpp``). Same weights, float32 sums in another order.

``attend`` is the float32 attention of ``decoding.model.fast_layers._attend`` for a few queries, each query over
its own visible slots only, in ascending order. torch's batched matmuls over the block's padded, masked key range
sum in an order that depends on the block's shape (3 query rows against 4, 250 slots against 300), so a token
verified in a chain or a tree got other bits than decoded alone, and bfloat16 speculation parted from AR at
near-ties. Here a row's arithmetic depends on nothing but its own values, in the linears and in attention alike:
every lossless method's bfloat16 greedy output equals AR's (``tests/decoding/test_greedy_bf16_real.py``).

Measured on this repository's 2-core host (SmolLM2-135M, a 256-token cache; ``python`` over ``ModelAdapter``): a
one-token step 8.1 -> 5.4-5.6 ms, four tokens 11.0 -> 7.3-7.7, eight 17.0 -> 10.5-10.7.

Attention loads each key and value row once for the query heads that share its KV head (SmolLM2: three), and keeps
their queries and weighted sums in registers; each head's arithmetic is what it was alone, so the output is bit for
bit the per-head kernel's. Over long contexts attention is bound by reading the cache, so this is where it pays:
SmolLM2's forward (the fastest of 6 alternating timings, ``ModelAdapter``, 2 threads) over 800 cached tokens went
7.31 -> 7.07 ms at one token, 10.00 -> 9.43 at four, 14.46 -> 13.17 at eight; over 1,600: 8.32 -> 7.95, 12.66 -> 11.44,
19.18 -> 16.17; over 100, unchanged (5.4-5.5, 7.4, 10.1).

Attention reads a float32 or a bfloat16 cache (the same values: the keys and values are bfloat16 projections);
where it is registered the 16-bit stacks keep a bfloat16 cache (``LayerStack.kv_dtype``), half the bytes to read.
``rms_norm`` and ``add_rms_norm`` are ``F.rms_norm(x) * w`` (and the residual sum before it) in one call, with torch's
bits: the squares are summed in the order of torch's CPU reduction. ``rope_attend`` rotates a layer's queries and
keys from its fused projection, writes the keys and values at their slots and attends, in one call where the
separate operations took about twenty, with the same bits (``decoding.model.fast_layers.fused_attention``). ``layer``
runs a whole decoder layer in one call where its four linears are on the int4 kernel: the same kernels and torch
operations in the same order. With them a one-token step over 100 cached tokens went 4.07 -> 3.11 ms (norms and
fused attention), then 3.35 -> 3.01 (the layer; another run), and over 800 4.84 -> 3.58, 4.05 -> 3.47
(docs/benchmarks.md).

It needs AVX512-BF16 (AMD Zen 4, Intel Cooper Lake and later) and a C++ compiler; it is built on first use into
torch's extension cache (about 20 s, once per machine). Elsewhere, or with ``SPECRAY_KERNELS=0``, torch's kernels
run. ``kernels.install()`` registers :func:`prepare` (``int4_linear``: a packed linear made after it runs here,
``decoding.model.quant.PackedLinear.fast``), :func:`attend` (``attend_cpu``), :func:`rms_norm`, :func:`add_rms_norm`,
:func:`rope_attend` and :func:`layer` (``layer_cpu``) with ``decoding.accel``; a forward being compiled runs torch's.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger("specray")
SOURCE = Path(__file__).with_name("cpu_int4.cpp")
# OpenMP: at::parallel_for runs on the torch threads; no contraction: a multiply and an add stay two roundings where the
# kernels reproduce torch's arithmetic (rms_norm)
FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-ffp-contract=off"]


def cpu_supported() -> bool:
    """This CPU has AVX512-BF16 (read from /proc/cpuinfo; Linux on x86-64 only) and kernels are not switched off."""
    return os.environ.get("SPECRAY_KERNELS", "1") != "0" and _has_avx512_bf16()


@functools.cache
def _has_avx512_bf16() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and "avx512_bf16" in line.split() for line in text.splitlines())


@functools.cache
def extension():
    """The compiled kernel module, or None (with one warning) where it cannot be built."""
    if not cpu_supported():
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        log.info("loading the AVX512-BF16 CPU kernels (built once per machine, about 20 s)")
        functions = ["int4_mm", "int8_mm", "attend", "rope_attend", "rms_norm", "add_rms_norm", "layer"]
        return load_inline("specray_cpu_int4", cpp_sources=SOURCE.read_text(), functions=functions, extra_cflags=FLAGS)
    except Exception as e:  # no compiler, no ninja, an old compiler without AVX512-BF16: torch's kernel runs
        log.warning("the AVX512-BF16 int4 kernel did not build (%s); torch's int4 kernel runs", str(e).splitlines()[0][:200])
        return None


def _unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """torch's int4 packing back to the 4-bit values u [N, K] (rows in whole blocks of 64; see :func:`repack`)."""
    blocks = packed.reshape(n // 64, k, 32)
    return torch.stack([blocks & 15, blocks >> 4], dim=2).reshape(n // 64, k, 64).permute(0, 2, 1).reshape(n, k)


def repack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor | None:
    """torch's int4 packing ([N, K/2] uint8: for rows 64b .. 64b + 63 and input k, byte j holds row 64b + j in its low
    nibble and row 64b + 32 + j in its high one) as this kernel's [N/16, K/4, 32] (``cpu_int4.cpp``); None where the
    rows are not whole blocks of 64 (torch packs those otherwise).

    >>> u = torch.randint(0, 16, (64, 32), dtype=torch.int32)
    >>> mine = repack(torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1), 64, 32)
    >>> bool((mine.view(4, 8, 16, 2)[0, 0, :, 0] & 15).eq(u[:16, 0]).all())   # outputs 0..15, input 0
    True
    """
    if n % 64 or k % 32 or packed.numel() != n * k // 2:
        return None
    u = _unpack(packed, n, k)  # [N, K]
    quads = u.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3)  # [N/16, K/4, 16, 4]
    pairs = torch.stack([quads[..., 0] | (quads[..., 2] << 4), quads[..., 1] | (quads[..., 3] << 4)], dim=-1)
    return pairs.reshape(n // 16, k // 4, 32).contiguous()


class PackedKernel:
    """``x [M, K] -> [M, N]`` for one packed linear: a kernel of the extension and the weights it was repacked into once
    (``int4_mm``: 4-bit values, scales, zeros; ``int8_mm``: the Q8_0 head's 8-bit values, scales)."""

    __slots__ = ("op", "weights")

    def __init__(self, op, *weights: torch.Tensor):
        self.op, self.weights = op, weights

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, *self.weights)


def repack_q8(packed: torch.Tensor, n: int, k: int) -> torch.Tensor | None:
    """The Q8_0 head as ``decoding.model.quant.pack_q8_as_q4`` packs it (two 4-bit halves along the input, ``[hi + 8 |
    lo]`` over ``2K``) back to its 8-bit values, as this kernel's [N/16, K/2, 32] int8 (``cpu_int4.cpp``).

    >>> import numpy as np
    >>> from decoding.model.quant import pack_q8_as_q4
    >>> q = np.random.default_rng(0).integers(-128, 128, (64, 32)).astype(np.int8)
    >>> head = pack_q8_as_q4(q, np.ones((64, 1), np.float32), torch.zeros(64, 32, dtype=torch.bfloat16))
    >>> mine = repack_q8(head.packed, 64, 32)
    >>> right = bool(mine.view(4, 16, 16, 2)[0, 0, :, 1].eq(torch.from_numpy(q[:16, 1])).all())   # outputs 0..15, input 1
    >>> right or not cpu_supported()   # torch packs int4 otherwise on a CPU without AVX-512, where this kernel never runs
    True
    """
    if n % 64 or k % 32 or packed.numel() != n * k:
        return None
    u = _unpack(packed, n, 2 * k).to(torch.int16)
    q = ((u[:, :k] - 8) * 16 + u[:, k:]).to(torch.int8)  # [N, K]
    return q.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(n // 16, k // 2, 32).contiguous()


def prepare(linear) -> PackedKernel | None:
    """This kernel for a ``decoding.model.quant.PackedLinear`` (None where it does not apply: not int4, not bfloat16,
    not on a CPU, rows not in blocks of 64, or the kernel unavailable)."""
    if linear.kind != "int4" or linear.scale_zero.dtype != torch.bfloat16 or linear.packed.device.type != "cpu":
        return None
    n, k = linear.scale_zero.shape[1], linear.scale_zero.shape[0] * linear.group
    ext = extension()
    if linear.repeat == 2 and ext is not None:  # the Q8_0 head's halves: scales [16 d | d], the second half's are d
        mine = repack_q8(linear.packed, n, k // 2)
        return None if mine is None else PackedKernel(ext.int8_mm, mine, linear.scale_zero[k // 2 // linear.group :, :, 0].contiguous())
    if linear.repeat != 1:
        return None
    mine = repack(linear.packed, n, k) if ext is not None else None
    if mine is None:
        return None
    return PackedKernel(ext.int4_mm, mine, linear.scale_zero[..., 0].contiguous(), linear.scale_zero[..., 1].contiguous())


_EVERY_SLOT = torch.empty(0, dtype=torch.bool)


def attend_applies(q, k, v, scale, mask) -> bool:
    """The attention kernel takes this call: bfloat16 queries over a float32 or bfloat16 cache on a CPU, heads of
    16-multiple sizes up to 256, not inside a forward being compiled, and the kernel built."""
    return (
        q.dtype == torch.bfloat16
        and k.dtype in (torch.float32, torch.bfloat16)
        and q.device.type == "cpu"
        and q.shape[-1] % 16 == 0
        and q.shape[-1] <= 256
        and not torch.compiler.is_compiling()
        and extension() is not None
    )


def attend(q, k, v, scale: float, mask) -> torch.Tensor:
    """``decoding.model.fast_layers._attend_own`` with each query over its own allowed slots only, in ascending order
    (``cpu_int4.cpp``): q [B, H, T, D] bfloat16 against k/v [B, KV, S, D] float32 or bfloat16, ``mask`` None or bool
    [B|1, 1, T, S] (True: may attend). A query's result depends on nothing but its slots, so a token verified in a
    chain or a tree gets the bits it gets decoded alone."""
    allowed = _EVERY_SLOT if mask is None else mask.squeeze(1).contiguous()
    return extension().attend(q, k, v, float(scale), allowed)


def norm_applies(x, weight, eps) -> bool:
    """The RMSNorm kernels take this call: bfloat16 rows on a CPU (2-D, each row contiguous), a bfloat16 weight, not
    inside a forward being compiled, and the kernel built."""
    return (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.stride(-1) == 1
        and not torch.compiler.is_compiling()
        and extension() is not None
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``decoding.model.fast_layers.rms_norm`` (``F.rms_norm(x, (N,), None, eps) * weight``) bit for bit, in one call:
    the squares summed in the order of torch's CPU reduction (``cpu_int4.cpp``). torch runs it as about ten
    operations (10 us for a row of 576 here, against 0.8), and a SmolLM2 step has 61 of them."""
    return extension().rms_norm(x, weight, float(eps))


def add_rms_norm(h: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``decoding.model.fast_layers.add_rms_norm`` bit for bit: the residual sum ``h + d`` and its norm, in one call."""
    total, normed = extension().add_rms_norm(h, d, weight, float(eps))
    return total, normed


def rope_attend_applies(hidden, k_layer) -> bool:
    """The fused rotation, cache write and attention take a forward: bfloat16 activations on a CPU over a float32 or
    bfloat16 cache, not inside a forward being compiled, and the kernel built."""
    return (
        hidden.dtype == torch.bfloat16
        and hidden.device.type == "cpu"
        and k_layer.device.type == "cpu"
        and k_layer.dtype in (torch.float32, torch.bfloat16)
        and k_layer.shape[-1] % 16 == 0
        and k_layer.shape[-1] <= 256
        and not torch.compiler.is_compiling()
        and extension() is not None
    )


def rope_attend(qkv, cos, sin, k, v, rows, slots, end: int, allowed, scale: float, heads: int, kv_heads: int) -> torch.Tensor:
    """``decoding.model.fast_layers.fused_attention``'s call: one layer's keys and queries rotated (``_rotate``'s three
    bfloat16 roundings), keys and values written at ``slots`` of cache rows ``rows``, then :func:`attend`'s
    arithmetic over slots ``[0, end)``, returned as [B*T, heads * head_dim] (``cpu_int4.cpp``). The same bits as
    the separate operations, in one call where they took about twenty."""
    return extension().rope_attend(qkv, cos, sin, k, v, rows, slots, end, allowed, float(scale), heads, kv_heads)


_LINEARS = ("qkv", "o", "gate_up", "down")


def layer_applies(stack, hidden) -> bool:
    """One call per layer (:func:`layer`) takes a forward: what :func:`rope_attend_applies` asks, at most
    ``accel.FAST_MAX_ROWS`` rows, and every layer's four linears on this extension's int4 kernel."""
    from decoding import accel

    ext = extension()
    if ext is None or hidden.dtype != torch.bfloat16 or hidden.shape[0] > accel.FAST_MAX_ROWS or torch.compiler.is_compiling():
        return False
    known = getattr(stack, "_int4_layers", None)  # (its weights list, the answer): asked at every forward
    if known is None or known[0] is not stack.weights:
        every = all(_on_int4(w.packed.get(name), ext) for w in stack.weights for name in _LINEARS)
        known = stack._int4_layers = (stack.weights, every)
    return known[1]


def _on_int4(linear, ext) -> bool:
    fast = getattr(linear, "fast", None)
    return isinstance(fast, PackedKernel) and fast.op is ext.int4_mm


def layer(w, hidden, cos, sin, k, v, rows, slots, end: int, allowed, heads: int, kv_heads: int) -> torch.Tensor:
    """``decoding.model.fast_layers.layer_step`` for one layer, with the fused attention (``fused_attention``'s
    arguments), in one call (``cpu_int4.cpp``: the same kernels and torch operations in the same order, so the same
    bits, without returning to Python between them)."""
    p = w.packed
    return extension().layer(
        hidden, w.norm_in, w.eps_in, w.norm_post, w.eps_post, *(p[name].fast.weights for name in _LINEARS),
        cos, sin, k, v, rows, slots, end, allowed, w.scale, heads, kv_heads,
    )  # fmt: skip
