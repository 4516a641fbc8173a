"""On a CUDA GPU: every method decodes on the model's device (kernels included) and equals AR there; Ray workers
use the GPU they were given and no other; bench's HF peer and drafter training run on the GPU too.

Run on a GPU machine: ``PYTHONPATH=$PWD python -m pytest tests/gpu -q -s`` (prints figures).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from decoding.config import SpecConfig
from decoding.errors import ConfigError
from decoding.in_process import SpecDecoder

PROMPT = "the cat sat on the mat and the cat sat on the"
METHODS = {
    "sps": dict(method="sps", draft_layers=1, k=3),
    "ngram": dict(method="ngram", k=4),
    "early-exit": dict(method="early-exit", exit_layer=1, k=3),
    "dyspec": dict(method="early-exit", exit_layer=1, k=3, tree="dyspec", tree_budget=8),
    "static-tree": dict(method="sps", draft_layers=1, k=2, tree="static", tree_paths="[[0],[1],[0,0],[0,1]]"),
    "triforce": dict(method="triforce", k=2, triforce_budget=32, triforce_chunk_size=8, triforce_window=16, triforce_sinks=2),
}


def on_cuda(dec: SpecDecoder) -> bool:
    return all(p.is_cuda for p in dec.loaded.model.parameters()) and dec.device.type == "cuda"


@pytest.fixture(scope="module")
def kernels_on():
    import kernels

    assert kernels.install(), "triton is not installed"
    yield
    from decoding import accel

    for name in accel.registered():
        accel.unregister(name)


def test_auto_is_cuda():
    dec_cfg = SpecConfig()
    assert dec_cfg.device == "auto"
    from decoding.model.loading import resolve_device

    assert resolve_device("auto").type == "cuda"
    with pytest.raises(ConfigError, match="^device: "):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.parametrize("name", sorted(METHODS))
def test_method_on_cuda_equals_ar(tiny_model_dir, kernels_on, name):
    base = SpecConfig(model=str(tiny_model_dir), dtype="float32", device="cuda", max_new_tokens=24)
    ar = SpecDecoder(base)
    dec = SpecDecoder(base.replace(**METHODS[name]))
    assert on_cuda(ar) and on_cuda(dec)
    want = ar.generate_text(PROMPT)["token_ids"]
    got = dec.generate_text(PROMPT)
    assert got["token_ids"] == want
    assert got["stats"]["target_forwards"] <= len(want)


def test_sampling_on_cuda(tiny_model_dir):
    """Seeded sampling on the device (k fixed: under k=auto the draft lengths follow measured times, and with them the
    random numbers drawn). A sampled token may be EOS: a generation then ends before max_new_tokens, with "stop"."""
    cfg = SpecConfig(
        model=str(tiny_model_dir), dtype="float32", device="cuda", method="sps", draft_layers=1, temperature=1.0, adaptive_k=False
    )
    dec = SpecDecoder(cfg)
    for seed in range(4):
        a = dec.generate_text(PROMPT, max_new_tokens=16, seed=seed)
        assert a["token_ids"] == dec.generate_text(PROMPT, max_new_tokens=16, seed=seed)["token_ids"]  # seeded on the device
        assert len(a["token_ids"]) == 16 or a["finish_reason"] == "stop"


def test_sequence_rows_sample_on_cuda(tiny_model_dir):
    """Rows made by SpecDecoder.sequence() (Serve, generate_batch, distillation) carry a generator on the GPU."""
    dec = SpecDecoder(SpecConfig(model=str(tiny_model_dir), dtype="float32", device="cuda", method="ngram", temperature=1.0))
    outs = dec.generate_batch([dec.encode(PROMPT), dec.encode("the dog")], max_new_tokens=8, max_rows=2)
    assert all(0 < len(o.token_ids) <= 8 for o in outs)


def test_tree_kernel_runs_on_cuda(kernels_on):
    from decoding import accel
    from decoding.loop.verify import greedy_tree_accept
    from decoding.trees.shapes import Tree

    tree = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]])
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, 5, (4, tree.size), device="cuda", generator=g)
    argmax = torch.randint(0, 5, (4, tree.size), device="cuda", generator=g)
    args = (tokens, tree.parents.cuda(), tree.mask.cuda(), tree.depth.cuda(), argmax)
    used = []
    ref = greedy_tree_accept(*args)
    out = accel.dispatch("greedy_tree_accept", lambda *a: used.append("reference") or greedy_tree_accept(*a), *args)
    assert used == [] and torch.equal(out.cpu(), ref.cpu())  # the Triton kernel ran, not the reference


def test_smollm2_on_cuda_figures(kernels_on):
    cfg = SpecConfig(device="cuda", dtype="bfloat16", max_new_tokens=128)
    ar, ng = SpecDecoder(cfg), SpecDecoder(cfg.replace(method="ngram", k=6))
    prompt = "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."
    for dec in (ar, ng):
        dec.generate_text(prompt, chat=True, max_new_tokens=8)  # warm-up
    rows = {}
    for name, dec in (("ar", ar), ("ngram", ng)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = dec.generate_text(prompt, chat=True)
        rows[name] = (len(out["token_ids"]) / (time.perf_counter() - t0), out["stats"]["mean_accepted_tokens"])
    figures = ", ".join(f"{k} {v[0]:.0f} tok/s tau {v[1]:.2f}" for k, v in rows.items())
    print(f"\nSmolLM2-135M bf16 on {torch.cuda.get_device_name()}: {figures}")
    assert rows["ar"][0] > 0


def test_hf_peer_on_cuda(tiny_model_dir):
    from evaluation.hf_peer import HFPeer

    cfg = SpecConfig(model=str(tiny_model_dir), dtype="float32", device="cuda", k=3, draft_layers=1, exit_layer=1)
    dec = SpecDecoder(cfg)
    peer = HFPeer(dec, cfg)
    ids = dec.encode(PROMPT)
    assert ids.device.type == "cpu"
    tokens, wall = peer.generate("hf-plain", ids, 12)
    assert tokens == dec.generate_ids(ids, max_new_tokens=12).token_ids and wall > 0


def test_hf_static_peer_compiles_on_cuda_and_equals_plain(tiny_model_dir):
    """transformers' fast mode (static cache, forward compiled by transformers on CUDA) as a bench peer: the compiled
    forward is made in the untimed warm-up, the timed calls decode hf-plain's greedy tokens; prompt lookup on the
    static cache too when this transformers version runs it (else probe() drops it, naming why)."""
    from evaluation.hf_peer import HFPeer

    cfg = SpecConfig(model=str(tiny_model_dir), dtype="float32", device="cuda", k=3, draft_layers=1, exit_layer=1)
    dec = SpecDecoder(cfg)
    peer = HFPeer(dec, cfg, modes=["hf-plain", "hf-static", "hf-static-prompt-lookup"])
    ids = dec.encode(PROMPT)
    skipped = peer.probe(ids, 8)
    assert "hf-static" not in skipped, skipped
    assert getattr(peer.model, "_compiled_call", None) is not None  # transformers compiled the forward itself
    assert '"_compiled": true' in peer.describe("hf-static")
    want, _ = peer.generate("hf-plain", ids, 24)
    rows = {}
    for mode in [m for m in ("hf-static", "hf-static-prompt-lookup") if m in peer.modes]:
        got, wall = peer.generate(mode, ids, 24)
        assert got == want, mode
        rows[mode] = len(got) / wall
    print(f"\nHF static-cache peer on {torch.cuda.get_device_name()}: {rows}; skipped: {skipped}")


def test_ray_workers_use_the_gpu_they_were_given():
    """Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for a worker given no GPU: ``auto`` must still mean CPU there."""
    ray = pytest.importorskip("ray", reason="no ray on this GPU machine (the device kit carries the model, not ray)")

    from actors.devices import placed_device

    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False)
    try:

        @ray.remote
        def where():
            return placed_device("auto"), torch.cuda.is_available()

        no_gpu = ray.get(where.options(num_gpus=0).remote())
        one_gpu = ray.get(where.options(num_gpus=1).remote())
    finally:
        ray.shutdown()
    assert no_gpu[0] == "cpu" and one_gpu == ("cuda", True)


def test_drafter_training_on_cuda(tmp_path):
    from conftest import tiny_llama
    from tests_support import generate

    from decoding.model.adapter import ModelAdapter
    from training.data import extract_hidden
    from training.trainer import TrainSpec, train

    target = tiny_llama(vocab=12, layers=3, seed=0).cuda()
    adapter, g, examples = ModelAdapter(target), torch.Generator().manual_seed(0), []
    for _ in range(6):
        prompt = torch.randint(0, 12, (1, 6), generator=g)
        gen = generate(adapter, prompt.cuda(), max_new_tokens=20, generator=torch.Generator(device="cuda"))
        tokens = torch.cat([prompt[0], torch.tensor(gen.token_ids)])
        hidden = {k: torch.from_numpy(v) for k, v in extract_hidden(adapter, tokens.cuda(), [1, 2, 3], start=2).items()}
        examples.append({"tokens": tokens, "start": 2, "hidden": hidden, "prompt_len": 6})
    spec = TrainSpec("medusa", {"num_heads": 2}, "kl", steps=20, batch=2, lr=3e-3, seed=0, window=16)
    out = train(spec, target, examples, tmp_path / "medusa", "tiny", progress=False)
    assert out["eval_agreement"]
    stored = train(dataclasses.replace(spec, as_stored=True), target, examples, tmp_path / "stored", "tiny", progress=False)
    assert stored["eval_agreement"] == pytest.approx(stored["eval_agreement_stored"], abs=0.02)  # rounded on the GPU


def test_as_stored_rounds_on_the_gpu_as_the_artifact_stores():
    """Training as stored on a GPU rounds each matrix there (no copy to the CPU per step): the values equal the CPU's
    (``decode(encode(...))``) but for a rare code a reduction rounds otherwise."""
    from decoding.drafters.storage import Storage, as_stored

    g = torch.Generator().manual_seed(0)
    base = torch.randn(256, 576, generator=g)
    for w in (base + 0.05 * torch.randn(256, 576, generator=g), torch.randn(256, 576, generator=g)):  # a change, its own
        cpu, gpu = as_stored(w, base, Storage()), as_stored(w.cuda(), base.cuda(), Storage())
        assert gpu.device.type == "cuda" and gpu.dtype == torch.float32
        assert (gpu.cpu() != cpu).float().mean() < 1e-3 and torch.allclose(gpu.cpu(), cpu, atol=1e-2)
