"""Draft loops as functions of device tensors (decoding/drafters/drafting.py's ``greedy_chain_loop`` and
``greedy_levels_loop``, replayed by ``decoding.model.graphs.LoopGraphs``): on a GPU each is one CUDA graph per shape;
here (no CUDA) the same loop runs on the static buffers, and it must draft what the eager loop drafts.

Checked in float32 on a tiny model: the same drafts step by step (the same accepted counts over a generation, the
same tree at a step), the output equal to AR's, the loop used where it applies (greedy, no stopping rule) and not
elsewhere. ``tests/gpu/test_graphs.py`` checks the captured graphs on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from tests_support import generate

from decoding.drafters.base import DecodeState
from decoding.drafters.draft_model import DraftModelDrafter
from decoding.drafters.drafting import level_sizes
from decoding.drafters.eagle import EagleDrafter, EagleNet
from decoding.model.adapter import ModelAdapter
from decoding.sampling import GREEDY, SamplingParams
from decoding.trees.shapes import Dynamic

VOCAB = 48


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=VOCAB, layers=4, seed=3, sharpness=8.0)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))


def _eagle(target, loops: bool, tree=None):
    torch.manual_seed(0)
    head = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[:32]  # a trimmed head: ids are mapped back
    net = EagleNet(target, (1, 2, 4), head)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return EagleDrafter(net.eval(), tree=tree, loop_graphs=loops)


def _run(target, prompt, drafter, k, **kw):
    return generate(ModelAdapter(target), prompt, drafter=drafter, k=k, max_new_tokens=48, **kw)


@pytest.mark.parametrize("k", [2, 5])
def test_the_eagle_chain_loop_drafts_what_the_eager_loop_drafts(target, prompt, k):
    ar = _run(target, prompt, None, 1).token_ids
    eager = _run(target, prompt, _eagle(target, False), k)
    drafter = _eagle(target, True)
    looped = _run(target, prompt, drafter, k)
    assert looped.token_ids == eager.token_ids == ar
    assert [s.accepted for s in looped.steps] == [s.accepted for s in eager.steps]
    assert [s.drafted for s in looped.steps] == [s.drafted for s in eager.steps]
    assert sum(s.accepted for s in looped.steps) > 0  # the drafts are not all rejected: the comparison means something
    chains = [s.drafted for s in looped.steps if s.drafted > 1]  # the last steps draft fewer (the tokens left)
    assert drafter.loops.replays == len(chains)  # every chain came from the loop
    # after a drafting step the catch-up (the pending token and the accepted drafts) is replayed with the chain as one
    # graph per (k, width); the first chain, after the prompt's long catch-up, replays the chain alone
    expected = set()
    for i, step in enumerate(looped.steps):
        width = looped.steps[i - 1].accepted + 1 if i else None
        if step.drafted > 1:
            fused = width is not None and width <= step.drafted + 1
            expected.add(("caught-up-chain", step.drafted, width) if fused else ("chain", step.drafted))
    keys = {(key[0], key[4], key[5]) if key[0] == "caught-up-chain" else (key[0], key[4]) for key in drafter.loops.graphs}
    assert keys == expected and drafter.loops.captures == len(expected)  # one per shape
    assert any(key[0] == "caught-up-chain" for key in keys)


@pytest.mark.parametrize("shape", [Dynamic(budget=12, width=4), Dynamic(budget=20, max_rank=3, width=6)])
def test_the_eagle_level_tree_loop_grows_the_eager_tree(target, prompt, shape):
    """At one step both loops return the same tree (node for node: tokens, parents, path probabilities); over a
    generation they accept the same drafts and both give AR's output."""
    state_of = {}
    for loops in (False, True):
        drafter = _eagle(target, loops, tree=shape)
        adapter = ModelAdapter(target)
        cache = adapter.new_cache(1, 64)
        features = dict.fromkeys(drafter.feature_layers)
        h = adapter.forward(cache, 0, input_ids=prompt[:, :-1], captured=features)  # the last prompt token is pending
        state = DecodeState(prompt, adapter, cache, GREEDY, None, 64, target_hidden=h, target_features=features)
        drafter.start(state)
        proposal = drafter.propose(state, 4)
        state_of[loops] = (proposal.tokens.tolist(), proposal.tree.parents.tolist(), drafter)
    (tokens, parents, _), (tokens_l, parents_l, looped) = state_of[False], state_of[True]
    assert tokens_l == tokens and parents_l == parents
    assert len(tokens[0]) == min(shape.budget, sum(level_sizes(shape.width, shape.max_rank, 4)))
    assert looped.loops.replays == 1
    ar = _run(target, prompt, None, 1).token_ids
    eager = _run(target, prompt, _eagle(target, False, tree=shape), 4)
    looped = _run(target, prompt, _eagle(target, True, tree=shape), 4)
    assert looped.token_ids == eager.token_ids == ar
    assert [s.accepted for s in looped.steps] == [s.accepted for s in eager.steps] and sum(s.accepted for s in looped.steps) > 0


