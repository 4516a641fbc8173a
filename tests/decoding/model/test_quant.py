"""Packed weights (decoding/model/quant.py): GGUF Q4_1 / Q8_0 blocks in torch's int4 kernel, int8 weight-only.

The stated tolerance: in bfloat16 the kernel keeps each group's scale and zero in bfloat16, so its weight is
``(q - 8) * bf16(d) + bf16(m + 8 d)``; against that weight the kernel's output is exact up to float32
accumulation and one bfloat16 rounding of the output (checked at 2^-7 relative); against the GGUF's own
float weight ``d * q + m`` the output differs by the scale rounding, at most 2^-8 of the output's scale
(about what rounding every weight to bfloat16 costs the dense path).
"""

from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT

from decoding import accel
from decoding.config import SpecConfig
from decoding.errors import ConfigError
from decoding.model.adapter import ModelAdapter
from decoding.model.quant import (
    MAX_ROWS,
    PackedLinear,
    pack_int8,
    pack_q4,
    pack_q8_as_q4,
    q4_1_blocks,
    q8_0_blocks,
    quantize_model,
    reference_weight,
    resolve_quant,
)
from kernels import cpu_int4


def _weights(n: int, k: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.05, (n, k)).astype(np.float32)


def _relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


def test_q4_1_blocks_read_what_gguf_wrote():
    w = _weights(48, 96)
    raw = gguf.quants.quantize(w, GT.Q4_1)
    q, d, m = q4_1_blocks(raw, 96)
    assert q.dtype == np.uint8 and q.max() <= 15
    values = (q.reshape(48, 3, 32) * d[..., None] + m[..., None]).reshape(48, 96)
    assert np.array_equal(values, gguf.quants.dequantize(raw, GT.Q4_1))


def test_q8_0_blocks_read_what_gguf_wrote():
    w = _weights(32, 64, seed=1)
    raw = gguf.quants.quantize(w, GT.Q8_0)
    q, d = q8_0_blocks(raw, 64)
    assert np.array_equal((q.reshape(32, 2, 32) * d[..., None]).reshape(32, 64), gguf.quants.dequantize(raw, GT.Q8_0))


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
def test_int4_kernel_computes_q4_1_groups(rows):
    w = _weights(64, 128, seed=2)
    q, d, m = q4_1_blocks(gguf.quants.quantize(w, GT.Q4_1), 128)
    exact = torch.from_numpy((q.reshape(64, 4, 32) * d[..., None] + m[..., None]).reshape(64, 128)).double()
    linear = pack_q4(q, d, m, exact.to(torch.bfloat16))
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    out = linear(x)
    assert out.shape == (rows, 64) and out.dtype == torch.bfloat16
    # against the weight the kernel holds (scale and zero in bfloat16): float32 accumulation and one output rounding
    assert _relative(out, x.double() @ reference_weight(linear).double().T) < 2**-7
    # against the GGUF's own weights: the bfloat16 scale rounding on top
    assert _relative(out, x.double() @ exact.T) < 2**-6


def test_reference_weight_is_the_groups_with_bfloat16_scales():
    w = _weights(32, 64, seed=3)
    q, d, m = q4_1_blocks(gguf.quants.quantize(w, GT.Q4_1), 64)
    linear = pack_q4(q, d, m, torch.zeros(32, 64, dtype=torch.bfloat16))
    scale = torch.from_numpy(d).to(torch.bfloat16).float().repeat_interleave(32, 1)
    zero = torch.from_numpy(m + 8 * d).to(torch.bfloat16).float().repeat_interleave(32, 1)
    assert torch.equal(reference_weight(linear), (torch.from_numpy(q).float() - 8) * scale + zero)


