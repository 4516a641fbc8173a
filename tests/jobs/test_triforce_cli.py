"""`generate --method triforce` on the usual contract: JSON output, and bad knobs as one line with exit code 2."""

import json

import pytest

from jobs.cli import main as cli_main
from jobs.generate import main

SMALL = ["--set", "triforce_budget=8", "--set", "triforce_chunk_size=4", "--set", "triforce_sinks=1", "--set", "triforce_window=4"]


def one_line_error(rc, err, needle):
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    return rc == 2 and len(lines) == 1 and "Traceback" not in err and needle in lines[0]


@pytest.mark.parametrize(
    ("knobs", "needle"),
    [
        (["--set", "triforce_chunk_size=0"], "triforce_chunk_size"),
        (["--set", "triforce_budget=100"], "triforce_budget: must be at least triforce_sinks + triforce_window (256)"),
        (["--set", "triforce_bottom=tree"], "triforce_bottom"),
        (["--set", "triforce_gamma=0"], "triforce_gamma"),
    ],
)
def test_bad_knobs_exit_2(knobs, needle, capsys):
    rc = main(["--method", "triforce", "--prompt", "hi", *knobs])
    err = capsys.readouterr().err
    assert one_line_error(rc, err, needle), err


def test_model_bottom_without_draft_model_exits_2(tiny_model_dir, capsys):
    rc = main(["--model", str(tiny_model_dir), "--method", "triforce", "--prompt", "hi", "--set", "triforce_bottom=model", *SMALL])
    err = capsys.readouterr().err
    assert one_line_error(rc, err, "draft_model"), err


@pytest.mark.parametrize("bottom", ["layers", "ngram", "model"])
def test_json_output(tiny_model_dir, bottom, capsys):
    extra = ["--set", "draft_layers=1"] if bottom == "layers" else ["--set", f"draft_model={tiny_model_dir}"] if bottom == "model" else []
    args = ["--model", str(tiny_model_dir), "--method", "triforce", "--set", f"triforce_bottom={bottom}", *SMALL, *extra]
    args += ["--prompt", "Tell me a story about a cat and a dog", "--chat", "--max-new-tokens", "9", "--json", "--dtype", "float32"]
    rc = cli_main(["generate", *args])  # in process: a subprocess would spend seconds importing torch and transformers
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    out = json.loads(captured.out)
    assert out["method"] == "triforce" and 1 <= len(out["token_ids"]) <= 9
    assert out["stats"]["new_tokens"] == len(out["token_ids"]) and out["stats"]["target_forwards"] >= 1
