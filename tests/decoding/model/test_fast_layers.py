"""decoding.model.fast_layers: the adapter's own layer forward against the transformers modules it replaces."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from conftest import tiny_llama

from decoding import accel
from decoding.model.adapter import ModelAdapter
from decoding.model.fast_layers import ATTEND_MAX, LayerStack, _attend, attend_own_max, supported
from decoding.trees.shapes import Tree


def pair(model):
    fast, modules = ModelAdapter(model), ModelAdapter(model, fast=False)
    assert fast.stack is not None and modules.stack is None
    return fast, modules


def run_both(fast, modules, steps, batch=1, max_len=64):
    """Feed the same steps to both adapters on their own caches; the hidden states of each step, side by side."""
    caches = [a.new_cache(batch, max_len) for a in (fast, modules)]
    out = []
    for kwargs in steps:
        out.append(tuple(a.forward(c, **kwargs) for a, c in zip((fast, modules), caches, strict=True)))
    return out, caches


def steps_of_every_kind(vocab):
    g = torch.Generator().manual_seed(1)
    ids = lambda t: torch.randint(vocab, (1, t), generator=g)  # noqa: E731
    tree = Tree.from_parents([-1, 0, 0, 1, 2])
    return [
        dict(start=0, input_ids=ids(9)),  # causal prefill from slot 0
        dict(start=9, input_ids=ids(1)),  # one token
        dict(start=10, input_ids=ids(4)),  # a chain (causal block after a prefix)
        dict(start=14, input_ids=ids(5), positions=tree.positions(14)[None], tree_mask=tree.mask),  # a token tree
        dict(start=19, input_ids=ids(1)),
    ]


def test_float32_hidden_states_and_cache_are_bit_identical_to_the_modules(tiny_model):
    fast, modules = pair(tiny_model)
    out, (c_fast, c_mod) = run_both(fast, modules, steps_of_every_kind(fast.vocab_size))
    for a, b in out:
        assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(c_fast.k + c_fast.v, c_mod.k + c_mod.v, strict=True))


def test_ragged_rows_match_the_modules(tiny_model):
    fast, modules = pair(tiny_model)
    g = torch.Generator().manual_seed(2)
    prefill = torch.randint(fast.vocab_size, (2, 12), generator=g)
    starts = torch.tensor([7, 11])
    steps = [dict(start=0, input_ids=prefill), dict(start=starts, input_ids=torch.randint(fast.vocab_size, (2, 3), generator=g))]
    steps.append(dict(start=starts + 3, input_ids=torch.randint(fast.vocab_size, (2, 1), generator=g)))
    out, _ = run_both(fast, modules, steps, batch=2)
    for a, b in out:
        assert torch.equal(a, b)


def test_bfloat16_prefill_and_wide_blocks_are_bit_identical_to_the_modules(tiny_model):
    """A causal prefill from slot 0 and blocks wider than attend_own_max() run SDPA as the modules do: the same bits."""
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    fast, modules = pair(model)
    g = torch.Generator().manual_seed(3)
    blocks = [dict(start=0, input_ids=torch.randint(fast.vocab_size, (1, 9), generator=g))]
    wide = attend_own_max() + 3  # a chunk after a prefix
    blocks.append(dict(start=9, input_ids=torch.randint(fast.vocab_size, (1, wide), generator=g)))
    out, _ = run_both(fast, modules, blocks, max_len=16 + wide)
    assert all(torch.equal(a, b) for a, b in out)  # fused projections give the very same products
    # the projections are views of the fused matrices: no weight is stored twice
    layer = model.model.layers[0]
    assert layer.self_attn.k_proj.weight.untyped_storage().data_ptr() == layer.self_attn.q_proj.weight.untyped_storage().data_ptr()
    assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == layer.mlp.gate_proj.weight.untyped_storage().data_ptr()


def test_a_float32_cache_of_bfloat16_values_changes_no_bit(tiny_model):
    """On a CPU a 16-bit stack keeps its KV cache in float32 where torch's matmuls attend (they read float32), and in
    bfloat16 where the CPU kernel does (it widens what it reads): every kind of step gives the same hidden states
    over either cache, with the kernel and without it, and the caches hold the same values."""
    kernel = accel.registered_impl("attend_cpu")
    for registered in [True, False] if kernel else [False]:
        if not registered:
            accel.unregister("attend_cpu")
        try:
            fast = ModelAdapter(copy.deepcopy(tiny_model).to(torch.bfloat16))
            assert fast.cache_dtype == (torch.bfloat16 if registered else torch.float32) == fast.new_cache(1, 8).k_all.dtype
            assert ("f32kv" in fast.implementation) != registered  # the cost models' calibrations are kept per implementation
            fast.cache_dtype = torch.float32
            caches = [fast.new_cache(1, 64)]
            fast.cache_dtype = torch.bfloat16
            caches.append(fast.new_cache(1, 64))
            for step in steps_of_every_kind(fast.vocab_size):
                a, b = (fast.forward(c, **step) for c in caches)
                assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)
            assert torch.equal(caches[0].k_all[:, :, :, :20], caches[1].k_all[:, :, :, :20].float())
            assert torch.equal(caches[0].v_all[:, :, :, :20], caches[1].v_all[:, :, :, :20].float())
        finally:
            if kernel:
                accel.register("attend_cpu", kernel[1], applies=kernel[0])


def test_bfloat16_narrow_steps_are_as_close_to_float32_as_the_modules():
    """Steps of up to ATTEND_MAX queries (one token, a chain, a token tree) attend with float32 scores instead of the
    CPU's 16-bit SDPA kernel. Per step the two paths' errors against float32 scatter around each other (other
    bfloat16 roundings dominate): over 4 models x 4 steps the fast path's error is on average within 10% of the
    modules' and never 1.5x theirs."""
    ratios = []
    for seed in range(4):
        exact = tiny_llama(seed=seed)
        fast, modules = pair(copy.deepcopy(exact).to(torch.bfloat16))
        reference = ModelAdapter(exact, fast=False)
        steps = steps_of_every_kind(fast.vocab_size)
        out, _ = run_both(fast, modules, steps)
        cache = reference.new_cache(1, 64)
        for (a, b), step in zip(out, steps, strict=True):
            ref = reference.forward(cache, **step)
            err_fast, err_modules = (float((h.float() - ref).norm() / ref.norm()) for h in (a, b))
            if step["start"] > 0:  # every step after the prefill is narrow
                ratios.append(err_fast / err_modules)
    assert len(ratios) == 16
    assert sum(ratios) / len(ratios) <= 1.1 and max(ratios) < 1.5, ratios


