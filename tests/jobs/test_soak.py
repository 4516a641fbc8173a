"""The short soak: `specray soak` for about a minute of load on its own test cluster (five Ray nodes on this machine,
a redis-server, the Serve app with an actor entry), every fault injected once, real HTTP; the tiny model in float32.

Nothing may be lost, hung, answered twice, mixed or wrong; every fault is injected and recovered from; the report,
its files and the README block are written. The 30-minute soak is the documented command (README, Results)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.cluster

# the two faults of the actor entry far enough apart for the first to recover; the others in between and beside them
SCHEDULE = "2:worker_kill,4:queue_fill,9:slow_reader,14:redis_restart,24:replica_kill,32:node_removal"
DURATION_S, NODE_RETURN_S = 72, 0


def test_a_short_soak_with_every_fault_loses_nothing(tiny_model_dir, tmp_path, capsys):
    import pyarrow.parquet as pq

    from evaluation.soak.plan import FAULTS
    from jobs.cli import main

    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- soak-results -->\nold\n<!-- /soak-results -->\n")
    out, docs = tmp_path / "soak", tmp_path / "docs" / "soak"
    argv = ["soak", "--model", str(tiny_model_dir), "--duration-s", str(DURATION_S), "--overlap", "--fault-gap-s", "0"]
    argv += ["--schedule", SCHEDULE]
    argv += ["--min-streams", "4", "--max-streams", "8", "--rate", "2", "--max-queued-requests", "12", "--pool", "4"]
    argv += ["--node-return-s", str(NODE_RETURN_S), "--stall-s", "3", "--window-s", "10", "--sample-s", "2", "--progress-s", "10"]
    argv += ["--growth-from-s", "10", "--out", str(out), "--docs", str(docs), "--readme", str(readme)]
    code = main(argv)
    captured = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    print("\n" + captured.out[:4000])
    assert code == 0, captured.err[-3000:]

    checks, faults = summary["checks"], {f["fault"]: f for f in summary["faults"]}
    assert checks["violations"] == 0 and summary["violations"] == dict.fromkeys(summary["violations"], 0)
    assert summary["faults_injected"] == dict.fromkeys(FAULTS, 1), [(f["fault"], f["error"]) for f in summary["faults"]]
    assert checks["requests"] > 200 and checks["greedy_checked"] > 50 and checks["greedy_mismatched"] == 0
    assert checks["seeded_checked"] > 0 and checks["seeded_inconsistent"] == 0
    assert checks["drained"] and checks["hangups"] == checks["hangups_cancelled"] == 1
    for name, f in faults.items():  # every fault recovered: a later request of what it could affect succeeded
        assert f["recovery_s"] is not None and f["violations"] == 0, (name, f)
    # the figures a minute can check: a killed model worker back within the soak's target of 30 s (it is restarted in
    # place: 11 s here on a loaded machine, 23 s when its replica was replaced), a node removal within 60 s; the engine
    # replica's cold restart within 60 s (the soak's target is 30 s: 14-17 s in the 30-minute run, up to 31 s here
    # beside other jobs); no role ends with more processes than it had (a replica replaced leaves no workers behind);
    # Serve's processes that live through the run flat (< 5%). The workers and replicas are replaced within the minute,
    # so their growth is the 30-minute soak's to measure.
    met = {t["target"]: t for t in summary["targets"]}
    for name, limit in (("worker_kill", 30), ("node_removal", 60)):
        assert met[f"{name} recovery <= {limit}s"]["met"], (name, faults[name]["recovery_s"], faults[name]["target"])
    assert faults["replica_kill"]["recovery_s"] <= 60, faults["replica_kill"]
    leaked = met["no role ends with more processes than it had (none leaked)"]
    assert leaked["met"], (leaked["value"], [r for r in summary["resources"]["roles"] if r["alive_to"] > r["alive_from"]])
    serve = [p for p in summary["resources"]["processes"] if p["role"] in ("ingress replica", "serve proxy", "serve controller")]
    assert len(serve) == 3 and all(p["rss_growth_pct"] < 5 for p in serve), serve
    assert faults["queue_fill"]["answered_429"] > 0 and all(v.isdigit() for v in faults["queue_fill"]["retry_after"])
    assert faults["slow_reader"]["slow_outcome"] == "ok" and faults["slow_reader"]["hangup_server_state"] == "cancelled"
    redis = faults["redis_restart"]
    assert redis["publish_one_line"] and redis["results_kept"] and redis["entries_kept"] and redis["republish_exit"] == 0
    assert redis["publish_exit"] == 0 or (redis["publish_exit"] == 2 and "error:" in redis["publish_stderr"][0])
    # the spare came back, unless the removal recovered too late for it: the soak adds it only while the load runs
    # (a slow machine recovered a removed replica's node 33 s after the removal at 32 s)
    removal = faults["node_removal"]
    assert "node_added_at_s" in removal or removal["t_s"] + removal["recovery_s"] + NODE_RETURN_S >= DURATION_S, removal
    assert summary["outcomes"].get("error", 0) > 0  # the faults did cost requests, and they ended cleanly

    roles = set(pq.read_table(out / "processes.parquet").column("role").to_pylist())
    wanted = {"soak driver", "gcs", "raylet", "redis", "serve controller", "serve proxy", "ingress replica", "engine replica"}
    assert wanted | {"placed replica", "model worker (target)", "model worker (draft)"} <= roles, roles
    requests = pq.read_table(out / "requests.parquet").to_pylist()
    assert len(requests) == checks["requests"] and {r["kind"] for r in requests} == {"load", "burst", "slow_reader", "hangup"}
    assert {r["model"] for r in requests} == {str(tiny_model_dir), "soak/ngram", "soak/suffix", "soak/pearl"}
    assert {(r["stream"], r["endpoint"]) for r in requests} == {(s, e) for s in (True, False) for e in ("chat", "completions")}
    for name in ("report.md", "soak.png", "summary.json", "requests.parquet", "processes.parquet", "faults.parquet"):
        assert (docs / name).is_file()
    text = readme.read_text()
    assert "old" not in text and "| worker_kill |" in text and "specray soak --model" in text and "soak.png" in text
