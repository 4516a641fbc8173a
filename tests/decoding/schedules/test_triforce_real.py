"""TriForce with the real SmolLM2 in float32 on a long prompt: token-identical to AR, with a sparse middle level."""

import pytest

from decoding.config import SpecConfig
from decoding.in_process import SpecDecoder

pytestmark = pytest.mark.slow

BASE = SpecConfig(dtype="float32", max_new_tokens=32, threads=1)  # the AR reference: conftest.long_prompt_and_ar
SPARSE = dict(method="triforce", k=6, triforce_gamma=4, triforce_budget=256, triforce_chunk_size=16, triforce_sinks=4, triforce_window=124)


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
