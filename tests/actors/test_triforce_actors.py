"""TriForce's levels on two actors (local Ray, 2 CPUs, real SmolLM2 in float32, a 1.1K-token prompt).

The draft worker hosts the middle level (the target over a retrieval cache, on its own copy of the target and
of its cache) and the n-gram bottom; the target worker verifies with the full cache. Greedy output must be
token-identical to in-process AR under both schedules, and the middle level must have drafted.
"""

import pytest

ray = pytest.importorskip("ray")

from actors.driver import ActorDecoder  # noqa: E402
from decoding.config import SpecConfig  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

NEW = 32  # conftest.long_prompt_and_ar: AR's 32 tokens on a 1.1K-token prompt
BASE = SpecConfig(
    method="triforce",
    dtype="float32",
    max_new_tokens=NEW,
    placement="actors",
    k=6,
    triforce_gamma=4,
    triforce_budget=256,
    triforce_chunk_size=16,
    triforce_sinks=4,
    triforce_window=124,
    rpc_timeout_s=300,
)


def test_both_workers_hold_the_whole_target(workers):
    _, _, placement = workers
    assert (placement["target"]["layers"], placement["draft"]["layers"]) == (30, 30)
    assert placement["target"]["pid"] != placement["draft"]["pid"]


@pytest.mark.parametrize("schedule", ["sps", "pearl"])
def test_greedy_identical_to_ar(workers, long_prompt_and_ar, schedule):
    target, draft, placement = workers
    ids, ref = long_prompt_and_ar
    dec = ActorDecoder(BASE.replace(triforce_schedule=schedule), target, draft, placement)
    out = dec.generate_ids(ids)
    assert out.token_ids == ref
    stats = dec.stats(out)
    levels = stats["levels"]
    assert levels["middle_drafted"] > 0 and levels["middle_steps"] > 0
    # the middle level's cache is the retrieval view: far smaller than the prompt's full KV
    assert 0 < levels["kv_bytes"]["middle"] < 30 * 2 * 3 * 64 * 4 * ids.shape[1] / 2
    assert out.stats.mean_accepted_tokens > 1.5  # the middle level's drafts reach the full target
    # memory per level: each worker holds a whole float32 SmolLM2-135M (~540 MB) plus its caches
    assert all(stats["peak_rss_mb"][role] > 500 for role in ("target", "draft")), stats["peak_rss_mb"]
    if schedule == "pearl":
        assert out.schedule_counts["first_draft_checks"] > 0
