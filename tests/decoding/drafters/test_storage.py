"""How drafter artifacts store their weights (decoding/drafters/storage.py): quantised changes from the target's
tensors, read back within the quantisation's error, checked against the target, and one-line errors for bad files."""

import json

import pytest
import torch
from conftest import tiny_llama

from decoding.drafters.artifacts import (
    DESCRIPTION,
    FORMAT,
    VOCAB_ORDER,
    WEIGHTS,
    base_state,
    load_artifact,
    save_artifact,
    stored_copy,
)
from decoding.drafters.storage import BITS, Storage, StorageError, dequantize, pack, quantize, unpack
from decoding.drafters.trained import get_recipe
from decoding.errors import ConfigError

KNOBS = {"kangaroo": {"exit_layer": 1, "draft_vocab": 8}, "eagle": {"draft_vocab": 8}, "hydra": {"num_heads": 2}}


@pytest.mark.parametrize("bits", BITS)
def test_pack_round_trips(bits):
    q = torch.randint(0, 2**bits, (64,), generator=torch.Generator().manual_seed(bits)).to(torch.uint8)
    packed = pack(q, bits)
    assert packed.numel() == 64 * bits // 8 and torch.equal(unpack(packed, bits), q)


def test_quantisation_error_falls_with_bits():
    x = torch.randn(300, 100, generator=torch.Generator().manual_seed(0))  # 30,000 values: 469 groups, the last padded
    errors = []
    for bits in BITS:
        codes, scale = quantize(x, bits, 64)
        assert codes.numel() == 469 * 64 * bits // 8 and scale.dtype == torch.float16 and scale.numel() == 469
        y = dequantize(codes, scale, bits, 64, x.shape)
        errors.append(float((y - x).square().mean().sqrt()))
    assert errors == sorted(errors, reverse=True)
    assert errors[1] < 0.55 and errors[2] < 0.11 and errors[3] < 0.01  # 2, 4 and 8 bits on unit-variance values
    zeros = quantize(torch.zeros(8, 8), 2, 64)
    assert torch.equal(dequantize(*zeros, 2, 64, (8, 8)), torch.zeros(8, 8))


def test_storage_validates_its_fields():
    bad = {"bits": 3, "large_bits": 5, "own_bits": 16, "group": 12, "max_change": 2, "grid": "log"}
    for field, value in bad.items():
        kw = {field: value}
        with pytest.raises(ValueError, match=f"^{field}: "):
            Storage(**kw)
    with pytest.raises(ValueError, match="^grid: "):
        Storage(bits=8)  # the normal grid has levels for 1, 2 and 4 bits
    assert Storage(bits=8, grid="uniform").bits == 8
    assert Storage.from_dict({"bits": 2, "group": 64}).grid == "uniform"  # a record written before grids
    assert Storage.from_dict(Storage().to_dict()) == Storage()


@pytest.mark.parametrize("bits,gain", [(1, 0.9), (2, 0.9), (4, 1.0)])  # at 4 bits the uniform grid is nearly as good
def test_the_normal_grid_fits_bell_shaped_values_better_in_the_same_bytes(bits, gain):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(256, 96, generator=g) * torch.rand(256, 1, generator=g)  # groups of different spreads
    errors = {}
    for grid in ("uniform", "normal"):
        codes, scale = quantize(x, bits, 64, grid)
        assert codes.numel() == x.numel() * bits // 8 and scale.numel() == x.numel() // 64
        errors[grid] = float((dequantize(codes, scale, bits, 64, x.shape, grid) - x).square().mean().sqrt())
    assert errors["normal"] < gain * errors["uniform"], errors
    zeros = quantize(torch.zeros(8, 8), bits, 64, "normal")
    assert torch.equal(dequantize(*zeros, bits, 64, (8, 8), "normal"), torch.zeros(8, 8))


