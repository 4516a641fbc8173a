"""`bench --context-tokens`: long prompts from summarization + RAG, per-context figures (tiny random model, byte tokenizer)."""

from __future__ import annotations

import contextlib
import io

import pytest
from tiny_models import build_tiny_model

from jobs import bench
from jobs.cli import main as cli_main


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))  # context 2048, one token per byte


def argv(model, out, *extra):
    knobs = ["triforce_budget=64", "triforce_chunk_size=8", "triforce_sinks=4", "triforce_window=28", "draft_layers=2", "k=4"]
    return (
        ["--model", model, "--dtype", "float32", "--max-new-tokens", "8", "--threads", "1", "--warmup", "0", "--out", str(out)]
        + [x for kv in knobs for x in ("--set", kv)]
        + list(extra)
    )


def test_context_lengths_report_speedup_acceptance_memory_and_attention_share(model, tmp_path, capsys):
    args = bench.build_parser().parse_args(argv(model, tmp_path / "o", "--methods", "triforce", "--context-tokens", "300,5000"))
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code, summary = bench.run_bench(args)
    assert code == 0
    assert "capped at 2040" in capsys.readouterr().err  # 2048 context - 8 new tokens
    assert summary["categories_run"] == ["ctx-300", "ctx-2040"]
    for cat, n in (("ctx-300", 300), ("ctx-2040", 2040)):
        c = summary["contexts"][cat]
        assert c["context_tokens"] == n and 0.0 <= c["attention_share"] < 1.0 and c["forward_ms"] > 0
        tri, ar = c["methods"]["triforce"], c["methods"]["ar"]
        assert tri["speedup"] > 0 and tri["decode_speedup"] > 0 and ar["speedup"] == pytest.approx(1.0)
        assert 0.0 <= tri["top_acceptance"] <= 1.0 and 0.0 <= tri["middle_acceptance"] <= 1.0
        assert set(tri["kv_mb"]) == {"top", "middle", "bottom"} and set(ar["kv_mb"]) == {"top"}
        assert tri["kv_mb"]["middle"] < tri["kv_mb"]["top"]
        assert tri["peak_rss_mb"] is None or tri["peak_rss_mb"] > 10
    assert summary["methods"]["triforce"]["identity"]["identical"] == 2  # float32: token-identical to AR
    assert "long contexts" in out.getvalue() or "attn share" in out.getvalue()


def test_bad_context_tokens_exit_2(model, tmp_path, capsys):
    cases = ((["--context-tokens", "2k"], "--context-tokens"), (["--context-tokens", "300", "--categories", "rag"], "exclude"))
    for extra, needle in cases:
        assert cli_main(["bench", *argv(model, tmp_path / "o", *extra)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
