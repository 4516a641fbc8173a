"""cluster.runtime: the embedded Ray listens on loopback only with token authentication on; a dead address fails fast."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis_server import closed_port

from cluster.runtime import check_reachable, connect
from decoding.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, os, psutil, ray
from cluster.runtime import connect, shutdown_if_started_here
info = connect(None, num_cpus=1)
@ray.remote
def ping():
    return os.getpid()
ray.get(ping.remote())  # a worker process is up too
from ray._private.authentication.authentication_utils import is_token_auth_enabled
me = psutil.Process()
pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
listening = sorted({c.laddr.ip for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pids})
count = sum(1 for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pids)
print(json.dumps({"address": info["address"], "embedded": info["embedded"], "listening": listening, "count": count,
                  "token_auth": is_token_auth_enabled()}))
shutdown_if_started_here()
"""


@pytest.mark.cluster
def test_embedded_ray_binds_loopback_and_keeps_token_auth():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["embedded"] and info["address"].startswith("127.0.0.1:"), info
    assert info["count"] >= 4, info  # GCS, raylet, worker, agents: all found and all on loopback
    assert set(info["listening"]) <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, info
    assert info["token_auth"] is True, info


def test_unreachable_address_fails_within_seconds():
    port = closed_port()
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        connect(f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 10
    assert e.value.field == "address" and f"127.0.0.1:{port}" in str(e.value)
    for bad in ("nonsense", "host:port", "ray://:1", "999.1.1.1:6379"):
        with pytest.raises(ConfigError, match="address"):
            check_reachable(bad, timeout_s=2.0)
