"""The processes of a soak: every process below the driver (GCS, raylets, Ray's agents, Serve's controller, proxy
and replicas, model workers, redis), what each is, and its RSS and open file descriptors sampled as time series."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from evaluation.soak.plan import log


# ---- processes -----------------------------------------------------------------------------------------------
def proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, command line) of every process this user can see (Linux /proc)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except (OSError, IndexError, ValueError):
            continue
        out[int(name)] = (ppid, cmd)
    return out


def descendants(root: int, table: dict[int, tuple[int, str]] | None = None) -> dict[int, str]:
    """pid -> command line of ``root`` and every process below it."""
    table = table if table is not None else proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in table and pid not in out:
            out[pid] = table[pid][1]
            todo += children.get(pid, [])
    return out


ROLE_PATTERNS = (  # (substring of the command line, role); the first match wins
    ("gcs_server", "gcs"),
    ("/raylet/raylet", "raylet"),
    ("log_monitor.py", "log monitor"),
    ("autoscaler/_private/monitor.py", "autoscaler monitor"),
    ("dashboard/dashboard.py", "dashboard"),
    ("ray::DashboardAgent", "dashboard agent"),
    ("ray::RuntimeEnvAgent", "runtime env agent"),
    ("ray::ServeController", "serve controller"),
    ("ray::ProxyActor", "serve proxy"),
    (":OpenAIIngress", "ingress replica"),
    (":ModelServer", "engine replica"),
    (":Placed-", "placed replica"),
    ("ray::ModelActor", "model worker"),
    ("ray::IDLE", "idle worker"),
    ("redis-server", "redis"),
    ("jobs.registry", "publish"),
    ("ray::", "ray worker"),
)


def role_of(cmd: str) -> str:
    """What a process of the run is, from its command line.

    >>> role_of("ray::ServeReplica:specray:ModelServer.handle_request_streaming"), role_of("redis-server 127.0.0.1:6379")
    ('engine replica', 'redis')
    """
    for needle, role in ROLE_PATTERNS:
        if needle in cmd:
            return role
    return "other"


def rss_and_fds(pid: int) -> tuple[float, int] | None:
    """(resident MiB, open file descriptors) of ``pid``; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next((int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:")), 0.0)
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        return None


class ProcessSampler:
    """Every ``interval_s``, RSS and open fds of the driver and every process below it (the cluster's GCS, raylets
    and workers, redis-server) into :attr:`rows` (t_s, pid, role, rss_mb, fds). ``roles`` overrides a pid's role
    (a model worker's side); ``extra`` adds pids outside the tree."""

    def __init__(self, clock: Callable[[], float], interval_s: float = 5.0, root: int | None = None):
        self.clock, self.interval_s, self.root = clock, interval_s, root or os.getpid()
        self.rows: list[dict] = []
        self.load: list[tuple[float, float]] = []  # (t_s, the machine's 1-minute load average): how busy the host was
        self.roles: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> ProcessSampler:
        self._thread.start()
        return self

    def sample(self) -> None:
        t = self.clock()
        self.load.append((round(t, 3), os.getloadavg()[0]))
        for pid, cmd in descendants(self.root).items():
            got = rss_and_fds(pid)
            if got is None:
                continue
            role = "soak driver" if pid == self.root else self.roles.get(pid) or role_of(cmd)
            self.rows.append({"t_s": round(t, 3), "pid": pid, "role": role, "rss_mb": round(got[0], 2), "fds": got[1]})

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception as e:  # noqa: BLE001 - a sampler must not end the run; say why and go on
                log(f"soak: sampling processes failed: {type(e).__name__}: {e}")
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        for row in self.rows:  # a pid's role learnt after its first samples (a model worker's side) applies to all of them
            row["role"] = self.roles.get(row["pid"], row["role"])


def find_pids(role: str, root: int | None = None) -> list[int]:
    return [pid for pid, cmd in descendants(root or os.getpid()).items() if role_of(cmd) == role]


TRANSIENT_ROLES = {"idle worker", "ray worker", "publish", "other"}  # come and go with the pool, not one service
