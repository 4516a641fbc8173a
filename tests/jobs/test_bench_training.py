"""``specray bench-training``: one sequence at a time against one batch, side by side, on the bundled model and the
committed data; bad input fails in one line."""

import json

import pytest

from jobs.bench_training import main


@pytest.mark.slow
def test_both_modes_train_the_same_steps_and_print_their_ratio(capsys):
    assert main(["--only", "kangaroo-l6", "--steps", "2", "--batch", "2", "--max-sequences", "8", "--threads", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    for mode in ("one-by-one", "batched"):
        assert len(result[mode]["runs"]) == 2 and all(v > 0 for v in result[mode]["runs"])
    ratio = result["one-by-one"]["seconds_per_step"] / result["batched"]["seconds_per_step"]
    assert result["speedup"] == round(ratio, 2) and result["device"] == "cpu" and result["steps_timed"] == 1


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--only", "stop-eagle"], "--only: expected a shipped drafter trained step by step"),
        (["--steps", "1"], "--steps must be >= 2"),
        (["--data", "/nonexistent"], "is not a `specray distill` data directory"),
    ],
)
def test_bad_input_fails_in_one_line(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and err.count("\n") == 1
