"""`specray ship-drafters`: retrains shipped drafters from distill data, publishes the artifacts and the curves."""

from __future__ import annotations

import json

import pytest
from tests_support import assert_one_line_error
from tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A 6-layer tiny model (the shipped distilled draft has 4 layers) and a small distill data set it wrote (one shard,
    a held-out prompt forced in)."""
    from decoding.config import SpecConfig
    from decoding.in_process import SpecDecoder
    from training import corpus
    from training.distill_data import DistillSpec, _write_manifest, run_shard, shard_path, write_shard

    root = tmp_path_factory.mktemp("ship")
    model = build_tiny_model(root / "model", layers=6, hidden=32, context=512, weight_std=0.5)
    spec = DistillSpec(model=str(model), dtype="float32", max_new_tokens={"1": 24, "2": 24, "3": 24}, rows=4)
    dec = SpecDecoder(SpecConfig(model=str(model), dtype="float32", threads=1))
    prompts = corpus.first_turn_prompts(seed=0, per_kind=2)[:10]
    prompts[-1]["split"] = "heldout"
    data = root / "data"
    write_shard(shard_path(data, 2, 0), run_shard(dec, prompts, 2, spec))
    _write_manifest(data, {"spec": spec.to_dict(), "shards": {}, "phases": {}})
    return model, data, root


def test_ship_drafters_trains_publishes_and_plots(tiny_data, capsys):
    from decoding.drafters.artifacts import load_artifact
    from decoding.model.loading import load_model
    from jobs.ship_drafters import main

    model, data, root = tiny_data
    argv = ["--model", str(model), "--data", str(data), "--only", "eagle,distill", "--steps-scale", "0.004", "--batch", "3"]
    argv += ["--shipped", str(root / "shipped"), "--docs", str(root / "docs"), "--no-progress", "--json", "--threads", "1"]
    assert main(argv) == 0
    results = json.loads(capsys.readouterr().out)
    assert set(results) == {"eagle", "distill"} and {r["batch"] for r in results.values()} == {3}
    target = load_model(str(model), "float32").model
    for name in results:
        art = load_artifact(str(root / "shipped" / name), target)  # published, loadable, fingerprinted to the model
        assert art.recipe.name == name and not (root / "shipped" / name / "checkpoint.pt").exists()
    assert (root / "docs" / "learning_curves.png").stat().st_size > 0
    assert json.loads((root / "docs" / "training.json").read_text())["eagle"]["steps"] == 12
    runs = json.loads((root / "docs" / "agreement_vs_data.json").read_text())  # one row per training, kept across runs
    assert sorted(r["drafter"] for r in runs) == ["distill", "eagle"]
    from training.features import distill_training_set
    from training.runs import held_out_name

    held_out = held_out_name(data, distill_training_set(data, None, 64)[1])  # the set each row was measured on
    assert held_out.startswith(f"{data}#") and {(r["device"], r["eval_set"]) for r in runs} == {("cpu", held_out)}
    assert all(
        r["train_sequences"] == results[r["drafter"]]["train_sequences"] and (r["steps"], r["batch"]) == (results[r["drafter"]]["steps"], 3)
        for r in runs
    )
    assert (root / "docs" / "agreement_vs_data.png").stat().st_size > 0


def test_init_shipped_trains_the_shipped_drafter_further(tiny_data, tmp_path, capsys):
    """``--init shipped``: each drafter starts from its shipped artifact (its weights and trimmed vocabulary): from its
    weights as trained while its run's checkpoint is in ``$SPECRAY_HOME/ship``, else as stored; so its held-out
    agreement before training is the shipped one's, as trained or as stored. The record names the start portably."""
    import torch

    from decoding.drafters.artifacts import load_artifact
    from decoding.model.loading import load_model
    from jobs.ship_drafters import main

    model, data, _ = tiny_data
    argv = ["--model", str(model), "--data", str(data), "--only", "eagle", "--steps-scale", "0.004", "--shipped", str(tmp_path / "shipped")]
    argv += ["--docs", str(tmp_path / "docs"), "--no-progress", "--json", "--threads", "1"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)["eagle"]
    target = load_model(str(model), "float32").model
    vocab = load_artifact(str(tmp_path / "shipped" / "eagle"), target).module.lm_head.vocab.clone()
    assert main([*argv, "--init", "shipped", "--lr-scale", "0.5"]) == 0
    second = json.loads(capsys.readouterr().out)["eagle"]
    assert second["agreement_before"] == pytest.approx(first["agreement_after"], abs=1e-6)  # the weights as trained
    from decoding.paths import specray_home
    from training.features import distill_training_set
    from training.trainer import TrainSpec, _session, draws

    start = json.loads((tmp_path / "shipped" / "eagle" / "drafter.json").read_text())["training"]["spec"]
    ckpt = torch.load(specray_home() / "ship" / model.name / "eagle-init" / "checkpoint.pt", weights_only=False)
    train_set, eval_set = distill_training_set(data)
    session = _session(TrainSpec(**start), target, train_set, (0, 1), None, eval_set)
    assert all(torch.equal(v, ckpt["module"][k]) for k, v in session.module.state_dict().items())  # started from them

    for run in ("eagle", "eagle-shipped"):  # the shipped run's float weights are gone (kept in eagle-shipped too)
        (specray_home() / "ship" / model.name / run / "checkpoint.pt").unlink()
    assert main([*argv, "--init", "shipped", "--lr-scale", "0.5"]) == 0
    third = json.loads(capsys.readouterr().out)["eagle"]
    assert third["agreement_before"] == pytest.approx(second["agreement_stored"], abs=1e-6)  # the weights as stored
    desc = json.loads((tmp_path / "shipped" / "eagle" / "drafter.json").read_text())
    assert desc["training"]["spec"]["init"].endswith("eagle-init") and not desc["training"]["spec"]["init"].startswith("/")
    assert desc["training"]["spec"]["lr"] == pytest.approx(0.5e-3)
    # each warm start draws other sequences than the run it continues: its start's seed + 1 (0, 1, 2), unless --seed
    assert (start["seed"], desc["training"]["spec"]["seed"]) == (1, 2)
    assert draws(TrainSpec(**start), 100, 0)[1] != draws(TrainSpec(**desc["training"]["spec"]), 100, 0)[1]
    assert main([*argv, "--init", "shipped", "--seed", "7"]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "shipped" / "eagle" / "drafter.json").read_text())["training"]["spec"]["seed"] == 7
    assert torch.equal(load_artifact(str(tmp_path / "shipped" / "eagle"), target).module.lm_head.vocab, vocab)
    code = main([*argv[:-6], "--shipped", str(tmp_path / "none"), "--docs", str(tmp_path / "docs"), "--init", "shipped"])
    assert_one_line_error(code, capsys.readouterr().err, "no artifact to start")