def test_q8_0_head_runs_as_two_4_bit_halves():
    w = _weights(48, 64, seed=4) * 4
    q, d = q8_0_blocks(gguf.quants.quantize(w, GT.Q8_0), 64)
    exact = torch.from_numpy((q.reshape(48, 2, 32).astype(np.float32) * d[..., None]).reshape(48, 64)).double()
    linear = pack_q8_as_q4(q, d, exact.to(torch.bfloat16))
    # the pair sums to bf16(d) * q exactly: 16 d and 8 d round like d
    d_bf16 = torch.from_numpy(d).to(torch.bfloat16).double().repeat_interleave(32, 1)
    assert torch.equal(reference_weight(linear).double(), torch.from_numpy(q.astype(np.float64)) * d_bf16)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    assert _relative(linear(x), x.double() @ exact.T) < 2**-6


def test_int8_kernel_and_the_dense_weight_it_rewrites():
    dense = torch.from_numpy(_weights(32, 64, seed=6)).to(torch.bfloat16)
    original = dense.clone()
    linear = pack_int8(dense)
    # the dense side now holds the int8 values times their scale: wide inputs compute the same quantised model
    assert torch.equal(dense, reference_weight(linear).to(torch.bfloat16))
    assert _relative(dense.float(), original.float()) < 2**-6
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    assert _relative(linear(x), x.double() @ reference_weight(linear).double().T) < 2**-7


def test_wide_inputs_take_the_dense_weights():
    q, d, m = q4_1_blocks(gguf.quants.quantize(_weights(32, 64, seed=8), GT.Q4_1), 64)
    dense = torch.full((32, 64), 0.5, dtype=torch.bfloat16)  # deliberately not the packed weights
    linear = pack_q4(q, d, m, dense)
    x = torch.ones(MAX_ROWS + 1, 64, dtype=torch.bfloat16)
    assert torch.equal(linear(x), torch.nn.functional.linear(x, dense))
    assert not torch.equal(linear(x[:1]), torch.nn.functional.linear(x[:1], dense))


def test_resolve_quant():
    from decoding.config import QUANTS
    from decoding.model import quant

    assert quant.QUANTS == QUANTS  # the loader's names and the config's are the same
    cpu, bf16, f32 = torch.device("cpu"), torch.bfloat16, torch.float32
    assert resolve_quant("auto", True, bf16, cpu) == "q4"
    assert resolve_quant("auto", False, bf16, cpu) == "none"
    assert resolve_quant("auto", True, f32, cpu) == "none"
    assert resolve_quant("int8", False, bf16, cpu) == "int8"
    with pytest.raises(ConfigError, match="quant"):
        resolve_quant("q4", True, f32, cpu)
    with pytest.raises(ConfigError, match="quant"):
        resolve_quant("q3", True, bf16, cpu)
    with pytest.raises(ConfigError, match="quant"):
        SpecConfig(quant="q3")


@pytest.mark.parametrize("mode", ["q4", "int8"])
def test_quantised_tiny_model_decodes_like_its_dense_twin(tiny_model, mode):
    """A tiny Llama quantised here: the adapter's packed forward and the modules' forward over the rewritten dense
    weights are the same model (bfloat16 apart); ngram's greedy output follows AR's wherever AR's margin is clear."""
    from tests_support import generate

    from decoding.drafters.ngram import NgramDrafter

    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    weights = quantize_model(model, mode)
    assert weights.source == "dense" and len(weights.layers) == len(model.model.layers)
    assert all(set(layer) == {"qkv", "o", "gate_up", "down"} for layer in weights.layers)
    model.specray_quant = weights
    packed = ModelAdapter(model)
    # on a CPU, 16-bit weights attend over a float32 cache unless the CPU kernel attends (over a 16-bit one); 4-bit
    # linears run kernels/cpu_int4.py where it is built
    fast = "-fast" if weights.layers[0]["qkv"].fast is not None else ""
    assert fast == ("-fast" if mode == "q4" and cpu_int4.extension() is not None else "")
    kv = "-fused" if accel.has("attend_cpu") else "-f32kv"
    assert packed.implementation == f"layers{kv}-{mode}-dense{fast}"
    modules = ModelAdapter(model, fast=False)
    ids = torch.tensor([[1, 5, 3, 7, 2, 9, 4, 1, 5, 3]])
    a = packed.logits(packed.forward(packed.new_cache(1, 32), 0, input_ids=ids[:, :1]))
    b = modules.logits(modules.forward(modules.new_cache(1, 32), 0, input_ids=ids[:, :1]))
    assert (a - b).abs().max() < 0.1 * b.abs().max()
    ar = generate(packed, ids, max_new_tokens=24).token_ids
    spec = generate(packed, ids, drafter=NgramDrafter(3, 1), k=3, max_new_tokens=24).token_ids
    from evaluation.bench_figures import compare_to_reference, reference_margins

    verdict = compare_to_reference(spec, ar, reference_margins(packed, ids, ar), "bfloat16")
    assert not verdict["suspicious"], verdict


