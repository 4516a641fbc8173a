"""`specray tune` end to end on a local 2-CPU Ray with a tiny model: files, registry (file and Redis), resume, Redis down."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import time
from pathlib import Path

import pytest
from redis_server import closed_port, redis_server
from tests_support import own_stderr_lines

from jobs import tune as tune_job
from jobs.cli import main as cli_main

PNG = b"\x89PNG\r\n\x1a\n"

ray = pytest.importorskip("ray")
tune = pytest.importorskip("ray.tune")


@pytest.fixture(scope="module")
def local_ray():
    """One embedded Ray for the module (never a stray cluster on the machine: address="local")."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def argv(tiny, out, *extra):
    return [
        "--model", tiny["model"], "--prompts", tiny["prompts"], "--dtype", "float32", "--max-new-tokens", "8",
        "--threads", "1", "--out", str(out), "--verbose", "0", *extra,
    ]  # fmt: skip


def run_cli(args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["tune", *args])
    return code, out.getvalue(), err.getvalue()


def parquet_rows(path):
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


@pytest.fixture(scope="module")
def first_run(tiny_tune, local_ray, tmp_path_factory):
    """3 trials: the untuned defaults of ngram, early-exit and sps; sps points at a draft model that does not exist."""
    root = tmp_path_factory.mktemp("tune")
    args = argv(tiny_tune, root / "out", "--name", "first", "--methods", "ngram,early-exit,sps", "--num-samples", "3")
    args += ["--set", f"draft_model={root / 'no-such-draft'}", "--publish", "--registry", str(root / "registry")]
    code, stdout, stderr = run_cli(args)
    return {"code": code, "stdout": stdout, "stderr": stderr, "exp": root / "out" / "first", "registry": root / "registry"}


def test_end_to_end_into_the_file_registry(first_run, tiny_tune):
    from cluster.registry import open_registry

    assert first_run["code"] == 0, first_run["stderr"][-3000:]
    exp = first_run["exp"]
    rows = parquet_rows(exp / "trials.parquet")
    assert len(rows) == 3 and len({r["trial_id"] for r in rows}) == 3  # one row per trial
    by_method = {r["method"]: r for r in rows}
    assert set(by_method) == {"ngram", "early-exit", "sps"}
    # the config that cannot run is an invalid trial with its reason, not a crashed one
    sps = by_method["sps"]
    assert sps["status"] == "TERMINATED" and sps["valid"] is False and sps["score"] == 0.0 and "no-such-draft" in sps["invalid_reason"]
    for m in ("ngram", "early-exit"):
        r = by_method[m]
        assert r["valid"] and r["speedup"] > 0 and r["mean_accepted_tokens"] >= 1.0
        assert r["fidelity_ok"] and r["suspicious"] == 0 and r["compared"] == r["prompts"]  # float32: identical to AR
    assert by_method["early-exit"]["exit_layer"] == 3  # the default 24 clamped below the 4-layer model
    best_rows = [r for r in rows if r["best"]]
    assert len(best_rows) == 1 and best_rows[0]["method"] in ("ngram", "early-exit")
    best = best_rows[0]
    assert (exp / "pareto.png").read_bytes()[:8] == PNG

    doc = json.loads((exp / "best.json").read_text())
    assert doc["best"]["trial_id"] == best["trial_id"]
    assert doc["verify"]["winner"]["speedup"] > 0  # --verify-best is on by default with --publish
    assert doc["verify"]["winner_is_defaults"] is True  # with 3 samples every trial ran a method's defaults
    # the search ran on one prompt per category; the winner was re-measured on the other one, three passes
    assert {r["prompts_total"] for r in rows if r["valid"]} == {2}
    v = doc["verify"]
    assert v["prompts"] == "held-out" and v["prompt_count"] == 2 and v["repeats"] == 3
    assert v["winner"]["speedup_band_low"] <= v["winner"]["speedup"] <= v["winner"]["speedup_band_high"]
    assert "2 held-out prompts x 3 pass(es)" in first_run["stdout"]

    name = f"model/q/{best['method']}"
    assert f"published {name} v1" in first_run["stdout"]
    entry = open_registry(first_run["registry"]).get(name)
    assert entry.config.method == best["method"] and entry.config.k == best["k"]
    assert entry.config.threads == 1  # the user's --threads, as measured
    assert entry.metrics["speedup"] == pytest.approx(best["speedup"])
    assert entry.metrics["speedup_verified"] == pytest.approx(doc["verify"]["winner"]["speedup"])
    assert entry.metrics["tuning"]["trials"] == 3 and entry.metrics["fidelity_ok"] is True
    assert entry.hardware["cores"] == os.cpu_count() and entry.created_at.endswith("Z")
    # the final summary names the winner and prints its config as JSON
    out = first_run["stdout"]
    assert "best: trial " + best["trial_id"] in out
    printed = json.loads(out.split("best config (JSON):\n", 1)[1].splitlines()[0])
    assert printed["method"] == best["method"]


