"""decoding.model.graphs on the CPU: the static form a CUDA graph captures, checked without a GPU.

* The runner without CUDA runs the graph body on its static buffers (no capture): float32 greedy output through it
  equals the eager forward's for AR, prompt lookup, early exit (chain and tree), an eagle head and a batch of rows.
* The body compiles as one graph (``torch.compile(fullgraph=True, dynamic=False)``: no graph break, so no host read
  inside) and does not recompile from step to step within a width bucket.
* Caches from the pool reuse storage at the same address once their tensors are gone.

The real capture and replay run in tests/gpu/test_graphs.py.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch._dynamo
from conftest import tiny_llama
from tests_support import generate

from decoding.drafters.eagle import EagleDrafter, EagleNet
from decoding.drafters.early_exit import EarlyExitDrafter
from decoding.drafters.ngram import NgramDrafter
from decoding.loop.batch import Sequence, generate_many
from decoding.model.adapter import ModelAdapter
from decoding.model.fast_layers import Placement
from decoding.model.graphs import CachePool, GraphRunner, row_bucket
from decoding.trees.shapes import Tree

VOCAB = 48


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=VOCAB, layers=4, seed=3)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))


def _eagle(model):
    torch.manual_seed(0)
    return EagleDrafter(EagleNet(model, (1, 2, 4), torch.arange(VOCAB)).eval())


DRAFTERS = {
    "ar": (lambda m: None, 4),
    "ngram": (lambda m: NgramDrafter(3, 1), 4),
    "early-exit": (lambda m: EarlyExitDrafter(2), 3),
    "early-exit-tree": (lambda m: EarlyExitDrafter(2, tree=Tree.from_paths([[0], [1], [0, 0], [1, 0]])), 3),
    "eagle": (_eagle, 3),
}


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_graph_body_gives_eager_greedy_output(model, prompt, name):
    make, k = DRAFTERS[name]
    eager, graphed = ModelAdapter(model), ModelAdapter(model, graphs=True)
    assert graphed.graphs is not None and not graphed.graphs.capture and graphed.implementation.endswith("-graphs")
    want = generate(eager, prompt, drafter=make(model), k=k, max_new_tokens=30).token_ids
    got = generate(graphed, prompt, drafter=make(model), k=k, max_new_tokens=30).token_ids
    assert got == want
    assert graphed.graphs.replays > 0 and graphed.graphs.failed == set()


def test_graph_body_in_a_batch_of_rows(model, prompt):
    def rows():
        return [Sequence(prompt[:, : 10 + i], drafter=NgramDrafter(3, 1) if i % 2 else None, k=3, max_new_tokens=20) for i in range(4)]

    eager, graphed = ModelAdapter(model), ModelAdapter(model, graphs=True)
    want = [g.token_ids for g in generate_many(eager, rows(), max_rows=4)]
    assert [g.token_ids for g in generate_many(graphed, rows(), max_rows=4)] == want
    assert 4 in {key[2] for key in graphed.graphs.graphs}  # the steps of four rows ran from their graphs


def test_a_continuous_batch_pads_its_rows_to_a_few_buckets(model, prompt):
    """Rows join and leave (eleven sequences of different lengths through a batch of up to 8 rows, some drafting):
    the row count takes most values from 1 to 8, the graphs only the row buckets that hold them; the padded rows
    never change a real row's tokens (equal to the eager batch's), and a real row never reads a padded row's."""

    def rows():
        return [
            Sequence(prompt[:, : 6 + i], drafter=NgramDrafter(3, 1) if i % 3 == 0 else None, k=3, max_new_tokens=5 + 3 * i)
            for i in range(11)
        ]

    eager, graphed = ModelAdapter(model), ModelAdapter(model, graphs=True)
    want = [g.token_ids for g in generate_many(eager, rows(), max_rows=8)]
    counts = []
    run = graphed.graphs.run

    def noting(cache, x, *args):
        counts.append(x.shape[0])
        return run(cache, x, *args)

    graphed.graphs.run = noting
    assert [g.token_ids for g in generate_many(graphed, rows(), max_rows=8)] == want
    row_keys = {key[2] for key in graphed.graphs.graphs}
    assert len(set(counts)) >= 6 and row_keys <= {1, 2, 4, 8}, (sorted(set(counts)), row_keys)
    assert row_bucket(3, 8) == 4 and row_bucket(3, 3) == 3  # a storage of 3 rows runs them as they are


