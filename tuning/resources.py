"""What a trial reserves, and how many trials run at once.

A trial whose config runs in one process (``placement=local``: ar, ngram,
early-exit, sps) reserves one bundle of ``cpus_per_trial`` CPUs (and
``gpus_per_trial`` GPUs); torch in the trial uses that many threads. A config
hosting its draft and target in two actors (``placement=actors``, ``pearl``)
reserves a placement group of two bundles of ``cpus_per_trial`` each (packed
on one node), so concurrent trials never fight over the same cores: the trial
itself and the target worker share the first bundle (the trial only waits
while the target computes, and the AR baseline it measures in process runs
while both workers are idle), the draft worker has the second.

>>> bundles_for({"method": "ngram"}, cpus_per_trial=2)
[{'CPU': 2.0}]
>>> bundles_for({"method": "pearl"}, cpus_per_trial=2)
[{'CPU': 2.0}, {'CPU': 2.0}]
>>> max_concurrent({"CPU": 8.0}, cpus_per_trial=2), max_concurrent({"CPU": 1.0}, cpus_per_trial=2)
(4, 1)
"""

from __future__ import annotations

from collections.abc import Mapping

from decoding.methods import runs_on_actors


def hosts_actors(sample: Mapping) -> bool:
    method = sample.get("method")
    placement = (sample.get(method) or {}).get("placement") if isinstance(sample.get(method), Mapping) else None
    return runs_on_actors(method, placement) or sample.get("placement") == "actors"


def bundles_for(sample: Mapping, cpus_per_trial: int = 1, gpus_per_trial: float = 0.0) -> list[dict]:
    """The placement-group bundles of one trial (first bundle: where the trainable itself runs)."""
    worker = {"CPU": float(cpus_per_trial)}
    if gpus_per_trial:
        worker["GPU"] = float(gpus_per_trial)
    if hosts_actors(sample):
        return [worker, dict(worker)]  # the trial and the target worker, the draft worker
    return [worker]


def trial_resources(cpus_per_trial: int = 1, gpus_per_trial: float = 0.0):
    """A callable for ``tune.with_resources``: sample -> ``tune.PlacementGroupFactory``."""

    def resources(sample: dict):
        from ray import tune

        return tune.PlacementGroupFactory(bundles_for(sample, cpus_per_trial, gpus_per_trial), strategy="PACK")

    return resources


def max_concurrent(cluster: Mapping, cpus_per_trial: int = 1, gpus_per_trial: float = 0.0) -> int:
    """How many one-bundle trials the cluster holds at once (at least 1)."""
    n = int(cluster.get("CPU", 1.0) // max(cpus_per_trial, 1e-9))
    if gpus_per_trial:
        n = min(n, int(cluster.get("GPU", 0.0) // gpus_per_trial))
    return max(1, n)
