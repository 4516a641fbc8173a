"""Start or join Ray.

Order: an explicit ``address`` (the CLI's ``--address``), else ``RAY_ADDRESS``
(what ``ray job submit`` sets for the job's driver), else an embedded local
Ray started inside this process (``ray.init(address="local")``, never joining
a stray cluster by accident). An ``http(s)://`` address is the dashboard /
job-submission address of a cluster, not its GCS; a driver given one joins the
cluster running on this machine (``address="auto"``).
"""

from __future__ import annotations

import logging
import os

_STARTED_HERE = False


def connect(address: str | None = None, num_cpus: int | None = None) -> dict:
    """Connect (once per process); returns how: {"address", "embedded", "nodes", "resources"}."""
    global _STARTED_HERE
    import ray

    if not ray.is_initialized():
        addr = address or os.environ.get("RAY_ADDRESS") or None
        kwargs = {"logging_level": logging.WARNING, "log_to_driver": True}
        if addr:
            if addr.startswith(("http://", "https://")):
                addr = "auto"
            ray.init(address=addr, **kwargs)
        else:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **kwargs)
            _STARTED_HERE = True
    return describe()


def started_here() -> bool:
    return _STARTED_HERE


def describe() -> dict:
    import ray

    ctx = ray.get_runtime_context()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return {
        "address": ctx.gcs_address,
        "embedded": _STARTED_HERE,
        "nodes": len(nodes),
        "resources": {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "memory") or k.startswith("accelerator")},
    }


def shutdown_if_started_here() -> None:
    """Stop the embedded Ray this process started; leave a joined cluster alone."""
    global _STARTED_HERE
    import ray

    if _STARTED_HERE and ray.is_initialized():
        ray.shutdown()
    _STARTED_HERE = False