def test_padding_to_the_bucket_never_reaches_a_position(model):
    """Three tokens in a width-4 graph: the fourth writes the scratch slot, every position's keys stay the eager ones."""
    eager, graphed = ModelAdapter(model), ModelAdapter(model, graphs=True)
    ids = torch.randint(VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    caches = [eager.new_cache(1, 16), graphed.new_cache(1, 16)]
    for adapter, cache in zip((eager, graphed), caches, strict=True):
        adapter.forward(cache, 0, input_ids=ids[:, :6])
        adapter.forward(cache, 6, input_ids=ids[:, 6:9])
    assert torch.allclose(caches[0].k_all[..., :16, :], caches[1].k_all[..., :16, :], atol=1e-5)
    assert (bucket_widths := {key[3] for key in graphed.graphs.graphs}) == {4, 8}, bucket_widths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_static_step_compiles_whole_and_once_per_bucket(dtype):
    """The body as torch.compile sees it: one graph (fullgraph: no break, so no host read), no recompile while only
    values change (slots, positions, prefix of later steps), the same logits as the body run eagerly."""
    model = tiny_llama(vocab=VOCAB, layers=2, seed=3).to(dtype)
    adapter = ModelAdapter(model)
    cache = adapter.new_cache(2, 32)
    rows = torch.arange(2)[:, None]

    def static_step(ids, positions, slots, prefix):
        place = Placement(slots, prefix, cache.max_len, None, rows=rows)
        return adapter.logits(adapter.eager_forward(cache, ids, None, 0, adapter.num_layers, positions, place, None))

    torch._dynamo.reset()
    compiled = torch.compile(static_step, fullgraph=True, dynamic=False, backend="aot_eager")
    try:
        for width in (1, 4):
            for step, start in enumerate((3, 7, 11)):
                torch._dynamo.config.error_on_recompile = step > 0
                ids = torch.randint(VOCAB, (2, width), generator=torch.Generator().manual_seed(step))
                pos = torch.tensor([[start], [start + 2]]) + torch.arange(width)
                with torch.inference_mode():
                    got = compiled(ids, pos, pos.clone(), pos[:, 0].clone())
                    want = static_step(ids, pos, pos.clone(), pos[:, 0].clone())
                assert torch.equal(got, want)
    finally:
        torch._dynamo.config.error_on_recompile = False


def test_pooled_caches_reuse_storage_once_gone():
    pool = CachePool()
    shape = (2, 1, 3, 17, 4)
    k, v = pool.take(shape, torch.float32, "cpu")
    address = k.data_ptr()
    view = k[:, :1]
    del k
    gc.collect()
    assert not pool.free, "a view still holds the storage: it is not free"
    del view, v
    gc.collect()
    k2, v2 = pool.take(shape, torch.float32, "cpu")
    assert k2.data_ptr() == address and tuple(k2.shape) == shape and pool.made == 1


def test_a_failed_capture_runs_eager_with_one_warning(model, prompt, monkeypatch, caplog):
    graphed, eager = ModelAdapter(model, graphs=True), ModelAdapter(model)

    def broken(self, *args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(GraphRunner, "_capture", broken)
    monkeypatch.setattr(graphed.graphs, "capture", True)
    with caplog.at_level("WARNING", logger="specray"):
        got = generate(graphed, prompt, max_new_tokens=8).token_ids
    assert got == generate(eager, prompt, max_new_tokens=8).token_ids
    assert caplog.text.count("capturing a CUDA graph failed for rows=1 width=1") == 1
