"""The feature-level drafter (decoding/drafters/eagle.py) and its training objective (training/objectives.py).

The unrolled training forward must compute what drafting computes: step j at row i of the objective is the
(j+1)-th draft made after position i-j, its input the previous step's output. Checked in float32 on a tiny
model, with the drafts forced to the true tokens. Greedy and sampled decoding stay lossless (the target
verifies); the statistical test of the sampled distribution lives with the other drafters' (test_trained.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_llama

from decoding.drafters.drafters import DecodeState
from decoding.drafters.eagle import EagleDrafter, EagleNet, VocabHead, feature_norm
from decoding.drafters.trained import RECIPES, Shared
from decoding.loop.loop import GREEDY, generate
from decoding.model.adapter import ModelAdapter
from decoding.trees.trees import Dynamic
from training.features import TargetFeatures
from training.objectives import eagle_objectives, ttt_mask

VOCAB = 48


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=VOCAB, layers=4, seed=3)


def _net(target, seed=0, vocab=None):
    torch.manual_seed(seed)
    net = EagleNet(target, (1, 2, 4), torch.arange(VOCAB) if vocab is None else vocab)
    with torch.no_grad():  # a drafter that is not the identity at its start, so that every input matters
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return net.eval()


def test_feature_norm_puts_depths_on_one_scale():
    h = torch.randn(2, 5, 16) * torch.tensor([0.1, 10.0])[:, None, None]
    rms = feature_norm(h).pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones_like(rms), atol=1e-3)


def test_ttt_mask_rows_see_true_prefix_and_their_own_chain():
    m = ttt_mask(5, 2)
    assert m.shape == (5, 15)
    # row 4 at step 2: true keys of rows <= 2, step-1 key of row 3, its own step-2 key
    assert m[4].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert ttt_mask(4, 0).equal(torch.ones(4, 4, dtype=torch.bool).tril())


def test_training_forward_equals_drafting(target):
    """Objective step j, row i == the drafter's (j+1)-th chain draft after position start+i-j (drafts = true tokens)."""
    net = _net(target)
    tokens = torch.randint(VOCAB, (24,), generator=torch.Generator().manual_seed(1))
    feats = TargetFeatures(target, [1, 2, 4])
    ex = feats.example({"tokens": tokens}, window=64)
    pairs, _ = eagle_objectives(net, Shared(target), ex, {"ttt_steps": 3})
    # drafting: after committing tokens[:n] (pending tokens[n-1]), drafts forced to tokens[n], tokens[n+1]
    adapter = ModelAdapter(target)
    for n in (8, 13, 17):
        cache = adapter.new_cache(1, 64)
        captured = dict.fromkeys([1, 2, 4])
        h = adapter.forward(cache, 0, input_ids=tokens[None, : n - 1], captured=captured)
        state = DecodeState(tokens[None, :n], adapter, cache, GREEDY, None, 64, target_hidden=h, target_features=captured)
        drafter = EagleDrafter(net)
        drafter.start(state)
        root = drafter._catch_up(state)
        logits = [drafter.adapter.logits(root)[0, -1]]
        prev = root
        for i in range(2):  # feed the true token as draft i+1
            prev = drafter.adapter.forward(drafter.cache, n - 1 + i, hidden=net.inputs(prev, tokens[None, n + i : n + i + 1]))
            logits.append(drafter.adapter.logits(prev)[0, -1])
        for step, got in enumerate(logits):
            row = n - 2 + step  # objective rows are positions start.. (start 0 here); step j sits j rows on
            keep = torch.arange(23) >= step  # rows the objective keeps at this step (no answer mask: every row)
            assert torch.allclose(pairs[step][0], pairs[step][0])  # shape sanity
            student = pairs[step][0][row - int((~keep[: row + 1]).sum())]
            assert torch.allclose(student, got, atol=1e-4), (n, step)


def test_trimmed_head_trains_and_drafts_over_its_tokens(target):
    vocab = torch.tensor([5, 9, 2, 40, 7, 11, 3, 30])
    net = _net(target, vocab=vocab)
    head = net.lm_head
    assert isinstance(head, VocabHead) and head.vocab.tolist() == vocab.tolist()
    out = head(torch.randn(3, target.config.hidden_size))
    assert out.shape == (3, VOCAB) and torch.isinf(out[:, 0]).all() and torch.isfinite(out[:, vocab]).all()
    head.reset(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert head.vocab.tolist() == [1, 2, 3, 4, 5, 6, 7, 8] and torch.equal(head.weight, target.lm_head.weight[1:9])
    recipe = RECIPES["eagle"]
    assert recipe.check({"draft_vocab": 8}, 4) == {"low_layer": 1, "mid_layer": 2, "draft_vocab": 8, "ttt_steps": 3}
    assert recipe.data_layers(recipe.check({}, 30), 30) == [2, 15, 30]


@pytest.mark.parametrize("shape", ["chain", "dyspec"])
def test_eagle_greedy_equals_ar(target, shape):
    """float32: greedy output identical to AR, chains and dynamic trees (the drafter is random: many rejections)."""
    model = copy.deepcopy(target)
    net = _net(model)
    adapter = ModelAdapter(model)
    prompt = torch.randint(VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    ar = generate(adapter, prompt, max_new_tokens=40).token_ids
    tree = Dynamic(budget=8) if shape == "dyspec" else None
    out = generate(adapter, prompt, drafter=EagleDrafter(net, tree=tree), k=4, max_new_tokens=40)
    assert out.token_ids == ar
    assert out.stats.target_forwards <= 40


def test_dynamic_trees_verify_the_prefix_the_cost_curve_pays_for(target):
    """Best-first nodes come in non-increasing path probability; a flat verification cost keeps every node, a steep
    one only the first few (TreeChooser.prefix)."""
    from decoding.trees.hardware import TreeChooser

    model = copy.deepcopy(target)
    adapter = ModelAdapter(model)
    prompt = torch.randint(VOCAB, (1, 12), generator=torch.Generator().manual_seed(6))
    sizes = {}
    for name, costs in (("flat", {1: 1.0, 64: 1.0001}), ("steep", {1: 1.0, 2: 2.0, 64: 64.0})):
        drafter = EagleDrafter(_net(model), tree=Dynamic(budget=12), chooser=TreeChooser(costs))
        out = generate(adapter, prompt, drafter=drafter, k=4, max_new_tokens=6)
        assert out.token_ids == generate(adapter, prompt, max_new_tokens=6).token_ids
        sizes[name] = drafter.last
    assert sizes["flat"]["verified"] == sizes["flat"]["drafted"] > 1
    assert sizes["steep"]["verified"] < sizes["steep"]["drafted"]