def test_own_attention_is_as_accurate_as_bfloat16_sdpa():
    """Against float64: _attend (float32 scores and P @ V, the result rounded once) errs at most 1.4 times as much as
    bfloat16 SDPA at the attention output; both stay near bfloat16's own rounding (2^-9)."""
    g = torch.Generator().manual_seed(5)
    for s, t in ((40, 1), (300, 5), (300, ATTEND_MAX)):
        q, k = (torch.randn(1, 9, t, 64, generator=g) * 2).bfloat16(), (torch.randn(1, 3, s, 64, generator=g) * 2).bfloat16()
        v = torch.randn(1, 3, s, 64, generator=g).bfloat16()
        mask = torch.ones(1, 1, t, s, dtype=torch.bool).tril(s - t)
        sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, attn_mask=mask, scale=0.125, enable_gqa=True)
        ref, got = sdpa(q.double(), k.double(), v.double()), sdpa(q, k, v)
        own = _attend(q, k, v, 0.125, ~mask[:, None])
        err_own, err_sdpa = (float((x.double() - ref).norm() / ref.norm()) for x in (own, got))
        assert err_own < 1.4 * err_sdpa and err_own < 2**-8, (s, t, err_own, err_sdpa)


def test_own_attention_equals_sdpa_in_float32_for_every_mask_kind():
    """_attend (the 16-bit path's attention) against SDPA, both in float32: causal after a prefix, a tree, ragged rows."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, 6, 5, 16, generator=g), torch.randn(3, 2, 12, 16, generator=g), torch.randn(3, 2, 12, 16, generator=g))
    causal = torch.ones(1, 1, 5, 12, dtype=torch.bool).tril(7)
    tree = torch.ones(1, 1, 5, 12, dtype=torch.bool)
    tree[..., 7:] = Tree.from_parents([-1, 0, 0, 1, 2]).mask
    ragged = torch.rand(3, 1, 5, 12, generator=g) < 0.7
    ragged[..., 0] = True  # every query sees at least one slot
    for mask in (None, causal, tree, ragged):
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
        got = _attend(q, k, v, 0.25, None if mask is None else ~mask[:, None])
        assert torch.allclose(got, ref, atol=1e-5), mask


def test_weights_that_move_after_fusing_are_fused_again(tiny_model):
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    fast = ModelAdapter(model)
    cache = fast.new_cache(1, 16)
    ids = torch.tensor([[1, 2, 3, 4]])
    before = fast.forward(cache, 0, input_ids=ids)
    for p in model.parameters():  # what .to(another device) does: every parameter gets new storage
        p.data = p.data.clone()
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(2.0)  # and a changed weight must be seen
        k_proj = model.model.layers[1].self_attn.k_proj  # a single projection given a new weight too
        k_proj.weight = torch.nn.Parameter(k_proj.weight * 0.5, requires_grad=False)
    modules = ModelAdapter(model, fast=False)
    after = modules.forward(modules.new_cache(1, 16), 0, input_ids=ids)
    assert torch.equal(fast.forward(fast.new_cache(1, 16), 0, input_ids=ids), after)
    assert not torch.equal(before, after)


@pytest.mark.parametrize("change", ["attention_bias", "mlp_bias", "sliding_window"])
def test_layers_it_does_not_compute_exactly_are_left_to_the_modules(change):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    small = dict(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if change == "sliding_window":
        model = MistralForCausalLM(MistralConfig(**small, sliding_window=4)).eval()
    else:
        model = LlamaForCausalLM(LlamaConfig(**small, **{change: True})).eval()
    adapter = ModelAdapter(model)
    assert adapter.stack is None and not supported(model.model.layers[0], model.config)
    hidden = adapter.forward(adapter.new_cache(1, 8), 0, input_ids=torch.tensor([[1, 2, 3]]))
    assert hidden.shape == (1, 3, 32)


def test_a_mistral_without_sliding_window_runs_fast_and_exactly():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    small = dict(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    cfg = MistralConfig(**small, sliding_window=None)
    model = MistralForCausalLM(cfg).eval()
    assert LayerStack.of(model.model.layers, cfg, torch.float32, torch.device("cpu")) is not None
    out, _ = run_both(*pair(model), steps_of_every_kind(16))
    assert all(torch.equal(a, b) for a, b in out)


def test_a_shallow_adapter_over_fused_layers_matches_the_modules():
    model = tiny_llama(layers=3).to(torch.bfloat16)
    ModelAdapter(model)  # fuses every layer
    shallow, shallow_modules = ModelAdapter(model, num_layers=2), ModelAdapter(model, num_layers=2, fast=False)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    a = shallow.forward(shallow.new_cache(1, 8), 0, input_ids=ids)
    b = shallow_modules.forward(shallow_modules.new_cache(1, 8), 0, input_ids=ids)
    assert torch.equal(a, b)
