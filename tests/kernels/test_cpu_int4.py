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


# ---- RMSNorm, the fused rotation + cache write + attention, a 16-bit cache ------------------------------------------


@pytest.mark.parametrize("n", [576, 64, 100, 17, 960, 2048, 3072, 8192])
def test_rms_norm_is_torchs_bit_for_bit(n):
    """The squares summed in torch's order: sizes under one cascade level (576), with leftover vectors (100) and a
    scalar tail (17), and sizes where the reduction's cascade of levels runs (960 and up)."""
    from decoding.model.fast_layers import add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(n)
    for trial in range(12):
        x = (torch.randn(1 + trial % 4, n, generator=g) * (0.05 + trial)).bfloat16()
        d = torch.randn(x.shape, generator=g).bfloat16()
        w, eps = torch.randn(n, generator=g).bfloat16(), [1e-5, 1e-6][trial % 2]
        assert torch.equal(cpu_int4.rms_norm(x, w, eps), rms_norm(x, w, eps))
        assert all(torch.equal(a, b) for a, b in zip(cpu_int4.add_rms_norm(x, d, w, eps), add_rms_norm(x, d, w, eps), strict=True))


def test_rms_norm_catches_a_changed_order():
    """The bit-for-bit check above can fail: the same squares summed one by one (float32, in order) give another
    result somewhere in a hundred rows of 8,192."""
    import numpy as np

    from decoding.model.fast_layers import rms_norm

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(100, 8192, generator=g).bfloat16(), torch.randn(8192, generator=g).bfloat16()
    xf = x.float()
    squares = (xf * xf).numpy()
    total = np.add.accumulate(squares, axis=1, dtype=np.float32)[:, -1]  # one by one, in order
    r = 1 / torch.sqrt(torch.from_numpy(total)[:, None] / 8192 + 1e-5)
    assert not torch.equal((xf * r).bfloat16() * w, rms_norm(x, w, 1e-5))
    assert torch.equal(cpu_int4.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))


