"""Greedy equality against AR in bfloat16, bit for bit, with the real SmolLM2 as shipped (4-bit weights) on the CPU
kernels (kernels/cpu_int4.py): there a token's forward does not depend on the tokens verified beside it, so every
lossless method, chains and trees, commits exactly AR's tokens. With torch's kernels the bfloat16 attention's sums
depend on the block's shape, and methods agree with AR only up to near-ties (the bench's "identical to ar")."""

import pytest
from tests_support import compare_with_ar, spec_bench_prompts

from decoding.config import SpecConfig
from decoding.in_process import SpecDecoder
from kernels import cpu_int4

PROMPTS = spec_bench_prompts(per_category=1, categories=["writing", "coding", "math_reasoning", "summarization", "rag", "translation"])
STATIC = "[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0]]"
METHODS = {
    "ngram": dict(method="ngram", k=4, adaptive_k=False),
    "suffix": dict(method="suffix"),  # its token trees, k=auto
    "eagle": dict(method="eagle"),
    "eagle-tree": dict(method="eagle", tree="dyspec", tree_budget=12, k=4, adaptive_k=False),
    "sps-static-tree": dict(method="sps", draft_layers=8, tree="static", tree_paths=STATIC, adaptive_k=False),
    "hybrid": dict(method="hybrid"),
    "early-exit": dict(method="early-exit", exit_layer=20, k=3, adaptive_k=False),
}
BASE = SpecConfig(dtype="bfloat16", threads=2, max_new_tokens=48)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cpu_int4.extension() is None, reason="no AVX512-BF16 CPU kernel here: bfloat16 is exact only on it"),
]


@pytest.fixture(scope="module")
def ar_outputs():
    dec = SpecDecoder(BASE)
    assert dec.loaded.quant is not None and dec.loaded.quant.layers[0]["gate_up"].fast is not None  # the kernels run
    return {q["question_id"]: dec.generate_ids(dec.encode(q["turns"][0], chat=True)).token_ids for q in PROMPTS}


@pytest.mark.parametrize("name", list(METHODS))
def test_bfloat16_method_is_token_identical_to_ar(name, ar_outputs):
    dec = SpecDecoder(BASE.replace(**METHODS[name]))
    mismatched, tau = compare_with_ar(dec, PROMPTS, ar_outputs)
    assert not mismatched, f"{name} diverged from AR in bfloat16 on questions {mismatched}"
    assert tau > 1.05, f"{name}: too little accepted ({tau:.2f} tokens a forward) for the identity to prove much"
