"""The `specray generate` contract: JSON shape, and one-line errors with exit code 2."""

import json

import pytest
from tests_support import assert_one_line_error

from jobs.generate import main


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--method", "medusa", "--prompt", "hi"], "method"),
        (["--prompt", "hi", "--set", "k=0"], "k"),
        (["--prompt", "hi", "--temperature", "-0.5"], "temperature"),
        (["--prompt", "   "], "empty"),
        (["--prompt", "hi", "--set", "nonsense=1"], "nonsense"),
        (["--prompt", "hi", "--top-p", "0"], "top_p"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "/nonexistent/prompt.txt"),
        (["--prompt", "hi", "--dtype", "float16"], "dtype"),
    ],
)
def test_cheap_bad_input_exits_2_in_process(args, needle, capsys):
    # these fail before any model loads; in-process keeps the test fast
    rc = main(args)
    assert_one_line_error(rc, capsys.readouterr().err, needle)


def test_unknown_model(capsys):
    rc = main(["--prompt", "hi", "--model", "no-such-model"])
    assert_one_line_error(rc, capsys.readouterr().err, "no-such-model")


def test_exit_layer_outside_model(tiny_model_dir, capsys):
    rc = main(["--model", str(tiny_model_dir), "--method", "early-exit", "--set", "exit_layer=2", "--prompt", "hi"])
    assert_one_line_error(rc, capsys.readouterr().err, "exit_layer")


def test_context_overflow(tiny_model_dir, capsys):
    rc = main(["--model", str(tiny_model_dir), "--prompt", "hello there", "--max-new-tokens", "600"])
    assert_one_line_error(rc, capsys.readouterr().err, "context")


@pytest.mark.parametrize("method", ["ar", "sps", "ngram", "early-exit"])
def test_json_output_shape(tiny_model_dir, method, capsys):
    overrides = {"sps": ["--set", "draft_layers=1"], "early-exit": ["--set", "exit_layer=1"]}.get(method, [])
    rc = main(
        [
            "--model",
            str(tiny_model_dir),
            "--method",
            method,
            "--prompt",
            "Tell me a story",
            "--chat",
            "--max-new-tokens",
            "7",
            "--json",
            "--dtype",
            "float32",
            *overrides,
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == method
    assert len(out["token_ids"]) <= 7 and isinstance(out["text"], str)
    for key in ("new_tokens", "wall_s", "tokens_per_s", "target_forwards", "mean_accepted_tokens"):
        assert key in out["stats"], key
    assert out["stats"]["new_tokens"] == len(out["token_ids"])


def test_console_script_lists_commands():
    from jobs.cli import main as cli_main

    assert cli_main(["--help"]) == 0
    assert cli_main(["frobnicate"]) == 2


def test_compile_is_opt_in():
    """--compile (or --set compile=true, or a config file) turns on the compiled stack; nothing given leaves it off."""
    import argparse

    from jobs.common import add_config_args, config_from_args

    parser = argparse.ArgumentParser()
    add_config_args(parser)
    assert config_from_args(parser.parse_args([])).compile is False
    assert config_from_args(parser.parse_args(["--compile"])).compile is True
    assert config_from_args(parser.parse_args(["--set", "compile=true"])).compile is True
