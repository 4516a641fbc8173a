"""specray bench-serve and bench-http: short real runs through HTTP on the tiny model."""

import json

import pytest

from jobs.bench_serve import main


@pytest.mark.cluster
def test_a_short_sweep_through_http(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "load"
    code = main(
        [
            "--model",
            str(tiny_model_dir),
            "--dtype",
            "float32",
            "--methods",
            "ar,ngram",
            "--concurrency",
            "1,3",
            "--max-tokens",
            "6",
            "--threads",
            "1",
            "--check",
            "--peer",
            "hf",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert "left out" in captured.err  # the tiny model's 512-token context cannot hold the long RAG/summary prompts
    rows = json.loads(captured.out.strip().splitlines()[-1])
    assert {(r["method"], r["concurrency"]) for r in rows} == {("ar", 1), ("ar", 3), ("ngram", 1), ("ngram", 3)}
    assert all(r["completed"] == r["requests"] and r["tokens"] > 0 for r in rows)
    assert all(r["mismatched"] == 0 for r in rows)  # float32: every stream says what it says alone
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["in_process"]) == {"specray_inprocess_ar", "hf_padded_generate"}
    assert (out / "load.png").stat().st_size > 10_000 and (out / "load.parquet").exists() and (out / "requests.parquet").exists()


@pytest.mark.cluster
def test_http_overhead_and_a_few_streams(tiny_model_dir, capsys):
    from jobs.bench_http import main as bench_http

    args = ["--model", str(tiny_model_dir), "--method", "ngram", "--tokens", "6", "--repeats", "1", "--load", "3"]
    assert bench_http(args) == 0
    result = json.loads([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")][-1])
    assert result["identical_text"] and set(result["median_s"]) == {"in_process", "http", "http_stream"}
    assert result["ratio_http"] > 0 and result["load"]["completed"] == 3 and result["load"]["tokens"] > 0


def test_bad_flags_fail_in_one_line(capsys):
    assert main(["--concurrency", "1,x"]) == 2
    assert main(["--rate", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error:") for line in err)
