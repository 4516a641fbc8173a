"""Faults under load: a soak of the OpenAI endpoints through real HTTP, with chaos, checking that nothing is lost.

``specray soak`` (``jobs.soak``) deploys the Serve app on the cluster built here and hands this harness its URL:

- :class:`SoakCluster`: a ``ray.cluster_utils.Cluster`` on this machine (a head that keeps Serve's controller, the
  proxy, the ingress and the engine replica, and worker nodes for the actor entry's placement group plus a spare)
  and :class:`RedisServer`, a persistent ``redis-server`` (append-only file, as ``infra/kuberay/redis.yaml``) for
  the registry;
- :class:`Soak`: the load (Poisson arrivals plus a concurrency floor, under a ceiling; streamed and plain
  completions and chat; greedy and seeded sampling; every served model, an actor entry included) and the faults
  at set times (:data:`FAULTS`), run on one asyncio loop with ``httpx``;
- :class:`ProcessSampler`: RSS and open file descriptors of every process of the run (the driver, GCS, raylets,
  Ray's agents, Serve's controller, proxy and replicas, model workers, redis), sampled as time series;
- :func:`analyse`, :func:`report_markdown`, :func:`plot`: per fault the recovery time (fault to the first success
  of a request it could affect, sent after it), the requests it affected and p99 latency before, during and
  after; over the run the outcomes, the greedy identity checks and the growth of every process's RSS and fds.

Every request ends in exactly one of three ways: ``ok`` (it completes); ``error``, a clean OpenAI-shaped error
(503, or 429 with ``Retry-After``), or in a stream an error event just before ``[DONE]``. Anything else is a
violation (:data:`VIOLATIONS`): ``lost`` (connection broken, no ``[DONE]``, no finish), ``hung`` (past its
timeout), ``bad_error`` (another status or shape), ``duplicated`` (two finishes, data after ``[DONE]``, an id
answered twice), ``mixed`` (another response's chunks in a stream) or ``wrong_output`` (a completed greedy
answer that differs from the same request run alone in float32, or a seeded answer that differs from the same
seeded request's other answers).

>>> events = ['{"id":"c1","choices":[{"index":0,"text":"Hi","finish_reason":null}]}',
...           '{"id":"c1","choices":[{"index":0,"text":"","finish_reason":"length"}],"usage":{"completion_tokens":1}}', "[DONE]"]
>>> v = classify_stream(200, {}, events, "completions")
>>> (v.outcome, v.text, v.finish_reason, v.tokens)
('ok', 'Hi', 'length', 1)
>>> classify_stream(200, {}, events[:1] + ['{"error":{"message":"m","type":"service_unavailable","code":"x"}}', "[DONE]"],
...                 "completions").outcome
'error'
>>> classify_stream(200, {}, events[:2], "completions").outcome
'lost'
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import os
import queue
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from cluster.runtime import free_port
from evaluation.load import percentile

FAULTS = ("replica_kill", "worker_kill", "node_removal", "redis_restart", "slow_reader", "queue_fill")
FAULT_WHAT = {
    "replica_kill": "SIGKILL the engine's Serve replica (ModelServer)",
    "worker_kill": "SIGKILL a model worker (target or draft, in turn) of the actor entry",
    "node_removal": "remove the node of the actor entry's replica, target or draft (in turn); a new node joins after recovery",
    "redis_restart": "stop redis-server (SIGTERM) while a `specray registry put` publishes, start it again on the same port",
    "slow_reader": "a client that stalls on a stream (4 KiB receive buffer, no reads) then reads it slowly; one that hangs up",
    "queue_fill": "a burst of plain requests past the ingress's admission limit (max_queued_requests)",
}
OK, ERROR = "ok", "error"
VIOLATIONS = ("lost", "hung", "bad_error", "duplicated", "mixed", "wrong_output", "malformed")
ABANDONED = "abandoned"  # the hang-up client leaves on purpose: checked for its cancellation instead
CLEAN_STREAM_ERRORS = {"service_unavailable": 503, "rate_limit_error": 429}
HEAD_RESOURCE = "specray_soak_head"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- outcomes ------------------------------------------------------------------------------------------------
@dataclass
class Answer:
    """How a request was answered: what the classifiers find (a :class:`Verdict`), and what its record keeps."""

    outcome: str = ""
    detail: str = ""
    status: int | None = None
    code: str | None = None
    response_id: str | None = None
    text: str | None = None
    tokens: int | None = None
    finish_reason: str | None = None
    retry_after: str | None = None


@dataclass
class Verdict(Answer):
    where: dict | None = None  # an actor entry's placement (specray.placement.where): which pids and nodes served it


def _error_shape(doc) -> dict | None:
    """OpenAI's error body ``{"error": {"message", "type", "code", ...}}``, else None."""
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str) and "code" in err:
        return err
    return None


def _where(doc: dict) -> dict | None:
    placement = (doc.get("specray") or {}).get("placement")
    return placement.get("where") if isinstance(placement, dict) else None


def classify_plain(status: int, headers, body: bytes | str, endpoint: str) -> Verdict:
    """A non-streamed answer (or a stream refused before it started): ok, a clean error, or a violation.

    >>> full = '{"error":{"message":"full","type":"rate_limit_error","code":"queue_full"}}'
    >>> classify_plain(429, {"retry-after": "1"}, full, "chat").outcome
    'error'
    >>> classify_plain(429, {}, full, "chat").detail
    'HTTP 429 without a Retry-After header'
    >>> classify_plain(500, {}, '{"error":{"message":"boom","type":"server_error","code":"internal_error"}}', "chat").outcome
    'bad_error'
    """
    headers = {k.lower(): v for k, v in dict(headers).items()}
    try:
        doc = json.loads(body)
    except ValueError:
        kind = "lost" if status == 200 else "bad_error"
        return Verdict(
            kind, f"HTTP {status}: the body is not JSON ({bytes(body[:60]) if isinstance(body, bytes) else body[:60]!r})", status
        )
    if status == 200:
        try:
            choice = doc["choices"][0]
            text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
            finish, tokens, rid = choice["finish_reason"], doc["usage"]["completion_tokens"], doc["id"]
        except (KeyError, IndexError, TypeError):
            return Verdict("malformed", f"a 200 without choices, usage or id: {str(doc)[:120]}", status)
        if finish not in ("stop", "length") or len(doc["choices"]) != 1:
            return Verdict("malformed", f"finish_reason {finish!r}, {len(doc['choices'])} choices", status)
        header_id = headers.get("x-specray-request-id")
        if header_id is not None and header_id != rid:
            return Verdict("mixed", f"the body answers {rid} but the header names {header_id}", status, response_id=rid)
        return Verdict(OK, "", status, response_id=rid, text=text, tokens=tokens, finish_reason=finish, where=_where(doc))
    err = _error_shape(doc)
    if err is None:
        return Verdict("bad_error", f"HTTP {status} without OpenAI's error shape: {str(doc)[:120]}", status)
    code, message = err.get("code"), err["message"].splitlines()[0][:160] if err["message"] else ""
    if status == 503:
        return Verdict(ERROR, message, status, code=code)
    if status == 429:
        retry = headers.get("retry-after")
        if retry is None or not retry.strip().isdigit():
            return Verdict("bad_error", "HTTP 429 without a Retry-After header", status, code=code)
        return Verdict(ERROR, message, status, code=code, retry_after=retry)
    return Verdict("bad_error", f"HTTP {status} {code}: {message}", status, code=code)


