"""Start a real ``redis-server`` for a test: free loopback port, temp dir, no persistence.

    with redis_server() as url:   # "redis://127.0.0.1:PORT/0"
        ...

When the binary is missing the test is skipped, except under CI (``CI`` set),
where .ci/run installs it and a missing binary is a failure.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def closed_port() -> int:
    """A loopback port nothing listens on (bound then released, so refused right away)."""
    return free_port()


def _binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        reason = "redis-server is not installed (apt-get install -y redis-server)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI must install it", pytrace=False)
        pytest.skip(reason)
    return path


def _ping(port: int) -> bool:
    """Speak RESP by hand so the helper does not depend on the client under test."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def redis_server(startup_timeout: float = 15.0) -> Iterator[str]:
    binary = _binary()
    workdir = Path(tempfile.mkdtemp(prefix="specray-redis-"))
    proc = None
    try:
        for _attempt in range(3):  # the free port can be taken between probe and bind: retry
            port = free_port()
            log = workdir / f"redis-{port}.log"
            proc = subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "", "--appendonly", "no"]
                + ["--daemonize", "no", "--logfile", str(log), "--databases", "2"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
            deadline = time.monotonic() + startup_timeout
            while time.monotonic() < deadline and proc.poll() is None and not _ping(port):
                time.sleep(0.05)
            if proc.poll() is None and _ping(port):
                break
            _stop(proc)
            proc = None
        if proc is None:
            text = "\n".join(p.read_text(errors="replace")[-2000:] for p in workdir.glob("*.log"))
            pytest.fail(f"redis-server did not answer PING within {startup_timeout}s:\n{text}", pytrace=False)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
