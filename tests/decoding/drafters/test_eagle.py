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
from tests_support import generate

from decoding.drafters.base import DecodeState
from decoding.drafters.eagle import EagleDrafter, EagleNet, VocabHead, feature_norm
from decoding.drafters.trained import RECIPES, Shared
from decoding.model.adapter import ModelAdapter
from decoding.sampling import GREEDY
from decoding.trees.shapes import Dynamic
from training.features import TargetFeatures
from training.objectives import as_windows, eagle_objectives, ttt_mask

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
    pairs, _ = eagle_objectives(net, Shared(target), as_windows(ex), {"ttt_steps": 3})
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


@pytest.mark.parametrize("shape", ["chain", "dyspec", "levels"])
def test_eagle_greedy_equals_ar(target, shape):
    """float32: greedy output identical to AR, chains and dynamic trees (the drafter is random: many rejections)."""
    model = copy.deepcopy(target)
    net = _net(model)
    adapter = ModelAdapter(model)
    prompt = torch.randint(VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    ar = generate(adapter, prompt, max_new_tokens=40).token_ids
    tree = {"dyspec": Dynamic(budget=8), "levels": Dynamic(budget=8, width=4), "chain": None}[shape]
    out = generate(adapter, prompt, drafter=EagleDrafter(net, tree=tree), k=4, max_new_tokens=40)
    assert out.token_ids == ar
    assert out.stats.target_forwards <= 40


@pytest.mark.parametrize("shape", ["chain", "dyspec", "levels"])
def test_eagle_over_a_short_context_equals_ar(target, shape):
    """A head that attends over at most 5 positions (its cache started afresh past them) stays lossless."""
    model = copy.deepcopy(target)
    adapter = ModelAdapter(model)
    prompt = torch.randint(VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    ar = generate(adapter, prompt, max_new_tokens=40).token_ids
    tree = {"dyspec": Dynamic(budget=8), "levels": Dynamic(budget=8, width=4), "chain": None}[shape]
    drafter = EagleDrafter(_net(model), tree=tree, context=5)
    assert generate(adapter, prompt, drafter=drafter, k=4, max_new_tokens=40).token_ids == ar
    assert drafter.base > 0


@pytest.mark.parametrize("shape", ["chain", "dyspec"])
def test_a_context_window_drafts_what_a_head_shown_only_those_positions_drafts(target, shape):
    """With ``context`` W the first catch-up feeds the last W positions into slots 0..W-1: the same bits as a head
    whose whole text is those positions (rotary embeddings see only position differences), and nothing before them."""
    net, adapter, n, window = _net(target), ModelAdapter(target), 20, 6
    tokens = torch.randint(VOCAB, (1, n), generator=torch.Generator().manual_seed(7))
    captured = dict.fromkeys([1, 2, 4])
    h = adapter.forward(adapter.new_cache(1, 64), 0, input_ids=tokens[:, : n - 1], captured=captured)
    base = n - 1 - window
    tree = Dynamic(budget=6) if shape == "dyspec" else None
    proposals = []
    for ids, feats, context in ((tokens, captured, window), (tokens[:, base:], {k: v[:, base:] for k, v in captured.items()}, None)):
        state = DecodeState(ids, adapter, adapter.new_cache(1, 64), GREEDY, None, 64, target_hidden=h, target_features=feats)
        drafter = EagleDrafter(net, tree=tree, context=context)
        drafter.start(state)
        proposals.append(drafter.propose(state, 3))
        assert drafter.fed == ids.shape[1] - 1 and drafter.cache.length == window  # only the window is in its cache
    (a, b) = proposals
    assert torch.equal(a.tokens, b.tokens) and (a.tree is None) == (b.tree is None)
    if a.tree is not None:
        assert torch.equal(a.tree.parents, b.tree.parents)


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


# ---- through the engine: the methods that draft with trained parts ---------------------------------------------------


@pytest.fixture(scope="module")
def four_layer_dir(tmp_path_factory):
    from tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny4"), layers=4, hidden=32, context=512, weight_std=0.5)


@pytest.fixture(scope="module")
def artifacts(four_layer_dir, tmp_path_factory):
    """Random (perturbed) eagle, distilled-draft and Kangaroo artifacts for the 4-layer tiny model."""
    from decoding.drafters.artifacts import save_artifact
    from decoding.drafters.trained import get_recipe
    from decoding.model.loading import load_model

    target = load_model(str(four_layer_dir), "float32").model
    root = tmp_path_factory.mktemp("artifacts")
    out = {}
    for name, recipe, knobs in (
        ("eagle", "eagle", {"draft_vocab": 64}),
        ("distill", "distill", {"draft_layers": 1, "draft_vocab": 64}),
        ("kangaroo-l2", "kangaroo", {"exit_layer": 2, "draft_vocab": 64}),
    ):
        r = get_recipe(recipe)
        knobs = r.check(knobs, 4)
        module = r.build(target, knobs)
        r.prepare(module, torch.arange(259))
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        # the eagle head's run "trained on windows of 8 tokens": it drafts over at most 8 positions of context
        training = {"spec": {"window": 8}} if name == "eagle" else {}
        out[name] = str(save_artifact(root / name, recipe, knobs, module, target, "tiny4", training=training))
    return out


def test_an_eagle_artifact_attends_over_its_training_window(four_layer_dir, artifacts):
    from decoding.drafters.artifacts import load_artifact
    from decoding.model.loading import load_model

    target = load_model(str(four_layer_dir), "float32").model
    assert load_artifact(artifacts["eagle"], target).drafter().context == 8
    assert load_artifact(artifacts["distill"], target).drafter().context is None  # nothing recorded: all of it


PROMPTS = ["Tell me about the sea.", "qzx vbn wrt plk"]  # the second offers nothing to copy


@pytest.mark.parametrize(
    "changes",
    [
        {"method": "eagle", "tree": "dyspec", "tree_budget": 10, "k": 4},
        {"method": "eagle", "tree": "dyspec", "tree_budget": 10, "k": 4, "tree_fit": "budget"},
        {"method": "eagle", "tree": "levels", "tree_budget": 10, "k": 4},
        {"method": "eagle", "k": 4},
        {"method": "hybrid", "k": 4},
        {"method": "sps", "k": 3},
        {"method": "early-exit", "exit_layer": 2, "k": 3},
    ],
    ids=lambda c: "-".join(str(v) for v in c.values()),
)
def test_trained_parts_through_the_engine_are_lossless(four_layer_dir, artifacts, changes):
    from decoding.config import SpecConfig
    from decoding.in_process import SpecDecoder

    base = SpecConfig(model=str(four_layer_dir), dtype="float32", max_new_tokens=24, threads=1)
    named = {"eagle": "eagle", "hybrid": "eagle", "sps": None, "early-exit": "kangaroo-l2"}[changes["method"]]
    cfg = base.replace(**changes, **({"drafter": artifacts[named]} if named else {"draft_model": artifacts["distill"]}))
    dec, ar = SpecDecoder(cfg), SpecDecoder(base)
    for text in PROMPTS:
        ids = ar.encode(text, chat=True)
        out = dec.generate_ids(ids)
        assert out.token_ids == ar.generate_ids(ids).token_ids, (changes, text)
        assert out.stats.target_forwards < len(out.token_ids) + 1
    if changes["method"] == "hybrid":  # where nothing can be copied the head drafted
        assert dec.drafter.head is not None and dec.drafter.feature_layers == dec.drafter.head.feature_layers
    if changes["method"] == "early-exit":
        from decoding.drafters.trained import KangarooDrafter

        assert isinstance(dec.drafter, KangarooDrafter)


def test_hybrid_runs_its_head_only_where_copying_offers_little(four_layer_dir, artifacts):
    """The gate, on prepared states: a long repeated text (prompt lookup and suffix expect several tokens) leaves the
    head idle; a text with nothing to copy makes it draft, and its nodes join the merged tree."""
    from decoding.config import SpecConfig
    from decoding.in_process import SpecDecoder
    from decoding.loop.prefill import prefill

    dec = SpecDecoder(SpecConfig(model=str(four_layer_dir), dtype="float32", method="hybrid", drafter=artifacts["eagle"], threads=1))
    hybrid = dec.drafter
    calls, draft_tree = [], hybrid.head.draft_tree

    def counting(state, k, *args):
        calls.append(k)
        return draft_tree(state, k, *args)

    hybrid.head.draft_tree = counting

    def state_for(text):
        ids = dec.encode(text, chat=False)
        cache = dec.target.new_cache(1, 512)
        captured = dict.fromkeys(hybrid.feature_layers)
        first, h = prefill(dec.target, cache, ids[:, :-1], GREEDY, None, captured)
        state = DecodeState(ids, dec.target, cache, GREEDY, None, 512, target_hidden=h, target_features=captured)
        hybrid.start(state)
        return state

    repeated = state_for("the cat sat on the mat, " * 6 + "the cat sat on")
    proposal = hybrid.propose(repeated, 4)
    assert not calls and proposal.tokens.shape[1] >= 3 and "eagle" not in hybrid.last_choice["sources"]
    hybrid.update(repeated, 0)
    fresh = state_for("qzx vbn wrt plk")
    proposal = hybrid.propose(fresh, 4)
    assert calls == [4] and "eagle" in hybrid.last_choice["sources"]


def test_wrong_artifacts_fail_in_one_line(four_layer_dir, artifacts):
    from decoding.config import SpecConfig
    from decoding.errors import ConfigError
    from decoding.in_process import SpecDecoder

    base = SpecConfig(model=str(four_layer_dir), dtype="float32", threads=1)
    with pytest.raises(ConfigError, match="not eagle") as e:
        SpecDecoder(base.replace(method="eagle", drafter=artifacts["distill"]))
    assert e.value.field == "drafter"
    with pytest.raises(ConfigError, match="exit layer 2") as e:
        SpecDecoder(base.replace(method="early-exit", exit_layer=1, drafter=artifacts["kangaroo-l2"]))
    with pytest.raises(ConfigError, match="not distill"):
        SpecDecoder(base.replace(method="sps", draft_model=artifacts["eagle"]))


def test_shipped_artifacts_are_the_defaults(monkeypatch, tmp_path, artifacts):
    import shutil

    import decoding.drafters.artifacts as arts
    from decoding.config import SpecConfig

    monkeypatch.setattr(arts, "SHIPPED", tmp_path)
    assert arts.shipped_artifact("tinyalias", "eagle") is None
    shutil.copytree(artifacts["eagle"], tmp_path / "tinyalias" / "eagle")
    assert arts.shipped_artifact("tinyalias", "eagle") == "tinyalias/eagle"
    assert arts.resolve_artifact("tinyalias/eagle") == tmp_path / "tinyalias" / "eagle"
    cfg = SpecConfig(model="tinyalias", method="hybrid")
    assert arts.default_drafter(cfg, "eagle") == "tinyalias/eagle"
    assert arts.default_drafter(cfg.replace(drafter="none"), "eagle") is None  # opting out
    assert arts.default_drafter(cfg.replace(drafter="x/y"), "eagle") == "x/y"


def test_tune_snaps_exit_layers_to_shipped_adapters(monkeypatch, tmp_path, artifacts):
    import shutil

    import decoding.drafters.artifacts as arts
    from decoding.config import SpecConfig
    from decoding.methods import method_of

    monkeypatch.setattr(arts, "SHIPPED", tmp_path)
    fit = method_of("early-exit").fit
    base = SpecConfig(model="tinyalias", method="early-exit")
    assert fit({"exit_layer": 3}, base, arts) == {"exit_layer": 3}  # nothing ships: the sample stands
    for layer in (2, 6):
        shutil.copytree(artifacts["kangaroo-l2"], tmp_path / "tinyalias" / f"kangaroo-l{layer}")
    assert arts.shipped_exit_layers("tinyalias") == [2, 6]
    assert [fit({"exit_layer": x}, base, arts)["exit_layer"] for x in (1, 3, 4, 5, 20)] == [2, 2, 2, 6, 6]
    assert fit({"exit_layer": 3}, base.replace(drafter="none"), arts) == {"exit_layer": 3}  # the user opted out
