"""`ray job submit --working-dir .` against a real `ray start --head` cluster with token authentication on.

How a job client authenticates (Ray 2.60): with ``RAY_AUTH_MODE=token`` in its environment, ``ray job submit``
sends ``Authorization: Bearer <token>``, the token read from ``RAY_AUTH_TOKEN``, else the file named by
``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token`` (``ray get-auth-token`` prints it on the head). The cluster
here gets its own random token through the same variables, so the test neither reads nor writes ~/.ray.

The cluster is this test's own: its own ports and temp dir, started with ``--block`` in a new process group
that the test ends (never ``ray stop``, which would stop every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
RAY = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))

pytestmark = pytest.mark.cluster


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="module")
def head():
    """A one-node cluster started with `ray start --head --block`, token auth on; yields (dashboard URL, env with the token)."""
    token = secrets.token_hex(16)
    temp = tempfile.mkdtemp(prefix="rj-", dir="/tmp")  # short: Ray's socket paths live under it
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_USAGE_STATS_ENABLED="0")
    gcs, dash, client, agent_http, agent_grpc, nm, om, metrics, rtenv = free_ports(9)
    cmd = [
        RAY, "start", "--head", "--block", "--num-cpus=3", "--num-gpus=0", f"--temp-dir={temp}",
        f"--port={gcs}", "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--node-manager-port={nm}", f"--object-manager-port={om}", f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={rtenv}",
    ]  # fmt: skip
    log = open(Path(temp) / "ray-start.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=temp)
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ray start exited {proc.returncode}: {(Path(temp) / 'ray-start.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/api/jobs/", headers={"Authorization": f"Bearer {token}"}, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the dashboard did not answer within 180 s")
            time.sleep(2)
        yield url, env, token
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)  # our own process group: ray start and what it spawned
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def ray_job(env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([RAY, "job", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_the_cluster_refuses_a_client_without_the_token(head):
    url, env, token = head
    assert httpx.get(f"{url}/api/jobs/", timeout=10).status_code == 401
    assert httpx.get(f"{url}/api/jobs/", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 403
    no_token = {k: v for k, v in env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    out = ray_job(no_token, "list", "--address", url, timeout=120)
    assert out.returncode != 0 and "authentication" in (out.stdout + out.stderr).lower()


def test_generate_job_with_working_dir(head, tiny_model_dir):
    url, env, _ = head
    sid = f"specray-test-{secrets.token_hex(4)}"
    entry = [
        "python", "-m", "jobs.generate", "--model", str(tiny_model_dir), "--method", "ngram", "--dtype", "float32",
        "--prompt", "the cat sat on the mat and the cat", "--max-new-tokens", "8", "--threads", "1", "--json",
    ]  # fmt: skip
    t0 = time.monotonic()
    out = ray_job(env, "submit", "--address", url, "--submission-id", sid, "--working-dir", ".", "--", *entry)
    wall = time.monotonic() - t0
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    status = ray_job(env, "status", "--address", url, sid, timeout=120)
    assert f"Job '{sid}' succeeded" in status.stdout, status.stdout + status.stderr
    logs = ray_job(env, "logs", "--address", url, sid, timeout=120).stdout
    (line,) = [ln for ln in logs.splitlines() if ln.startswith("{") and '"method"' in ln]
    result = json.loads(line)
    assert result["method"] == "ngram" and result["stats"]["new_tokens"] == len(result["token_ids"]) == 8
    # the job ran in the uploaded copy of the working dir, not in this checkout
    info = httpx.get(f"{url}/api/jobs/{sid}", headers={"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"}, timeout=10).json()
    assert info["status"] == "SUCCEEDED" and info["runtime_env"]["working_dir"].startswith("gcs://")
    print(f"job {sid}: submit to success {wall:.1f}s, {result['stats']['tokens_per_s']:.1f} tokens/s")


def test_bench_tune_and_train_drafter_jobs_leave_their_artifacts_where_the_readme_says(head, tiny_model_dir, tmp_path):
    """Three short jobs at once on the same cluster (``--no-wait``), then their logs and artifacts: bench under its
    absolute ``--out``, tune and train-drafter under the job's ``$SPECRAY_HOME`` (set with ``--runtime-env-json``)."""
    from tiny_models import write_prompts

    url, env, token = head
    home, bench_out = tmp_path / "home", tmp_path / "bench"
    prompts = str(write_prompts(tmp_path / "q.jsonl", cats=("writing", "qa")))
    common = ["--model", str(tiny_model_dir), "--prompts", prompts, "--max-new-tokens", "8", "--threads", "1"]
    jobs = {
        "bench": ["python", "-m", "jobs.bench", *common, "--dtype", "float32", "--methods", "ar,ngram", "--limit", "1",
                  "--warmup", "0", "--out", str(bench_out), "--json"],
        "tune": ["python", "-m", "jobs.tune", *common, "--dtype", "float32", "--methods", "ngram", "--num-samples", "1",
                 "--limit", "1", "--warmup", "0", "--name", "job-tune", "--verbose", "0", "--json"],
        "train": ["python", "-m", "jobs.train_drafter", *common, "--recipe", "kangaroo", "--knob", "exit_layer=1", "--steps", "4",
                  "--batch", "2", "--limit", "1", "--data-dtype", "float32", "--name", "job-kangaroo", "--no-progress", "--json"],
    }  # fmt: skip
    runtime_env = json.dumps({"env_vars": {"SPECRAY_HOME": str(home)}})
    ids = {name: f"specray-{name}-{secrets.token_hex(3)}" for name in jobs}
    t0 = time.monotonic()
    for name, entry in jobs.items():
        out = ray_job(env, "submit", "--address", url, "--submission-id", ids[name], "--no-wait", "--working-dir", ".",
                      "--runtime-env-json", runtime_env, "--", *entry)  # fmt: skip
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    headers = {"Authorization": f"Bearer {token}"}
    status: dict = {}
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline:
        status = {n: httpx.get(f"{url}/api/jobs/{sid}", headers=headers, timeout=10).json()["status"] for n, sid in ids.items()}
        if all(s in ("SUCCEEDED", "FAILED", "STOPPED") for s in status.values()):
            break
        time.sleep(3)
    wall = time.monotonic() - t0
    logs = {n: ray_job(env, "logs", "--address", url, sid, timeout=120).stdout for n, sid in ids.items()}
    for n in jobs:
        assert status[n] == "SUCCEEDED", f"{n}: {status[n]}\n{logs[n][-3000:]}"

    bench = json.loads(logs["bench"][logs["bench"].index("{") :])
    assert set(bench["methods"]) >= {"ar", "ngram"}
    assert (bench_out / "summary.json").is_file() and list(bench_out.glob("generations/run=*/method=ngram/*.parquet"))
    assert list(bench_out.glob("traces/run=*/method=ngram/*.parquet"))

    exp = home / "tune" / "job-tune"
    assert (exp / "trials.parquet").is_file() and (exp / "best.json").is_file() and (exp / "specray_tune.json").is_file()
    assert json.loads((exp / "best.json").read_text())["best"]["config"]["method"] == "ngram"

    art = home / "drafters" / "job-kangaroo"
    assert (art / "drafter.safetensors").is_file() and json.loads((art / "drafter.json").read_text())["recipe"] == "kangaroo"
    assert (home / "drafter-data").is_dir()
    print(f"bench, tune and train-drafter jobs: submitted to all three succeeded in {wall:.1f}s")
