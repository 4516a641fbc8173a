"""The AVX512-BF16 CPU kernels (kernels/cpu_int4.py) against torch's, and the property they add: a row's bits do not
depend on the rows or the masked slots beside it.

Skipped on CPUs without AVX512-BF16 or where the extension cannot be built (torch's kernels run there)."""

from __future__ import annotations

import pytest
import torch

from decoding import accel
from decoding.model.fast_layers import _attend
from decoding.model.quant import pack_dense, pack_q8_as_q4, reference_weight
from kernels import cpu_int4

pytestmark = pytest.mark.skipif(cpu_int4.extension() is None, reason="no AVX512-BF16 CPU kernel here (torch's kernels run)")


def _linear(n: int, k: int, seed: int = 0):
    torch.manual_seed(seed)
    return pack_dense((torch.randn(n, k) * 0.05).bfloat16(), "q4")


def test_registered_and_chosen_for_packed_linears():
    assert "int4_linear" in accel.registered() and "attend_cpu" in accel.registered()  # tests/conftest.py installed
    linear = _linear(128, 64)
    assert isinstance(linear.fast, cpu_int4.PackedKernel) and linear.fast.op is cpu_int4.extension().int4_mm
    assert pack_dense(torch.randn(128, 64).float(), "q4").fast is None  # float32 weights: torch's kernel


@pytest.mark.parametrize("n,k", [(64, 32), (576, 576), (960, 576), (192, 1536)])
def test_int4_matmul_matches_torchs_kernel(n, k):
    linear = _linear(n, k)
    exact = reference_weight(linear).double()
    for rows in (1, 2, 3, 4, 8, 9, 16):
        x = torch.randn(rows, k).bfloat16()
        ours = linear.fast(x)
        theirs = torch.ops.aten._weight_int4pack_mm_for_cpu(x, linear.packed, 32, linear.scale_zero)
        ref = x.double() @ exact.T
        scale = ref.abs().max()
        # both are float32 sums of the same products rounded to bfloat16: within a rounding of each other and of exact
        assert (ours.double() - ref).abs().max() <= 8e-3 * scale
        assert (ours.double() - theirs.double()).abs().max() <= 8e-3 * scale
        assert ours.shape == (rows, n) and ours.dtype == torch.bfloat16


def test_int4_rows_do_not_depend_on_each_other():
    linear = _linear(576, 1536, seed=1)
    x = torch.randn(16, 1536).bfloat16()
    together = linear.fast(x)
    for r in range(16):
        assert torch.equal(linear.fast(x[r : r + 1]), together[r : r + 1])
    assert torch.equal(linear.fast(x[3:11]), together[3:11])


def test_q8_head_as_halves_runs_the_kernel():
    torch.manual_seed(2)
    q = torch.randint(-128, 128, (256, 64), dtype=torch.int8).numpy()
    d = (torch.rand(256, 2) * 0.01).half().float().numpy()
    dense = torch.from_numpy(q.astype("float32").reshape(256, 2, 32) * d[..., None]).reshape(256, 64).bfloat16()
    head = pack_q8_as_q4(q, d, dense)
    assert head.fast.op is cpu_int4.extension().int8_mm and head.repeat == 2  # its 8-bit values in one pass
    x = torch.randn(3, 64).bfloat16()
    ref = x.double() @ reference_weight(head).double().T
    assert (head(x).double() - ref).abs().max() <= 8e-3 * ref.abs().max()


def test_repack_rejects_what_it_cannot_map():
    assert cpu_int4.repack(torch.zeros(48 * 16, dtype=torch.uint8), 48, 32) is None  # rows not in blocks of 64


def _qkv(t: int, s: int, seed: int = 0):
    torch.manual_seed(seed)
    q = torch.randn(1, t, 9, 64).bfloat16().transpose(1, 2)  # as the layers make it: a transposed view
    k = torch.randn(1, 3, s + 8, 64).bfloat16().float()[:, :, :s]  # a float32 cache of 16-bit values, sliced
    v = torch.randn(1, 3, s + 8, 64).bfloat16().float()[:, :, :s]
    return q, k, v


@pytest.mark.parametrize("t,s", [(1, 1), (1, 300), (4, 260), (9, 700)])
def test_attention_matches_the_float32_reference(t, s):
    q, k, v = _qkv(t, s)
    causal = torch.arange(s)[None, :] <= (s - t + torch.arange(t))[:, None]
    for mask in (None, causal[None, None]):
        ours = cpu_int4.attend(q, k, v, 0.125, mask)
        ref = _attend(q, k, v, 0.125, None if mask is None else ~mask.unsqueeze(1))
        assert torch.allclose(ours.float(), ref.float(), atol=2e-2, rtol=1e-2)


def test_attention_of_a_query_is_its_own():
    """A chain's query t and a tree node get exactly the bits of the same token decoded alone over its visible slots."""
    t, s = 5, 220
    q, k, v = _qkv(t, s, seed=3)
    visible = torch.arange(s)[None, :] <= (s - t + torch.arange(t))[:, None]  # a chain: causal over the block
    visible[4, s - 3] = False  # a tree: node 4 does not see node 2 (a sibling branch), padded slots beside
    together = cpu_int4.attend(q, k, v, 0.125, visible[None, None])
    for i in range(t):
        slots = visible[i].nonzero().flatten()
        alone = cpu_int4.attend(q[:, :, i : i + 1], k[:, :, slots], v[:, :, slots], 0.125, None)
        assert torch.equal(alone[:, :, 0], together[:, :, i])


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (8, 4), (12, 3)])
def test_heads_sharing_a_kv_head_get_the_bits_of_each_head_alone(heads, kv_heads):
    """The kernel reads each key and value row once for the query heads of its KV head (groups of 2-4 at head dim
    64); each head's arithmetic is its own: attending one head at a time (one query head per KV head, the per-head
    path) gives the same bits."""
    gen = torch.Generator().manual_seed(5)
    t, s, group = 3, 150, heads // kv_heads
    q = torch.randn(2, heads, t, 64, generator=gen).bfloat16()
    k, v = (torch.randn(2, kv_heads, s, 64, generator=gen).bfloat16().float() for _ in range(2))
    visible = (torch.rand(2, t, s, generator=gen) > 0.2)[:, None]
    together = cpu_int4.attend(q, k, v, 0.125, visible)
    for h in range(heads):
        kv = h // group
        alone = cpu_int4.attend(q[:, h : h + 1], k[:, kv : kv + 1], v[:, kv : kv + 1], 0.125, visible)
        assert torch.equal(alone[:, 0], together[:, h]), h


def test_a_query_that_sees_nothing_gives_zeros():
    q, k, v = _qkv(2, 10)
    visible = torch.zeros(1, 1, 2, 10, dtype=torch.bool)
    visible[0, 0, 1, :4] = True
    out = cpu_int4.attend(q, k, v, 0.125, visible)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0])) and torch.isfinite(out.float()).all()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPECRAY_KERNELS", "0")
    assert not cpu_int4.cpu_supported()
