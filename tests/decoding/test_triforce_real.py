"""TriForce with the real SmolLM2 in float32 on a long prompt: token-identical to AR, with a sparse middle level."""

import pytest

from decoding.config import SpecConfig
from decoding.engine import SpecDecoder
from decoding.workloads import load_prompts, long_context_prompt

pytestmark = pytest.mark.slow

BASE = SpecConfig(dtype="float32", max_new_tokens=32, threads=1)
SPARSE = dict(method="triforce", k=6, triforce_gamma=4, triforce_budget=256, triforce_chunk_size=16, triforce_sinks=4, triforce_window=124)


@pytest.fixture(scope="module")
def long_prompt_and_ar():
    ar = SpecDecoder(BASE)
    prompt = long_context_prompt(load_prompts(), 1200, lambda text: ar.encode(text, chat=True).shape[1])
    ids = ar.encode(prompt.prompt, chat=True)
    assert 1100 <= ids.shape[1] <= 1200
    return ids, ar.generate_ids(ids).token_ids


@pytest.mark.parametrize("bottom", ["layers", "ngram"])
def test_triforce_is_token_identical_to_ar(long_prompt_and_ar, bottom):
    ids, ref = long_prompt_and_ar
    dec = SpecDecoder(BASE.replace(triforce_bottom=bottom, draft_layers=12, **SPARSE))
    out = dec.generate_ids(ids)
    assert out.token_ids == ref
    view = dec.drafter.retrieval
    assert view.kept + (view.length - view.tail_start) < ids.shape[1] // 3  # the middle level really is sparse
    assert out.stats.mean_accepted_tokens > 1.5  # and it drafts well enough to matter
    assert dec.drafter.inner_steps