def test_a_layout_written_before_grids_reads_as_uniform():
    from decoding.drafters.storage import LAYOUT_KEY, decode, encode, layout_of

    g = torch.Generator().manual_seed(1)
    base = torch.randn(64, 64, generator=g)
    state, bases = {"w": base + 0.02 * torch.randn(64, 64, generator=g)}, {"w": base}
    tensors, metadata = encode(state, bases, Storage())
    assert layout_of(metadata)["w"]["grid"] == "normal"
    old_t, old_m = encode(state, bases, Storage(grid="uniform"))
    assert "grid" not in layout_of(old_m)["w"]  # what an artifact written before grids holds
    change = state["w"] - base.bfloat16().float()
    codes, scale = quantize(change, 2, 64)
    assert torch.equal(decode(old_t, old_m, bases)["w"], dequantize(codes, scale, 2, 64, (64, 64)) + base.bfloat16().float())
    normal = decode(tensors, metadata, bases)["w"]
    assert (normal - state["w"]).norm() < (decode(old_t, old_m, bases)["w"] - state["w"]).norm()
    broken = {
        LAYOUT_KEY: json.dumps({"w": {**layout_of(metadata)["w"], "grid": "log"}}),
        **{k: v for k, v in metadata.items() if k != LAYOUT_KEY},
    }
    with pytest.raises(StorageError):
        decode(tensors, broken, bases)


