"""Several Ray nodes on this machine (``ray.cluster_utils.Cluster``: one raylet per node, each with its own CPUs).

PEARL and two-actor SpS put draft and target on different nodes (``STRICT_SPREAD``) and still equal AR
(float32 greedy); losing the node of a worker mid-generation ends that generation with a line naming the lost
worker within ``rpc_timeout_s``, and the next request is placed on the node that is left.
"""

from __future__ import annotations

import time

import pytest
from tests_support import multinode_cluster

ray = pytest.importorskip("ray")

from actors.driver import WorkerDied  # noqa: E402
from cluster.placement import build_actor_decoder  # noqa: E402
from decoding.config import SpecConfig  # noqa: E402
from decoding.in_process import SpecDecoder  # noqa: E402

pytestmark = pytest.mark.cluster

PROMPT = "the cat sat on the mat and the cat sat on the"
NEW = 24


@pytest.fixture(scope="module")
def cluster():
    """A head with no CPUs (the driver only) and two worker nodes of 2 CPUs each."""
    with multinode_cluster([2, 2]) as (c, workers):
        yield c, workers


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return SpecConfig(model=str(tiny_model_dir), dtype="float32", placement="actors", draft_layers=1, k=3, max_new_tokens=NEW)


@pytest.fixture(scope="module")
def ar_ids(base):
    return SpecDecoder(base.replace(method="ar", placement="local")).generate_text(PROMPT)["token_ids"]


def node_ids(workers) -> set[str]:
    return {w.node_id for w in workers}


@pytest.mark.parametrize("method", ["pearl", "sps"])
def test_draft_and_target_on_different_nodes_equal_ar(cluster, base, ar_ids, method):
    _, workers = cluster
    dec = build_actor_decoder(base.replace(method=method))
    try:
        out = dec.generate_text(PROMPT)
    finally:
        dec.close()
    placement = out["stats"]["placement"]
    assert placement["strategy"] == "STRICT_SPREAD" and placement["same_node"] is False
    assert {placement["target"]["node_id"], placement["draft"]["node_id"]} == node_ids(workers)
    assert placement["target"]["device"] == placement["draft"]["device"] == "cpu"
    assert out["token_ids"] == ar_ids


def test_losing_a_workers_node_fails_that_generation_and_the_next_one_succeeds(cluster, base, ar_ids):
    c, workers = cluster
    cfg = base.replace(method="pearl", max_new_tokens=200, rpc_timeout_s=60)
    dec = build_actor_decoder(cfg)
    draft_node = dec.placement["draft"]["node_id"]
    seen: list[int] = []
    lost = {}

    def remove_after_five(tokens):
        seen.extend(tokens)
        if len(seen) >= 5 and not lost:
            (node,) = [w for w in workers if w.node_id == draft_node]
            lost["t"] = time.perf_counter()
            c.remove_node(node)  # the draft worker's raylet and everything on it die here

    try:
        with pytest.raises(WorkerDied) as e:
            dec.generate_ids(dec.encode(PROMPT), on_step=remove_after_five)
    finally:
        dec.close()
    failed_after = time.perf_counter() - lost["t"]
    first_line = str(e.value).splitlines()[0]
    print(f"\nnode of the draft worker removed after {len(seen)} tokens; generation failed {failed_after:.1f}s later: {first_line[:160]}")
    assert "draft worker" in first_line, first_line
    assert failed_after < cfg.rpc_timeout_s
    assert 5 <= len(seen) < 200

    again = build_actor_decoder(base.replace(method="pearl"))
    try:
        out = again.generate_text(PROMPT)
    finally:
        again.close()
    left = node_ids(workers) - {draft_node}
    assert out["stats"]["placement"]["same_node"] is True
    assert {out["stats"]["placement"]["target"]["node_id"]} == left
    assert out["token_ids"] == ar_ids


def test_auto_device_inside_a_ray_worker_is_what_ray_gave_it(cluster):
    from actors.devices import in_ray_worker, placed_device

    @ray.remote(num_cpus=1, num_gpus=0)
    def where():
        return in_ray_worker(), placed_device("auto"), placed_device("cuda:1")

    assert ray.get(where.remote()) == (True, "cpu", "cuda:1")  # no GPU given: CPU, whatever torch sees
    assert not in_ray_worker() and placed_device("auto") == "auto"  # the driver keeps auto (torch decides)
