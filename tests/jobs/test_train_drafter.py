"""`specray train-drafter` on a tiny random model: data + training + artifact, then `specray bench` runs it as a method;
bad input is one line and exit 2."""

from __future__ import annotations

import json

import pytest
from tiny_models import build_tiny_model, write_prompts

from jobs.cli import main as cli_main
from jobs.common import UsageError
from tests.jobs.test_bench import run_quiet


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    model, prompts = str(build_tiny_model(root / "model", layers=3)), str(write_prompts(root / "q.jsonl", n_per_cat=2))
    argv = ["train-drafter", "--recipe", "kangaroo", "--knob", "exit_layer=1", "--model", model, "--prompts", prompts]
    argv += ["--max-new-tokens", "10", "--steps", "6", "--batch", "2", "--threads", "1", "--data-dtype", "float32"]
    argv += ["--out", str(root / "kangaroo"), "--data-dir", str(root / "data"), "--no-progress", "--json"]
    return root, model, prompts, argv


def test_train_then_bench_as_a_method(trained, capsys, monkeypatch):
    root, model, prompts, argv = trained
    monkeypatch.setenv("SPECRAY_HOME", str(root / "home"))
    assert cli_main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["artifact"] == str(root / "kangaroo") and len(result["agreement_after"]) == 1
    desc = json.loads((root / "kangaroo" / "drafter.json").read_text())
    assert desc["recipe"] == "kangaroo" and desc["knobs"] == {"exit_layer": 1, "draft_vocab": 0} and desc["training"]["steps"] == 6
    assert (root / "data" / "meta.json").exists() and (root / "kangaroo" / "loss.png").exists()

    (root / "home" / "drafters").mkdir(parents=True)
    (root / "home" / "drafters" / "kangaroo-l1").symlink_to(root / "kangaroo")  # an artifact by name
    label = "trained:kangaroo-l1"
    argv = ["--model", model, "--prompts", prompts, "--dtype", "float32", "--max-new-tokens", "12", "--threads", "1"]
    code, summary, _ = run_quiet([*argv, "--methods", f"ngram,{label}", "--limit", "1", "--out", str(root / "bench")])
    assert code == 0 and label in summary["methods"]
    identity = summary["methods"][label]["identity"]
    assert identity["compared"] > 0 and identity["fraction"] == 1.0


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--recipe", "bogus"], "--recipe: unknown recipe"),
        (["--recipe", "medusa", "--knob", "num_heads"], "--knob: expected KEY=INT"),
        (["--recipe", "medusa", "--knob", "exit_layer=3"], "exit_layer: not a knob of recipe 'medusa'"),
        (["--recipe", "medusa", "--steps", "0"], "--steps: must be >= 1"),
        (["--recipe", "medusa", "--strategy", "zero9"], "--strategy: unknown strategy"),
        (["--recipe", "medusa", "--prompts", "/no/such.jsonl"], "prompt file does not exist"),
    ],
)
def test_bad_input_is_one_line_exit_2(trained, capsys, extra, message):
    _, model, prompts, _ = trained
    argv = ["train-drafter", "--model", model, "--prompts", prompts, *extra]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_bench_names_a_missing_artifact(trained, capsys, tmp_path):
    _, model, prompts, _ = trained
    assert cli_main(["bench", "--model", model, "--prompts", prompts, "--methods", "trained:nope", "--out", str(tmp_path)]) == 2
    assert "no trained drafter 'nope'" in capsys.readouterr().err
    assert cli_main(["bench", "--model", model, "--prompts", prompts, "--methods", "trained:/a/path", "--out", str(tmp_path)]) == 2
    assert "--set drafter=PATH" in capsys.readouterr().err


def test_generate_with_method_flag_and_drafter_set(trained, capsys):
    """--method trained and --set drafter=... arrive from different flags and are validated together."""
    root, model, _, _ = trained
    argv = ["generate", "--model", model, "--method", "trained", "--set", "drafter=nope", "--prompt", "hi", "--dtype", "float32"]
    assert cli_main(argv) == 2
    assert "no trained drafter 'nope'" in capsys.readouterr().err  # the drafter was seen, not 'needs drafter=NAME'


def test_trained_heads_draft_trees_in_the_tree_bench(trained, capsys, monkeypatch):
    """A Medusa artifact runs as chains and as token trees in jobs.bench_trees, identical to AR."""
    from jobs.bench_trees import build_parser
    from jobs.bench_trees import main_with_args as bench_trees

    root, model, prompts, _ = trained
    home = root / "home-trees"
    monkeypatch.setenv("SPECRAY_HOME", str(home))
    argv = ["train-drafter", "--recipe", "medusa", "--knob", "num_heads=3", "--model", model, "--prompts", prompts]
    argv += ["--max-new-tokens", "10", "--steps", "4", "--batch", "2", "--threads", "1", "--data-dtype", "float32"]
    argv += ["--name", "medusa-3", "--data-dir", str(root / "data"), "--no-progress", "--json"]
    assert cli_main(argv) == 0
    capsys.readouterr()
    argv = ["--drafters", "trained:medusa-3", "--chain-k", "2", "--shapes", "sequoia,dyspec", "--budgets", "4", "--depth", "3"]
    argv += ["--model", model, "--prompts", prompts, "--limit", "1", "--max-new-tokens", "12", "--dtype", "float32"]
    argv += ["--threads", "1", "--warmup", "0", "--out", str(root / "bench-trees")]
    assert bench_trees(build_parser().parse_args(argv)) == 0
    summary = json.loads((root / "bench-trees" / "summary.json").read_text())["summary"]["methods"]
    for label in ("trained:medusa-3/chain-k2", "trained:medusa-3/sequoia-n4", "trained:medusa-3/dyspec-n4"):
        assert summary[label]["identity"]["fraction"] == 1.0 and summary[label]["identity"]["compared"] > 0
    argv[1] = "trained:/a/path"
    with pytest.raises(UsageError, match="name an artifact"):
        bench_trees(build_parser().parse_args(argv))
