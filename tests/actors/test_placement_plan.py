"""The placement plan is pure: which strategy and bundles for which cluster, and the errors for impossible requests."""

import pytest

from cluster.placement import PlacementError, plan_placement
from decoding.config import SpecConfig

PEARL = SpecConfig(method="pearl")


def node(cpu, gpu=0.0, alive=True):
    res = {"CPU": float(cpu)}
    if gpu:
        res["GPU"] = float(gpu)
    return {"Alive": alive, "Resources": res}


def test_cpu_only_machine_splits_its_cores():
    plan = plan_placement(PEARL, [node(2)])
    assert plan.strategy == "STRICT_PACK"
    assert plan.bundles == [{"CPU": 1.0}, {"CPU": 1.0}] and plan.threads == {"target": 1, "draft": 1}
    assert plan_placement(PEARL, [node(16)]).threads == {"target": 8, "draft": 8}


def test_explicit_threads_win():
    plan = plan_placement(PEARL.replace(target_threads=3, draft_threads=1), [node(4)])
    assert plan.bundles == [{"CPU": 3.0}, {"CPU": 1.0}]


def test_two_nodes_spread():
    plan = plan_placement(PEARL, [node(8), node(4), node(0, alive=False)])
    assert plan.strategy == "STRICT_SPREAD" and plan.threads == {"target": 4, "draft": 4}


def test_gpus_one_each_or_half_of_one():
    assert plan_placement(PEARL, [node(8, gpu=2)]).bundles == [{"CPU": 1.0, "GPU": 1.0}] * 2
    one = plan_placement(PEARL, [node(8, gpu=1)])
    assert one.strategy == "STRICT_PACK" and one.gpus_per_model == 0.5
    spread = plan_placement(PEARL, [node(8, gpu=1), node(8, gpu=1)])
    assert spread.strategy == "STRICT_SPREAD" and spread.gpus_per_model == 1.0


def test_gpu_request_on_cpu_cluster_fails_naming_resources():
    with pytest.raises(PlacementError) as err:
        plan_placement(PEARL.replace(num_gpus_per_model=1), [node(2)])
    msg = str(err.value)
    assert err.value.field == "num_gpus_per_model"
    assert "'GPU': 1.0" in msg and "'CPU': 2.0" in msg


def test_too_many_threads_for_one_node_fails():
    with pytest.raises(PlacementError, match="both workers"):
        plan_placement(PEARL.replace(target_threads=2, draft_threads=2), [node(2)])
    with pytest.raises(PlacementError, match="target_threads"):
        plan_placement(PEARL.replace(target_threads=4), [node(2)])


def test_new_config_fields_are_validated():
    from decoding.errors import ConfigError

    for bad, field in [
        ("draft_threads=0", "draft_threads"),
        ("num_gpus_per_model=-1", "num_gpus_per_model"),
        ("rpc_timeout_s=0", "rpc_timeout_s"),
        ("actor_transport=grpc", "actor_transport"),
    ]:
        with pytest.raises(ConfigError) as err:
            PEARL.with_overrides([bad])
        assert err.value.field == field
