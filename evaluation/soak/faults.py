"""The faults of a soak, injected at their times while the load runs, and the wait for each one's recovery."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from evaluation.soak.answers import (
    ABANDONED,
    ERROR,
    OK,
    RequestRecord,
    Verdict,
    classify_plain,
    classify_stream,
    dechunk,
    path_of,
    sse_payloads,
)
from evaluation.soak.plan import FaultRecord, log
from evaluation.soak.processes import find_pids


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


class FaultInjection:
    """The faults' half of :class:`evaluation.soak.harness.Soak` (a mixin): :meth:`chaos` injects the plan's faults
    while the load runs, each through the soak's own clock, records, requests and services."""

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