def test_the_loop_stays_out_where_the_host_decides(target, prompt):
    """Sampled drafts, a confidence threshold and best-first (DySpec) trees take decisions on the host: the eager loop
    drafts them, and sampled output stays a function of the seed."""
    sampled = SamplingParams(temperature=0.8)
    for drafter, kw in (
        (_eagle(target, True), {"sampling": sampled, "generator": torch.Generator().manual_seed(0)}),
        (_eagle(target, True, tree=Dynamic(budget=8)), {}),
    ):
        _run(target, prompt, drafter, 3, **kw)
        assert drafter.loops.replays == 0
    drafter = _eagle(target, True)
    drafter.threshold = 0.5
    _run(target, prompt, drafter, 3)
    assert drafter.loops.replays == 0


def test_the_draft_model_chain_loop_drafts_what_the_eager_loop_drafts(target, prompt):
    """SpS's drafter (a separate small model, or the distilled draft) replays its k drafts as one loop too."""
    ar = _run(target, prompt, None, 1).token_ids
    draft = tiny_llama(vocab=VOCAB, layers=2, seed=5, sharpness=8.0)
    eager = _run(target, prompt, DraftModelDrafter(ModelAdapter(draft), loop_graphs=False), 4)
    drafter = DraftModelDrafter(ModelAdapter(draft), loop_graphs=True)
    looped = _run(target, prompt, drafter, 4)
    assert looped.token_ids == eager.token_ids == ar
    assert [s.accepted for s in looped.steps] == [s.accepted for s in eager.steps]
    chains = [s.drafted for s in looped.steps if s.drafted > 1]
    assert drafter.loops.replays == len(chains) > 0
    # the catch-up (the target's token, and the last draft when every draft was accepted) is replayed with the chain:
    # one graph per (k, width); the first chain, after the prompt, replays the chain alone
    expected = {("chain", chains[0])}
    for before, step in zip(looped.steps, looped.steps[1:], strict=False):
        if step.drafted > 1:
            expected.add(("caught-up-chain", step.drafted, 1 + (before.accepted == before.drafted)))
    keys = {(key[0], key[4], key[5]) if key[0] == "caught-up-chain" else (key[0], key[3]) for key in drafter.loops.graphs}
    assert keys == expected and drafter.loops.captures == len(expected)


def test_drafters_over_one_module_share_its_adapter_and_a_trimmed_head_stays_their_own(target):
    """Every drafter over one module shares its adapter (its graphs and cache pool: a new request replays what an
    earlier one captured); trimming one drafter's vocabulary gives that drafter its own head, not the others."""
    from decoding.drafters.trained import TrimmedHead, trim_vocab

    net = _eagle(target, False).net
    a, b = EagleDrafter(net), EagleDrafter(net)
    assert a.adapter is b.adapter is ModelAdapter.shared(net)
    head = TrimmedHead(target.lm_head, torch.arange(16))
    trim_vocab(b, head)
    assert b.adapter.lm_head is head and a.adapter.lm_head is net.lm_head and ModelAdapter.shared(net) is a.adapter
    assert b.adapter.graphs is a.adapter.graphs and b.adapter.pool is a.adapter.pool


def test_a_model_drafter_marks_the_end_of_its_catch_up(target, prompt):
    """k=auto learns what catching up on committed tokens costs apart from what drafts cost (``decoding.loop.batch``)
    from the mark a model drafter leaves where its catch-up ends: every drafting step of an eager draft has it, within
    its drafting time. A catch-up run in one graph with the chain leaves none."""
    draft = tiny_llama(vocab=VOCAB, layers=2, seed=5, sharpness=8.0)
    for drafter in (_eagle(target, False), DraftModelDrafter(ModelAdapter(draft), loop_graphs=False)):
        steps = [s for s in _run(target, prompt, drafter, 3).steps if s.drafted]
        assert steps and all(s.catch_up_s is not None and 0.0 <= s.catch_up_s <= s.draft_s for s in steps), drafter.name
    looped = DraftModelDrafter(ModelAdapter(draft), loop_graphs=True)
    steps = _run(target, prompt, looped, 4).steps
    assert looped.loops.replays > 0 and any(s.drafted > 1 and s.catch_up_s is None for s in steps)
