"""The ``device`` field: its values, and that decoding creates nothing on a device other than the model's.

CPU is the only device here, so the plumbing check makes every stray tensor visible: while a generation
runs, torch's default device is ``meta`` (a tensor made without ``device=`` lands there) and a dispatch
mode records the device of every tensor any op returns; all of them must be the model's (``cpu``).
The real CUDA path is tests/gpu/.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from decoding.config import SpecConfig
from decoding.errors import ConfigError
from decoding.in_process import SpecDecoder
from decoding.model.loading import load_model, resolve_device


class DeviceLog(TorchDispatchMode):
    """Records the device of every tensor an op is given or returns."""

    def __init__(self):
        super().__init__()
        self.devices: dict[str, str] = {}  # device -> the first op that made a tensor there

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in (*args, *(kwargs or {}).values()):  # what an op is given (a stray input is caught even if the op fails)
            if isinstance(t, torch.Tensor):
                self.devices.setdefault(str(t.device), str(func))
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.devices.setdefault(str(t.device), str(func))
        return out


def run_on_meta_default(dec: SpecDecoder, prompt: str) -> tuple[dict, dict]:
    log = DeviceLog()
    torch.set_default_device("meta")
    try:
        with log:
            out = dec.generate_text(prompt, max_new_tokens=12)
    finally:
        torch.set_default_device(None)
    return out, log.devices


@pytest.mark.parametrize("value", ["auto", "cpu", "cuda", "cuda:0", "cuda:3"])
def test_valid_devices(value):
    assert SpecConfig(device=value).device == value
    assert SpecConfig.from_json(SpecConfig(device=value).to_json()).device == value


@pytest.mark.parametrize("value", ["gpu", "CUDA", "cuda:", "cuda:x", "tpu", "", "meta"])
def test_invalid_device_names_the_field(value):
    with pytest.raises(ConfigError) as e:
        SpecConfig(device=value)
    assert e.value.field == "device" and str(e.value).startswith("device: ")


def test_auto_is_cuda_only_when_available():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("value", ["cuda", "cuda:1"])
def test_cuda_without_cuda_fails_naming_the_field(value, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"^device: .*CUDA is not available"):
        SpecDecoder(SpecConfig(model=str(tiny_model_dir), device=value, dtype="float32"))


def test_cli_rejects_a_bad_device(tiny_model_dir, capsys):
    from jobs.generate import main

    rc = main(["--model", str(tiny_model_dir), "--prompt", "hi", "--set", "device=gpu"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "device" in err and "Traceback" not in err


def test_load_model_keeps_one_copy_per_device(tiny_model_dir):
    a = load_model(str(tiny_model_dir), "float32", "cpu")
    assert a is load_model(str(tiny_model_dir), "float32", "auto" if not torch.cuda.is_available() else "cpu")
    assert a.device == torch.device("cpu") and all(p.device.type == "cpu" for p in a.model.parameters())


CONFIGS = {
    "ar": dict(method="ar"),
    "sps-greedy": dict(method="sps", draft_layers=1, k=3),
    "sps-sampled": dict(method="sps", draft_layers=1, k=3, temperature=0.9, top_k=50, top_p=0.9, adaptive_k=False),
    # sampled with k=auto, the draft lengths follow measured times and with them which random numbers each step draws:
    # the tokens follow the same distribution but differ from run to run; these runs fix k to compare them
    "sps-draft-model": dict(method="sps", k=3, temperature=0.7, adaptive_k=False),  # draft_model set below: a second model load
    "early-exit-dyspec": dict(method="early-exit", exit_layer=1, k=3, tree="dyspec", tree_budget=6),
    "ngram-sampled": dict(method="ngram", k=3, temperature=1.0, adaptive_k=False),
    "sps-tree-sampled": dict(
        method="sps", draft_layers=1, k=2, tree="static", tree_paths="[[0],[1],[0,0]]", temperature=1.0, adaptive_k=False
    ),
    "triforce": dict(method="triforce", k=2, triforce_budget=32, triforce_chunk_size=8, triforce_window=16, triforce_sinks=2),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_nothing_is_created_off_the_model_device(tiny_model_dir, one_thread, name):
    changes = dict(CONFIGS[name])
    if name == "sps-draft-model":
        changes["draft_model"] = str(tiny_model_dir)
    dec = SpecDecoder(SpecConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", **changes))
    reference = dec.generate_text("the cat sat on the mat and the cat", max_new_tokens=12)
    assert dec.device == torch.device("cpu") == dec.target.device
    out, devices = run_on_meta_default(dec, "the cat sat on the mat and the cat")
    assert devices and set(devices) == {"cpu"}, f"tensors created off the model's device: {devices}"
    assert out["token_ids"] == reference["token_ids"] and len(out["token_ids"]) == 12
    json.dumps(out)  # the CLI's shape stays serialisable


def test_the_meta_check_catches_a_stray_tensor(tiny_model_dir, one_thread):
    """The check above can fail: a generator made on the default device (as the decoder did before it had a device) is caught."""
    dec = SpecDecoder(SpecConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", method="ngram"))
    dec.device = None  # prompts and the generator fall back to the default device
    log = DeviceLog()
    torch.set_default_device("meta")
    try:
        with log, pytest.raises((RuntimeError, NotImplementedError)):
            ids = torch.tensor([[1, 2, 3, 1, 2]])  # made on meta
            dec.generate_ids(ids, max_new_tokens=4)
    finally:
        torch.set_default_device(None)
    assert "meta" in log.devices


def test_fork_cannot_move_the_model(tiny_model_dir):
    dec = SpecDecoder(SpecConfig(model=str(tiny_model_dir), dtype="float32", device="cpu"))
    with pytest.raises(ConfigError, match="^device: "):
        dec.fork(device="cuda")


def test_a_batch_creates_nothing_off_the_model_device(tiny_model_dir, one_thread, tmp_path, monkeypatch):
    """Ragged rows of different lengths, k=auto (its cost model measured here too) and a tree drafter in one batch."""
    monkeypatch.setenv("SPECRAY_HOME", str(tmp_path))  # no calibration file to read: it is measured under the check
    dec = SpecDecoder(SpecConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", method="ngram", k=3, adaptive_k=True))
    trees = SpecDecoder(
        SpecConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", method="ngram", k=3, tree="dyspec", tree_budget=5)
    )
    prompts = ["the cat sat on the mat and the cat", "a b a b a b", "once upon a time there was a time"]
    ids = [dec.encode(p) for p in prompts]
    reference = [dec.generate_ids(x, max_new_tokens=10).token_ids for x in ids]
    from decoding.loop.batch import generate_many
    from decoding.model.costs import forward_costs

    log = DeviceLog()
    torch.set_default_device("meta")
    try:
        with log:
            cost = forward_costs(dec.target, "tiny-device-test", "float32", max_rows=4)
            seqs = [dec.sequence(ids[0], 10), trees.sequence(ids[1], 10), dec.sequence(ids[2], 10)]
            outs = generate_many(dec.target, seqs, max_rows=3, cost=cost)
    finally:
        torch.set_default_device(None)
    assert set(log.devices) == {"cpu"}, f"tensors created off the model's device: {log.devices}"
    assert [o.token_ids for o in outs] == reference
    assert max(r.rows for o in outs for r in o.steps) == 3
