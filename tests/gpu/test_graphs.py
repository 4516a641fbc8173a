"""On a CUDA GPU: forwards replayed from captured graphs (decoding.model.graphs) give the eager forward's float32
greedy output, for the target and every drafter; a decoding step synchronises once; sampling replays too.

Run on a GPU machine: ``PYTHONPATH=$PWD python -m pytest tests/gpu -q -s``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tiny_llama
from tests_support import generate

from decoding.drafters.draft_model import DraftModelDrafter
from decoding.drafters.eagle import EagleDrafter, EagleNet
from decoding.drafters.early_exit import EarlyExitDrafter
from decoding.drafters.ngram import NgramDrafter
from decoding.loop.batch import Batch, Sequence, generate_many
from decoding.model.adapter import ModelAdapter
from decoding.sampling import SamplingParams
from decoding.trees.shapes import Dynamic, Tree

VOCAB = 48


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=VOCAB, layers=4, seed=3).cuda()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(VOCAB, (1, 20), generator=torch.Generator().manual_seed(0)).cuda()


def _eagle(model, tree=None):
    torch.manual_seed(0)
    return EagleDrafter(EagleNet(model, (1, 2, 4), torch.arange(VOCAB)).eval().cuda(), tree=tree)


DRAFTERS = {
    "ar": (lambda m: None, 4),
    "ngram": (lambda m: NgramDrafter(3, 1), 4),
    "sps-layers": (lambda m: DraftModelDrafter(ModelAdapter(m, num_layers=1)), 3),
    "early-exit": (lambda m: EarlyExitDrafter(2), 3),
    "early-exit-tree": (lambda m: EarlyExitDrafter(2, tree=Tree.from_paths([[0], [1], [0, 0], [1, 0]])), 3),
    "eagle": (_eagle, 3),
    "eagle-dyspec": (lambda m: _eagle(m, Dynamic(budget=12)), 4),
    "eagle-levels": (lambda m: _eagle(m, Dynamic(budget=12, width=4)), 4),
}


@pytest.mark.parametrize("name", ["eagle", "eagle-levels", "sps-layers"])
def test_whole_draft_loops_replay_as_one_graph_and_keep_the_output(model, prompt, name):
    """Greedy chains and level trees: the drafter's whole draft loop is one captured graph per shape (LoopGraphs), and
    the output is what the drafter gives with its loop run op by op."""
    make, k = DRAFTERS[name]
    target = ModelAdapter(model)
    plain = make(model)
    plain.loops = None
    want = generate(target, prompt, drafter=plain, k=k, max_new_tokens=40)
    looped = make(model)
    got = generate(target, prompt, drafter=looped, k=k, max_new_tokens=40)
    assert got.token_ids == want.token_ids
    assert [s.accepted for s in got.steps] == [s.accepted for s in want.steps]
    loops = looped.loops
    assert loops.capture and loops.captures > 0 and loops.replays > loops.captures and not loops.failed
    assert all(graph is not None for _, graph, _ in loops.graphs.values())


def test_graphs_are_on_by_default_on_cuda(model):
    adapter = ModelAdapter(model)
    assert adapter.graphs is not None and adapter.graphs.capture and adapter.implementation.endswith("-graphs")
    assert ModelAdapter(model, graphs=False).graphs is None


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_graph_replay_gives_eager_greedy_output(model, prompt, name):
    make, k = DRAFTERS[name]
    eager, graphed = ModelAdapter(model, graphs=False), ModelAdapter(model)
    want = generate(eager, prompt, drafter=make(model), k=k, max_new_tokens=40).token_ids
    got = generate(graphed, prompt, drafter=make(model), k=k, max_new_tokens=40).token_ids
    assert got == want
    assert graphed.graphs.captures > 0 and graphed.graphs.replays > graphed.graphs.captures and not graphed.graphs.failed


def test_graphs_are_reused_across_generations(model, prompt):
    """Caches come from the pool: the second generation replays the first one's graphs, it captures nothing."""
    graphed = ModelAdapter(model)
    generate(graphed, prompt, max_new_tokens=16)
    captured = graphed.graphs.captures
    generate(graphed, prompt, max_new_tokens=16)
    assert graphed.graphs.captures == captured