def classify_stream(status: int, headers, events: list[str], endpoint: str) -> Verdict:
    """A stream's ``data:`` payloads in order (``[DONE]`` included): ok, a clean error event before ``[DONE]``, or a
    violation: no ``[DONE]`` (lost), two finishes or data after the end (duplicated), chunks of several responses (mixed).

    >>> ok = '{"id":"a","choices":[{"index":0,"text":"x","finish_reason":"stop"}],"usage":{"completion_tokens":1}}'
    >>> classify_stream(200, {}, [ok, ok, "[DONE]"], "completions").outcome
    'duplicated'
    >>> classify_stream(200, {}, [ok.replace('"a"', '"b"', 1), '{"id":"a","choices":[]}', "[DONE]"], "completions").outcome
    'mixed'
    >>> classify_stream(200, {}, [ok, "[DONE]", "[DONE]"], "completions").outcome
    'duplicated'
    """
    headers = {k.lower(): v for k, v in dict(headers).items()}
    done = [i for i, e in enumerate(events) if e == "[DONE]"]
    if not done:
        return Verdict("lost", f"the stream ended without [DONE] after {len(events)} events", status)
    if len(done) > 1 or done[0] != len(events) - 1:
        return Verdict("duplicated", f"[DONE] at events {done} of {len(events)}: data after the end or two ends", status)
    ids, parts, finishes, errors = [], [], [], []
    tokens, where = None, None
    for i, payload in enumerate(events[:-1]):
        try:
            doc = json.loads(payload)
        except ValueError:
            return Verdict("malformed", f"event {i} is not JSON: {payload[:80]!r}", status)
        if not isinstance(doc, dict):
            return Verdict("malformed", f"event {i} is not an object: {payload[:80]!r}", status)
        if "error" in doc:
            errors.append((i, doc))
            continue
        if errors:
            return Verdict("duplicated", f"a chunk after the error event (event {i})", status)
        if doc.get("id") not in ids:
            ids.append(doc.get("id"))
        for ch in doc.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content") if endpoint == "chat" else ch.get("text")
            if piece and finishes:
                return Verdict("duplicated", f"content after the finish (event {i})", status)
            if piece:
                parts.append(piece)
            if ch.get("finish_reason") is not None:
                finishes.append(ch["finish_reason"])
        if isinstance(doc.get("usage"), dict):
            tokens = doc["usage"].get("completion_tokens")
        where = _where(doc) or where
    rid = ids[0] if ids else None
    if len(ids) > 1:
        return Verdict("mixed", f"chunks of {len(ids)} responses in one stream: {ids[:4]}", status, response_id=rid)
    header_id = headers.get("x-specray-request-id")
    if header_id is not None and rid is not None and header_id != rid:
        return Verdict("mixed", f"the chunks answer {rid} but the header names {header_id}", status, response_id=rid)
    if errors:
        if len(errors) > 1 or finishes:
            return Verdict("duplicated", f"{len(errors)} error event(s) and {len(finishes)} finish(es) in one stream", status)
        if errors[0][0] != len(events) - 2:
            return Verdict("duplicated", "the error event is not the last before [DONE]", status)
        err = _error_shape(errors[0][1])
        if err is None:
            return Verdict("bad_error", f"an error event without OpenAI's shape: {events[errors[0][0]][:120]}", status)
        message = err["message"].splitlines()[0][:160] if err["message"] else ""
        if err["type"] not in CLEAN_STREAM_ERRORS:
            return Verdict("bad_error", f"a {err['type']} error event ({err.get('code')}): {message}", status, code=err.get("code"))
        return Verdict(ERROR, message, CLEAN_STREAM_ERRORS[err["type"]], code=err.get("code"), response_id=rid, text="".join(parts))
    if not finishes:
        return Verdict("lost", "[DONE] without a finish_reason or an error event", status, response_id=rid)
    if len(finishes) > 1:
        return Verdict("duplicated", f"{len(finishes)} finish_reasons in one stream", status, response_id=rid)
    if finishes[0] not in ("stop", "length"):
        return Verdict("malformed", f"finish_reason {finishes[0]!r}", status, response_id=rid)
    return Verdict(OK, "", status, response_id=rid, text="".join(parts), tokens=tokens, finish_reason=finishes[0], where=where)


def _has_content(line: str) -> bool:
    """Whether an SSE line of a chunk carries generated text (not the role chunk or an empty finish).

    >>> _has_content('data: {"choices":[{"delta":{"content":"Hi"}}]}'), _has_content('data: {"choices":[{"text":""}]}')
    (True, False)
    """
    return ('"content":"' in line and '"content":""' not in line) or ('"text":"' in line and '"text":""' not in line)


