"""specray bench-serve: its figures from request records, its README table, and one short real run through HTTP."""

import json

import pytest

from jobs.bench_serve import main, percentile, results_table, summarize_wave, update_readme


def test_wave_figures():
    reqs = [
        {"ok": True, "tokens": 10, "ttft_s": 0.5, "itl_s": [0.1, 0.1, 0.3]},
        {"ok": True, "tokens": 20, "ttft_s": 2.0, "itl_s": [0.2]},
        {"ok": False, "tokens": 0, "ttft_s": None, "itl_s": []},
    ]
    fig = summarize_wave(reqs, wall=2.0, slo_ttft=1.0, slo_itl=0.5)
    assert fig["completed"] == 2 and fig["requests"] == 3 and fig["tokens"] == 30
    assert fig["tokens_per_s"] == 15.0 and fig["requests_per_s"] == 1.0
    assert fig["goodput_tokens_per_s"] == 5.0  # only the first met the TTFT objective
    assert fig["ttft_p50_s"] == 1.25 and fig["itl_p99_s"] == pytest.approx(percentile([0.1, 0.1, 0.3, 0.2], 99))
    assert percentile([], 50) is None


def test_readme_block_is_rewritten_in_place(tmp_path):
    summary = {
        "model": "m",
        "dtype": "bfloat16",
        "threads": 2,
        "max_tokens": 8,
        "entries": {"ngram": {"k": 4, "adaptive_k": True}},
        "rows": [
            {
                "method": m,
                "concurrency": c,
                "tokens_per_s": t,
                "speedup_vs_batched_ar": t / a,
                "vs_one_stream_ar": a / 10.0,
                "ttft_p99_s": 0.5,
                "itl_p99_s": 0.1,
            }
            for c, a, n in [(1, 10.0, 14.0), (16, 60.0, 59.0)]
            for m, t in [("ar", a), ("ngram", n)]
        ],
        "in_process": {"specray_inprocess_ar": {"1": 11.0, "16": 70.0}, "hf_padded_generate": {"1": 10.0, "16": 50.0}},
    }
    table = results_table(summary)
    assert "| 16 | 60.0 | 59.0 | 0.98x | 6.00x | 0.50 | 100 | 1.40x |" in table
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- load-results -->\nold\n<!-- /load-results -->\n\nafter\n")
    update_readme(readme, summary, tmp_path / "load.png")
    text = readme.read_text()
    assert "old" not in text and table in text and text.endswith("after\n") and "ngram: k=4, adaptive_k=True" in text


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


def test_bad_flags_fail_in_one_line(capsys):
    assert main(["--concurrency", "1,x"]) == 2
    assert main(["--rate", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error:") for line in err)
