"""PEARL and two-actor SpS on a local Ray (2 CPUs, one worker per core) with the real SmolLM2 in float32.

Greedy output must be token-identical to in-process AR; a worker killed mid-generation and a placement the
cluster cannot satisfy must fail at once with a clear message.
"""

import json
import subprocess
import sys
import threading
import time

import pytest
from tests_support import spec_bench_prompts

ray = pytest.importorskip("ray")

from actors.driver import ActorDecoder, WorkerDied, WorkerTimeout  # noqa: E402
from cluster.placement import PlacementError, place_workers  # noqa: E402
from decoding.config import SpecConfig  # noqa: E402
from decoding.in_process import SpecDecoder  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

PROMPTS = spec_bench_prompts(per_category=1, categories=["writing", "coding", "summarization"])
NEW = 40
BASE = SpecConfig(
    method="pearl", dtype="float32", max_new_tokens=NEW, placement="actors", k=4, draft_layers=8, draft_model="layers", rpc_timeout_s=120
)  # the target's first 8 layers draft (the shipped distilled draft is tested in process)


@pytest.fixture(scope="module")
def ar_reference(ar_greedy):
    dec = SpecDecoder(SpecConfig(dtype="float32", max_new_tokens=NEW))
    return {q["question_id"]: (dec.encode(q["turns"][0], chat=True), ar_greedy(q, NEW)) for q in PROMPTS}


def decoder(workers, **changes):
    target, draft, placement = workers
    return ActorDecoder(BASE.replace(**changes), target, draft, placement)


def test_placement_splits_the_two_cores(workers):
    _, _, placement = workers
    assert placement["strategy"] == "STRICT_PACK" and placement["same_node"]
    assert placement["target"]["threads"] == 1 and placement["draft"]["threads"] == 1
    assert placement["target"]["pid"] != placement["draft"]["pid"]
    assert (placement["target"]["layers"], placement["draft"]["layers"]) == (30, 8)


@pytest.mark.parametrize("method", ["pearl", "sps"])
def test_greedy_identical_to_ar(workers, ar_reference, method):
    dec = decoder(workers, method=method)
    mismatched, rounds, alone = [], 0, {"calls": 0, "tokens": 0}
    for qid, (ids, ref) in ar_reference.items():
        out = dec.generate_ids(ids)
        if out.token_ids != ref:
            mismatched.append(qid)
        rounds += len(out.rounds)
        stats = dec.stats(out)
        alone = {key: alone[key] + stats["alone"][key] for key in alone}
        assert stats["rpc"]["rounds"] == len(out.rounds) and stats["placement"]["transport"] == "calls"
    assert not mismatched, f"{method} over actors diverged from AR on {mismatched}"
    assert rounds < len(ar_reference) * NEW  # every round committed at least one token, some more
    assert alone["calls"] and alone["tokens"] > 2 * alone["calls"], alone  # k=auto's idle stretches: the target alone


def test_compiled_graph_transport_is_identical(workers, ar_reference):
    qid, (ids, ref) = next(iter(ar_reference.items()))
    for method in ("pearl", "sps"):
        dec = decoder(workers, method=method, actor_transport="compiled")
        try:
            out = dec.generate_ids(ids)
            assert out.token_ids == ref, method
            assert out.schedule_counts["alone"]["calls"], "no run of the target alone beside the compiled graph"
        finally:
            dec.executor.teardown()


@pytest.mark.parametrize("method", ["pearl", "sps"])
def test_sampling_over_actors_is_seeded(workers, ar_reference, method):
    # the distribution itself is tested in process (tests/decoding/schedules/test_two_sided.py); here: q/p rows cross the wire
    # and seeds hold
    ids, _ = next(iter(ar_reference.values()))
    dec = decoder(workers, method=method, temperature=1.0, top_k=50)
    a, b, c = (dec.generate_ids(ids, max_new_tokens=16, seed=s) for s in (1, 1, 2))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16
    assert a.token_ids != c.token_ids
    if method == "pearl":
        assert a.schedule_counts["first_draft_checks"] > 0


def test_unanswered_call_times_out_clearly(workers, ar_reference):
    ids, _ = next(iter(ar_reference.values()))
    dec = decoder(workers)
    dec.executor.timeout_s = 1e-3  # shorter than any forward
    t0 = time.perf_counter()
    with pytest.raises(WorkerTimeout, match="rpc_timeout_s"):
        dec.generate_ids(ids)
    assert time.perf_counter() - t0 < 5


def test_placement_that_cannot_be_satisfied_fails_at_once(local_ray):
    t0 = time.perf_counter()
    with pytest.raises(PlacementError) as err:
        place_workers(BASE.replace(num_gpus_per_model=1))
    assert time.perf_counter() - t0 < 5
    msg = str(err.value)
    assert "'GPU': 1.0" in msg and "'CPU': 2.0" in msg, msg


def test_cli_pearl_json(tmp_path):
    # its own embedded Ray in a subprocess: the `specray generate` / `ray job submit` entry point
    q = PROMPTS[0]["turns"][0]
    cmd = [sys.executable, "-m", "jobs.generate", "--method", "pearl", "--chat", "--prompt", q, "--max-new-tokens", "12", "--json"]
    proc = subprocess.run([*cmd, "--dtype", "float32"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["method"] == "pearl" and len(out["token_ids"]) == 12
    assert out["stats"]["placement"]["mode"] == "actors" and out["stats"]["pearl"]["gamma"] == 4
    assert out["stats"]["rpc"]["rounds"] >= 1


def test_killed_target_gives_a_clear_error_promptly(workers, ar_reference):
    # last in the module: it kills the shared target worker
    target, _, _ = workers
    ids, _ = next(iter(ar_reference.values()))
    dec = decoder(workers)
    seen = []

    def kill_after_five(tokens):
        seen.extend(tokens)
        if len(seen) >= 5 and not getattr(kill_after_five, "done", False):
            kill_after_five.done = True
            threading.Thread(target=ray.kill, args=(target,)).start()

    t0 = time.perf_counter()
    with pytest.raises(WorkerDied, match="target worker died during generation"):
        dec.generate_ids(ids, on_step=kill_after_five)
    assert time.perf_counter() - t0 < 30
    assert 5 <= len(seen) < NEW
