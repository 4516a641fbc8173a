"""What a soak runs the Serve app on, and breaks: a Ray cluster of several nodes on this machine, and a persistent
``redis-server`` for the registry."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from cluster.runtime import free_port
from evaluation.soak.processes import proc_table

HEAD_RESOURCE = "specray_soak_head"


# ---- the cluster and redis -----------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """In a child before exec (Linux): SIGTERM it when the process that started it dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class RedisServer:
    """A ``redis-server`` on a free loopback port with an append-only file in its own directory (what
    ``infra/kuberay/redis.yaml`` runs), so a restart keeps the registry. :meth:`restart` stops it gracefully
    (SIGTERM: it writes the file and exits) and starts it again on the same port and directory."""

    def __init__(self, workdir: Path | None = None):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server); the soak's registry runs on it")
        self.binary = binary
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="specray-soak-redis-"))
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def start(self, timeout_s: float = 20.0) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir), "--appendonly", "yes"]
        args += ["--save", "", "--daemonize", "no", "--logfile", str(self.dir / "redis.log"), "--databases", "2"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.ping():
                return
            time.sleep(0.05)
        tail = (self.dir / "redis.log").read_text(errors="replace")[-400:] if (self.dir / "redis.log").exists() else ""
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING within {timeout_s:.0f}s: {tail}")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def restart(self, down_s: float) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()
        self.restarts += 1

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class SoakCluster:
    """Several Ray nodes on this machine: a head with no CPUs and the :data:`HEAD_RESOURCE` (Serve's controller, its
    proxy, the ingress and the engine replica stay there; it is never removed), and ``worker_nodes`` nodes of
    ``cpus_per_node`` CPUs for the actor entry's placement group (replica, target and draft on three of them) with
    one spare, so a removed node's work has somewhere to go. The driver (this process) is connected to it."""

    def __init__(self, worker_nodes: int = 4, cpus_per_node: int = 1):
        self.worker_nodes, self.cpus_per_node = worker_nodes, cpus_per_node
        self.cluster = None
        self.removed: list[str] = []
        self.added = 0

    def start(self) -> SoakCluster:
        import ray
        from ray.cluster_utils import Cluster

        if ray.is_initialized():
            ray.shutdown()
        head = {"num_cpus": 0, "include_dashboard": False, "resources": {HEAD_RESOURCE: 1}}
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        for _ in range(self.worker_nodes):
            self.cluster.add_node(num_cpus=self.cpus_per_node)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, logging_level="WARNING", log_to_driver=False)
        return self

    @property
    def nodes(self) -> list:
        """The worker nodes alive now (``ray._private.node.Node``)."""
        return list(self.cluster.worker_nodes)

    def node_by_id(self, node_id: str):
        return next((n for n in self.nodes if n.node_id == node_id), None)

    def raylet_pids(self) -> dict[int, object]:
        """raylet pid -> its node (head included)."""
        from ray._private import ray_constants

        out = {}
        for node in [self.cluster.head_node, *self.nodes]:
            for info in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []):
                out[info.process.pid] = node
        return out

    def node_of_pid(self, pid: int):
        """The node whose raylet started ``pid`` (a worker process), or None."""
        table, raylets = proc_table(), self.raylet_pids()
        while pid in table:
            if pid in raylets:
                return raylets[pid]
            pid = table[pid][0]
        return None

    def remove(self, node) -> None:
        self.removed.append(node.node_id)
        self.cluster.remove_node(node)

    def add(self):
        node = self.cluster.add_node(num_cpus=self.cpus_per_node)
        self.added += 1
        return node

    def session_logs(self) -> str | None:
        try:
            return str(Path(self.cluster.head_node.get_session_dir_path()) / "logs")
        except Exception:  # noqa: BLE001 - only a hint for the report
            return None

    def shutdown(self) -> None:
        import ray

        try:
            ray.shutdown()
        finally:
            if self.cluster is not None:
                self.cluster.shutdown()
                self.cluster = None
