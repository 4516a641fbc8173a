"""`specray bench` on a tiny random-weight Llama: outputs, Parquet layout, plots, bad input, interruption."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from tiny_models import build_tiny_model, write_prompts

from evaluation import bench_figures as bm
from evaluation import bench_report as report
from evaluation import hf_peer, traces
from jobs import bench
from jobs.cli import main as cli_main

PNG = b"\x89PNG\r\n\x1a\n"
SPECRAY = ["ar", "ngram", "sps", "early-exit"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {"model": str(build_tiny_model(root / "model")), "prompts": str(write_prompts(root / "q.jsonl")), "root": root}


def base_argv(tiny, out, *extra):
    return [
        "--model", tiny["model"], "--prompts", tiny["prompts"], "--dtype", "float32", "--max-new-tokens", "12", "--threads", "1",
        "--set", "exit_layer=2", "--set", "draft_layers=2", "--set", "k=3", "--out", str(out), *extra,
    ]  # fmt: skip


def run_quiet(argv, on_prompt_done=None):
    args = bench.build_parser().parse_args(argv)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code, summary = bench.run_bench(args, on_prompt_done)
    return code, summary, buf.getvalue()


@pytest.fixture(scope="module")
def full_run(tiny):
    out = tiny["root"] / "out"
    argv = base_argv(tiny, out, "--methods", "ngram,sps,early-exit", "--peer", "hf", "--set", "adaptive_k=false", "--json")
    code, summary, stdout = run_quiet(argv)  # fixed k: the model drafters propose k=3 every step
    return {"code": code, "summary": summary, "stdout": stdout, "out": out}


# ---- a complete run ---------------------------------------------------------------------------


def test_summary_structure_and_rows(full_run):
    assert full_run["code"] == 0
    s = full_run["summary"]
    for key in ("run_id", "model", "dtype", "config", "methods", "methods_order", "categories", "peer", "plots", "traces", "interrupted"):
        assert key in s, key
    assert s["interrupted"] is False
    assert s["specray_methods"] == SPECRAY  # ar first (always included), then in the order asked
    assert s["methods_order"][:4] == SPECRAY
    assert set(s["methods_order"][4:]) == set(hf_peer.PEER_MODES), s["peer_skipped"]
    assert s["runs_complete"] == 3 and s["runs_incomplete"] == 0
    assert list(s["categories"]) == ["writing", "qa", "summarization"]
    for m, row in s["methods"].items():
        assert row["prompts"] == 3 and row["new_tokens"] > 0 and row["tokens_per_s"] > 0, m
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / s["methods"]["ar"]["tokens_per_s"])
    assert s["methods"]["ar"]["mean_accepted_tokens"] == pytest.approx(1.0)
    assert s["methods"]["ar"]["target_forwards_per_token"] == pytest.approx(1.0)
    for m in ("sps", "early-exit"):  # model drafters always propose k=3 tokens
        assert len(s["methods"][m]["per_position_acceptance"]) == 3
        assert s["methods"][m]["draft_ms_per_step"] > 0
    assert s["peer"]["plain_peer"] == "hf-plain" and s["peer"]["ar_vs_plain"] > 0


def test_hf_modes_run_at_specray_knobs_and_at_hf_defaults(full_run):
    s = full_run["summary"]
    modes = {m: json.loads(kw) for m, kw in s["peer_modes"].items()}
    assert modes["hf-prompt-lookup"]["prompt_lookup_num_tokens"] == 3  # specray's k
    assert modes["hf-prompt-lookup-default"] == {"prompt_lookup_num_tokens": 10}
    assert modes["hf-assistant"]["_assist"]["num_assistant_tokens"] == 3
    assert modes["hf-assistant-default"]["_assist"] == hf_peer.HF_ASSIST_DEFAULT
    assert modes["hf-early-exit-default"]["_assist"] == hf_peer.HF_ASSIST_DEFAULT


def test_over_hf_divides_by_the_best_hf_mode(full_run):
    s = full_run["summary"]
    peers = {m: v["tokens_per_s"] for m, v in s["methods"].items() if v["kind"] == "peer"}
    best = max(peers, key=peers.get)
    over = s["over_best_peer"]
    assert over["overall"]["best_peer"] == best == s["peer"]["best_peer"]
    for m in SPECRAY:
        assert over["overall"][m] == pytest.approx(s["methods"][m]["tokens_per_s"] / peers[best])
    for c, row in over["categories"].items():
        cat = s["categories"][c]
        cbest = max(peers, key=lambda m: cat[m]["tokens_per_s"])
        assert row["best_peer"] == cbest
        assert row["ngram"] == pytest.approx(cat["ngram"]["tokens_per_s"] / cat[cbest]["tokens_per_s"])


def test_model_free_methods_run_in_the_bench(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRAY_HOME", str(tmp_path / "home"))
    code, s, _ = run_quiet(base_argv(tiny, tmp_path / "out", "--methods", "recycling,suffix,hybrid", "--limit", "1", "--json"))
    assert code == 0
    assert s["specray_methods"] == ["ar", "recycling", "suffix", "hybrid"]
    for m in ("recycling", "suffix", "hybrid"):
        assert s["methods"][m]["identity"]["identical"] == s["methods"][m]["identity"]["compared"] > 0, m
    assert list((tmp_path / "home" / "calibration").glob("*.json"))  # tree_fit=measured: the forward measured once


def test_later_turns_chosen_peer_modes_and_the_readme_block(tiny, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# r\n\n<!-- bench-results -->\nold\n<!-- /bench-results -->\ntail\n")
    argv = base_argv(tiny, tmp_path / "out", "--methods", "ngram", "--later-turns", "--peer", "hf")
    argv += ["--peer-modes", "hf-plain,hf-prompt-lookup-default", "--readme", str(readme), "--json"]
    args = bench.build_parser().parse_args(argv)
    args.command_line = "specray bench --the-command"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code, s = bench.run_bench(args)
    assert code == 0 and s["later_turns"] is True
    assert s["methods_order"] == ["ar", "ngram", "hf-plain", "hf-prompt-lookup-default"]  # only the modes asked for
    assert s["runs_complete"] == 6  # 3 questions, each with its second turn
    gens = traces.read_run(tmp_path / "out", s["run_id"], "generations")
    assert {r["prompt_id"] for r in gens if r["method"] == "ar"} == {"101", "101-t2", "102", "102-t2", "103", "103-t2"}
    assert s["methods"]["ngram"]["identity"]["identical"] == 6  # float32: later turns identical to ar as well
    text = readme.read_text()
    assert "old" not in text and text.endswith("tail\n") and "| **mean of categories** |" in text
    assert "specray bench --the-command" in text and "(later turns of multi-turn questions included)" in text
    assert (tmp_path / "docs" / "bench" / "speedup_by_category.png").read_bytes()[:8] == PNG
    assert json.loads((tmp_path / "docs" / "bench" / "summary.json").read_text())["run_id"] == s["run_id"]


def test_a_later_turn_holds_the_conversation_with_ar_answers(tiny):
    from decoding.config import SpecConfig
    from evaluation.prompt_runner import PromptRunner
    from evaluation.workloads import load_prompts, with_later_turns

    cfg = SpecConfig(model=tiny["model"], dtype="float32", max_new_tokens=6, threads=1)
    runner = PromptRunner({"ar": cfg})
    first, second = with_later_turns(load_prompts(tiny["prompts"]))[:2]
    answer = runner.ar.decode(runner.ar.generate_ids(runner.encode(first), 6).token_ids)
    expected = runner.ar.encode(
        [{"role": "user", "content": first.prompt}, {"role": "assistant", "content": answer}, {"role": "user", "content": "a second turn"}]
    )
    assert second.prompt_id == f"{first.question_id}-t2" and runner.encode(second).tolist() == expected.tolist()
    _, tokens, _ = runner.generate("ar", runner.encode(first))  # a timed baseline generation is reused, not redone
    assert list(runner.answers.values())[0] == tokens


def test_bad_peer_modes_and_readme_fail_in_one_line(tiny, tmp_path, capsys):
    readme = tmp_path / "R.md"
    readme.write_text("no block here\n")
    for extra in (
        ["--peer-modes", "hf-plain"],
        ["--peer", "hf", "--peer-modes", "hf-nonsense"],
        ["--readme", str(readme)],
        ["--readme", str(tmp_path / "missing.md")],
    ):
        assert cli_main(["bench", *base_argv(tiny, tmp_path / "o", *extra)]) == 2, extra
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 4 and all(line.startswith("error:") for line in err), err


def test_float32_outputs_match_ar_without_suspicious_divergence(full_run):
    for m, row in full_run["summary"]["methods"].items():
        if m == "ar":
            continue
        ident = row["identity"]
        assert ident["compared"] == 3, m
        assert ident["suspicious"] == 0, (m, ident["divergences"])


def test_json_stdout_is_the_summary_file(full_run):
    on_disk = json.loads((full_run["out"] / "summary.json").read_text())
    printed = json.loads(full_run["stdout"])
    assert printed == on_disk
    assert on_disk["run_id"] == full_run["summary"]["run_id"]


def test_parquet_is_partitioned_by_run_and_method(full_run):
    import pyarrow.parquet as pq

    out, run = full_run["out"], full_run["summary"]["run_id"]
    trace_dirs = sorted(p.name for p in (out / "traces" / f"run={run}").iterdir())
    assert trace_dirs == sorted(f"method={m}" for m in SPECRAY)  # peers have no per-step traces
    gen_dirs = {p.name for p in (out / "generations" / f"run={run}").iterdir()}
    assert {f"method={m}" for m in full_run["summary"]["methods_order"]} == gen_dirs
    parts = sorted((out / "traces" / f"run={run}" / "method=ngram").glob("part-*.parquet"))
    assert len(parts) == 3  # written after each of the 3 prompts
    t = pq.read_table(parts[0])
    assert t.column_names == [
        "prompt_id",
        "category",
        "repeat",
        "worker",
        "step",
        "drafted",
        "accepted",
        "draft_s",
        "verify_s",
        "looked",
        "config",
    ]
    assert json.loads(t.column("config")[0].as_py())["method"] == "ngram"
    assert t.column("step").to_pylist() == list(range(t.num_rows))
    g = pq.read_table(out / "generations" / f"run={run}" / "method=sps")
    assert g.num_rows == 3 and "identical" in g.column_names and "margin" in g.column_names


def test_trace_rows_agree_with_generation_rows(full_run):
    out, run = full_run["out"], full_run["summary"]["run_id"]
    gens, steps = traces.read_run(out, run, "generations"), traces.read_run(out, run, "traces")
    for m in SPECRAY:
        mine = [r for r in gens if r["method"] == m]
        assert len(mine) == 3
        assert sum(r["steps"] for r in mine) == sum(s["method"] == m for s in steps)
        # every generation: 1 prefill forward + one per step
        assert all(r["target_forwards"] == r["steps"] + 1 for r in mine)
        assert all(s["accepted"] <= s["drafted"] for s in steps if s["method"] == m)
    assert bm.summarize_methods(gens, steps)["methods"]["ngram"]["steps"] == full_run["summary"]["methods"]["ngram"]["steps"]


def test_plots_are_written_as_png(full_run):
    plots = [Path(p) for p in full_run["summary"]["plots"]]
    assert {p.name for p in plots} == {"speedup_by_category.png", "acceptance_by_position.png"}
    for p in plots:
        data = p.read_bytes()
        assert data[:8] == PNG and len(data) > 2000


def test_plain_table_names_every_method(full_run):
    buf = io.StringIO()
    report.render(full_run["summary"], file=buf)
    text = buf.getvalue()
    assert "speedup" in text and "tok/s" in text
    for m in full_run["summary"]["methods_order"]:
        assert f"\n{m} " in text
    assert "specray ar vs hf-plain" in text


# ---- plots come from the Parquet files ---------------------------------------------------------


def test_plots_are_built_from_parquet_files(tmp_path):
    g = bm.gen_row
    gens = [
        g("ar", 1, "A", new_tokens=10, wall_s=1.0, target_forwards=10),
        g("ngram", 1, "A", new_tokens=10, wall_s=0.5, target_forwards=5),
    ]
    steps = [
        {"method": "ngram", "prompt_id": "1", "category": "A", "repeat": 0, "worker": "local", "step": i,
         "drafted": 2, "accepted": a, "draft_s": 0.001, "verify_s": 0.002, "looked": False, "config": "{}"}
        for i, a in enumerate([2, 1, 0])
    ]  # fmt: skip
    traces.TraceWriter(tmp_path, "r1").write(gens, steps)
    paths = report.make_plots(tmp_path, "r1")
    assert len(paths) == 2 and all(p.read_bytes()[:8] == PNG for p in paths)
    assert report.make_plots(tmp_path, "no-such-run") == []  # nothing on disk, nothing to plot
    back = traces.read_run(tmp_path, "r1", "traces")
    assert [r["accepted"] for r in back] == [2, 1, 0] and back[0]["method"] == "ngram"


def test_the_steps_a_model_drafter_looked_up_survive_the_traces_and_reach_the_table(tmp_path):
    """A step that drafted prompt lookup's chain in place of its model drafter's (k=auto's glance) is marked in the
    traces and counted in the summary and the table ("steps drafted": "67% (33% lookup)"); a run traced before the
    column existed reads back with none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from decoding.loop.metrics import StepRecord

    g = bm.gen_row
    gens = [g("ar", 1, "A", new_tokens=3, wall_s=1.0, target_forwards=3), g("eagle", 1, "A", new_tokens=3, wall_s=0.5, target_forwards=2)]
    records = [StepRecord(2, 1, 0.001, 0.002, looked=True), StepRecord(1, 0, 0.001, 0.002), StepRecord(0, 0, 0.0, 0.002)]
    steps = bm.step_rows("eagle", 1, "A", records) + bm.step_rows("ar", 1, "A", [StepRecord(0, 0, 0.0, 0.002)] * 3)
    traces.TraceWriter(tmp_path, "r1").write(gens, steps)
    back = traces.read_run(tmp_path, "r1", "traces")
    assert [r["looked"] for r in back if r["method"] == "eagle"] == [True, False, False]
    figures = bm.summarize_methods(gens, back)["methods"]["eagle"]
    assert figures["steps_looked"] == pytest.approx(1 / 3) and report.drafted_cell(figures) == "67% (33% lookup)"
    old = tmp_path / "traces" / "run=r0" / "method=eagle"
    old.mkdir(parents=True)
    legacy = [{k: v for k, v in r.items() if k not in ("looked", "method", "k", "rows")} for r in steps[:1]]
    pq.write_table(pa.Table.from_pylist(legacy), old / "part-00000.parquet")
    assert [r["looked"] for r in traces.read_run(tmp_path, "r0", "traces")] == [None]


# ---- bad input: one line, exit 2 --------------------------------------------------------------------


def _bad(capsys, tiny, tmp_path, *extra):
    code = cli_main(["bench", *base_argv(tiny, tmp_path / "o"), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    return err


def test_missing_prompt_file(capsys, tiny, tmp_path):
    err = _bad(capsys, tiny, tmp_path, "--prompts", str(tmp_path / "nope.jsonl"))
    assert "nope.jsonl" in err and "does not exist" in err


def test_malformed_jsonl_line_names_file_and_line(capsys, tiny, tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(Path(tiny["prompts"]).read_text() + '{"question_id": 9, "category": "qa", "turns": ["x"]\n')
    err = _bad(capsys, tiny, tmp_path, "--prompts", str(f))
    assert f"{f}:4: not valid JSON" in err


def test_unknown_category_lists_known(capsys, tiny, tmp_path):
    err = _bad(capsys, tiny, tmp_path, "--categories", "qa,poetry")
    assert "unknown category 'poetry'" in err and "known categories: writing, qa, summarization" in err


def test_bad_method_and_bad_knobs(capsys, tiny, tmp_path):
    assert "unknown method 'medusa'" in _bad(capsys, tiny, tmp_path, "--methods", "ar,medusa")
    assert "--repeats" in _bad(capsys, tiny, tmp_path, "--repeats", "0")
    assert "--peer-repeats needs --peer hf" in _bad(capsys, tiny, tmp_path, "--peer-repeats", "1")
    assert "between 1 and --repeats (2)" in _bad(capsys, tiny, tmp_path, "--peer", "hf", "--repeats", "2", "--peer-repeats", "3")
    assert "no_such_field" in _bad(capsys, tiny, tmp_path, "--set", "no_such_field=1")
    # a knob that only the model can check: exit layer beyond the tiny model's 4 layers
    assert "exit_layer" in _bad(capsys, tiny, tmp_path, "--methods", "early-exit", "--set", "exit_layer=9")
    assert not (tmp_path / "o").exists()  # nothing written for a run that never started


# ---- interruption keeps what finished ----------------------------------------------------------------


def test_interrupt_after_first_prompt_keeps_traces_and_summary(tiny, tmp_path):
    seen = []

    def stop(index, prompt):
        seen.append(prompt.question_id)
        raise KeyboardInterrupt

    out = tmp_path / "out"
    code, summary, stdout = run_quiet(base_argv(tiny, out, "--methods", "ngram,early-exit", "--warmup", "0"), on_prompt_done=stop)
    assert code == 130 and seen == [101]
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["interrupted"] is True
    assert on_disk["runs_complete"] == 1 and on_disk["prompts_selected"] == 3
    assert on_disk["methods"]["ngram"]["prompts"] == 1
    for m in ("ar", "ngram", "early-exit"):
        parts = list((out / "traces" / f"run={summary['run_id']}" / f"method={m}").glob("part-*.parquet"))
        assert len(parts) == 1, m
    assert "INTERRUPTED" in stdout
    assert all(Path(p).exists() for p in on_disk["plots"]) and len(on_disk["plots"]) == 2


def test_repeats_report_a_spread(tiny, tmp_path):
    """Each repeat drafts as a run that saw nothing before it: suffix decoding's cache forgets the answers of the
    warm-up and of earlier repeats (else the warm-up's prompt, measured first, and every later repeat copy their
    earlier answers: 32 drafts accepted in 7 steps here instead of 26 in 13)."""
    argv = ["--methods", "ngram,suffix", "--categories", "qa,writing", "--set", "adaptive_k=false", "--max-new-tokens", "40"]
    argv += ["--set", "k=6", "--json"]
    code, s, _ = run_quiet(base_argv(tiny, tmp_path / "o", *argv, "--repeats", "3"))
    assert code == 0 and s["repeats"] == 3 and s["runs_complete"] == 6 and s["prompts_complete"] == 2
    spread = s["methods"]["ngram"]["speedup_per_repeat"]
    assert spread["n"] == 3 and spread["min"] <= spread["median"] <= spread["max"]
    code, alone, _ = run_quiet(base_argv(tiny, tmp_path / "alone", *argv, "--warmup", "0"))  # nothing seen before
    assert code == 0

    def suffix_steps(out, run_id, repeat):
        steps = traces.read_run(out, run_id, "traces")
        mine = [r for r in steps if r["method"] == "suffix" and r["repeat"] == repeat]
        return sorted((r["prompt_id"], r["step"], r["drafted"], r["accepted"]) for r in mine)

    reference = suffix_steps(tmp_path / "alone", alone["run_id"], 0)
    assert reference and all(suffix_steps(tmp_path / "o", s["run_id"], k) == reference for k in range(3))


def test_the_hf_peer_can_run_in_fewer_repeats(tiny, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# r\n\n<!-- bench-results -->\nold\n<!-- /bench-results -->\n")
    argv = ["--methods", "ngram", "--categories", "qa", "--repeats", "2", "--peer", "hf", "--peer-modes", "hf-plain"]
    code, s, _ = run_quiet(base_argv(tiny, tmp_path / "o", *argv, "--peer-repeats", "1", "--readme", str(readme), "--json"))
    assert code == 0 and s["repeats"] == 2 and s["peer_repeats"] == 1 and s["runs_complete"] == 2
    gens = traces.read_run(tmp_path / "o", s["run_id"], "generations")
    assert sorted(r["repeat"] for r in gens if r["method"] == "ngram") == [0, 1]
    assert [r["repeat"] for r in gens if r["method"] == "hf-plain"] == [0]  # the peer ran once
    assert s["methods"]["hf-plain"]["prompts"] == 1 and s["methods"]["hf-plain"]["speedup"] > 0
    assert s["categories"]["qa"]["ar"]["prompts"] == 1 and s["categories"]["qa"]["ar"]["runs"] == 2
    assert ", each run 2 times (the HF modes once)" in readme.read_text()


# ---- on a (local) Ray cluster --------------------------------------------------------------------------


@pytest.mark.cluster
def test_on_cluster_fans_prompts_out_over_actors(tiny, tmp_path):
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        argv = base_argv(tiny, tmp_path / "o", "--methods", "ngram", "--on-cluster", "--workers", "2", "--warmup", "0", "--json")
        code, s, _ = run_quiet(argv)
    finally:
        ray.shutdown()
    assert code == 0 and s["on_cluster"] is True
    assert s["runs_complete"] == 3
    assert set(s["workers"]) == {"worker-0", "worker-1"}  # each worker reports its own AR-relative speedup
    assert sum(w["ar"]["prompts"] for w in s["workers"].values()) == 3
    assert all(w["ngram"]["speedup"] > 0 for w in s["workers"].values())
    pids = {info["pid"] for info in s["worker_info"].values()}
    assert len(pids) == 2  # two actor processes, each with its own model
    assert s["methods"]["ngram"]["identity"]["suspicious"] == 0
