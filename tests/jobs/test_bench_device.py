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
    assert summary["batched_capture_s"] == {"1": 0.0, "2": 0.0}  # graph capture inside the timed batches: none on a CPU
    assert all(v > 0 for part in ("one_stream", "batched_ar", "under_load") for v in summary[part].values())
    written = readme.read_text()
    assert "old" not in written and written.endswith("after\n") and "| batched AR, rows | 1 | 2 |" in written
    capsys.readouterr()
    readme.write_text("# x\n")  # no block yet: appended
    assert main(["--from-json", str(tmp_path / "out" / "device.json"), "--readme", str(readme), "--block", "gpu"]) == 0
    again = readme.read_text()
    assert "<!-- device-results:gpu -->" in again and again.count("| one stream, tokens/s |") == 1


def test_rendering_adds_a_bench_runs_categories(tmp_path, capsys):
    """--categories: the bench's per-category tables join the device's in the block (the GPU script's two figures)."""
    device = {"device": "X", "device_type": "cuda", "dtype": "bfloat16", "implementation": "layers-graphs", "threads": 1,
              "max_new_tokens": 8, "one_stream": {"specray-ar": 10.0}, "batched_ar": {"1": 10.0}, "spec_rows": 2,
              "under_load": {"ar": 10.0}, "command": "c"}  # fmt: skip
    (tmp_path / "device.json").write_text(json.dumps(device))
    method = {"kind": "specray", "prompts": 1, "tokens_per_s": 20.0, "speedup": 2.0, "mean_accepted_tokens": 2.0, "steps_drafted": 1.0,
              "draft_ms_per_step": 1.0, "verify_ms_per_step": 1.0, "identity": None, "lossy": False}  # fmt: skip
    bench = {"baseline": "ar", "methods_order": ["ar", "ngram"], "methods": {"ar": {**method, "speedup": 1.0}, "ngram": method},
             "categories": {"writing": {"ar": {"prompts": 1, "speedup": 1.0}, "ngram": {"prompts": 1, "speedup": 2.0}}}}  # fmt: skip
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    readme = tmp_path / "README.md"
    readme.write_text("# x\n")
    argv = ["--from-json", str(tmp_path / "device.json"), "--categories", str(tmp_path / "bench.json")]
    argv += ["--readme", str(readme), "--block", "gpu"]
    assert main(argv) == 0
    text = readme.read_text()
    assert "| ngram | 2.00 | **2.00** | 2.00 | 2.00 | 100% |" in text and "| one stream, tokens/s |" in text and "20 tokens/s" in text
    capsys.readouterr()
    (tmp_path / "bad.json").write_text("{}")
    assert_one_line_error(main(argv[:3] + [str(tmp_path / "bad.json")] + argv[4:]), capsys.readouterr().err, "--categories")


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
