"""decoding.model.compiled: the one-row stack compiled by torch.compile (SpecConfig.compile).

The fast tier checks where the compiled path steps aside (without compiling anything) and compiles one width of
a 2-layer model; the runs that compile every width (minutes on this 2-core host) are marked slow.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import tiny_llama
from tests_support import generate

from decoding.drafters.ngram import NgramDrafter
from decoding.model import compiled as compiled_module
from decoding.model.adapter import ModelAdapter
from decoding.model.kv_views import RetrievalCache, ViewAdapter

PROMPT = torch.tensor([[3, 7, 3, 7, 3, 1, 2, 5]])  # 8 tokens: the prefill is one width-8 graph


class Recorder:
    """Stands in for the compiled function: records the widths it is called with and runs the eager stack."""

    def __init__(self):
        self.widths = []

    def __call__(self, stack, h, cos, sin, k_all, v_all, slots, allowed):
        self.widths.append(h.shape[1])
        return compiled_module._layers(stack, h, cos, sin, k_all, v_all, slots, allowed)


@pytest.fixture
def recorded(tiny_model, monkeypatch):
    """An adapter with compile=True whose 'compiled' function is the uncompiled graph body (no compiling here)."""
    adapter = ModelAdapter(tiny_model, compile=True)
    rec = Recorder()
    monkeypatch.setattr(adapter.compiled, "_fn", rec)
    return adapter, rec


def test_the_graph_body_pads_to_the_bucket_and_matches_eager(tiny_model, recorded):
    """The function that gets compiled, run as plain torch: blocks padded to their bucket (3 -> 4, 5 -> 8), the
    same hidden states and cache as the eager stack (float32, up to the order of float32 sums)."""
    adapter, rec = recorded
    eager = ModelAdapter(tiny_model)
    caches = [eager.new_cache(1, 32), adapter.new_cache(1, 32)]
    steps = [
        dict(start=0, input_ids=PROMPT),
        dict(start=8, input_ids=torch.tensor([[4, 2, 9]])),
        dict(start=11, input_ids=torch.tensor([[1]])),
    ]
    steps.append(dict(start=12, input_ids=torch.tensor([[5, 6, 7, 8, 9]])))
    for step in steps:
        a, b = (m.forward(c, **step) for m, c in zip((eager, adapter), caches, strict=True))
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (a - b).abs().max()
    assert rec.widths == [8, 4, 1, 8]
    assert torch.allclose(caches[0].k_all[:, :, :, :17], caches[1].k_all[:, :, :, :17], atol=1e-5)


def test_what_the_graph_does_not_cover_runs_eager(tiny_model, recorded):
    adapter, rec = recorded
    eager = ModelAdapter(tiny_model)
    ids = torch.randint(12, (2, 3), generator=torch.Generator().manual_seed(0))
    # several rows
    a = adapter.forward(adapter.new_cache(2, 16), 0, input_ids=ids)
    assert torch.equal(a, eager.forward(eager.new_cache(2, 16), 0, input_ids=ids))
    # 3 tokens at 13 of 16: their bucket of 4 fits, since padding writes the scratch slot after the last position
    cache = adapter.new_cache(1, 16)
    adapter.forward(cache, 0, input_ids=torch.randint(12, (1, 13)))
    rec.widths.clear()
    adapter.forward(cache, 13, input_ids=ids[:1])
    assert rec.widths == [4]
    rec.widths.clear()
    # a block wider than every bucket, a partial layer range, captured hidden states, a sparse view
    adapter.forward(adapter.new_cache(1, 64), 0, input_ids=torch.randint(12, (1, 33)))
    adapter.forward(adapter.new_cache(1, 16), 0, input_ids=ids[:1], last=2)
    adapter.forward(adapter.new_cache(1, 16), 0, input_ids=ids[:1], captured={2: None})
    full = adapter.new_cache(1, 32)
    adapter.forward(full, 0, input_ids=torch.randint(12, (1, 12)))
    full.length = 12
    rec.widths.remove(16)  # that prefill was compiled
    view = RetrievalCache(full, budget=8, chunk_size=2, max_len=32)
    ViewAdapter(adapter).forward(view, 12, input_ids=ids[:1, :1])
    assert rec.widths == []


def test_a_shallow_adapter_is_never_compiled(tiny_model, caplog):
    with caplog.at_level(logging.WARNING, logger="specray"):
        shallow = ModelAdapter(tiny_model, num_layers=2, compile=True)
    assert shallow.compiled is None and "eager" in caplog.text


def test_a_failed_compile_warns_once_and_runs_eager(tiny_model, monkeypatch, caplog):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: no_compiler)
    adapter, eager = ModelAdapter(tiny_model, compile=True), ModelAdapter(tiny_model)
    with caplog.at_level(logging.WARNING, logger="specray"):
        out = generate(adapter, PROMPT, max_new_tokens=6).token_ids
    assert out == generate(eager, PROMPT, max_new_tokens=6).token_ids
    assert adapter.compiled.disabled and caplog.text.count("compiling the layer stack failed") == 1
    assert adapter.implementation.startswith("compiled")


def test_compiled_one_token_steps_give_eager_greedy_output(one_thread, tmp_path, monkeypatch):
    """Really compiled, one width only (about 25 s on the loaded 2-core host): a 40-token prompt fills eager (wider
    than every bucket), each one-token step runs the width-1 graph; float32 greedy output equals the eager stack's."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = tiny_llama(layers=2)
    prompt = torch.randint(12, (1, 40), generator=torch.Generator().manual_seed(1))
    adapter, eager = ModelAdapter(model, compile=True), ModelAdapter(model)
    out = generate(adapter, prompt, max_new_tokens=12).token_ids
    assert adapter.compiled.compiled_widths == {1} and not adapter.compiled.disabled
    assert out == generate(eager, prompt, max_new_tokens=12).token_ids


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_greedy_speculation_equals_compiled_ar(dtype, one_thread, tmp_path, monkeypatch):
    """Really compiled (widths 1, 2, 4 and 8): float32 greedy prompt lookup equals AR on the same compiled target,
    and both equal the eager stack's AR; in bfloat16 the compiled graphs stay within a few roundings of eager."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = copy.deepcopy(tiny_llama(layers=2)).to(dtype)
    adapter, eager = ModelAdapter(model, compile=True), ModelAdapter(model)
    ar = generate(adapter, PROMPT, max_new_tokens=24).token_ids
    spec = generate(adapter, PROMPT, drafter=NgramDrafter(2, 1), k=3, max_new_tokens=24).token_ids
    assert adapter.compiled.compiled_widths >= {1, 8} and not adapter.compiled.disabled
    if dtype == torch.float32:
        assert spec == ar == generate(eager, PROMPT, max_new_tokens=24).token_ids
    caches = [eager.new_cache(1, 16), adapter.new_cache(1, 16)]
    a, b = (m.forward(c, 0, input_ids=PROMPT) for m, c in zip((eager, adapter), caches, strict=True))
    # bfloat16: the generated kernels keep fused intermediates in float32 where eager rounds each op; after two
    # random layers (hidden values ~50) that is a few bfloat16 ulps of the largest value
    assert (a.float() - b.float()).abs().max() <= 2**-5 * a.float().abs().max()
