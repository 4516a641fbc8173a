"""`specray serve`: bad input exits 2 with one line; a real run prints the URL and models, serves, and stops on Ctrl-C."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from redis_server import free_port

from cluster.registry import Entry, open_registry
from decoding.config import SpecConfig
from jobs.serve import main, read_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--port", "70000"], "--port"),
        (["--set", "max_queued_requests=0"], "max_queued_requests"),
        (["--set", "no_such_setting=1"], "no_such_setting"),
        (["--dtype", "float16"], "dtype"),
        (["--config", "/nonexistent/serve.yaml"], "/nonexistent/serve.yaml"),
        (["--registry", "ftp://example"], "ftp://example"),
        (["--bogus"], "--bogus"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, needle, capsys):
    rc = main(args)  # all fail before Ray starts
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and needle in lines[0], err


def test_infra_serve_yaml_is_a_valid_serve_config():
    from serving.app import app_builder
    from serving.settings import ServeSettings

    data = yaml.safe_load((REPO / "infra" / "serve.yaml").read_text())
    app = data["applications"][0]
    assert app["import_path"] == "serving.app:app_builder" and app["route_prefix"] == "/"
    args, http = read_config(str(REPO / "infra" / "serve.yaml"))
    settings = ServeSettings.from_dict(args)  # every arg is a known, valid setting
    assert settings.base_model == "smollm2-135m" and http["port"] == 8000
    assert type(app_builder(args)).__name__ == "Application"


@pytest.mark.cluster
def test_serve_command_serves_and_stops_on_ctrl_c(tmp_path, tiny_model_dir):
    reg = open_registry(tmp_path / "reg")
    reg.put(Entry("tiny/cli/ngram", SpecConfig(method="ngram", dtype="float32", model=str(tiny_model_dir)), metrics={"speedup": 1.3}))
    port = free_port()
    cmd = [sys.executable, "-m", "jobs.serve", "--config", str(REPO / "infra" / "serve.yaml"), "--registry", str(tmp_path / "reg")]
    cmd += ["--base-model", str(tiny_model_dir), "--dtype", "float32", "--port", str(port), "--num-replicas", "1", "--set", "threads=1"]
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        out = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            out.append(line)
            if "Ctrl-C to stop" in line:
                break
        text = "".join(out)
        assert "Ctrl-C to stop" in text, text
        assert f"http://127.0.0.1:{port}/v1" in text
        assert "tiny/cli/ngram  [ngram v1 speedup 1.30]" in text and str(tiny_model_dir) in text
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny/cli/ngram", str(tiny_model_dir)]
            r = c.post("/v1/completions", json={"model": "tiny/cli/ngram", "prompt": "Hello", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)  # nothing listens any more