def test_packed_linear_is_skipped_for_shapes_the_kernel_cannot_take(tiny_model):
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)  # vocabulary 12: not a multiple of 16
    assert quantize_model(model, "q4").head is None
    assert isinstance(quantize_model(copy.deepcopy(tiny_model).to(torch.bfloat16), "int8").layers[0]["qkv"], PackedLinear)


# ---- the bundled GGUF -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bundled_gguf_runs_its_own_blocks():
    """quant=q4 on the bundled model reads the GGUF's blocks (q/k rows un-permuted as transformers does) and the
    kernel computes the file's own weights within the stated tolerance, the Q8_0 head included."""
    from decoding.model.loading import load_model, model_fingerprint, resolve

    loaded = load_model("smollm2-135m", "bfloat16", "cpu", "q4")
    dense = load_model("smollm2-135m", "float32", "cpu", "none")  # the GGUF de-quantised exactly
    assert loaded.quant.implementation.startswith("q4-gguf") and loaded.quant.head is not None
    assert model_fingerprint(loaded.model) == model_fingerprint(dense.model)
    _, path, name = resolve("smollm2-135m")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path / name)).tensors}
    assert tensors["blk.3.attn_q.weight"].tensor_type == GT.Q4_1
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    layer = dense.model.model.layers[3]
    exact_qkv = torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight])
    assert _relative(loaded.quant.layers[3]["qkv"](x), x.double() @ exact_qkv.double().T) < 2**-6
    assert _relative(loaded.quant.head(x), x.double() @ dense.model.lm_head.weight.double().T) < 2**-6


@pytest.mark.slow
def test_speculation_under_q4_diverges_from_ar_only_at_near_ties():
    """Lossless against the target as run: AR and the speculative methods all with quant=q4 in bfloat16; a
    divergence may only sit where AR's top-1/top-2 margin is within bfloat16's rounding (the bench's rule)."""
    from tests_support import spec_bench_prompts

    from decoding.in_process import SpecDecoder
    from evaluation.bench_figures import compare_to_reference, reference_margins

    base = SpecConfig(quant="q4", dtype="bfloat16", max_new_tokens=48, threads=1)
    ar = SpecDecoder(base)
    prompts = spec_bench_prompts(per_category=1, categories=["writing", "coding", "summarization", "rag"])
    verdicts = []
    for method in ("ngram", "hybrid", "sps"):
        dec = SpecDecoder(base.replace(method=method, k=4) if method != "hybrid" else base.replace(method=method))
        for q in prompts:
            ids = ar.encode(q["turns"][0], chat=True)
            ref = ar.generate_ids(ids).token_ids
            out = dec.generate_ids(ids).token_ids
            verdicts.append((method, q["question_id"], compare_to_reference(out, ref, reference_margins(ar.target, ids, ref), "bfloat16")))
    assert not [v for v in verdicts if v[2]["suspicious"]], verdicts
    # bfloat16 rounds differently at different widths, so many outputs part from AR's at some near-tie (as dense
    # bfloat16 does); they must still agree with it over most of their length
    agreed = [base.max_new_tokens if v[2]["identical"] else v[2]["first_diff"] for v in verdicts]
    assert sum(agreed) >= 0.5 * base.max_new_tokens * len(verdicts), verdicts
