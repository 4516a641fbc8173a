"""`specray registry list|show|delete|put`: round trip on both stores, one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from redis_server import closed_port, redis_server
from tests_support import assert_one_line_error

from jobs.registry import main

REPO = Path(__file__).resolve().parents[2]
NAME = "smollm2-135m/spec_bench/ngram"
HW = '{"cpu": "test", "cores": 2}'  # skip describe_hardware (imports torch) where it does not matter


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as url:
        yield url


@pytest.fixture(params=["file", "redis"])
def registry(request, tmp_path, monkeypatch):
    """The --registry value of a fresh, empty store."""
    monkeypatch.delenv("SPECRAY_REDIS_URL", raising=False)
    monkeypatch.setenv("SPECRAY_HOME", str(tmp_path / "home"))
    if request.param == "file":
        return str(tmp_path / "reg")
    import redis

    url = request.getfixturevalue("redis_url")
    redis.Redis.from_url(url).flushdb()  # the CLI uses the default namespace: start each test empty
    return url


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"method": "ngram", "k": 6, "ngram_max": 4}))
    return str(path)


def cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_put_list_show_delete_round_trip(registry, config_file, capsys):
    metrics = '{"speedup": 1.83, "tokens_per_s": 61.25, "mean_accepted_tokens": 2.4}'
    rc, out, err = cli(capsys, "put", NAME, "--config", config_file, "--metrics", metrics, "--hardware", HW, "--registry", registry)
    assert rc == 0, err
    assert f"stored {NAME} version 1" in out
    rc, out, _ = cli(capsys, "put", NAME, "--config", config_file, "--set", "k=3", "--hardware", HW, "--registry", registry, "--json")
    assert rc == 0 and json.loads(out) == {"name": NAME, "version": 2, "op": "put"}

    rc, out, _ = cli(capsys, "list", "--registry", registry)
    assert rc == 0
    header, row = out.strip().splitlines()
    assert header.split() == ["name", "method", "version", "speedup", "tokens/s", "created_at", "status"]
    assert row.split()[:5] == [NAME, "ngram", "2", "-", "-"] and row.split()[-1] == "ok"

    cli(capsys, "put", "mine/fast", "--config", config_file, "--metrics", metrics, "--hardware", HW, "--registry", registry)
    rc, out, _ = cli(capsys, "list", "--registry", registry, "--json")
    rows = json.loads(out)
    assert [(r["name"], r["version"], r["status"], r["speedup"], r["tokens_per_s"]) for r in rows] == [
        ("mine/fast", 1, "ok", 1.83, 61.25),
        (NAME, 2, "ok", None, None),
    ]
    rc, out, _ = cli(capsys, "list", "--registry", registry)
    assert "1.83" in out and "61.2" in out  # formatted figures in the table

    rc, out, _ = cli(capsys, "show", NAME, "--registry", registry, "--json")
    shown = json.loads(out)
    assert rc == 0 and len(out.strip().splitlines()) == 1
    assert (shown["name"], shown["version"], shown["config"]["k"], shown["config"]["ngram_max"]) == (NAME, 2, 3, 4)
    assert shown["hardware"] == {"cpu": "test", "cores": 2} and shown["source"]["config_file"].endswith("cfg.json")
    rc, out, _ = cli(capsys, "show", NAME, "--registry", registry)
    assert rc == 0 and json.loads(out) == shown and len(out.splitlines()) > 5  # indented

    rc, out, _ = cli(capsys, "delete", NAME, "--registry", registry)
    assert rc == 0 and f"deleted {NAME} (version 2)" in out
    rc, _, err = cli(capsys, "show", NAME, "--registry", registry)
    assert_one_line_error(rc, err, f"no registry entry '{NAME}'")
    rc, _, err = cli(capsys, "delete", NAME, "--registry", registry)
    assert_one_line_error(rc, err, f"no registry entry '{NAME}'")
    rc, out, _ = cli(capsys, "list", "--registry", registry, "--json")
    assert [r["name"] for r in json.loads(out)] == ["mine/fast"]


def test_default_put_describes_this_machine(registry, config_file, capsys):
    assert cli(capsys, "put", "hw/test", "--config", config_file, "--registry", registry)[0] == 0
    rc, out, _ = cli(capsys, "show", "hw/test", "--registry", registry, "--json")
    hw = json.loads(out)["hardware"]
    assert rc == 0 and hw["cores"] >= 1 and hw["torch"] and "gpus" in hw


def test_corrupt_entry_flagged_in_list_and_refused_by_show(registry, config_file, capsys):
    for name in ("m/w/ngram", "m/w/sps"):
        assert cli(capsys, "put", name, "--config", config_file, "--hardware", HW, "--registry", registry)[0] == 0
    bad = json.dumps({"name": "m/w/ngram", "version": 1, "config": {"method": "ngram", "k": -1}})
    if registry.startswith("redis://"):
        import redis

        redis.Redis.from_url(registry).set("specray:registry:entry:m/w/ngram", bad)
    else:
        (Path(registry) / "entries" / "m%2Fw%2Fngram.json").write_text(bad)
    rc, _, err = cli(capsys, "show", "m/w/ngram", "--registry", registry)
    assert_one_line_error(rc, err, "'m/w/ngram'", "corrupt", "k: draft length must be >= 1")
    rc, out, err = cli(capsys, "list", "--registry", registry)
    assert rc == 0, err
    status = {ln.split()[0]: ln.split()[-1] for ln in out.splitlines()[1:3]}
    assert status == {"m/w/ngram": "corrupt", "m/w/sps": "ok"}
    assert "corrupt m/w/ngram: invalid config: k: draft length" in out
    assert cli(capsys, "show", "m/w/sps", "--registry", registry)[0] == 0


def test_env_var_selects_redis(redis_url, config_file, tmp_path, monkeypatch, capsys):
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    monkeypatch.setenv("SPECRAY_REDIS_URL", redis_url)
    monkeypatch.setenv("SPECRAY_HOME", str(tmp_path / "home"))
    assert cli(capsys, "put", "env/picked", "--config", config_file, "--hardware", HW)[0] == 0
    assert redis.Redis.from_url(redis_url).exists("specray:registry:entry:env/picked") == 1
    assert not (tmp_path / "home" / "registry").exists()
    rc, out, _ = cli(capsys, "list", "--json")
    assert rc == 0 and [r["name"] for r in json.loads(out)] == ["env/picked"]


def test_file_store_is_the_default(config_file, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SPECRAY_REDIS_URL", raising=False)
    monkeypatch.setenv("SPECRAY_HOME", str(tmp_path / "home"))
    assert cli(capsys, "put", "home/default", "--config", config_file, "--hardware", HW)[0] == 0
    assert (tmp_path / "home" / "registry" / "entries" / "home%2Fdefault.json").is_file()
    rc, out, _ = cli(capsys, "list")
    assert rc == 0 and "home/default" in out


def test_unreachable_redis_exits_2_with_the_url(config_file, capsys):
    url = f"redis://127.0.0.1:{closed_port()}/0"
    for argv in (["list"], ["show", "a/b"], ["delete", "a/b"], ["put", "a/b", "--config", config_file, "--hardware", HW]):
        rc, _, err = cli(capsys, *argv, "--registry", url)
        assert_one_line_error(rc, err, url, "unreachable")


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["show", "a//b"], ["invalid registry name 'a//b'", "empty segment"]),
        (["put", "a/../b", "--config", "CFG"], ["'a/../b'"]),
        (["put", "a/b", "--config", "/nonexistent/cfg.json"], ["/nonexistent/cfg.json"]),
        (["put", "a/b", "--config", "CFG", "--set", "k=0"], ["k"]),
        (["put", "a/b", "--config", "CFG", "--metrics", "[1, 2]"], ["--metrics", "JSON object"]),
        (["put", "a/b", "--config", "CFG", "--metrics", "{bad"], ["--metrics"]),
        (["put", "a/b", "--config", "CFG", "--metrics", '{"speedup": NaN}', "--hardware", HW], ["'a/b'", "finite number"]),
        (["put", "a/b", "--config", "CFG", "--metrics", '{"speedup": "fast"}', "--hardware", HW], ["'a/b'", "finite number"]),
        (["put", "a/b", "--config", "CFG", "--metrics", '{"other": NaN}', "--hardware", HW], ["'a/b'", "plain JSON"]),
        (["show"], ["name"]),
        (["frobnicate"], ["frobnicate"]),
        ([], ["required"]),
        (["list", "--registry", "http://example.com"], ["unsupported registry URL"]),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, needles, config_file, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SPECRAY_REDIS_URL", raising=False)
    monkeypatch.setenv("SPECRAY_HOME", str(tmp_path / "home"))
    argv = [config_file if a == "CFG" else a for a in argv]
    rc, _, err = cli(capsys, *argv)
    assert_one_line_error(rc, err, *needles)
    assert not (tmp_path / "home" / "registry" / "entries").exists() or not any((tmp_path / "home" / "registry" / "entries").iterdir())


def test_console_script_dispatch_in_a_subprocess(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "SPECRAY_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}

    def run(*argv):
        cmd = [sys.executable, "-m", "jobs.cli", "registry", *argv]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)

    proc = run("show", "no/such")
    assert_one_line_error(proc.returncode, proc.stderr, "no registry entry 'no/such'")
    proc = run("list")
    assert proc.returncode == 0 and "no entries in" in proc.stdout, proc.stderr