def test_repack_rewrites_the_shipped_artifacts_and_measures_them(tiny_data, tmp_path, capsys, monkeypatch):
    """``--repack`` trains nothing: an artifact in the old dense format (1) is rewritten in the current one, its
    training record kept, its held-out agreement measured before and after; from the weights as trained while its
    run's checkpoint holds them, else from the weights as stored."""
    import copy
    import shutil

    import torch
    from safetensors.torch import save_file

    from decoding.drafters.artifacts import FORMAT, load_artifact, stored_copy
    from decoding.drafters.storage import Storage
    from decoding.model.loading import load_model
    from jobs.ship_drafters import main
    from training.runs import SHIPPED_RECIPES

    monkeypatch.setenv("SPECRAY_HOME", str(tmp_path / "home"))  # the run's checkpoint lands here
    model, data, root = tiny_data
    shipped = tmp_path / "shipped"
    argv = ["--model", str(model), "--data", str(data), "--only", "distill", "--steps-scale", "0.004", "--shipped", str(shipped)]
    argv += ["--docs", str(tmp_path / "docs"), "--no-progress", "--json", "--threads", "1"]
    assert main(argv) == 0
    capsys.readouterr()
    target = load_model(str(model), "float32").model
    art = load_artifact(str(shipped / "distill"), target)
    dense = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in art.module.state_dict().items()}
    save_file(dense, str(shipped / "distill" / "drafter.safetensors"))  # as format 1 stored it
    desc = json.loads((shipped / "distill" / "drafter.json").read_text())
    trained = desc["training"]
    (shipped / "distill" / "drafter.json").write_text(json.dumps({**desc, "format": 1}))
    shutil.rmtree(tmp_path / "docs")
    assert main(["--model", str(model), "--data", str(data), "--only", "distill", "--shipped", str(shipped), "--repack", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["distill"]
    after = json.loads((shipped / "distill" / "drafter.json").read_text())
    assert after["format"] == FORMAT and after["storage"]["bytes"] == result["bytes_after"]
    assert after["training"]["steps"] == trained["steps"] and after["training"]["repacked"]["from_format"] == 1
    assert result["agreement_before"] == after["training"]["repacked"]["eval_agreement_before"] and len(result["agreement_before"]) == 1
    assert result["agreement_stored"] == after["training"]["eval_agreement_stored"] and 0 <= result["agreement_stored"][0] <= 1
    assert not (tmp_path / "docs").exists()  # no training: no curves, no record
    assert result["from_checkpoint"] and after["training"]["repacked"]["from"].startswith("the weights as trained")
    ckpt_path = tmp_path / "home" / "ship" / model.name / "distill-shipped" / "checkpoint.pt"  # the shipped run's, kept
    ckpt = torch.load(ckpt_path, weights_only=False)
    art = load_artifact(str(shipped / "distill"), target)
    loaded = {k: v.clone() for k, v in art.module.state_dict().items()}
    module = copy.deepcopy(art.module).float()
    module.load_state_dict(ckpt["module"])
    storage = Storage(**SHIPPED_RECIPES["distill"].storage)  # the drafter's own encoding, as --repack uses
    expected = stored_copy(module, "distill", art.knobs, target, storage).state_dict()
    assert all(torch.equal(loaded[k], v.to(loaded[k].dtype)) for k, v in expected.items())  # the weights as trained, stored once
    assert not all(torch.equal(loaded[k], v.to(loaded[k].dtype)) for k, v in ckpt["module"].items())  # and stored: rounded
    torch.save({**ckpt, "step": ckpt["step"] + 1}, ckpt_path)  # another run's checkpoint: the stored weights are used
    assert main(["--model", str(model), "--data", str(data), "--only", "distill", "--shipped", str(shipped), "--repack", "--json"]) == 0
    assert not json.loads(capsys.readouterr().out)["distill"]["from_checkpoint"]
    code = main(["--model", str(model), "--data", str(data), "--only", "eagle", "--shipped", str(shipped), "--repack"])
    assert_one_line_error(code, capsys.readouterr().err, "no artifact to repack")


def test_bad_input_fails_in_one_line(tiny_data, tmp_path, capsys):
    from jobs.ship_drafters import main

    model, data, _ = tiny_data
    for argv, needle in (
        (["--only", "eagle,nope", "--data", str(data)], "nope"),
        (["--data", str(tmp_path)], "manifest.json"),
        (["--data", str(data), "--steps-scale", "0"], "steps-scale"),
        (["--data", str(data), "--batch", "0"], "--batch"),
    ):
        assert_one_line_error(main(argv), capsys.readouterr().err, needle)


def test_ship_drafters_fits_the_stop_head_on_rows_computed_once(tiny_data, capsys):
    """The stop head (SpecDec++) ships like the drafters: its rows (features of the target's exits, agreement labels)
    are computed once and fitted at once; its record says how well it predicts acceptance on held-out sequences; and a
    drafter that stops with it is still AR's greedy output."""
    from decoding.config import SpecConfig
    from decoding.in_process import SpecDecoder
    from jobs.ship_drafters import main

    model, data, root = tiny_data
    argv = ["--model", str(model), "--data", str(data), "--only", "stop-exit", "--steps-scale", "0.03"]
    argv += ["--shipped", str(root / "shipped"), "--docs", str(root / "docs-stop"), "--no-progress", "--json", "--threads", "1"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)["stop-exit"]
    assert result["train_answer_tokens"] > 20 and 0.0 <= result["eval"]["auc"] <= 1.0
    desc = json.loads((root / "shipped" / "stop-exit" / "drafter.json").read_text())
    assert desc["recipe"] == "stop" and desc["training"]["train_windows"] == 6  # 3 steps x 2 windows, each computed once
    assert desc["training"]["eval"]["rows"] > 0 and len(desc["training"]["eval"]["calibration"]) > 0
    assert (root / "shipped" / "stop-exit" / "drafter.safetensors").stat().st_size < 2048
    base = SpecConfig(model=str(model), dtype="float32", threads=1, max_new_tokens=24, method="early-exit", exit_layer=3, k=6)
    stopped = base.replace(stop_threshold=0.5, stop_head=str(root / "shipped" / "stop-exit"))
    ids = SpecDecoder(base).encode("Tell me a story")
    assert SpecDecoder(stopped).generate_ids(ids).token_ids == SpecDecoder(base.replace(method="ar")).generate_ids(ids).token_ids


def test_the_check_set_keeps_a_worse_drafter_from_shipping(tiny_data, tmp_path, capsys):
    """``--ship better`` (the default): a retrained drafter replaces the shipped one only where its agreement with the
    target on the check set (the target's answers to the last prompts of each Spec-Bench category) is not lower. A
    barely trained head (learning rate x 1e-6) is kept from replacing a trained one: the shipped artifact, the record,
    the curves and the shipped run's weights as trained stay; ``--ship always`` ships it; ``--check`` measures the
    shipped drafters by category."""
    from training.check_set import better

    model, data, _ = tiny_data
    shipped, docs = tmp_path / "shipped", tmp_path / "docs"
    argv = ["--model", str(model), "--data", str(data), "--only", "eagle", "--shipped", str(shipped), "--docs", str(docs)]
    argv += ["--no-progress", "--json", "--threads", "1", "--check-per-category", "1"]
    first = main_ok([*argv, "--steps-scale", "0.03"], capsys)["eagle"]
    assert first["shipped"] and "check" not in first  # nothing shipped yet: no check
    weights = (shipped / "eagle" / "drafter.safetensors").read_bytes()
    record = json.loads((docs / "training.json").read_text())["eagle"]
    curves = (docs / "learning_curves.png").stat().st_mtime_ns

    worse = main_ok([*argv, "--steps-scale", "0.004", "--lr-scale", "1e-6", "--seed", "3"], capsys)["eagle"]
    check = worse["check"]
    assert len(check["new"]["agreement"]) == 3 and check["new"]["tokens"] > 0 and 5 <= len(check["new"]["by_category"]) <= 13
    assert check["ship"] is False and not better(check["new"]["agreement"], check["shipped"]["agreement"])
    assert worse["shipped"] is None and worse["artifact"].endswith("eagle")
    assert (shipped / "eagle" / "drafter.safetensors").read_bytes() == weights  # the shipped one stays
    assert json.loads((docs / "training.json").read_text())["eagle"] == record
    assert (docs / "learning_curves.png").stat().st_mtime_ns == curves  # a run not shipped is not drawn over the shipped one
    rows = json.loads((docs / "agreement_vs_data.json").read_text())
    assert [r["shipped"] for r in rows] == [True, False] and rows[-1]["check_agreement"]["new"] == check["new"]["agreement"]

    from jobs.ship_drafters import main

    assert main([*argv, "--check"]) == 0
    measured = json.loads(capsys.readouterr().out)["eagle"]
    assert measured == check["shipped"]  # the same weights, the same answers
    # the shipped run's weights as trained outlive the run that was not shipped (kept in eagle-shipped): a warm start
    # begins from them
    forced = main_ok([*argv, "--steps-scale", "0.004", "--lr-scale", "1e-6", "--init", "shipped", "--ship", "always"], capsys)["eagle"]
    assert forced["agreement_before"] == pytest.approx(first["agreement_after"], abs=1e-6)
    assert forced["shipped"] and "check" not in forced and (shipped / "eagle" / "drafter.safetensors").read_bytes() != weights

    assert main([*argv, "--check", "--only", "stop-eagle"]) == 2
    assert "do not draft" in capsys.readouterr().err
    assert_one_line_error(main([*argv, "--check-per-category", "0"]), capsys.readouterr().err, "--check-per-category")
    assert_one_line_error(main([*argv, "--check", "--check-prompts", str(tmp_path)]), capsys.readouterr().err, "--check-prompts")


def main_ok(argv: list[str], capsys) -> dict:
    from jobs.ship_drafters import main

    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_refresh_vocab_drafts_over_the_data_s_top_tokens_now(tiny_data, tmp_path, capsys):
    """``--init shipped --refresh-vocab``: a head trained on a few sequences drafts over their tokens; warm-started on the
    whole data it drafts over the whole data's most frequent tokens (its trained rows kept for the tokens it had)."""
    from decoding.drafters.artifacts import load_artifact
    from decoding.model.loading import load_model
    from training.features import distill_training_set
    from training.objectives import vocab_order

    model, data, _ = tiny_data
    argv = ["--model", str(model), "--data", str(data), "--only", "eagle", "--steps-scale", "0.004", "--shipped", str(tmp_path / "s")]
    argv += ["--docs", str(tmp_path / "docs"), "--no-progress", "--json", "--threads", "1", "--ship", "always"]
    target = load_model(str(model), "float32").model
    head = lambda: load_artifact(str(tmp_path / "s" / "eagle"), target).module.lm_head.vocab  # noqa: E731
    ranked = vocab_order(distill_training_set(data)[0], target.config.vocab_size)
    main_ok([*argv, "--max-sequences", "2"], capsys)
    few = head().clone()
    assert not torch_equal_prefix(few, ranked)  # ranked on two sequences
    result = main_ok([*argv, "--init", "shipped", "--refresh-vocab"], capsys)["eagle"]
    assert torch_equal_prefix(head(), ranked) and result["shipped"]
    spec = json.loads((tmp_path / "s" / "eagle" / "drafter.json").read_text())["training"]["spec"]
    assert spec["refresh_vocab"] is True and spec["init"].endswith("eagle-init")
    from jobs.ship_drafters import main

    assert_one_line_error(main([*argv, "--refresh-vocab"]), capsys.readouterr().err, "--init shipped")


def torch_equal_prefix(vocab, ranked) -> bool:
    n = min(len(vocab), len(ranked))
    return vocab[:n].tolist() == ranked[:n].tolist()
