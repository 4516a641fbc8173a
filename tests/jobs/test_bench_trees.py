"""`python -m jobs.bench_trees` on a tiny random-weight Llama: chains and trees side by side, identical to AR."""

from __future__ import annotations

import contextlib
import io
import json

from tiny_models import build_tiny_model, write_prompts

from jobs.bench_trees import build_parser, main_with_args


def test_chains_and_trees_of_one_drafter_side_by_side(tmp_path):
    model, prompts = build_tiny_model(tmp_path / "model"), write_prompts(tmp_path / "q.jsonl")
    argv = ["--model", str(model), "--prompts", str(prompts), "--dtype", "float32", "--max-new-tokens", "10", "--threads", "1"]
    argv += ["--drafters", "ngram", "--chain-k", "2,3", "--shapes", "dyspec", "--budgets", "4,8", "--limit", "1"]
    argv += ["--categories", "writing,qa", "--out", str(tmp_path / "out")]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main_with_args(build_parser().parse_args(argv)) == 0
    doc = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert set(doc["summary"]["methods"]) == {"ar", "ngram/chain-k2", "ngram/chain-k3", "ngram/dyspec-n4", "ngram/dyspec-n8"}
    for name, v in doc["summary"]["methods"].items():
        if name != "ar":
            assert v["identity"]["identical"] == v["identity"]["compared"] == 2, name  # float32 greedy: every variant equals AR
    report = doc["trees"]["ngram"]
    assert report["best_chain"].startswith("ngram/chain-") and report["best_tree"].startswith("ngram/dyspec-")
    assert "ngram: best chain" in out.getvalue()
