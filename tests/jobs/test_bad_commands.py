"""The command corpus of the fuzz test: bad flags and values for every command.

Each must exit 2 with one line on stderr, no traceback, within seconds (an
unreachable ``--address`` included), and write nothing outside its ``--out``.
The HTTP corpus is tests/serving/test_fuzz.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from redis_server import closed_port

REPO = Path(__file__).resolve().parents[2]


def command_cases(tiny: str, tmp: Path) -> list[list[str]]:
    afile = tmp / "a-file"
    afile.write_text("x")
    port = closed_port()
    noweights = tmp / "no-weights"  # a model directory whose config reads but that holds no weights
    noweights.mkdir()
    (noweights / "config.json").write_text((Path(tiny) / "config.json").read_text())
    broken = tmp / "broken-config"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    truncated = tmp / "truncated-weights"  # everything there, but the weights file cut short
    shutil.copytree(tiny, truncated)
    weights = next(truncated.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:200])
    gen = ["generate", "--model", tiny, "--max-new-tokens", "2"]
    broken_model = [[*gen[:1], "--model", str(d), "--prompt", "hi", "--max-new-tokens", "2"] for d in (broken, noweights, truncated)]
    return [
        *broken_model,  # a model directory that does not load: one line naming it, whatever transformers raised
        ["serve", "--base-model", str(truncated)],
        [*gen, "--prompt", "hi", "--threads", "100000"],
        ["train-drafter", "--recipe", "eagle", "--lr", "nan", "--model", tiny],
        ["ship-drafters", "--steps-scale", "nan"],
        ["ship-drafters", "--shipped", str(afile)],
        ["bench-training", "--model", "no-such-model"],
        ["serve", "--base-model", tiny, "--drain-timeout-s", "nan"],
        ["bench-serve", "--model", tiny, "--out", str(afile)],
        ["bench-http", "--model", tiny, "--repeats", "0"],
        ["bench-device", "--model", tiny, "--readme", str(tmp)],
        ["bench", "--methods", "ar", "--model", tiny, "--prompts", str(tmp)],
        ["tune", "--methods", "ngram", "--model", tiny, "--gpus-per-trial", "-1"],
        ["distill", "--out", str(tmp / "d"), "--max-minutes", "3"],
        ["bench-serve", "--model", tiny, "--slo-ttft-s", "-1"],
        ["bench-serve", "--model", tiny, "--readme", str(afile)],  # a file without the block the run rewrites
        ["bench-device", "--model", tiny, "--peer-modes", "hf-foo"],
        ["bench-device", "--model", tiny, "--categories", "writing"],
        ["bench", "--methods", "ar", "--model", tiny, "--categories", ","],
        ["bench", "--methods", "ar", "--model", tiny, "--workers", "2"],
        ["pipeline", "--model", tiny, "--name", "bad name", "--out", str(tmp / "p")],
        ["pipeline", "--model", tiny, "--num-samples", "0", "--out", str(tmp / "p")],
        ["pipeline", "--model", tiny, "--registry", "foo://x", "--out", str(tmp / "p")],
        ["tune", "--methods", "ngram", "--model", tiny, "--publish", "--registry", "foo://x", "--out", str(tmp / "t")],
        ["ship-drafters", "--strategy", "deepspeed"],
        ["ship-drafters", "--strategy", "zero9"],
        ["generate", "--model", tiny, "--prompt", "hi", "--set", "=3"],
        [*gen, "--prompt", "hi \udcff\udcfe"],  # bytes that are not UTF-8, as Python hands them over from argv
        [*gen, "--prompt", "hi", "--seed", str(2**70)],
        [*gen, "--prompt", "hi", "--seed", "-1"],
        [*gen, "--prompt", "hi", "--temperature", "inf"],
        [*gen, "--prompt", "hi", "--temperature", "nan"],
        [*gen, "--prompt", "hi", "--temperature", "2.5"],
        [*gen, "--prompt", "hi", "--top-p", "0"],
        [*gen, "--prompt", "hi", "--top-k", "-1"],
        [*gen, "--prompt", "hi", "--max-new-tokens", "0"],
        [*gen, "--prompt", "hi", "--set", "k=abc"],
        [*gen, "--prompt", "hi", "--set", "\udcff=1"],
        [*gen, "--prompt", ""],
        [*gen, "--prompt-file", str(tmp)],
        [*gen, "--prompt-file", str(tmp / "missing.txt")],
        [*gen, "--prompt", "hi", "--config", str(tmp)],
        [*gen, "--prompt", "hi", "--config", str(afile)],
        [*gen, "--prompt", "hi", "--method", "nope"],
        ["generate", "--prompt", "hi", "--model", "/nonexistent/model"],
        [*gen, "--prompt", "hi", "--method", "pearl", "--address", f"127.0.0.1:{port}"],
        [*gen, "--prompt", "hi", "--method", "pearl", "--address", "not-an-address"],
        ["tune", "--methods", "ngram", "--model", tiny, "--range", "k=abc", "--out", str(tmp / "t")],
        ["tune", "--methods", "ngram", "--model", tiny, "--range", "k=", "--out", str(tmp / "t")],
        ["tune", "--methods", "ngram", "--model", tiny, "--out", str(afile)],
        ["tune", "--methods", "ngram", "--model", tiny, "--out", "/proc/specray-nope"],
        ["tune", "--methods", "ngram", "--model", tiny, "--name", "../../x", "--out", str(tmp / "t")],
        ["tune", "--methods", "ngram", "--model", tiny, "--name", "/abs", "--out", str(tmp / "t")],
        ["tune", "--methods", "ngram", "--model", tiny, "--num-samples", "0"],
        ["bench", "--methods", "ar", "--model", tiny, "--out", str(afile)],
        ["bench", "--methods", "ar", "--model", tiny, "--out", "/proc/specray-nope"],
        ["bench", "--methods", "nope", "--model", tiny],
        ["registry", "list", "--registry", "/nonexistent/registry"],
        ["registry", "list", "--registry", str(afile)],
        ["registry", "show", "../../etc/passwd", "--registry", str(tmp)],
        ["registry", "nope"],
        ["bench-serve", "--model", tiny, "--concurrency", "0"],
        ["bench-serve", "--model", tiny, "--methods", "ar,nope"],
        ["bench-http", "--model", "/nonexistent/model"],
        ["bench-http", "--model", tiny, "--method", "nope"],
        ["serve", "--host", "999.1.1.1", "--base-model", tiny],
        ["serve", "--port", "0"],
        ["serve", "--port", "99999"],
        ["serve", "--base-model", "/nonexistent"],
        ["serve", "--base-model", str(tmp)],
        ["serve", "--base-model", str(noweights)],
        ["serve", "--base-model", str(broken)],
        ["serve", "--base-model", tiny, "--max-body-bytes", "10"],
        ["serve", "--base-model", tiny, "--api-key", "has space"],
        ["serve", "--base-model", tiny, "--preload", "no/such/entry", "--registry", str(tmp / "emptyreg")],
        ["soak", "--model", tiny, "--duration-s", "5"],
        ["soak", "--model", tiny, "--faults", "replica_kill,nope"],
        ["soak", "--model", tiny, "--schedule", "x:replica_kill"],
        ["soak", "--model", tiny, "--schedule", "500:replica_kill", "--duration-s", "60"],
        ["soak", "--model", tiny, "--min-streams", "8", "--max-streams", "4"],
        ["soak", "--model", tiny, "--max-queued-requests", "8"],
        ["soak", "--model", tiny, "--max-tokens", "0"],
        ["soak", "--model", tiny, "--tail-s", "-5"],
        ["soak", "--model", tiny, "--out", str(afile)],
        ["soak", "--model", tiny, "--duration-s", "30", "--readme", str(afile), "--out", str(tmp / "s")],
        ["soak", "--model", "/nonexistent/model", "--duration-s", "30", "--out", str(tmp / "s")],
        ["train-drafter", "--recipe", "kangaroo", "--name", "../x", "--model", tiny],
        ["train-drafter", "--recipe", "kangaroo", "--out", str(afile), "--model", tiny],
        ["nope"],
        [],
    ]


def test_bad_commands_exit_2_with_one_line(tiny_model_dir, tmp_path, capsys, monkeypatch):
    import cluster.runtime as runtime
    from jobs.cli import main

    monkeypatch.setenv("RAY_ADDRESS", "")
    real_connect = runtime.connect

    def no_embedded_ray(address=None, *args, **kwargs):  # a bad command must fail before it starts Ray
        if not address:
            raise AssertionError("a bad command got as far as starting Ray")
        return real_connect(address, *args, **kwargs)

    monkeypatch.setattr(runtime, "connect", no_embedded_ray)
    monkeypatch.setenv("SPECRAY_HOME", str(tmp_path / "home"))
    for argv in command_cases(str(tiny_model_dir), tmp_path):
        t0 = time.monotonic()
        rc = main(argv)
        out = capsys.readouterr()
        err = [ln for ln in out.err.splitlines() if ln.strip()]
        assert rc == 2, (argv, rc, out.err[-500:])
        assert len(err) == 1 and err[0].startswith("error:") if argv else True, (argv, out.err[-500:])
        assert "Traceback" not in out.err + out.out, argv
        assert time.monotonic() - t0 < 30, argv  # nothing hangs (an unreachable --address included)
    assert not (tmp_path.parent / "x").exists()  # tune --name ../../x wrote nothing outside --out


def test_invalid_utf8_prompt_in_a_real_process(tiny_model_dir):
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "jobs.generate",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        b"hi \xff\xfe".decode("utf-8", "surrogateescape"),
    ]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--prompt" in r.stderr and "UTF-8" in r.stderr, r.stderr
