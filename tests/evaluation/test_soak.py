"""The soak harness's judgement, without a cluster: how answers are classified, recovery and latency windows,
resource growth, the seeded-repeat check, the schedule, the report; the process sampler on a real child process;
the greedy references' prefix rule on the tiny model. The soak itself runs in tests/jobs/test_soak.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from evaluation.load import percentile
from evaluation.soak.analysis import analyse, fault_rows, resource_growth, resource_targets
from evaluation.soak.answers import RequestRecord, classify_plain, classify_stream, dechunk, sse_payloads
from evaluation.soak.faults import first_success
from evaluation.soak.harness import Soak
from evaluation.soak.outputs import write_outputs
from evaluation.soak.plan import FAULTS, FaultRecord, Mix, SoakPlan, even_schedule, parse_schedule
from evaluation.soak.processes import ProcessSampler, descendants, role_of


def chunk(rid: str, text: str | None = None, finish: str | None = None, chat: bool = True, **extra) -> str:
    if chat:
        delta = {} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return json.dumps({"id": rid, "object": "chat.completion.chunk", "choices": [choice], **extra})
    choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    return json.dumps({"id": rid, "object": "text_completion", "choices": [choice], **extra})


def error_event(kind: str = "service_unavailable", code: str = "replica_unavailable") -> str:
    return json.dumps({"error": {"message": "the generation failed (request x)", "type": kind, "param": None, "code": code}})


USAGE = {"usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
ROLE = json.dumps({"id": "a", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
GOOD_CHAT = [ROLE, chunk("a", "Hel"), chunk("a", "lo"), chunk("a", None, "length", **USAGE), "[DONE]"]


# ---- streams ---------------------------------------------------------------------------------------------------
def test_a_complete_chat_stream_is_ok_with_its_text_and_tokens():
    v = classify_stream(200, {"X-Specray-Request-Id": "a"}, GOOD_CHAT, "chat")
    assert (v.outcome, v.text, v.tokens, v.finish_reason, v.response_id) == ("ok", "Hello", 3, "length", "a")
    usage_chunk = json.dumps({"id": "a", "choices": [], **USAGE})
    assert classify_stream(200, {}, GOOD_CHAT[:-1] + [usage_chunk, "[DONE]"], "chat").outcome == "ok"


def test_a_completion_stream_is_ok():
    events = [chunk("c", "x", chat=False), chunk("c", "y", chat=False), chunk("c", "", "stop", chat=False, **USAGE), "[DONE]"]
    v = classify_stream(200, {}, events, "completions")
    assert (v.outcome, v.text, v.finish_reason) == ("ok", "xy", "stop")


def test_an_error_event_before_done_is_a_clean_end():
    v = classify_stream(200, {}, [ROLE, chunk("a", "Hel"), error_event(), "[DONE]"], "chat")
    assert (v.outcome, v.status, v.code) == ("error", 503, "replica_unavailable")
    assert classify_stream(200, {}, [error_event("rate_limit_error", "queue_full"), "[DONE]"], "chat").status == 429


@pytest.mark.parametrize(
    "events, outcome, why",
    [
        (GOOD_CHAT[:-1], "lost", "without [DONE]"),
        ([ROLE, chunk("a", "Hel"), "[DONE]"], "lost", "without a finish_reason"),
        (GOOD_CHAT + ["[DONE]"], "duplicated", "two ends"),
        (GOOD_CHAT + [chunk("a", "more")], "duplicated", "data after the end"),
        ([ROLE, chunk("a", "x", "stop"), chunk("a", None, "stop"), "[DONE]"], "duplicated", "2 finish_reasons"),
        ([ROLE, chunk("a", None, "stop"), chunk("a", "late"), "[DONE]"], "duplicated", "content after the finish"),
        ([ROLE, error_event(), chunk("a", "x"), "[DONE]"], "duplicated", "a chunk after the error event"),
        ([ROLE, chunk("a", None, "stop"), error_event(), "[DONE]"], "duplicated", "1 error event(s) and 1 finish(es)"),
        ([ROLE, error_event(), error_event(), "[DONE]"], "duplicated", "2 error event(s)"),
        ([ROLE, chunk("b", "x"), chunk("a", None, "stop"), "[DONE]"], "mixed", "chunks of 2 responses"),
        ([ROLE, chunk("a", "x"), error_event("server_error", "internal_error"), "[DONE]"], "bad_error", "server_error"),
        ([ROLE, '{"error": "x"}', "[DONE]"], "bad_error", "without OpenAI's shape"),
        ([ROLE, "not json", "[DONE]"], "malformed", "not JSON"),
        ([ROLE, chunk("a", None, "cancelled"), "[DONE]"], "malformed", "finish_reason 'cancelled'"),
    ],
)
def test_streams_that_break_the_rules(events, outcome, why):
    v = classify_stream(200, {}, events, "chat")
    assert v.outcome == outcome and why in v.detail, (v.outcome, v.detail)


def test_a_stream_whose_header_names_another_request_is_mixed():
    v = classify_stream(200, {"x-specray-request-id": "b"}, GOOD_CHAT, "chat")
    assert v.outcome == "mixed" and "header names b" in v.detail


# ---- plain answers ---------------------------------------------------------------------------------------------
def plain(rid: str = "p", text: str = "hi", chat: bool = False) -> bytes:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
    return json.dumps({"id": rid, "choices": [{**choice, "finish_reason": "length"}], **USAGE}).encode()


def api_error(kind: str, code: str) -> bytes:
    return json.dumps({"error": {"message": "m\nsecond line", "type": kind, "param": None, "code": code}}).encode()


def test_plain_answers():
    v = classify_plain(200, {"X-Specray-Request-Id": "p"}, plain(chat=True), "chat")
    assert (v.outcome, v.text, v.tokens, v.response_id) == ("ok", "hi", 3, "p")
    assert classify_plain(200, {}, plain(), "completions").text == "hi"
    assert classify_plain(200, {"x-specray-request-id": "q"}, plain(), "completions").outcome == "mixed"
    v = classify_plain(503, {}, api_error("service_unavailable", "replica_unavailable"), "chat")
    assert (v.outcome, v.status, v.code, v.detail) == ("error", 503, "replica_unavailable", "m")  # one line
    v = classify_plain(429, {"Retry-After": "1"}, api_error("rate_limit_error", "queue_full"), "chat")
    assert (v.outcome, v.retry_after) == ("error", "1")


@pytest.mark.parametrize(
    "status, headers, body, outcome",
    [
        (429, {}, api_error("rate_limit_error", "queue_full"), "bad_error"),  # no Retry-After
        (429, {"Retry-After": "soon"}, api_error("rate_limit_error", "queue_full"), "bad_error"),
        (500, {}, api_error("server_error", "internal_error"), "bad_error"),
        (502, {}, b"Bad Gateway", "bad_error"),
        (503, {}, b'{"detail": "x"}', "bad_error"),
        (200, {}, b"", "lost"),
        (200, {}, b'{"id": "p", "choices": []}', "malformed"),
    ],
)
def test_plain_answers_that_break_the_rules(status, headers, body, outcome):
    assert classify_plain(status, headers, body, "completions").outcome == outcome


def test_a_chunked_event_stream_read_off_a_socket():
    events = [chunk("a", "x", chat=False), chunk("a", "", "stop", chat=False), "[DONE]"]
    body = "".join(f"data: {e}\n\n" for e in events).encode()
    wire = b"".join(f"{len(part):x}\r\n".encode() + part + b"\r\n" for part in (body[:7], body[7:40], body[40:])) + b"0\r\n\r\n"
    assert sse_payloads(dechunk(wire)) == events
    assert classify_stream(200, {}, sse_payloads(dechunk(wire)), "completions").outcome == "ok"


# ---- the schedule ----------------------------------------------------------------------------------------------
def test_schedules():
    assert even_schedule(list(FAULTS), 2, 180, 1740)[:3] == [(180.0, "replica_kill"), (310.0, "worker_kill"), (440.0, "node_removal")]
    assert len(even_schedule(list(FAULTS), 2, 180, 1740)) == 12 and even_schedule([], 2, 0, 10) == []
    assert parse_schedule("20:queue_fill,5:replica_kill") == [(5.0, "replica_kill"), (20.0, "queue_fill")]
    for bad in ("5:nope", "x:replica_kill", "-1:replica_kill", "replica_kill"):
        with pytest.raises(ValueError, match="SECONDS:FAULT"):
            parse_schedule(bad)


# ---- recovery, windows, checks ---------------------------------------------------------------------------------
def soak_with(records: list[dict], faults: list[FaultRecord] = ()) -> Soak:
    plan = SoakPlan(duration_s=100, window_s=20)
    mix = Mix(models={"m": 1.0, "e/pearl": 1.0}, placed=("e/pearl",))
    soak = Soak("http://127.0.0.1:1", plan, mix, ["p"], None, None, engine=["m"], placed=["e/pearl"])
    for i, r in enumerate(records):
        base = {"kind": "load", "model": "m", "endpoint": "chat", "stream": False, "temperature": 0.0, "seed": None}
        base.update(max_tokens=8, prompt_idx=0, timeout_s=60, outcome="ok")
        soak.records.append(RequestRecord(idx=i, **{**base, **r}))
    soak.faults.extend(faults)
    return soak


def test_recovery_is_the_first_answer_served_after_the_fault():
    records = [
        {"t_start": 0, "t_first": 1, "t_end": 9, "stream": True},  # streaming before the fault: no proof of recovery
        {"t_start": 2, "t_first": 10.2, "t_end": 10.2},  # answered at the moment of the fault
        {"t_start": 3, "t_end": 12, "outcome": "error"},
        {"t_start": 11, "t_end": 25, "model": "e/pearl"},  # another model: unaffected by an engine replica kill
        {"t_start": 11, "t_end": 31},  # the first answer of the recovered engine
        {"t_start": 20, "t_end": 40},
        {"t_start": 32, "t_end": 52},
    ]
    fault = FaultRecord("replica_kill", 0, 10.0, t_inject=10.0, t_end=10.0, target="engine replica pid 1")
    soak = soak_with(records, [fault])
    assert first_success(soak.records, 10.0, ["m"]).t_end == 31
    (row,) = fault_rows(soak)
    assert row["recovery_s"] == 21.0 and row["during_s"] == 21.0
    assert row["in_flight"] == 2 and row["affected"] == 1 and row["violations"] == 0
    assert row["p99_before_s"] == pytest.approx(percentile([9, 8.2], 99))
    assert row["sent_during"] == 3 and row["p99_after_s"] == 20.0
    worker = FaultRecord("worker_kill", 1, 10.0, t_inject=10.0, t_end=10.0)
    soak.faults[:] = [worker]
    assert fault_rows(soak)[0]["recovery_s"] == 15.0  # the actor entry's first answer after the fault


def test_seeded_answers_must_agree_with_their_repeats_and_ids_must_be_unique():
    same = {"temperature": 0.8, "seed": 1000, "t_start": 0, "t_end": 1}
    soak = soak_with([{**same, "text": "abc"}, {**same, "text": "abc"}, {**same, "text": "abd"}, {**same, "text": "x", "max_tokens": 9}])
    soak._check_seeded()
    assert [r.check for r in soak.records] == ["consistent", "consistent", "inconsistent", None]
    assert soak.records[2].outcome == "wrong_output"
    soak = soak_with([{"response_id": "a", "t_start": 0, "t_end": 1}, {"response_id": "a", "t_start": 0, "t_end": 2}])
    summary = analyse(soak)
    assert summary["violations"]["duplicated"] == 2 and summary["checks"]["duplicate_ids"] == ["a"]


def test_resource_growth_per_process_and_per_role():
    rows = []
    for t in range(0, 1801, 30):
        rows.append({"t_s": t, "pid": 1, "role": "gcs", "rss_mb": 100.0 + t / 100, "fds": 50})  # +18% over the window
        rows.append({"t_s": t, "pid": 2, "role": "raylet", "rss_mb": 200.0, "fds": 40 + (t > 1500)})  # one more fd at the end
        rows.append({"t_s": t, "pid": 3 if t < 900 else 4, "role": "engine replica", "rss_mb": 1000.0, "fds": 60})  # replaced
        rows.append({"t_s": t, "pid": 100 + t, "role": "idle worker", "rss_mb": 50.0, "fds": 10})  # transient
    # a worker killed at 310 s: its replacement loads its model (a low RSS) in its first minute, then stays flat
    for t in range(0, 301, 30):
        rows.append({"t_s": t, "pid": 5, "role": "model worker (target)", "rss_mb": 1100.0, "fds": 40})
    for t in range(330, 1801, 30):
        rows.append({"t_s": t, "pid": 6, "role": "model worker (target)", "rss_mb": 200.0 if t < 390 else 1100.0, "fds": 40})
    g = resource_growth(rows, 300, 1800)
    procs = {p["pid"]: p for p in g["processes"]}
    assert set(procs) == {1, 2}  # 3 to 6 did not live through the window; idle workers come and go
    # medians of the samples in [300, 360] s and in [1740, 1800] s
    assert procs[1]["rss_growth_pct"] == pytest.approx(100 * (117.7 - 103.3) / 103.3, abs=0.01) and procs[2]["fds_growth"] == 1
    lives = {p["pid"]: p for p in g["lives"]}
    assert set(lives) == {1, 2, 3, 4, 6}  # 5 lived 30 s of the window; 6 is judged from a minute after its start
    assert lives[6]["from_s"] == 390 and lives[6]["rss_growth_pct"] == 0.0 and lives[3]["to_s"] == 870
    roles = {r["role"]: r for r in g["roles"]}
    assert "idle worker" not in roles and roles["engine replica"]["rss_growth_pct"] == 0.0 and roles["engine replica"]["processes"] == 2
    worker = roles["model worker (target)"]  # its total straddles the restart (a loading process): not a growth
    assert worker["rss_growth_pct"] == 0.0 and worker["alive_to"] == 1 and worker["rss_sum_from_mb"] == 200.0
    targets = {t["target"].split(" (")[0]: t for t in resource_targets({"resources": g})}
    assert not targets["RSS growth < 5% for every process"]["met"] and "gcs" in targets["RSS growth < 5% for every process"]["value"]
    assert not targets["no fd growth in any process"]["met"]
    assert targets["no role ends with more processes than it had"]["met"]
    leaked = rows + [{"t_s": t, "pid": 7, "role": "model worker (target)", "rss_mb": 1100.0, "fds": 40} for t in range(900, 1801, 30)]
    targets = {t["target"].split(" (")[0]: t for t in resource_targets({"resources": resource_growth(leaked, 300, 1800)})}
    assert not targets["no role ends with more processes than it had"]["met"]
    # a replacement started while the process it replaces still lingers (both in the last samples) is not a leak
    overlap = rows + [{"t_s": t, "pid": 8, "role": "engine replica", "rss_mb": 900.0, "fds": 60} for t in (1770, 1800)]
    overlap = [r for r in overlap if not (r["pid"] == 4 and r["t_s"] == 1800)]
    g = resource_growth(overlap, 300, 1800)
    assert {r["role"]: r["alive_to"] for r in g["roles"]}["engine replica"] == 1
    met = {t["target"].split(" (")[0]: t["met"] for t in resource_targets({"resources": g})}
    assert met["no role ends with more processes than it had"]


def test_the_report_and_its_files(tmp_path):
    records = [{"t_start": t, "t_first": t + 1, "t_end": t + 2, "tokens": 8, "stream": True} for t in range(0, 90, 3)]
    records.append({"t_start": 40, "t_end": 41, "outcome": "error", "status": 503, "code": "replica_unavailable"})
    fault = FaultRecord("replica_kill", 0, 40.0, t_inject=40.0, t_end=40.0, target="engine replica pid 7")
    soak = soak_with(records, [fault, FaultRecord("queue_fill", 1, 95.0, error="not injected: the run ended first")])
    soak.sampler.rows = [{"t_s": t, "pid": 9, "role": "redis", "rss_mb": 10.0, "fds": 8} for t in range(0, 100, 5)]
    soak.drain = {"drained": True}
    summary = analyse(soak, growth_from_s=10)
    assert summary["faults_injected"] == {"replica_kill": 1} and summary["checks"]["violations"] == 0
    paths = write_outputs(soak, summary, tmp_path / "out")
    text = paths["report"].read_text()
    assert "| replica_kill | 40 | 4.0 |" in text and "not injected" in text
    assert "| redis | 1 | 1 / 1 | 10.0 | 10.0 | +0.0% (pid 9) | +0 |" in text
    import pyarrow.parquet as pq

    assert pq.read_table(paths["requests"]).num_rows == 31 and pq.read_table(paths["processes"]).num_rows == 20
    assert paths["plot"].stat().st_size > 10_000 and json.loads(paths["summary"].read_text())["checks"]["drained"] is True


# ---- processes -------------------------------------------------------------------------------------------------
def test_the_sampler_sees_a_child_process_with_its_memory_and_fds():
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(50 * 2**20); time.sleep(60)"])
    try:
        sampler = ProcessSampler(lambda: 0.0)
        for _ in range(50):  # until the child has its 50 MB
            sampler.rows.clear()
            sampler.sample()
            mine = [r for r in sampler.rows if r["pid"] == child.pid]
            if mine and mine[0]["rss_mb"] > 50:
                break
            import time

            time.sleep(0.1)
        assert mine and mine[0]["role"] == "other" and mine[0]["rss_mb"] > 50 and mine[0]["fds"] >= 3
        assert any(r["pid"] == os.getpid() and r["role"] == "soak driver" for r in sampler.rows)
    finally:
        child.kill()
        child.wait()


def test_roles_from_command_lines():
    table = {
        10: (1, "python -m jobs.soak"),
        11: (10, "/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=x"),
        12: (10, "/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x"),
        13: (12, "ray::ServeReplica:specray:OpenAIIngress"),
        14: (12, "ray::ServeReplica:specray:Placed-soak-pearl.handle_request_with_rejection"),
        15: (12, "ray::ModelActor.verify"),
        16: (10, "/usr/bin/redis-server 127.0.0.1:1234"),
        20: (1, "unrelated"),
    }
    kids = descendants(10, table)
    assert set(kids) == {10, 11, 12, 13, 14, 15, 16}
    assert [role_of(kids[p]) for p in (11, 12, 13, 14, 15, 16)] == [
        "gcs",
        "raylet",
        "ingress replica",
        "placed replica",
        "model worker",
        "redis",
    ]


# ---- the greedy references --------------------------------------------------------------------------------------
def test_a_shorter_greedy_request_is_checked_against_the_prefix_of_the_reference(tiny_model_dir):
    from decoding.config import SpecConfig
    from decoding.in_process import SpecDecoder
    from jobs.soak import References

    dec = SpecDecoder(SpecConfig(model=str(tiny_model_dir), dtype="float32"))
    prompts = ["the cat sat on the mat", "one two three"]
    refs = References(dec, prompts, max_tokens=12, long_tokens=20)
    rec = RequestRecord(
        idx=0, kind="load", model="m", endpoint="chat", stream=False, temperature=0.0, seed=None, max_tokens=5, prompt_idx=1, timeout_s=60.0
    )
    alone = dec.decode(dec.generate_ids(dec.encode(prompts[1], chat=True), max_new_tokens=5).token_ids)
    assert refs(rec) == alone
    rec.max_tokens = 13  # longer than the chat reference was run for
    assert refs(rec) is None
    rec.endpoint, rec.prompt_idx, rec.max_tokens = "completions", refs.long_prompt, 20
    assert refs(rec) == dec.decode(dec.generate_ids(dec.encode(prompts[refs.long_prompt]), max_new_tokens=20).token_ids)
