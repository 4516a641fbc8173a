"""Fixtures of the actor tests: one local Ray per module and the two workers placed for the module's ``BASE`` config."""

import pytest


@pytest.fixture(scope="module")
def local_ray():
    pytest.importorskip("ray")
    from cluster.runtime import connect, shutdown_if_started_here

    info = connect(num_cpus=2)
    yield info
    shutdown_if_started_here()


@pytest.fixture(scope="module")
def workers(local_ray, request):
    """(target, draft, placement) placed for the test module's ``BASE``; removed after the module."""
    from cluster.placement import place_workers

    target, draft, placement, cleanup = place_workers(request.module.BASE)
    yield target, draft, placement
    cleanup()
