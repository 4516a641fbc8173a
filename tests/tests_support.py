"""Helpers the tests import (pytest runs with --import-mode=importlib, tests/ is on the path)."""

import contextlib
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPEC_BENCH = REPO / "data" / "spec_bench" / "question.jsonl"


def spec_bench_prompts(per_category: int, categories=None) -> list[dict]:
    rows, seen = [], {}
    for line in SPEC_BENCH.read_text().splitlines():
        q = json.loads(line)
        if categories and q["category"] not in categories:
            continue
        if seen.get(q["category"], 0) < per_category:
            seen[q["category"]] = seen.get(q["category"], 0) + 1
            rows.append(q)
    return rows


# Ray forwards its workers' and daemons' logs to the driver's stderr, prefixed "(ActorName pid=123)", "(raylet, ip=..)"
# or "(autoscaler +1s)" (coloured on a terminal).
_RAY_FORWARDED = re.compile(r"^(\x1b\[[0-9;]*m)?\(([^)]*pid=\d+|raylet|autoscaler|gcs_server)[^)]*\)")


def own_stderr_lines(err: str) -> list[str]:
    """The non-blank lines of ``err`` that the code under test printed, without the worker logs Ray forwards to a
    driver (a test that runs a command in the driver of a live cluster sees those interleaved)."""
    return [ln for ln in err.splitlines() if ln.strip() and not _RAY_FORWARDED.match(ln)]


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    """A command failed on bad input as the house wants it: exit 2, one line on stderr naming every needle."""
    lines = own_stderr_lines(err)
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


def compare_with_ar(decoder, prompts: list[dict], reference: dict) -> tuple[list, float]:
    """Run ``decoder`` on the prompts: (question ids whose output differs from ``reference``, tokens per target forward)."""
    mismatched, forwards, tokens = [], 0, 0
    for q in prompts:
        out = decoder.generate_ids(decoder.encode(q["turns"][0], chat=True))
        if out.token_ids != reference[q["question_id"]]:
            mismatched.append(q["question_id"])
        forwards += out.stats.target_forwards
        tokens += out.stats.new_tokens
    return mismatched, tokens / forwards


@contextlib.contextmanager
def multinode_cluster(worker_cpus: list[int], head_resources: dict | None = None, log_to_driver: bool = True):
    """A ``ray.cluster_utils.Cluster`` on this machine: a head with no CPUs (the driver only) and one worker node
    per entry of ``worker_cpus``; the driver is connected to it. Yields (cluster, worker nodes); tears it all down."""
    import ray
    from ray.cluster_utils import Cluster

    from cluster import runtime

    if ray.is_initialized():
        ray.shutdown()
    head = {"num_cpus": 0, "include_dashboard": False, **({"resources": head_resources} if head_resources else {})}
    c = Cluster(initialize_head=True, head_node_args=head)
    workers = [c.add_node(num_cpus=n) for n in worker_cpus]
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="WARNING", log_to_driver=log_to_driver)
    try:
        yield c, workers
    finally:
        ray.shutdown()
        runtime._STARTED_HERE = False
        c.shutdown()
