"""`python -m jobs.bench_variants` on a tiny random-weight Llama: several configs of one method beside AR, EAD's
divergence measured and plotted, bad variants one line."""

from __future__ import annotations

import contextlib
import io
import json

from tests_support import assert_one_line_error
from tiny_models import build_tiny_model, write_prompts

from jobs.bench_variants import build_parser, main, main_with_args


def test_variants_side_by_side_with_eads_tradeoff(tmp_path):
    model, prompts = build_tiny_model(tmp_path / "model", layers=3, weight_std=0.5), write_prompts(tmp_path / "q.jsonl")
    head = _head(tmp_path / "head", model)
    argv = ["--model", str(model), "--prompts", str(prompts), "--dtype", "float32", "--max-new-tokens", "16", "--threads", "1"]
    argv += ["--limit", "1", "--categories", "writing,qa", "--out", str(tmp_path / "out"), "--set", "draft_layers=1"]
    argv += ["--variant", "sps-k2=sps:k=2", "--variant", f"sps-stop=sps:k=6,stop_head={head},stop_threshold=0.5"]
    argv += ["--variant", "ead-low=ead:ead_threshold=0.5", "--variant", "ead-high=ead:ead_threshold=9"]
    argv += ["--plot-lossy", str(tmp_path / "ead.png")]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main_with_args(build_parser().parse_args(argv)) == 0
    doc = json.loads((tmp_path / "out" / "summary.json").read_text())
    methods = doc["methods"]
    assert list(methods) == ["ar", "sps-k2", "sps-stop", "ead-low", "ead-high"]
    for name in ("sps-k2", "sps-stop"):
        assert methods[name]["identity"]["identical"] == methods[name]["identity"]["compared"] == 2 and not methods[name]["lossy"]
    low, high = methods["ead-low"]["divergence"], methods["ead-high"]["divergence"]
    assert methods["ead-low"]["lossy"] and high["large_share"] < low["large_share"]  # a higher threshold: the small model writes more
    assert high["differ_share"] > 0  # unverified small-model tokens: not AR's output
    assert (tmp_path / "ead.png").stat().st_size > 0 and "ead-high (LOSSY)" in out.getvalue()


def _head(path, model_dir):
    """A stop head artifact for the tiny model (untrained: these tests need one that loads, not one that predicts)."""
    from decoding.drafters.artifacts import save_artifact
    from decoding.drafters.stop_head import StopHead
    from decoding.model.loading import load_model

    target = load_model(str(model_dir), "float32").model
    return save_artifact(path, "stop", {"source": "exit", "hidden": 4}, StopHead(4), target, "tiny", training={"steps": 1})


def test_bad_variants_are_one_line(capsys):
    for argv, needle in (
        (["--variant", "ar=ngram"], "NAME other than ar"),
        (["--variant", "x=ngram:k=0"], "k"),
        (["--variant", "x=nope"], "method"),
        ([], "at least one"),
    ):
        assert_one_line_error(main(argv), capsys.readouterr().err, needle)
