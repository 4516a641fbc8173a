"""Greedy equality against AR in bfloat16, bit for bit, with the real SmolLM2 as shipped (4-bit weights) on the CPU
kernels (kernels/cpu_int4.py): there a token's forward does not depend on the tokens verified beside it, so every
lossless method, chains and trees, commits exactly AR's tokens. With torch's kernels the bfloat16 attention's sums
depend on the block's shape, and methods agree with AR only up to near-ties (the bench's "identical to ar")."""

import pytest
from tests_support import spec_bench_prompts

from decoding.config import SpecConfig
from decoding.in_process import SpecDecoder
from kernels import cpu_int4

PROMPTS = spec_bench_prompts(per_category=1, categories=["writing", "coding", "math_reasoning", "summarization", "rag", "translation"])
STATIC = "[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0]]"
METHODS = {
    "ngram": dict(method="ngram", k=4, adaptive_k=False),
    "suffix": dict(method="suffix"),  # its token trees, k=auto
    "eagle": dict(method="eagle", k=3, adaptive_k=False),
    "eagle-auto": dict(method="eagle"),  # k=auto: how far it drafts depends on this machine's timings
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


def _divergence(out, ref: list[int]) -> str:
    """Where ``out`` leaves ``ref``, and the steps (position, drafted, accepted) around it: what a failure must show."""
    first = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref, strict=False)) if a != b), min(len(ref), len(out.token_ids)))
    steps, pos = [], 0
    for st in out.steps:
        steps.append((pos, st.drafted, st.accepted))
        pos += st.accepted + 1
    return f"first differing token {first}; steps from there: {[s for s in steps if s[0] >= first - 8][:6]}"


@pytest.mark.parametrize("name", list(METHODS))
def test_bfloat16_method_is_token_identical_to_ar(name, ar_outputs):
    dec = SpecDecoder(BASE.replace(**METHODS[name]))
    forwards = tokens = 0
    for q in PROMPTS:
        out = dec.generate_ids(dec.encode(q["turns"][0], chat=True))
        ref = ar_outputs[q["question_id"]]
        assert out.token_ids == ref, f"{name} diverged from AR in bfloat16 on {q['question_id']}: {_divergence(out, ref)}"
        forwards, tokens = forwards + out.stats.target_forwards, tokens + out.stats.new_tokens
    if METHODS[name].get("adaptive_k") is False:  # k=auto may rightly draft little on a loaded machine
        assert tokens / forwards > 1.05, (
            f"{name}: too little accepted ({tokens / forwards:.2f} tokens a forward) for the identity to prove much"
        )


@pytest.mark.parametrize("method", ["ar", "ngram", "suffix"])
def test_bfloat16_batch_gives_each_row_its_alone_output(method, ar_outputs):
    """A continuous batch (rows of unlike lengths, one verification width for all) commits AR's tokens in every row:
    a row's linears and attention do not depend on the rows beside it (up to quant.FAST_MAX_ROWS tokens a step)."""
    dec = SpecDecoder(BASE.replace(method=method))
    outs = dec.generate_batch([dec.encode(q["turns"][0], chat=True) for q in PROMPTS], max_rows=len(PROMPTS))
    assert [o.token_ids for o in outs] == [ar_outputs[q["question_id"]] for q in PROMPTS]