def test_publishing_to_an_unreachable_redis_exits_2_and_keeps_the_results(first_run, tiny_tune):
    exp = first_run["exp"]
    for f in ("trials.parquet", "best.json", "pareto.png"):
        (exp / f).unlink()
    url = f"redis://127.0.0.1:{closed_port()}/0"
    code, stdout, stderr = run_cli(["--resume", str(exp), "--publish", "tuned/x", "--registry", url, "--verbose", "0"])
    assert code == 2
    err = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1, stderr[-2000:]
    assert "unreachable" in err[0] and "trials.parquet" in err[0] and "best.json" in err[0] and "tuned/x" in err[0]
    assert len(parquet_rows(exp / "trials.parquet")) == 3  # restored experiment: the same 3 trials, none rerun
    assert json.loads((exp / "best.json").read_text())["best"]["config"]["method"] in ("ngram", "early-exit")
    assert (exp / "pareto.png").exists()


class InterruptAfterFirstTrial(tune.Callback):
    """Ctrl-C as Tune sees it (its SIGINT/SIGUSR1 handler), once: the marker file keeps a restored copy quiet."""

    def __init__(self, marker: str):
        self.marker = marker

    def on_trial_complete(self, iteration, trials, trial, **info):
        if not os.path.exists(self.marker):
            Path(self.marker).touch()
            os.kill(os.getpid(), signal.SIGUSR1)


def test_interrupted_search_resumes_and_publishes_to_redis(tiny_tune, local_ray, tmp_path):
    from cluster.registry import open_registry

    out = tmp_path / "out"
    args = tune_job.build_parser().parse_args(
        argv(tiny_tune, out, "--name", "cut", "--methods", "ngram", "--num-samples", "3", "--max-concurrent", "1", "--no-early-stop")
    )
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        code, summary = tune_job.run(args, callbacks=[InterruptAfterFirstTrial(str(tmp_path / "interrupted"))])
    assert code == 130 and summary["interrupted"] is True
    assert summary["resume"] == f"specray tune --resume {out / 'cut'}"
    before = {r["trial_id"]: r for r in parquet_rows(out / "cut" / "trials.parquet")}  # what finished is on disk
    done_before = {t for t, r in before.items() if r["complete"]}
    assert 1 <= len(done_before) < 3

    with redis_server() as url:
        code, stdout, stderr = run_cli(["--resume", str(out / "cut"), "--publish", "tuned/ngram", "--registry", url, "--no-verify-best"])
        assert code == 0, stderr[-3000:]
        rows = parquet_rows(out / "cut" / "trials.parquet")
        assert len(rows) == 3 and all(r["complete"] for r in rows)  # num_samples in total, each on every prompt
        after = {r["trial_id"]: r for r in rows}
        for t in done_before:  # finished trials were kept, not run again
            assert after[t]["speedup"] == pytest.approx(before[t]["speedup"])
        entry = open_registry(url).get("tuned/ngram")
        best = next(r for r in rows if r["best"])
        assert entry.version == 1 and entry.config.method == "ngram" and entry.config.k == best["k"]
        assert entry.metrics["speedup"] == pytest.approx(best["speedup"]) and "verify" not in entry.metrics


def test_bad_input_is_one_line_exit_2(tiny_tune, tmp_path, capsys):
    def bad(*extra):
        code = cli_main(["tune", *argv(tiny_tune, tmp_path / "o"), *extra])
        err = own_stderr_lines(capsys.readouterr().err)
        assert code == 2 and len(err) == 1, err
        return err[0]

    assert "medusa" in bad("--methods", "ngram,medusa")  # not a method
    assert "exit_layer" in bad("--methods", "early-exit", "--set", "exit_layer=9")
    assert "--num-samples" in bad("--num-samples", "0")
    assert "unknown category" in bad("--categories", "poetry")
    assert "--holdout" in bad("--holdout", "1")
    assert "--verify-repeats" in bad("--verify-repeats", "0")
    assert "not a specray tune experiment" in bad("--resume", str(tmp_path / "nothing-here"))
    assert not (tmp_path / "o").exists()


def test_pearl_trials_place_their_workers_in_the_trial_group(tiny_tune, local_ray, tmp_path):
    """A pearl trial reserves [driver, target, draft] bundles and its two workers run inside them; the winner is
    re-measured outside Tune with workers in a group of its own, and both are lossless in float32."""
    out = tmp_path / "out"
    args = argv(tiny_tune, out, "--name", "pearl", "--methods", "pearl", "--num-samples", "2", "--set", "draft_layers=2", "--verify-best")
    args += ["--verify-repeats", "1"]  # one pass over the held-out prompts: the band is tested in the first run
    code, stdout, stderr = run_cli(args)
    assert code == 0, stderr[-3000:]
    rows = parquet_rows(out / "pearl" / "trials.parquet")
    assert len(rows) == 2 and all(r["method"] == "pearl" for r in rows)
    for r in rows:
        assert r["valid"], r["invalid_reason"]
        assert r["speedup"] > 0 and r["mean_accepted_tokens"] >= 1.0
        assert r["fidelity_ok"] and r["compared"] == r["prompts"] >= 1  # ASHA may stop the weaker trial after one prompt
    doc = json.loads((out / "pearl" / "best.json").read_text())
    assert doc["verify"]["winner"]["speedup"] > 0 and doc["verify"]["winner"]["fidelity_ok"]
    # every worker was released (ray.kill and group removal are asynchronous): the 2-CPU cluster is whole again
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0.0) < 2.0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU") == pytest.approx(2.0)
