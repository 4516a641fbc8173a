"""The Ray Train path: a TorchTrainer worker trains a recipe from a data set and writes the artifact; DeepSpeed refuses
clearly where it cannot run."""

import json

import pytest
from tiny_models import build_tiny_model, write_prompts

from decoding.errors import ConfigError
from training.ray_train import scaling


def test_deepspeed_needs_gpus_and_the_package():
    with pytest.raises(ConfigError) as e:
        scaling({"CPU": 4}, None, "deepspeed")
    assert e.value.field == "strategy"
    with pytest.raises(ConfigError) as e:
        scaling({"CPU": 4, "GPU": 2}, None, "deepspeed")  # deepspeed is not installed here
    assert e.value.field == "strategy" and "not installed" in str(e.value)
    assert scaling({"CPU": 4}, 2, "ddp") == (2, False)


@pytest.mark.cluster
def test_ray_train_writes_the_artifact(tmp_path, monkeypatch):
    from decoding.config import SpecConfig
    from decoding.in_process import SpecDecoder
    from evaluation.workloads import load_prompts
    from training.data import generate_data
    from training.ray_train import train_on_cluster
    from training.trainer import TrainSpec

    monkeypatch.setenv("SPECRAY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    model = build_tiny_model(tmp_path / "m", layers=2)
    prompts = load_prompts(write_prompts(tmp_path / "p.jsonl", n_per_cat=1))
    generate_data(SpecDecoder(SpecConfig(model=str(model), dtype="float32")), prompts, [2], tmp_path / "data", max_new_tokens=8)
    spec = TrainSpec("medusa", {"num_heads": 2}, steps=4, batch=2, checkpoint_every=2)
    training = train_on_cluster(spec, str(model), tmp_path / "data", [2], tmp_path / "out", workers=1)
    desc = json.loads((tmp_path / "out" / "drafter.json").read_text())
    assert desc["recipe"] == "medusa" and training["steps"] == 4 and training["ray_workers"] == 1