def sse_payloads(raw: bytes) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream (the body of a streamed answer), in order.

    >>> sse_payloads(b'data: {"a":1}\\n\\ndata: [DONE]\\n\\n')
    ['{"a":1}', '[DONE]']
    """
    out = []
    for block in raw.decode("utf-8", "replace").replace("\r\n", "\n").split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data:"):
                out.append(line[5:].strip())
    return out


# ---- the requests ------------------------------------------------------------------------------------------------
@dataclass
class Mix:
    """What the load sends: each model's share (actor entries capped at ``placed_max_inflight`` streams each, as their
    generations run one at a time), the streamed, chat and seeded-sampling shares, and the ``max_tokens`` values."""

    models: dict  # name -> weight
    placed: tuple = ()  # the actor entries among them
    placed_max_inflight: int = 2
    stream_share: float = 0.5
    chat_share: float = 0.5
    sampled_share: float = 0.3
    temperature: float = 0.8
    top_p: float = 0.95
    max_tokens: tuple = (16, 32, 48)


@dataclass(kw_only=True)
class RequestRecord(Answer):
    idx: int
    kind: str  # load | burst | slow_reader | hangup
    model: str
    endpoint: str  # chat | completions
    stream: bool
    temperature: float
    seed: int | None
    max_tokens: int
    prompt_idx: int
    timeout_s: float
    t_start: float = 0.0
    t_first: float | None = None  # first content (stream) or the whole answer (plain)
    t_end: float | None = None
    check: str | None = None  # greedy: match | mismatch; seeded: checked later (consistent | inconsistent)
    server_state: str | None = None  # hang-up: the replica's record of the request (cancelled, completed, ...)

    @property
    def latency(self) -> float | None:
        return None if self.t_end is None else self.t_end - self.t_start

    def body(self, prompt: str, top_p: float) -> dict:
        out = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature, "stream": self.stream}
        if self.endpoint == "chat":
            out["messages"] = [{"role": "user", "content": prompt}]
        else:
            out["prompt"] = prompt
        if self.seed is not None:
            out.update(seed=self.seed, top_p=top_p)
        return out

    def apply(self, v: Verdict) -> None:
        for f in fields(Answer):
            setattr(self, f.name, getattr(v, f.name))


def path_of(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


# ---- processes -----------------------------------------------------------------------------------------------
def _proc_table() -> dict[int, tuple[int, str]]:
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
    table = table if table is not None else _proc_table()
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
        table, raylets = _proc_table(), self.raylet_pids()
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


# ---- the plan ------------------------------------------------------------------------------------------------
@dataclass
class SoakPlan:
    duration_s: float = 1800.0
    min_streams: int = 8
    max_streams: int = 16
    rate: float = 1.0  # Poisson arrivals per second, on top of the floor
    request_timeout_s: float = 180.0
    schedule: list = field(default_factory=list)  # [(t_s, fault name)], in time order
    fault_gap_s: float = 10.0  # a fault waits for the previous one's recovery (bounded) plus this gap
    overlap: bool = False  # faults at their planned times, without waiting for the previous one's recovery
    recovery_wait_s: float = 120.0
    window_s: float = 60.0  # p99 windows before and after a fault
    sample_s: float = 5.0
    progress_s: float = 30.0
    node_return_s: float = 10.0  # after a node removal's recovery, a new node joins (the spare again)
    redis_down_s: float = 3.0
    burst_over: int = 16  # queue_fill: requests sent at once beyond the admission limit
    max_queued_requests: int = 24
    slow_stall_s: float = 15.0
    slow_max_tokens: int = 96
    slow_prompt_idx: int = 0  # a prompt whose completion runs to slow_max_tokens (no early end): the slow and the hung-up stream
    seed: int = 0


def even_schedule(faults: list[str], repeats: int, start_s: float, end_s: float) -> list[tuple[float, str]]:
    """Each fault ``repeats`` times, interleaved, evenly spread over [start_s, end_s).

    >>> even_schedule(["a", "b"], 2, 100, 500)
    [(100.0, 'a'), (200.0, 'b'), (300.0, 'a'), (400.0, 'b')]
    """
    n = len(faults) * repeats
    if n == 0:
        return []
    step = (end_s - start_s) / n
    return [(round(start_s + i * step, 1), faults[i % len(faults)]) for i in range(n)]


def parse_schedule(text: str, known=FAULTS) -> list[tuple[float, str]]:
    """``"60:replica_kill,150:queue_fill"`` -> [(60.0, 'replica_kill'), (150.0, 'queue_fill')]; ValueError naming the bad item.

    >>> parse_schedule("90:queue_fill, 30:replica_kill")
    [(30.0, 'replica_kill'), (90.0, 'queue_fill')]
    """
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        t, sep, name = item.partition(":")
        try:
            when = float(t)
        except ValueError:
            raise ValueError(f"{item!r} is not SECONDS:FAULT") from None
        if not sep or name not in known or when < 0:
            raise ValueError(f"{item!r} is not SECONDS:FAULT with a fault among {', '.join(known)}")
        out.append((when, name))
    return sorted(out)


@dataclass
class FaultRecord:
    name: str
    index: int
    t_planned: float
    t_inject: float | None = None
    t_end: float | None = None  # when its own action ended (the kill: at once; the restart, the burst, the slow read: later)
    target: str = ""
    detail: dict = field(default_factory=dict)
    error: str | None = None


# ---- the soak ------------------------------------------------------------------------------------------------
class Soak:
    """The load and the faults against ``base_url`` (the Serve app on ``cluster``), with ``redis`` holding its registry.

    ``engine`` and ``placed``: the model names served by the engine replica and by actor entries; ``expected(record)``
    gives a greedy request's float32 alone answer (None: not checked); ``publish(name) -> argv`` the command line of
    a publish into the registry (the redis_restart fault runs it as a subprocess)."""

    def __init__(
        self,
        base_url: str,
        plan: SoakPlan,
        mix: Mix,
        prompts: list[str],
        cluster: SoakCluster | None,
        redis: RedisServer | None,
        engine: list[str],
        placed: list[str],
        expected: Callable[[RequestRecord], str | None] | None = None,
        publish: Callable[[str, Path], list[str]] | None = None,
        workdir: Path | None = None,
    ):
        self.url, self.plan, self.mix, self.prompts = base_url.rstrip("/"), plan, mix, prompts
        self.cluster, self.redis = cluster, redis
        self.engine, self.placed = list(engine), list(placed)
        self.expected, self.publish = expected, publish
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="specray-soak-"))
        self.rng = random.Random(plan.seed)
        self.records: list[RequestRecord] = []
        self.faults: list[FaultRecord] = []
        self.where: dict = {}  # the actor entry's latest placement: role -> {node_id, pid, ...}
        self.arrivals_over_ceiling = 0
        self._t0 = time.monotonic()
        self.wall_start = time.time()
        self.sampler = ProcessSampler(self.clock, plan.sample_s)
        self._load_inflight = 0
        self._placed_inflight = 0
        self._wake: asyncio.Event | None = None
        self._calls: queue.Queue = queue.Queue()
        self.stopping = False
        self.drain: dict = {}

    def clock(self) -> float:
        return time.monotonic() - self._t0

    # ---- requests ---------------------------------------------------------------------------------------
    def _new(self, kind: str, **fixed) -> RequestRecord:
        m = self.mix
        names = list(m.models)
        weights = [m.models[n] for n in names]
        if self._placed_inflight >= m.placed_max_inflight * max(1, len(self.placed)) or kind != "load":
            keep = [i for i, n in enumerate(names) if n not in self.placed]
            names, weights = [names[i] for i in keep], [weights[i] for i in keep]
        model = fixed.pop("model", None) or self.rng.choices(names, weights)[0]
        sampled = self.rng.random() < m.sampled_share
        prompt_idx = self.rng.randrange(len(self.prompts))
        rec = RequestRecord(
            idx=len(self.records),
            kind=kind,
            model=model,
            endpoint="chat" if self.rng.random() < m.chat_share else "completions",
            stream=self.rng.random() < m.stream_share,
            temperature=m.temperature if sampled else 0.0,
            seed=1000 + prompt_idx if sampled else None,
            max_tokens=self.rng.choice(m.max_tokens),
            prompt_idx=prompt_idx,
            timeout_s=self.plan.request_timeout_s,
        )
        for k, v in fixed.items():
            setattr(rec, k, v)
        self.records.append(rec)
        return rec

    async def send(self, client, rec: RequestRecord) -> RequestRecord:
        import httpx

        placed = rec.model in self.placed
        self._placed_inflight += placed
        rec.t_start = self.clock()
        body = rec.body(self.prompts[rec.prompt_idx], self.mix.top_p)
        try:
            async with asyncio.timeout(rec.timeout_s):
                if rec.stream:
                    async with client.stream("POST", self.url + path_of(rec.endpoint), json=body) as r:
                        if r.status_code != 200 or "text/event-stream" not in r.headers.get("content-type", ""):
                            verdict = classify_plain(r.status_code, r.headers, await r.aread(), rec.endpoint)
                        else:
                            events = []
                            async for line in r.aiter_lines():
                                if line.startswith("data:"):
                                    events.append(line[5:].strip())
                                    if rec.t_first is None and _has_content(line):
                                        rec.t_first = self.clock()
                            verdict = classify_stream(r.status_code, r.headers, events, rec.endpoint)
                else:
                    r = await client.post(self.url + path_of(rec.endpoint), json=body)
                    rec.t_first = self.clock()
                    verdict = classify_plain(r.status_code, r.headers, r.content, rec.endpoint)
        except TimeoutError:
            verdict = Verdict("hung", f"no end within its timeout of {rec.timeout_s:.0f}s")
        except httpx.TimeoutException as e:
            verdict = Verdict("hung", f"{type(e).__name__} past the client's timeout")
        except httpx.HTTPError as e:
            verdict = Verdict("lost", f"{type(e).__name__}: {str(e)[:160]}")
        rec.t_end = self.clock()
        rec.apply(verdict)
        self._placed_inflight -= placed
        if verdict.where:
            self.where = verdict.where
            for role in ("target", "draft"):
                pid = (verdict.where.get(role) or {}).get("pid")
                if pid:
                    self.sampler.roles[pid] = f"model worker ({role})"
        self._check(rec)
        return rec

    def _check(self, rec: RequestRecord) -> None:
        if rec.outcome != OK or rec.temperature > 0 or self.expected is None:
            return
        want = self.expected(rec)
        if want is None:
            return
        rec.check = "match" if rec.text == want else "mismatch"
        if rec.check == "mismatch":
            rec.outcome = "wrong_output"
            at = next(
                (i for i, (a, b) in enumerate(zip(rec.text or "", want, strict=False)) if a != b), min(len(rec.text or ""), len(want))
            )
            rec.detail = (
                f"differs from the float32 alone answer at character {at}: {(rec.text or '')[at : at + 30]!r} vs {want[at : at + 30]!r}"
            )

    # ---- the load ---------------------------------------------------------------------------------------
    async def _load_one(self, client, rec: RequestRecord) -> None:
        try:
            await self.send(client, rec)
        finally:
            self._load_inflight -= 1
            if self._wake is not None:
                self._wake.set()

    async def steady(self, client, until: float, tasks: set) -> None:
        """Poisson arrivals at ``plan.rate`` plus the floor of ``min_streams`` in flight, under ``max_streams``
        (an arrival that finds the ceiling is counted and dropped)."""
        p = self.plan
        self._wake = asyncio.Event()
        next_arrival = self.clock() + (self.rng.expovariate(p.rate) if p.rate > 0 else math.inf)
        while self.clock() < until and not self.stopping:
            now = self.clock()
            start = self._load_inflight < p.min_streams
            if not start and now >= next_arrival:
                next_arrival += self.rng.expovariate(p.rate)
                if self._load_inflight < p.max_streams:
                    start = True
                else:
                    self.arrivals_over_ceiling += 1
            if start:
                self._load_inflight += 1  # counted now: the task starts at the next await
                t = asyncio.create_task(self._load_one(client, self._new("load")))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                await asyncio.sleep(0)
                continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=max(0.01, min(next_arrival, until) - self.clock()))
            except TimeoutError:
                pass

    # ---- recovery ---------------------------------------------------------------------------------------
    def affected_models(self, name: str) -> list[str]:
        if name == "replica_kill":
            return self.engine
        if name in ("worker_kill", "node_removal"):
            return self.placed
        return self.engine + self.placed

    def first_ok_after(self, t: float, models: list[str]) -> RequestRecord | None:
        """The first success of ``models`` served after ``t``: completed, its first content (the whole answer for a
        plain request) more than half a second after ``t``, so it was not on its way before the fault."""
        return first_success(self.records, t, models)

    async def wait_recovered(self, fault: FaultRecord, limit_s: float) -> float | None:
        """When the first request the fault could affect succeeded after it (None: not within ``limit_s``)."""
        models = self.affected_models(fault.name)
        deadline = self.clock() + limit_s
        while self.clock() < deadline and not self.stopping:
            first = self.first_ok_after(fault.t_inject, models)
            if first is not None:
                return first.t_end
            await asyncio.sleep(0.5)
        return None

    # ---- the faults ---------------------------------------------------------------------------------------
    async def chaos(self, client, tasks: set) -> None:
        """Inject each fault of the schedule at its time; unless ``plan.overlap``, not before the previous fault has
        recovered (bounded by ``recovery_wait_s``) plus ``fault_gap_s``. After a node removal has recovered, a new node
        joins (the spare again) ``node_return_s`` later."""
        p = self.plan
        ready_at, followups = 0.0, []
        for i, (t_plan, name) in enumerate(p.schedule):
            fault = FaultRecord(name, i, t_plan)
            self.faults.append(fault)
            wait = max(t_plan, ready_at) - self.clock()
            if wait > 0:
                await asyncio.sleep(wait)
            if self.clock() >= p.duration_s - 5 or self.stopping:
                fault.error = "not injected: the run ended first"
                log(f"soak: {name} not injected, the run ends")
                continue
            fault.t_inject = self.clock()
            log(f"soak: t={fault.t_inject:6.1f}s fault {i + 1}/{len(p.schedule)}: {name}")
            try:
                await getattr(self, f"_fault_{name}")(fault, client, tasks)
            except Exception as e:  # noqa: BLE001 - a failed injection is reported, the run goes on
                fault.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                log(f"soak: {name} could not be injected: {fault.error}")
            if fault.t_end is None:
                fault.t_end = self.clock()
            if name == "node_removal" and self.cluster is not None and fault.error is None:
                followups.append(asyncio.create_task(self._node_returns(fault)))
            if not p.overlap:
                await self.wait_recovered(fault, p.recovery_wait_s)
            ready_at = self.clock() + p.fault_gap_s
        if followups:
            await asyncio.gather(*followups)

    async def _node_returns(self, fault: FaultRecord) -> None:
        await self.wait_recovered(fault, self.plan.recovery_wait_s)
        await asyncio.sleep(self.plan.node_return_s)
        if self.clock() >= self.plan.duration_s or self.stopping:
            return  # the load is over: no spare needed any more
        try:
            await self.on_main(self.cluster.add)
            fault.detail["node_added_at_s"] = round(self.clock(), 1)
            log(f"soak: t={self.clock():6.1f}s a new node joined (the spare again)")
        except Exception as e:  # noqa: BLE001 - reported; the run goes on one node short
            fault.detail["node_add_error"] = f"{type(e).__name__}: {e}"

    def _kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)

    async def _fault_replica_kill(self, fault: FaultRecord, client, tasks) -> None:
        pids = find_pids("engine replica")
        if not pids:
            raise RuntimeError("no engine replica process found")
        fault.target = f"engine replica pid {pids[0]}"
        self._kill(pids[0])

    async def _fault_worker_kill(self, fault: FaultRecord, client, tasks) -> None:
        role = ("target", "draft")[sum(f.name == "worker_kill" for f in self.faults[:-1]) % 2]
        pid = (self.where.get(role) or {}).get("pid")
        alive = find_pids("model worker")
        if pid not in alive:
            if not alive:
                raise RuntimeError("no model worker process found")
            pid, role = alive[0], "a model worker"
        fault.target = f"{role} worker pid {pid}"
        self._kill(pid)

    async def _fault_node_removal(self, fault: FaultRecord, client, tasks) -> None:
        if self.cluster is None:
            raise RuntimeError("node removal needs the soak's own test cluster")
        role = ("replica", "target", "draft")[sum(f.name == "node_removal" for f in self.faults[:-1]) % 3]
        node = self.cluster.node_by_id((self.where.get(role) or {}).get("node_id", ""))
        if node is None:  # no placement seen yet (or it moved): the node of any model worker
            pids = find_pids("model worker")
            node = self.cluster.node_of_pid(pids[0]) if pids else None
            role = "a model worker"
        if node is None:
            raise RuntimeError("no node hosts the actor entry")
        fault.target = f"node {node.node_id[:12]} (the {role}'s)"
        await self.on_main(self.cluster.remove, node)
        fault.detail["removed_in_s"] = round(self.clock() - fault.t_inject, 2)

    async def _fault_redis_restart(self, fault: FaultRecord, client, tasks) -> None:
        if self.redis is None or self.publish is None:
            raise RuntimeError("the Redis fault needs the soak's redis-server and a publish command")
        name = f"soak/published-{fault.index}"
        results = self.workdir / f"publish-{fault.index}"
        argv = self.publish(name, results)
        files = {p: p.read_bytes() for p in sorted(results.rglob("*")) if p.is_file()}
        before = await asyncio.to_thread(self._registry_names)
        fault.target = f"redis-server :{self.redis.port} during `{' '.join(argv[2:5])}`"
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        await asyncio.sleep(0.5)  # the publisher is starting: its connection falls into the restart
        t_down = self.clock()
        await asyncio.to_thread(self.redis.restart, self.plan.redis_down_s)
        fault.detail["redis_down_s"] = round(self.clock() - t_down, 2)
        out, err = await asyncio.to_thread(proc.communicate, None, 120)
        own = [ln for ln in err.splitlines() if ln.strip()]
        kept = all(p.is_file() and p.read_bytes() == data for p, data in files.items())
        fault.detail.update(
            publish_exit=proc.returncode,
            publish_stdout=out.strip()[-300:],
            publish_stderr=own[-3:],
            publish_one_line=proc.returncode == 0 or (len(own) == 1 and "Traceback" not in err),
            results_kept=kept,
            results_files=len(files),
        )
        again = await asyncio.to_thread(self._publish_again, name, results, before)
        fault.detail.update(again)
        log(
            f"soak: publish during the restart exited {proc.returncode} ({(own or [out.strip()])[-1][:140]}); "
            f"after it: exit {again['republish_exit']}, registry entries kept {again['entries_kept']}"
        )

    def _registry_names(self) -> set[str]:
        from cluster.registry import open_registry

        with open_registry(self.redis.url) as reg:
            return set(reg.names())

    def _publish_again(self, name: str, results: Path, before: set[str]) -> dict:
        """After the restart: the same publish succeeds, and every entry the registry had before is still there."""
        r = subprocess.run(self.publish(name, results), capture_output=True, text=True, timeout=120)
        after = self._registry_names()
        return {"republish_exit": r.returncode, "entries_kept": before <= after, "entries": len(after)}

    async def _fault_slow_reader(self, fault: FaultRecord, client, tasks) -> None:
        model = self.engine[-1]
        fixed = {"model": model, "stream": True, "temperature": 0.0, "seed": None, "endpoint": "completions"}
        fixed.update(max_tokens=self.plan.slow_max_tokens, prompt_idx=self.plan.slow_prompt_idx)
        slow = self._new("slow_reader", **fixed)
        slow.timeout_s = self.plan.request_timeout_s + self.plan.slow_stall_s
        hang = self._new("hangup", **fixed)
        fault.target = f"a stream of {model} ({self.plan.slow_max_tokens} tokens) stalled {self.plan.slow_stall_s:.0f}s; one hung up"
        a = asyncio.create_task(asyncio.to_thread(self._raw_stream, slow, self.plan.slow_stall_s, False))
        b = asyncio.create_task(asyncio.to_thread(self._raw_stream, hang, 0.0, True))
        await b
        await self._server_record(hang, client)
        await a
        fault.t_end = self.clock()
        fault.detail.update(
            slow_outcome=slow.outcome,
            slow_s=round(slow.latency or 0.0, 1),
            hangup_server_state=hang.server_state,
            hangup_tokens=hang.tokens,
        )
        log(f"soak: slow reader {slow.outcome} in {slow.latency or 0:.1f}s; the hung-up stream was {hang.server_state} on the replica")

    def _raw_stream(self, rec: RequestRecord, stall_s: float, hang_up: bool) -> None:
        """A streamed request over a plain socket with a 4 KiB receive buffer: ``stall_s`` without reading after the
        headers, then slow reads (``hang_up``: leave after the first event instead)."""
        host, port = self.url.split("//", 1)[1].split(":")
        body = json.dumps(rec.body(self.prompts[rec.prompt_idx], self.mix.top_p)).encode()
        head = (
            f"POST {path_of(rec.endpoint)} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        rec.t_start = self.clock()
        raw, deadline = b"", time.monotonic() + rec.timeout_s
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(10)
            sock.connect((host, int(port)))
            sock.sendall(head + body)
            while b"\r\n\r\n" not in raw and time.monotonic() < deadline:
                chunk = sock.recv(256)
                if not chunk:
                    break
                raw += chunk
            header_text, _, rest = raw.partition(b"\r\n\r\n")
            lines = header_text.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1]) if lines and len(lines[0].split()) > 1 else 0
            headers = dict(ln.split(": ", 1) for ln in lines[1:] if ": " in ln)
            hdr = {k.lower(): v for k, v in headers.items()}
            rec.response_id = hdr.get("x-specray-request-id")
            if hang_up:
                while b"data:" not in rest and time.monotonic() < deadline:
                    chunk = sock.recv(256)
                    if not chunk:
                        break
                    rest += chunk
                rec.t_end = self.clock()
                rec.status, rec.outcome, rec.detail = status, ABANDONED, "the client hung up after the first event"
                return
            time.sleep(stall_s)
            sock.settimeout(max(1.0, deadline - time.monotonic()))
            while time.monotonic() < deadline:
                chunk = sock.recv(512)
                if not chunk:
                    break
                rest += chunk
                time.sleep(0.01)  # a slow reader: about 50 KB/s
            else:
                rec.t_end = self.clock()
                rec.apply(Verdict("hung", f"no end within its timeout of {rec.timeout_s:.0f}s"))
                return
            body_bytes = dechunk(rest) if "chunked" in hdr.get("transfer-encoding", "") else rest
            rec.t_end = self.clock()
            if status == 200 and "text/event-stream" in hdr.get("content-type", ""):
                rec.apply(classify_stream(status, headers, sse_payloads(body_bytes), rec.endpoint))
            else:
                rec.apply(classify_plain(status, headers, body_bytes, rec.endpoint))
            self._check(rec)
        except (OSError, ValueError) as e:
            rec.t_end = self.clock()
            rec.apply(Verdict("hung" if isinstance(e, TimeoutError) else "lost", f"{type(e).__name__}: {e}"))
        finally:
            sock.close()

    async def _server_record(self, rec: RequestRecord, client) -> None:
        """The replica's record of a request whose client hung up: it should stop (``cancelled``) well before its end."""
        if not rec.response_id:
            rec.server_state = "unknown (no request id)"
            return
        deadline = self.clock() + 30
        while self.clock() < deadline:
            try:
                r = await client.get(f"{self.url}/v1/specray/requests/{rec.response_id}", timeout=15)
                doc = r.json() if r.status_code == 200 else {}
            except Exception:  # noqa: BLE001 - asked again until the deadline
                doc = {}
            if doc.get("state") and doc["state"] != "running":
                rec.server_state, rec.tokens = doc["state"], doc.get("tokens")
                rec.check = "cancelled" if doc["state"] == "cancelled" else "ran_to_end"
                return
            await asyncio.sleep(0.5)
        rec.server_state = "still running 30s after the client left"
        rec.check = "ran_to_end"

    async def _fault_queue_fill(self, fault: FaultRecord, client, tasks) -> None:
        n = self.plan.max_queued_requests + self.plan.burst_over
        burst = [self._new("burst", model=self.engine[0], stream=False, temperature=0.0, seed=None, max_tokens=8) for _ in range(n)]
        fault.target = f"{n} plain requests at once (admission limit {self.plan.max_queued_requests})"
        await asyncio.gather(*(self.send(client, r) for r in burst))
        fault.t_end = self.clock()
        fault.detail.update(
            burst=n,
            answered_429=sum(r.status == 429 and r.outcome == ERROR for r in burst),
            completed=sum(r.outcome == OK for r in burst),
            retry_after=sorted({r.retry_after for r in burst if r.retry_after}),
        )
        log(f"soak: burst of {n}: {fault.detail['completed']} completed, {fault.detail['answered_429']} answered 429")

    # ---- the run ------------------------------------------------------------------------------------------
    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(self.plan.progress_s)
            done = [r for r in self.records if r.t_end is not None]
            oks = [r for r in done if r.outcome == OK]
            bad = [r for r in done if r.outcome in VIOLATIONS]
            recent = [r for r in oks if r.t_end > self.clock() - self.plan.progress_s]
            toks = sum(r.tokens or 0 for r in recent) / self.plan.progress_s
            log(
                f"soak: t={self.clock():6.0f}s/{self.plan.duration_s:.0f}s in flight {self._load_inflight:2d}, done {len(done)} "
                f"(ok {len(oks)}, clean errors {sum(r.outcome == ERROR for r in done)}, violations {len(bad)}), {toks:.1f} tok/s"
                + (f"; last violation: {bad[-1].outcome} {bad[-1].detail[:100]}" if bad else "")
            )

    async def _run(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        timeout = httpx.Timeout(self.plan.request_timeout_s, connect=30)
        tasks: set = set()
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            progress = asyncio.create_task(self._progress())
            chaos = asyncio.create_task(self.chaos(client, tasks))
            try:
                await self.steady(client, self.plan.duration_s, tasks)
                log(f"soak: t={self.clock():.0f}s load stopped; waiting for {len(tasks)} request(s) in flight")
                if tasks:
                    await asyncio.wait(set(tasks))
                await chaos
            finally:
                progress.cancel()
                chaos.cancel()
            self.drain = await self._drained(client)

    async def _drained(self, client, limit_s: float = 30.0) -> dict:
        """Once every client is done: nothing left in flight on the ingress or generating on the engine replica."""
        deadline, last = self.clock() + limit_s, {}
        while self.clock() < deadline:
            try:
                doc = (await client.get(self.url + "/v1/specray/stats", timeout=15)).json()
                worker = doc.get("worker") or {}
                engines = worker.get("engines") or {}
                last = {
                    "ingress_inflight": (doc.get("ingress") or {}).get("inflight"),
                    "active_generations": worker.get("active_generations"),
                    "rows": sum(e.get("rows", 0) for e in engines.values()),
                    "waiting": sum(e.get("waiting", 0) for e in engines.values()),
                    "engine_restarts": sum(e.get("restarts", 0) for e in engines.values()),
                }
                if not any(last[k] for k in ("ingress_inflight", "active_generations", "rows", "waiting")):
                    return {**last, "drained": True}
            except Exception as e:  # noqa: BLE001 - asked again until the deadline
                last = {"error": f"{type(e).__name__}: {e}"}
            await asyncio.sleep(1)
        return {**last, "drained": False}

    def run(self) -> Soak:
        """The load and the faults on an event loop in a thread of their own; this (main) thread runs what Ray allows
        only there (adding a node registers signal handlers) when the faults ask (:meth:`on_main`). Ctrl-C stops the
        load early: the requests in flight still end and are reported."""
        self._t0 = time.monotonic()
        self.wall_start = time.time()
        self.sampler.start()
        failure: list[BaseException] = []

        def loop() -> None:
            try:
                asyncio.run(self._run())
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                failure.append(e)
            finally:
                self._calls.put(None)

        thread = threading.Thread(target=loop, name="soak-load", daemon=True)
        thread.start()
        try:
            while True:
                try:
                    call = self._calls.get(timeout=0.5)
                except queue.Empty:
                    continue
                except KeyboardInterrupt:
                    log("soak: interrupted; stopping the load, the requests in flight still end")
                    self.stopping = True
                    continue
                if call is None:
                    break
                fn, args, fut = call
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to the coroutine that asked
                    fut.set_exception(e)
            thread.join()
        finally:
            self.sampler.sample()
            self.sampler.stop()
        if failure:
            raise failure[0]
        self._check_seeded()
        return self

    async def on_main(self, fn, *args):
        """Run ``fn(*args)`` in the main thread (see :meth:`run`) and wait for it without blocking the load."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, args, fut))
        return await asyncio.wrap_future(fut)

    def _check_seeded(self) -> None:
        """Seeded requests asked the same way (model, endpoint, prompt, seed, max_tokens) must answer the same text:
        the most common answer of each group is taken as right, and every other is a wrong output."""
        groups: dict[tuple, list[RequestRecord]] = {}
        for r in self.records:
            if r.outcome == OK and r.temperature > 0 and r.seed is not None:
                groups.setdefault((r.model, r.endpoint, r.prompt_idx, r.seed, r.max_tokens), []).append(r)
        for rs in groups.values():
            if len(rs) < 2:
                continue
            texts = [r.text for r in rs]
            common = max(set(texts), key=texts.count)
            for r in rs:
                r.check = "consistent" if r.text == common else "inconsistent"
                if r.text != common:
                    r.outcome = "wrong_output"
                    r.detail = f"a seeded answer differs from {texts.count(common)} other(s) of the same request"


def dechunk(data: bytes) -> bytes:
    """The body of an HTTP/1.1 chunked transfer (as far as it goes).

    >>> dechunk(b"5\\r\\nhello\\r\\n0\\r\\n\\r\\n")
    b'hello'
    """
    out, i = [], 0
    while True:
        j = data.find(b"\r\n", i)
        if j < 0:
            break
        size = int(data[i:j].split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out.append(data[j + 2 : j + 2 + size])
        i = j + 2 + size + 2
    return b"".join(out)


# ---- the figures ---------------------------------------------------------------------------------------------
def first_success(records: list[RequestRecord], t: float, models: list[str], margin_s: float = 0.5) -> RequestRecord | None:
    """The first request of ``models`` to complete after ``t`` whose first content came after ``t + margin_s``
    (what a fault's recovery is measured to: the first answer the recovered service gave)."""
    done = [
        r
        for r in records
        if r.outcome == OK
        and r.model in models
        and r.t_end is not None
        and (r.t_first if r.t_first is not None else r.t_end) > t + margin_s
    ]
    return min(done, key=lambda r: r.t_end, default=None)


def window_latency(records: list[RequestRecord], t0: float, t1: float) -> dict:
    """p50/p99 latency of the load's completed requests sent in [t0, t1), and how many were sent and failed."""
    sent = [r for r in records if r.kind == "load" and t0 <= r.t_start < t1 and r.t_end is not None]
    lat = [r.latency for r in sent if r.outcome == OK]
    return {
        "sent": len(sent),
        "ok": len(lat),
        "errors": sum(r.outcome == ERROR for r in sent),
        "p50_s": percentile(lat, 50, digits=6),
        "p99_s": percentile(lat, 99, digits=6),
    }


def fault_rows(soak: Soak) -> list[dict]:
    """Per fault: recovery, the requests it affected, p99 latency before, during and after."""
    out = []
    w = soak.plan.window_s
    for f in soak.faults:
        row = {"fault": f.name, "index": f.index, "t_planned_s": f.t_planned, "t_s": f.t_inject, "target": f.target, "error": f.error}
        row.update(f.detail)
        if f.t_inject is None:
            out.append(row)
            continue
        first = first_success(soak.records, f.t_inject, soak.affected_models(f.name))
        recovered = first.t_end if first is not None else None
        row["recovery_s"] = None if recovered is None else round(recovered - f.t_inject, 2)
        end = max(f.t_end or f.t_inject, recovered or f.t_inject)
        row["during_s"] = round(end - f.t_inject, 2)
        touched = [r for r in soak.records if r.t_start < end and (r.t_end or math.inf) > f.t_inject]
        row["in_flight"] = sum(r.t_start <= f.t_inject < (r.t_end or math.inf) for r in soak.records)
        row["affected"] = sum(r.outcome not in (OK, ABANDONED) for r in touched)
        row["violations"] = sum(r.outcome in VIOLATIONS for r in touched)
        for name, (a, b) in {
            "before": (f.t_inject - w, f.t_inject),
            "during": (f.t_inject, max(end, f.t_inject + 1)),
            "after": (end, end + w),
        }.items():
            fig = window_latency(soak.records, a, b)
            row[f"p99_{name}_s"] = fig["p99_s"]
            row[f"sent_{name}"] = fig["sent"]
        out.append(row)
    return out


def _median_in(series: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    vals = [v for t, v in series if t0 <= t <= t1]
    return statistics.median(vals) if vals else None


TRANSIENT_ROLES = {"idle worker", "ray worker", "publish", "other"}  # come and go with the pool, not one service


def _growth(rs: list[dict], t0: float, t1: float, span_s: float) -> dict | None:
    """RSS and fd change of one process between the medians of its samples in [t0, t0 + span] and [t1 - span, t1]."""
    rss = [(r["t_s"], r["rss_mb"]) for r in rs]
    fds = [(r["t_s"], r["fds"]) for r in rs]
    a, b = _median_in(rss, t0, t0 + span_s), _median_in(rss, t1 - span_s, t1)
    fa, fb = _median_in(fds, t0, t0 + span_s), _median_in(fds, t1 - span_s, t1)
    if None in (a, b, fa, fb):
        return None
    return {"rss_from_mb": round(a, 1), "rss_to_mb": round(b, 1), "rss_growth_pct": round(100 * (b - a) / a, 2) if a else None,
            "fds_from": fa, "fds_to": fb, "fds_growth": fb - fa}  # fmt: skip


def resource_growth(rows: list[dict], t_from: float, t_to: float, span_s: float = 60.0) -> dict:
    """RSS and fd change over [t_from, t_to] (medians of the samples within ``span_s`` at either end).

    ``processes``: every process alive through the whole window. ``lives``: every process of a lasting role (idle
    workers and the like left out) over its own part of the window: from ``span_s`` after it started (a replacement
    loads its model first) or ``t_from``, to its end or ``t_to``, when that leaves at least ``2 * span_s``; a process
    replaced by a fault is judged over its own life, not summed with its successor mid-restart (a role's total
    straddling a restart compares a loading process with a loaded one). ``roles``: per role, the processes seen, how
    many were alive at either end (a role that ends with more processes than it had leaks processes), the RSS sum at
    either end, and its worst life's growth."""
    by_pid: dict[int, list[dict]] = {}
    for r in rows:
        by_pid.setdefault(r["pid"], []).append(r)
    procs, lives = [], []
    warm_before = max(t_from - span_s, min((r["t_s"] for r in rows), default=0.0))  # there by then (or from the start): warm
    for pid, rs in by_pid.items():
        ts = [r["t_s"] for r in rs]
        role = rs[-1]["role"]
        warm = min(ts) <= warm_before
        if warm and max(ts) >= t_to - span_s:
            g = _growth(rs, t_from, t_to, span_s)
            if g is not None:
                procs.append({"pid": pid, "role": role, **g})
        if role in TRANSIENT_ROLES:
            continue
        t0 = t_from if warm else max(t_from, min(ts) + span_s)
        t1 = min(t_to, max(ts))
        if t1 - t0 >= 2 * span_s:
            g = _growth(rs, t0, t1, span_s)
            if g is not None:
                lives.append({"pid": pid, "role": role, "from_s": round(t0, 1), "to_s": round(t1, 1), **g})

    def alive_at(rs: list[dict], t: float) -> bool:  # at the window's start, or within its last span
        ts = [r["t_s"] for r in rs]
        return min(ts) <= t <= max(ts) if t == t_from else max(ts) >= t - span_s

    roles = []
    for role in sorted({rs[-1]["role"] for rs in by_pid.values()} - TRANSIENT_ROLES):
        mine = {pid: rs for pid, rs in by_pid.items() if rs[-1]["role"] == role}
        sums = {}
        for end, t in (("from", t_from), ("to", t_to)):
            series: dict[float, float] = {}
            for rs in mine.values():
                for r in rs:
                    series[r["t_s"]] = series.get(r["t_s"], 0.0) + r["rss_mb"]
            lo, hi = (t, t + span_s) if end == "from" else (t - span_s, t)
            sums[end] = _median_in(sorted(series.items()), lo, hi)
        role_lives = [x for x in lives if x["role"] == role]
        worst = max(role_lives, key=lambda x: x["rss_growth_pct"] or 0, default=None)
        roles.append(
            {"role": role, "processes": len(mine), "alive_from": sum(alive_at(rs, t_from) for rs in mine.values()),
             "alive_to": sum(alive_at(rs, t_to) for rs in mine.values()),
             "rss_sum_from_mb": sums["from"] and round(sums["from"], 1), "rss_sum_to_mb": sums["to"] and round(sums["to"], 1),
             "lives": len(role_lives), "rss_growth_pct": worst["rss_growth_pct"] if worst else None, "worst_pid": worst and worst["pid"],
             "fds_growth": max((x["fds_growth"] for x in role_lives), default=None)}
        )  # fmt: skip
    return {
        "t_from_s": t_from,
        "t_to_s": t_to,
        "span_s": span_s,
        "processes": sorted(procs, key=lambda p: (p["role"], p["pid"])),
        "lives": sorted(lives, key=lambda p: (p["role"], p["from_s"], p["pid"])),
        "roles": roles,
    }


def load_figures(load: list[tuple[float, float]]) -> dict:
    """The host's 1-minute load average over the run (mean and max): how much else the CPUs were doing."""
    vals = [v for _, v in load]
    return {"load_avg_mean": round(statistics.mean(vals), 2) if vals else None, "load_avg_max": round(max(vals), 2) if vals else None}


def outcome_counts(records: list[RequestRecord]) -> dict:
    out: dict[str, int] = {}
    for r in records:
        out[r.outcome or "unfinished"] = out.get(r.outcome or "unfinished", 0) + 1
    return dict(sorted(out.items()))


def duplicate_ids(records: list[RequestRecord]) -> list[str]:
    """Response ids given to more than one request (an answer given twice)."""
    seen: dict[str, int] = {}
    for r in records:
        if r.response_id:
            seen[r.response_id] = seen.get(r.response_id, 0) + 1
    return sorted(k for k, n in seen.items() if n > 1)


def analyse(soak: Soak, recovery_targets: dict | None = None, growth_from_s: float = 300.0) -> dict:
    """Everything the report says, as one JSON-plain dict (the targets met or missed included)."""
    recs = soak.records
    dups = duplicate_ids(recs)
    for r in recs:
        if r.response_id in dups and r.outcome == OK:
            r.outcome, r.detail = "duplicated", f"response id {r.response_id} answered another request too"
    counts = outcome_counts(recs)
    violations = {k: counts.get(k, 0) for k in VIOLATIONS}
    load = [r for r in recs if r.kind == "load" and r.t_end is not None]
    oks = [r for r in load if r.outcome == OK]
    duration = soak.plan.duration_s
    faults = fault_rows(soak)
    targets = recovery_targets or {"replica_kill": 30.0, "worker_kill": 30.0, "node_removal": 60.0}
    t_end = max((r["t_s"] for r in soak.sampler.rows), default=duration)
    t_from = min(growth_from_s, t_end / 2)
    growth = resource_growth(soak.sampler.rows, t_from, t_end, span_s=min(60.0, (t_end - t_from) / 4))  # a short run: shorter spans
    greedy = [r for r in recs if r.check in ("match", "mismatch")]
    seeded = [r for r in recs if r.check in ("consistent", "inconsistent")]
    hangups = [r for r in recs if r.kind == "hangup"]
    injected = {}
    for f in soak.faults:
        if f.t_inject is not None and f.error is None:
            injected[f.name] = injected.get(f.name, 0) + 1
    checks = {
        "requests": len(recs),
        "violations": sum(violations.values()),
        "greedy_checked": len(greedy),
        "greedy_mismatched": sum(r.check == "mismatch" for r in greedy),
        "seeded_checked": len(seeded),
        "seeded_inconsistent": sum(r.check == "inconsistent" for r in seeded),
        "duplicate_ids": dups[:10],
        "hangups_cancelled": sum(r.check == "cancelled" for r in hangups),
        "hangups": len(hangups),
        "drained": soak.drain.get("drained"),
    }
    target_rows = []
    for name, limit in targets.items():
        vals = [f["recovery_s"] for f in faults if f["fault"] == name and f.get("t_s") is not None]
        if vals:
            worst = None if None in vals else max(vals)
            target_rows.append({"target": f"{name} recovery <= {limit:.0f}s", "value": worst, "met": worst is not None and worst <= limit})
    redis = [f for f in faults if f["fault"] == "redis_restart" and f.get("t_s") is not None and not f.get("error")]
    if redis:
        ok = all(f.get("publish_one_line") and f.get("results_kept") and f.get("entries_kept") for f in redis)
        target_rows.append({"target": "publish during a Redis restart: succeeds or one line, results kept", "value": len(redis), "met": ok})
    summary = {
        "run": {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(soak.wall_start)),
            "duration_s": duration,
            "plan": asdict(soak.plan),
            "mix": asdict(soak.mix),
            "prompts": len(soak.prompts),
            "arrivals_over_ceiling": soak.arrivals_over_ceiling,
            "host": {"cpus": os.cpu_count(), **load_figures(soak.sampler.load)},
            "cluster": {"removed_nodes": len(soak.cluster.removed), "added_nodes": soak.cluster.added, "logs": soak.cluster.session_logs()}
            if soak.cluster
            else None,
        },
        "outcomes": counts,
        "violations": violations,
        "checks": checks,
        "throughput": {
            "load_requests": len(load),
            "load_ok": len(oks),
            "tokens_per_s": sum(r.tokens or 0 for r in oks) / duration if duration else None,
            "latency_p50_s": percentile([r.latency for r in oks], 50, digits=6),
            "latency_p99_s": percentile([r.latency for r in oks], 99, digits=6),
            "streams_mean": sum(r.latency for r in load) / duration if duration else None,
        },
        "faults_injected": injected,
        "faults": faults,
        "resources": growth,
        "drain": soak.drain,
        "targets": target_rows,
    }
    summary["targets"] += resource_targets(summary)
    return summary


# ---- writing it down -------------------------------------------------------------------------------------------
def _f(v, fmt="{:.1f}", none="-") -> str:
    return none if v is None else fmt.format(v)


def report_markdown(summary: dict, plot_name: str | None = "soak.png") -> str:
    """The run's tables in Markdown: outcomes, faults, resources, targets."""
    from evaluation.markdown import markdown_table

    run, th, ch = summary["run"], summary["throughput"], summary["checks"]
    host = run.get("host") or {}
    where = f"{run.get('model', 'the model')} float32 on {host.get('cpus', '?')} CPUs" + (
        f" (1-minute load average {host['load_avg_mean']:.1f} on average, {host['load_avg_max']:.1f} at most)"
        if host.get("load_avg_mean") is not None
        else ""
    )
    lines = [
        f"Soak of {run['duration_s'] / 60:.0f} min started {run['started']}, {where}: {ch['requests']} requests "
        f"({th['load_requests']} of the steady load at {run['plan']['min_streams']}-{run['plan']['max_streams']} streams, "
        f"{th['tokens_per_s']:.1f} tok/s, p99 {_f(th['latency_p99_s'])} s), faults injected: "
        + ", ".join(f"{k} x{v}" for k, v in summary["faults_injected"].items())
        + ".",
        "",
        markdown_table(["outcome", "requests"], [[k, str(v)] for k, v in summary["outcomes"].items()]),
        "",
        f"Violations (lost, hung, bad error, duplicated, mixed, wrong output, malformed): **{ch['violations']}**. "
        f"Greedy answers checked against the same request alone in float32: {ch['greedy_checked']}, "
        f"{ch['greedy_mismatched']} differ; seeded answers checked against their repeats: {ch['seeded_checked']}, "
        f"{ch['seeded_inconsistent']} differ; clients that hung up and whose generation was cancelled: "
        f"{ch['hangups_cancelled']} of {ch['hangups']}; ingress and engine drained at the end: {ch['drained']}.",
        "",
    ]
    rows = []
    for f in summary["faults"]:
        if f.get("t_s") is None:
            rows.append([f["fault"], "-", "-", "-", "-", "-", "-", "-", f.get("error") or ""])
            continue
        note = f.get("error") or f["target"]
        if f["fault"] == "redis_restart" and not f.get("error"):
            note += f"; publish exit {f.get('publish_exit')}, one line {f.get('publish_one_line')}, results kept {f.get('results_kept')}"
        if f["fault"] == "queue_fill" and not f.get("error"):
            note += f"; {f.get('answered_429')} answered 429"
        if f["fault"] == "slow_reader" and not f.get("error"):
            note += f"; slow stream {f.get('slow_outcome')} in {f.get('slow_s')}s, hung-up one {f.get('hangup_server_state')}"
        rows.append(
            [f["fault"], _f(f["t_s"], "{:.0f}"), _f(f.get("recovery_s")), str(f["in_flight"]), str(f["affected"]), str(f["violations"]),
             f"{_f(f.get('p99_before_s'))} / {_f(f.get('p99_during_s'))} / {_f(f.get('p99_after_s'))}", _f(f.get("during_s")), note]
        )  # fmt: skip
    head = ["fault", "at s", "recovery s", "in flight", "affected", "violations", "p99 s before / during / after", "during s", "what"]
    lines += [markdown_table(head, rows), ""]
    g = summary["resources"]
    res_rows = [
        [r["role"], str(r["processes"]), f"{r['alive_from']} / {r['alive_to']}", _f(r["rss_sum_from_mb"]), _f(r["rss_sum_to_mb"]),
         _f(r["rss_growth_pct"], "{:+.1f}%") + (f" (pid {r['worst_pid']})" if r.get("worst_pid") else ""), _f(r["fds_growth"], "{:+.0f}")]
        for r in g["roles"]
    ]  # fmt: skip
    lines += [
        f"RSS and open fds by role from minute {g['t_from_s'] / 60:.1f} to the end, minute {g['t_to_s'] / 60:.1f} (medians over "
        f"{g['span_s']:.0f} s). Growth is each process's over its own life in that window (from {g['span_s']:.0f} s after it "
        "started, when a fault replaced it, to its end); the worst of the role's processes is shown:",
        "",
        markdown_table(["role", "processes", "alive from / end", "RSS MB sum from", "RSS MB sum end", "worst growth", "fds"], res_rows),
        "",
    ]
    procs = g["processes"]
    if procs:
        worst = max(procs, key=lambda p: p["rss_growth_pct"] or 0)
        fd_worst = max(procs, key=lambda p: p["fds_growth"])
        lines += [
            f"{len(procs)} processes lived through the whole window: the largest RSS growth {worst['rss_growth_pct']:+.1f}% "
            f"({worst['role']}, pid {worst['pid']}, {worst['rss_from_mb']:.0f} -> {worst['rss_to_mb']:.0f} MB), the largest fd "
            f"change {fd_worst['fds_growth']:+.0f} ({fd_worst['role']}, pid {fd_worst['pid']}).",
            "",
        ]
    if summary["targets"]:
        lines += [
            markdown_table(
                ["target", "figure", "met"],
                [[t["target"], _f(t["value"], "{}"), "yes" if t["met"] else "**no**"] for t in summary["targets"]],
            ),
            "",
        ]
    if plot_name:
        lines.append(f"![latency, RSS and fds over the run]({plot_name})")
    return "\n".join(lines)


def resource_targets(summary: dict, limit_pct: float = 5.0) -> list[dict]:
    """The RSS and fd targets over the growth window: every process (each over its own life in the window: see
    :func:`resource_growth`), and no role ending with more processes than it had (leaked processes)."""
    g = summary["resources"]
    lives = g.get("lives", g["processes"])
    if not lives:
        return []
    worst = max(lives, key=lambda p: p["rss_growth_pct"] or 0)
    fd_up = [p for p in lives if p["fds_growth"] > 0]
    out = [
        {"target": f"RSS growth < {limit_pct:.0f}% for every process (minute {g['t_from_s'] / 60:.0f} to {g['t_to_s'] / 60:.0f}, "
         "each over its own life there)",
         "value": f"{worst['rss_growth_pct']:+.1f}% ({worst['role']}, pid {worst['pid']})",
         "met": (worst["rss_growth_pct"] or 0) < limit_pct},
        {"target": "no fd growth in any process", "value": f"{len(fd_up)} grew" + (f" (max {max(p['fds_growth'] for p in fd_up):+.0f}, "
         f"{max(fd_up, key=lambda p: p['fds_growth'])['role']})" if fd_up else ""), "met": not fd_up},
    ]  # fmt: skip
    more = [r for r in g["roles"] if "alive_to" in r and r["alive_to"] > r["alive_from"] > 0]
    if g["roles"] and "alive_to" in g["roles"][0]:
        out.append(
            {"target": "no role ends with more processes than it had (none leaked)",
             "value": ", ".join(f"{r['role']} {r['alive_from']} -> {r['alive_to']}" for r in more) or "none", "met": not more}
        )  # fmt: skip
    return out


def plot(soak: Soak, summary: dict, path: Path) -> Path:
    """Latency of every request over time (faults marked), and RSS and fds of each role."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(14, 11), sharex=True)
    ax = axes[0]
    colors = {OK: "tab:blue", ERROR: "tab:orange", ABANDONED: "tab:gray"}
    for outcome in sorted({r.outcome for r in soak.records if r.t_end is not None}):
        rs = [r for r in soak.records if r.outcome == outcome and r.t_end is not None]
        ax.scatter(
            [r.t_start / 60 for r in rs], [r.latency for r in rs], s=6, color=colors.get(outcome, "tab:red"), label=f"{outcome} ({len(rs)})"
        )
    ax.set_ylabel("request latency (s)")
    ax.set_yscale("log")
    for a in axes:
        for f in summary["faults"]:
            if f.get("t_s") is not None:
                a.axvline(f["t_s"] / 60, color="tab:red", alpha=0.3, lw=1)
    for f in summary["faults"]:
        if f.get("t_s") is not None:
            ax.text(f["t_s"] / 60, ax.get_ylim()[1], f["fault"], rotation=90, va="top", ha="right", fontsize=7, color="tab:red")
    by_role: dict[str, dict[float, list[float]]] = {}
    for r in soak.sampler.rows:
        if r["role"] in TRANSIENT_ROLES:
            continue
        slot = by_role.setdefault(r["role"], {}).setdefault(r["t_s"], [0.0, 0.0])
        slot[0] += r["rss_mb"]
        slot[1] += r["fds"]
    palette = plt.get_cmap("tab20")
    for i, (role, series) in enumerate(sorted(by_role.items())):
        ts = sorted(series)
        style = {"lw": 1.2, "color": palette(i % 20), "ls": ("-", "--", ":")[i // 20 % 3], "label": role}
        axes[1].plot([t / 60 for t in ts], [series[t][0] for t in ts], **style)
        axes[2].plot([t / 60 for t in ts], [series[t][1] for t in ts], **style)
    axes[1].set_ylabel("RSS (MB, sum per role)")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("open fds (sum per role)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("minutes")
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.suptitle("specray soak: requests under faults, and every process's memory and file descriptors")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(soak: Soak, summary: dict, out: Path) -> dict[str, Path]:
    """requests.parquet (one row per request), processes.parquet (one row per process and sample), faults.parquet,
    summary.json, report.md and soak.png under ``out``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "requests": out / "requests.parquet",
        "processes": out / "processes.parquet",
        "faults": out / "faults.parquet",
        "summary": out / "summary.json",
        "report": out / "report.md",
        "plot": out / "soak.png",
    }
    rows = [{**asdict(r), "latency_s": r.latency} for r in soak.records]
    pq.write_table(pa.Table.from_pylist(rows) if rows else pa.table({}), paths["requests"])
    pq.write_table(pa.Table.from_pylist(soak.sampler.rows) if soak.sampler.rows else pa.table({}), paths["processes"])
    frows = [{k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in f.items()} for f in summary["faults"]]
    pq.write_table(pa.Table.from_pylist(frows) if frows else pa.table({}), paths["faults"])
    paths["summary"].write_text(json.dumps(summary, indent=1, default=str))
    plot(soak, summary, paths["plot"])
    paths["report"].write_text(report_markdown(summary, paths["plot"].name) + "\n")
    return paths