def test_batched_rows_replay_and_match_eager(model, prompt):
    def rows():
        return [Sequence(prompt[:, : 10 + i], drafter=NgramDrafter(3, 1) if i % 2 else None, k=3, max_new_tokens=24) for i in range(6)]

    eager, graphed = ModelAdapter(model, graphs=False), ModelAdapter(model)
    want = [g.token_ids for g in generate_many(eager, rows(), max_rows=6)]
    assert [g.token_ids for g in generate_many(graphed, rows(), max_rows=6)] == want


def test_a_continuous_batch_captures_its_row_buckets_only(model, prompt):
    """Eleven sequences of different lengths through up to 8 rows: the row count takes most values from 1 to 8, the
    captured graphs only the buckets 1, 2, 4, 8; the output is the eager batch's."""

    def rows():
        return [
            Sequence(prompt[:, : 6 + i], drafter=NgramDrafter(3, 1) if i % 3 == 0 else None, k=3, max_new_tokens=5 + 3 * i)
            for i in range(11)
        ]

    eager, graphed = ModelAdapter(model, graphs=False), ModelAdapter(model)
    want = [g.token_ids for g in generate_many(eager, rows(), max_rows=8)]
    assert [g.token_ids for g in generate_many(graphed, rows(), max_rows=8)] == want
    assert {key[2] for key in graphed.graphs.graphs} <= {1, 2, 4, 8} and graphed.graphs.captures > 0


def test_a_step_synchronises_once(model, prompt):
    """CUDA's sync debug mode warns at every synchronising call: one a step (the verdicts' read), after warm-up."""
    graphed = ModelAdapter(model)
    batch = Batch(graphed, max_rows=1)
    batch.add(Sequence(prompt, drafter=NgramDrafter(3, 1), k=3, max_new_tokens=40))
    for _ in range(4):
        batch.step()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batch.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) <= 1, [str(w.message) for w in syncs]


def test_sampling_replays_and_is_seeded(model, prompt):
    """Sampled rows on the GPU: each row's generator lives there, the same seed gives the same tokens (fixed k)."""
    graphed = ModelAdapter(model)
    sampling = SamplingParams(temperature=1.0, top_k=20, top_p=0.95)

    def run(seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        return generate(graphed, prompt, drafter=NgramDrafter(3, 1), k=3, sampling=sampling, max_new_tokens=24, generator=gen).token_ids

    assert run(5) == run(5) and len(run(6)) > 0


def test_batched_sampling_follows_the_target_on_cuda():
    """The batched sampled step on the GPU (graphs and device verification) keeps the target's distribution: the
    joint law of the first tokens, by enumeration on the CPU, against 800 draws in batches of 8 rows."""
    from decoding.loop.metrics import chi_square_pvalue
    from tests.decoding.loop.test_loop import N_TOKENS, PROMPT, SAMPLING, exact_joint

    cpu_model = tiny_llama()
    joint = exact_joint(cpu_model, PROMPT, N_TOKENS, SAMPLING)
    target = ModelAdapter(tiny_llama().cuda())
    counts = torch.zeros_like(joint)
    for draw in range(100):
        seqs = [
            Sequence(
                PROMPT.cuda(),
                drafter=NgramDrafter(2, 1),
                k=2,
                sampling=SAMPLING,
                max_new_tokens=N_TOKENS,
                generator=torch.Generator(device="cuda").manual_seed(draw * 8 + i),
            )
            for i in range(8)
        ]
        for out in generate_many(target, seqs, max_rows=8):
            counts[tuple(out.token_ids[:N_TOKENS])] += 1
    p = chi_square_pvalue(counts.flatten(), joint.flatten())
    assert p > 1e-4, p
