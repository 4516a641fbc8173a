"""A Tune search survives the loss of a node running a trial (``ray.cluster_utils.Cluster``: Ray nodes on this machine).

Two 1-CPU nodes run one trial each; once a trial has reported its first prompt, its node is removed. Tune's
``FailureConfig`` (``specray tune --max-failures``) retries the trial on the node left, and the search finishes with
every trial accounted for: each ran every prompt, none errored, the results are on disk and a winner is chosen.
"""

from __future__ import annotations

import contextlib
import io
import time

import pytest
from tests_support import multinode_cluster
from tiny_models import build_tiny_model, write_prompts

ray = pytest.importorskip("ray")
tune = pytest.importorskip("ray.tune")

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster():
    """A head with no CPUs (the Tune driver) and two 1-CPU worker nodes."""
    with multinode_cluster([1, 1], log_to_driver=False) as (c, workers):
        yield c, workers


def node_running(pid: int, nodes):
    """The Ray node whose raylet started process ``pid`` (all nodes share this machine, so look at process parents)."""
    import psutil

    ancestors = {p.pid for p in psutil.Process(pid).parents()}
    for node in nodes:
        raylets = {info.process.pid for info in node.all_processes.get("raylet", [])}
        if raylets & ancestors:
            return node
    return None


_CLUSTER: dict = {}  # the Cluster and its worker nodes, outside the callback (Tune pickles its callbacks)


class RemoveNodeOfFirstResult(tune.Callback):
    """After the first reported result, remove the node whose raylet runs that trial (once); note retries."""

    def __init__(self):
        self.removed: dict = {}
        self.recovered: list[str] = []

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if self.removed:
            return
        cluster, nodes = _CLUSTER["cluster"], _CLUSTER["nodes"]
        node = node_running(result["pid"], nodes)
        if node is None:
            return
        self.removed = {"trial": trial.trial_id, "node_id": node.node_id, "after_prompts": result["training_iteration"]}
        self.removed["t"] = time.monotonic()
        cluster.remove_node(node)

    def on_trial_recover(self, iteration, trials, trial, **info):
        self.recovered.append(trial.trial_id)


def test_search_survives_losing_a_trials_node(cluster, tmp_path):
    from jobs import tune as tune_job

    c, workers = cluster
    model = str(build_tiny_model(tmp_path / "model", layers=2, hidden=32, context=512, weight_std=0.5))
    prompts = str(write_prompts(tmp_path / "q.jsonl", n_per_cat=2))
    argv = [
        "--model", model, "--prompts", prompts, "--dtype", "float32", "--max-new-tokens", "24", "--threads", "1",
        "--methods", "ngram", "--num-samples", "2", "--no-early-stop", "--warmup", "0", "--max-failures", "2",
        "--out", str(tmp_path / "out"), "--name", "loss", "--verbose", "0",
    ]  # fmt: skip
    args = tune_job.build_parser().parse_args(argv)
    _CLUSTER.update(cluster=c, nodes=workers)
    killer = RemoveNodeOfFirstResult()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        code, summary = tune_job.run(args, callbacks=[killer])
    wall = time.monotonic() - t0
    print(f"\nremoved {killer.removed} ; retried trials {killer.recovered} ; search done in {wall:.1f}s")
    assert killer.removed, "no trial reported before finishing: nothing was removed"
    assert code == 0 and not summary["interrupted"], err.getvalue()[-3000:]
    assert killer.removed["trial"] in killer.recovered  # FailureConfig retried the trial whose node went

    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "out" / "loss" / "trials.parquet").to_pylist()
    assert len(rows) == 2 == summary["trials"]  # every trial accounted for
    n_prompts = summary["prompts"]
    for r in rows:
        assert r["status"] == "TERMINATED" and not r.get("error"), r
        assert r["complete"] and r["prompts"] == n_prompts and r["fidelity_ok"]
    assert summary["best"] is not None
