"""``specray bench-device`` on the CPU with a tiny model: the three figures side by side in one run, device.json, the
README block, and the block rendered again from device.json alone (as after a GPU machine's run)."""

import json

from tests_support import assert_one_line_error

from jobs.bench_device import main


def test_bench_device_measures_writes_and_renders_again(tiny_model_dir, tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- device-results:cpu -->\nold\n<!-- /device-results:cpu -->\n\nafter\n")
    argv = ["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--threads", "1", "--prompts", "1",
            "--max-new-tokens", "4", "--rows", "1,2", "--spec-rows", "2", "--methods", "ngram", "--peer-modes", "hf-plain",
            "--out", str(tmp_path / "out"), "--readme", str(readme)]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((tmp_path / "out" / "device.json").read_text())
    assert summary["device_type"] == "cpu" and set(summary["one_stream"]) == {"specray-ar", "hf-plain"}
    assert set(summary["batched_ar"]) == {"1", "2"} and set(summary["under_load"]) == {"ar", "ngram"}
    assert all(v > 0 for part in ("one_stream", "batched_ar", "under_load") for v in summary[part].values())
    written = readme.read_text()
    assert "old" not in written and written.endswith("after\n") and "| batched AR, rows | 1 | 2 |" in written
    capsys.readouterr()
    readme.write_text("# x\n")  # no block yet: appended
    assert main(["--from-json", str(tmp_path / "out" / "device.json"), "--readme", str(readme), "--block", "gpu"]) == 0
    again = readme.read_text()
    assert "<!-- device-results:gpu -->" in again and again.count("| one stream, tokens/s |") == 1


def test_bad_input_fails_in_one_line(tmp_path, capsys):
    bad = tmp_path / "device.json"
    bad.write_text("{}")
    for argv, needle in (
        (["--from-json", str(bad)], "--from-json"),
        (["--rows", "0"], "--rows"),
        (["--prompts", "0"], "--prompts"),
        (["--methods", "nosuch"], "method"),
    ):
        assert_one_line_error(main(argv), capsys.readouterr().err, needle)