def _cache(rows: int, kv: int, slots: int, d: int, dtype, g):
    k = torch.randn(rows, kv, slots, d, generator=g).bfloat16().to(dtype)
    return k, torch.randn(rows, kv, slots, d, generator=g).bfloat16().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_a_bfloat16_cache_is_the_float32_caches(dtype):
    """The cache holds bfloat16 values either way; the kernel widens them as it reads: the same bits."""
    g = torch.Generator().manual_seed(3)
    for t, s, heads, kv in [(1, 300, 9, 3), (4, 77, 8, 2), (3, 40, 4, 4)]:
        q = torch.randn(2, heads, t, 64, generator=g).bfloat16()
        k, v = _cache(2, kv, s, 64, torch.bfloat16, g)
        allowed = torch.rand(2, t, s, generator=g) > 0.3
        assert torch.equal(
            cpu_int4.attend(q, k.to(dtype), v.to(dtype), 0.125, allowed[:, None]),
            cpu_int4.attend(q, k.float(), v.float(), 0.125, allowed[:, None]),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_given", [False, True])
def test_fused_rotation_write_and_attention_are_the_separate_operations(dtype, rows_given):
    """rope_attend against fast_layers' own steps: rotate q and k, write k and v at the slots of the rows, attend."""
    from decoding.model.fast_layers import _rotate, signed_sin

    g = torch.Generator().manual_seed(int(rows_given) + 2 * (dtype == torch.float32))
    for b, t, heads, kv, d in [(1, 1, 9, 3, 64), (2, 3, 8, 2, 64), (3, 2, 4, 4, 32), (1, 5, 6, 1, 64)]:
        cache_rows, slots_n, prefix = 4, 40, 20
        k_all, v_all = _cache(cache_rows, kv, slots_n, d, dtype, g)
        k_ref, v_ref = k_all.clone(), v_all.clone()
        qkv = torch.randn(b * t, (heads + 2 * kv) * d, generator=g).bfloat16()
        cos, sin = torch.randn(b, t, d, generator=g).bfloat16(), torch.randn(b, t, d, generator=g).bfloat16()
        rows = torch.randperm(cache_rows, generator=g)[:b] if rows_given else torch.arange(b)
        slots = prefix + torch.stack([torch.randperm(6, generator=g)[:t] for _ in range(b)])
        end = prefix + 6
        allowed = torch.rand(b, t, end, generator=g) > 0.2
        # the separate operations
        x = qkv.view(b, t, heads + kv + kv, d).transpose(1, 2)
        qk = _rotate(x[:, : heads + kv], cos[:, None], signed_sin(sin)[:, None])
        q, k = qk[:, :heads], qk[:, heads:]
        for i in range(b):
            for j in range(t):
                k_ref[rows[i], :, slots[i, j]] = k[i, :, j].to(dtype)
                v_ref[rows[i], :, slots[i, j]] = x[i, heads + kv :, j].to(dtype)
        want = cpu_int4.attend(q, k_ref[rows, :, :end], v_ref[rows, :, :end], 0.125, allowed[:, None])
        got = cpu_int4.rope_attend(
            qkv,
            cos,
            signed_sin(sin).contiguous(),
            k_all,
            v_all,
            rows if rows_given else torch.empty(0, dtype=torch.long),
            slots,
            end,
            allowed,
            0.125,
            heads,
            kv,
        )
        assert torch.equal(k_all, k_ref) and torch.equal(v_all, v_ref)
        assert torch.equal(got, want.transpose(1, 2).reshape(b * t, heads * d))


def test_a_slot_outside_the_cache_is_refused():
    k, v = _cache(1, 1, 8, 64, torch.bfloat16, torch.Generator().manual_seed(0))
    qkv, cos = torch.zeros(1, 3 * 64).bfloat16(), torch.zeros(1, 1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="slot outside"):
        cpu_int4.rope_attend(
            qkv, cos, cos, k, v, torch.empty(0, dtype=torch.long), torch.tensor([[9]]), 8, torch.empty(0, dtype=torch.bool), 0.1, 1, 1
        )


def _steps(vocab: int):
    from decoding.trees.shapes import Tree

    g = torch.Generator().manual_seed(1)
    tree = Tree.from_parents([-1, 0, 0, 1, 2])
    one = [
        dict(start=0, input_ids=torch.randint(vocab, (1, 9), generator=g)),  # a causal prefill from slot 0
        dict(start=9, input_ids=torch.randint(vocab, (1, 1), generator=g)),  # one token
        dict(start=10, input_ids=torch.randint(vocab, (1, 4), generator=g)),  # a chain after a prefix
        dict(start=14, input_ids=torch.randint(vocab, (1, 5), generator=g), positions=tree.positions(14)[None], tree_mask=tree.mask),
    ]
    rows = [  # two rows at their own lengths (indexed writes)
        dict(start=0, input_ids=torch.randint(vocab, (2, 12), generator=g)),
        dict(start=torch.tensor([7, 11]), input_ids=torch.randint(vocab, (2, 3), generator=g)),
        dict(start=torch.tensor([10, 14]), input_ids=torch.randint(vocab, (2, 1), generator=g)),
    ]
    return [(1, one), (2, rows)]


@pytest.mark.parametrize("quantised", [False, True])
def test_the_fused_forward_gives_the_op_by_op_forwards_bits(quantised):
    """A 16-bit Llama with 64-wide heads, dense or with 4-bit linears: every kind of step (one token, a chain, a tree,
    rows at their own lengths) gives the same hidden states and cache with the norm, fused-attention and whole-layer
    kernels registered and without them; with 4-bit linears the whole-layer call is what ran."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from decoding.model.adapter import ModelAdapter
    from decoding.model.quant import quantize_model

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=192, intermediate_size=256, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1
    )
    model = LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    names = ("rms_norm", "add_rms_norm", "rope_attend", "layer_cpu")
    saved = {n: accel.registered_impl(n) for n in names}
    assert all(saved.values())
    calls = []
    results = []
    try:
        for on in (True, False):
            for n in names:
                if on:
                    fn = saved[n][1]
                    impl = (lambda *a, fn=fn: calls.append(1) or fn(*a)) if n == "layer_cpu" else fn
                    accel.register(n, impl, applies=saved[n][0])
                else:
                    accel.unregister(n)
            twin = copy.deepcopy(model)
            if quantised:
                twin.specray_quant = quantize_model(twin, "q4")
            fast = ModelAdapter(twin)
            for batch, steps in _steps(fast.vocab_size):
                cache = fast.new_cache(batch, 64)
                results.append(([fast.forward(cache, **step) for step in steps], cache.k_all.clone(), cache.v_all.clone()))
    finally:
        for n in names:
            accel.register(n, saved[n][1], applies=saved[n][0])
    assert bool(calls) == quantised  # the whole-layer call takes only 4-bit linears on this kernel
    half = len(results) // 2
    for (a, ka, va), (b, kb, vb) in zip(results[:half], results[half:], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)) and torch.equal(ka, kb) and torch.equal(va, vb)