def test_small_changes_take_few_bits_large_ones_and_own_matrices_more():
    from decoding.drafters.storage import decode, encode, layout_of

    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 64, generator=g)
    changes = {
        "near": 0.02 * torch.randn(64, 64, generator=g),  # a small change: 2 bits
        "far": 0.5 * torch.randn(64, 64, generator=g),  # a new map over its start (|D| = 0.45 |W|): 4 bits of the change
    }
    state = {**{k: base + d for k, d in changes.items()}, "own": torch.randn(64, 64, generator=g), "norm": torch.ones(64)}
    bases = {k: base for k in changes}
    storage = Storage()
    tensors, metadata = encode(state, bases, storage)
    layout = layout_of(metadata)
    assert {k: layout[k]["bits"] for k in ("near", "far", "own")} == {"near": 2, "far": 4, "own": 8}
    assert layout["near"]["base"] and layout["far"]["base"] and not layout["own"]["base"]
    assert layout["norm"] == {"plain": "float32"} and tensors["near.q"].numel() == 64 * 64 // 4
    back = decode(tensors, metadata, bases)
    assert torch.equal(back["norm"], state["norm"])
    near = state["near"] - base.bfloat16().float()
    assert 0.2 * near.norm() < (back["near"] - state["near"]).norm() < 0.6 * near.norm()  # 2 bits: a fraction of the change
    far = state["far"] - base.bfloat16().float()
    assert (back["far"] - state["far"]).norm() < 0.15 * far.norm()  # 4 bits of the change
    assert (back["own"] - state["own"]).norm() < 0.01 * state["own"].norm()  # 8 bits of the matrix
    fixed, _ = encode(state, bases, Storage(bits=4, large_bits=4, own_bits=4))
    assert all(fixed[k + ".q"].numel() == 64 * 64 // 2 for k in ("near", "far", "own"))


def trained(model, recipe, seed=0):
    """The recipe's module moved off its initialisation by small steps (as training moves it)."""
    r = get_recipe(recipe)
    module = r.build(model, r.check(KNOBS[recipe], 3))
    r.prepare(module, torch.tensor([3, 7, 1, 0, 5, 9, 2, 4, 6]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1 * p.detach().float().std().clamp_min(0.02))
    return module.eval()


@pytest.mark.parametrize("recipe", list(KNOBS))
def test_artifact_stores_changes_and_loads_them_back(tiny_model, recipe, tmp_path):
    module = trained(tiny_model, recipe)
    r = get_recipe(recipe)
    knobs = r.check(KNOBS[recipe], 3)
    save_artifact(tmp_path, recipe, knobs, module, tiny_model, "tiny", training={"data": "data/x"}, vocab=torch.tensor([3, 7, 1]))
    desc = json.loads((tmp_path / DESCRIPTION).read_text())
    assert desc["format"] == FORMAT == 2
    stored = desc["storage"]
    assert stored["group"] == 64 and stored["bits"] == 2 and stored["bytes"] == (tmp_path / WEIGHTS).stat().st_size
    matrices = [k for k, v in module.state_dict().items() if v.is_floating_point() and v.dim() >= 2]
    assert sum(stored["bits_used"].values()) == len(matrices)
    art = load_artifact(str(tmp_path), tiny_model)
    assert art.vocab.dtype == torch.long and art.vocab.tolist() == [3, 7, 1]
    kept = stored_copy(module, recipe, knobs, tiny_model)
    bases = base_state(r, knobs, tiny_model, module.state_dict())
    for name, want in module.state_dict().items():
        got = art.module.state_dict()[name]
        assert got.dtype == want.dtype and torch.equal(got, kept.state_dict()[name]), name  # loading = the stored copy
        if not want.is_floating_point() or want.dim() < 2:
            assert torch.equal(got, want), name  # ids and vectors as they are
        elif name in bases and (want - bases[name].bfloat16().float()).norm() <= 0.25 * want.norm():  # 2 bits of the change
            change = want - bases[name].bfloat16().float()
            assert 0 < float((got - want).norm()) < 0.6 * float(change.norm()), name
        else:  # no base, or a large change: 8 bits
            assert 0 < float((got - want).norm()) < 0.01 * float(want.norm()), name
    assert recipe == "hydra" or bases  # the recipes that start from the target store changes


def test_a_target_with_other_weights_is_refused(tmp_path):
    """Same fingerprint (the probes it hashes are equal), other weights in the layer the adapter started from."""
    model = tiny_llama()
    save_artifact(tmp_path, "kangaroo", {"exit_layer": 1, "draft_vocab": 8}, trained(model, "kangaroo"), model, "tiny", training={})
    other = tiny_llama()
    with torch.no_grad():
        other.model.layers[1].self_attn.q_proj.weight.mul_(1.5)
    with pytest.raises(ConfigError) as e:
        load_artifact(str(tmp_path), other)
    assert e.value.field == "drafter" and "other base tensors" in str(e.value) and "\n" not in str(e.value)


def test_corrupt_and_mismatched_files_fail_in_one_line(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    knobs = {"exit_layer": 1, "draft_vocab": 8}
    save_artifact(tmp_path, "kangaroo", knobs, trained(tiny_model, "kangaroo"), tiny_model, "tiny", training={})
    good = (tmp_path / WEIGHTS).read_bytes()
    from safetensors import safe_open

    with safe_open(str(tmp_path / WEIGHTS), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(tmp_path / WEIGHTS))
    cases = {
        "truncated": lambda: (tmp_path / WEIGHTS).write_bytes(good[: len(good) // 2]),
        "garbage": lambda: (tmp_path / WEIGHTS).write_bytes(b"\x00" * 64),
        "missing": lambda: (tmp_path / WEIGHTS).unlink(),
        "a tensor short": lambda: save_file(
            {k: v for k, v in tensors.items() if k != "model.layers.0.mlp.up_proj.weight.q"}, str(tmp_path / WEIGHTS), metadata=metadata
        ),
        "codes cut": lambda: save_file(
            {**tensors, "lm_head.weight.q": tensors["lm_head.weight.q"][:-4]}, str(tmp_path / WEIGHTS), metadata=metadata
        ),
        "bad layout": lambda: save_file(tensors, str(tmp_path / WEIGHTS), metadata={**metadata, "specray.layout": "{"}),
    }
    for case, damage in cases.items():
        damage()
        with pytest.raises(ConfigError) as e:
            load_artifact(str(tmp_path), tiny_llama(seed=0))  # a new target object: no cached load
        assert e.value.field == "drafter" and str(tmp_path / WEIGHTS) in str(e.value) and "\n" not in str(e.value), (case, e.value)
        (tmp_path / WEIGHTS).write_bytes(good)
    desc = json.loads((tmp_path / DESCRIPTION).read_text())
    (tmp_path / DESCRIPTION).write_text(json.dumps({**desc, "format": 99}))
    with pytest.raises(ConfigError, match="format 99"):
        load_artifact(str(tmp_path), tiny_model)


def test_dense_artifacts_of_format_1_still_load(tiny_model, tmp_path):
    from safetensors.torch import save_file

    module = trained(tiny_model, "kangaroo")
    knobs = {"exit_layer": 1, "draft_vocab": 8}
    save_artifact(tmp_path, "kangaroo", knobs, module, tiny_model, "tiny", training={})
    desc = json.loads((tmp_path / DESCRIPTION).read_text())
    dense = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in module.state_dict().items()}
    save_file({**dense, VOCAB_ORDER: torch.tensor([3, 7])}, str(tmp_path / WEIGHTS))
    (tmp_path / DESCRIPTION).write_text(json.dumps({**{k: v for k, v in desc.items() if k != "storage"}, "format": 1}))
    art = load_artifact(str(tmp_path), tiny_model)
    for name, want in dense.items():
        assert torch.equal(art.module.state_dict()[name], want.to(art.module.state_dict()[name].dtype)), name
    assert art.vocab.tolist() == [3, 7]
