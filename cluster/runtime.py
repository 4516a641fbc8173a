"""Start or join Ray.

Order: an explicit ``address`` (the CLI's ``--address``), else ``RAY_ADDRESS``
(what ``ray job submit`` sets for the job's driver), else an embedded local
Ray started inside this process (``ray.init(address="local")``, never joining
a stray cluster by accident). An ``http(s)://`` address is the dashboard /
job-submission address of a cluster, not its GCS; a driver given one joins the
cluster running on this machine (``address="auto"``).

The embedded Ray listens on loopback only (GCS, raylet, workers, agents, Serve's
proxy): its node address is 127.0.0.1, so nothing on the network can reach it.
Ray's token authentication stays as Ray sets it (on by default for a local
cluster; ``RAY_AUTH_MODE`` decides otherwise). An ``address`` that does not
answer fails within :data:`CONNECT_TIMEOUT_S` with a :class:`ConfigError`
naming it, instead of Ray's minutes of retries.
"""

from __future__ import annotations

import logging
import os
import socket
import sys

from decoding.errors import ConfigError

_STARTED_HERE = False
CONNECT_TIMEOUT_S = 5.0
LOOPBACK = "127.0.0.1"
# Ray resolves a node address of 127.0.0.1 to the machine's outward address unless this is off
_LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


# Serve kills its HTTP proxy when the actor is not ready within 3 checks of 5 s; starting a Python actor on a busy
# 2-core machine can take longer than that. The embedded Ray (its processes inherit this environment) waits longer.
PATIENT_SERVE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}


def _loopback_only() -> None:
    """Make the next ``ray.init(address="local")`` keep 127.0.0.1 as its node address (every server then binds loopback)."""
    os.environ[_LOOPBACK_SWITCH] = "0"  # read when ray is imported, by this process and the ones Ray starts
    for key, value in PATIENT_SERVE.items():
        os.environ.setdefault(key, value)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # ray was imported before: the flag is already read, set its value too
        constants.ENABLE_RAY_CLUSTER = False


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise ConfigError unless ``host:port`` (or ``ray://host:port``) accepts a TCP connection within ``timeout_s``.

    >>> check_reachable("127.0.0.1:1", 1.0)
    Traceback (most recent call last):
    ...
    decoding.errors.ConfigError: address: no Ray cluster answers at 127.0.0.1:1 (Connection refused)
    """
    target = address.split("://", 1)[1] if "://" in address else address
    host, sep, port_text = target.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError("address", f"expected HOST:PORT of a Ray cluster (or auto), got {address!r}")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port_text)), timeout=timeout_s):
            pass
    except TimeoutError:
        raise ConfigError("address", f"no Ray cluster answers at {target} (no reply within {timeout_s:g}s)") from None
    except (OSError, UnicodeError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise ConfigError("address", f"no Ray cluster answers at {target} ({why})") from None


def connect(address: str | None = None, num_cpus: int | None = None, log_to_driver: bool = True) -> dict:
    """Connect (once per process); returns how: {"address", "embedded", "nodes", "resources"}."""
    global _STARTED_HERE
    addr = address or os.environ.get("RAY_ADDRESS") or None
    if not addr:
        _loopback_only()
    import ray

    if not ray.is_initialized():
        kwargs = {"logging_level": logging.WARNING, "log_to_driver": log_to_driver}
        if addr:
            if addr.startswith(("http://", "https://")):
                addr = "auto"
            if addr != "auto":
                check_reachable(addr)
            try:
                ray.init(address=addr, **kwargs)
            except ConnectionError as e:
                raise ConfigError("address", f"cannot join the Ray cluster at {addr}: {str(e).splitlines()[0]}") from None
        else:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address=LOOPBACK, **kwargs)
            _STARTED_HERE = True
    return describe()


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


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nothing listens on now (for a Serve proxy or a test server started next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def keep_replica_grpc_on_loopback() -> None:
    """Ray Serve (2.60) starts each replica's inter-deployment gRPC server on ``[::]:0``, all interfaces, whatever
    the node's address (token authentication guards it). On a node whose address is 127.0.0.1 (the embedded Ray
    of ``cluster.runtime``, where every other server listens on loopback) bind it to loopback too. Runs in the
    replica's constructor, before Serve starts that server; a Ray without this hook is left as it is."""
    try:
        import ray
        from ray.serve._private import replica as serve_replica
    except ImportError:
        return
    add = getattr(serve_replica, "add_port_to_grpc_server", None)
    if add is None or getattr(add, "specray_loopback", False) or ray.util.get_node_ip_address() != "127.0.0.1":
        return

    def add_on_loopback(server, address: str):
        if address.startswith("[::]:"):
            address = "127.0.0.1:" + address.rsplit(":", 1)[1]
        return add(server, address)

    add_on_loopback.specray_loopback = True
    serve_replica.add_port_to_grpc_server = add_on_loopback
