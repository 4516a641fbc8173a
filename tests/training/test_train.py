"""Training recipes on tiny random models: losses fall, resume after an interruption, data generation and its cache."""

import json

import pytest
import torch
from conftest import tiny_llama
from tests_support import generate
from tiny_models import build_tiny_model, write_prompts

from decoding.drafters.artifacts import load_artifact
from decoding.drafters.trained import RECIPES
from decoding.model.adapter import ModelAdapter
from training.data import extract_hidden, generate_data, load_examples, read_meta
from training.trainer import TrainSpec, train

KNOBS = {
    "kangaroo": {"exit_layer": 1},
    "distill": {"draft_layers": 1},
    "medusa": {"num_heads": 2},
    "hydra": {"num_heads": 2},
    "feature": {},
    "eagle": {"draft_vocab": 12},
    "stop": {"source": "exit", "hidden": 8},
}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=12, layers=3, seed=0)


@pytest.fixture(scope="module")
def examples(target):
    """Sequences the target wrote itself (greedy), with hidden states of every layer: what training.data stores."""
    adapter, g, out = ModelAdapter(target), torch.Generator().manual_seed(0), []
    for _ in range(8):
        prompt = torch.randint(0, 12, (1, 6), generator=g)
        gen = generate(adapter, prompt, max_new_tokens=26)
        tokens = torch.cat([prompt[0], torch.tensor(gen.token_ids)])
        hidden = {k: torch.from_numpy(v) for k, v in extract_hidden(adapter, tokens, [1, 2, 3], start=2).items()}
        out.append({"tokens": tokens, "start": 2, "hidden": hidden, "prompt_len": 6})
    return out


def test_every_recipe_is_trained():
    assert set(KNOBS) == set(RECIPES)


# the stop head is a binary classifier over 8 features of the draft distribution: on a random model they explain little
# of its exits' agreement (test_stop_head_learns_the_drafts_agreement; the shipped heads are checked on real data)
@pytest.mark.parametrize("recipe", [r for r in KNOBS if r != "stop"])
def test_loss_falls(target, examples, recipe, tmp_path):
    spec = TrainSpec(recipe, KNOBS[recipe], steps=24, batch=3, lr=1e-2, checkpoint_every=100)
    train(spec, target, examples, tmp_path, "tiny", progress=False)
    history = json.loads((tmp_path / "history.json").read_text())
    first = sum(h["loss"] for h in history[:4]) / 4
    last = sum(h["loss"] for h in history[-4:]) / 4
    assert last < 0.8 * first, (recipe, first, last)
    art = load_artifact(str(tmp_path), target)  # the artifact loads back for this target
    assert art.description["recipe"] == recipe and (tmp_path / "loss.png").stat().st_size > 0


@pytest.mark.parametrize("recipe", ["eagle", "distill"])
def test_a_step_as_one_batch_trains_too(target, examples, recipe, tmp_path):
    """``micro_batch`` = the step's sequences: one forward and backward over right-padded windows (a GPU's default)."""
    spec = TrainSpec(recipe, KNOBS[recipe], steps=24, batch=3, lr=1e-2, checkpoint_every=100, micro_batch=3)
    train(spec, target, examples, tmp_path, "tiny", progress=False)
    history = json.loads((tmp_path / "history.json").read_text())
    assert sum(h["loss"] for h in history[-4:]) < 0.8 * sum(h["loss"] for h in history[:4])


def test_a_time_budget_runs_the_whole_schedule(target, examples, tmp_path):
    """With a deadline the learning rate warms up and decays to its floor over the time budget, not over steps the
    budget will never reach: the last step runs near 10% of the peak."""
    import time

    spec = TrainSpec("eagle", KNOBS["eagle"], steps=10**6, batch=2, lr=1e-2, checkpoint_every=10**6)
    train(spec, target, examples, tmp_path, "tiny", progress=False, deadline=time.time() + 4)
    lrs = [h["lr"] for h in json.loads((tmp_path / "history.json").read_text())]
    assert 10 < len(lrs) < spec.steps
    assert max(lrs) > 0.9 * spec.lr and lrs[-1] < 0.15 * spec.lr
    assert lrs.index(max(lrs)) < len(lrs) // 2


def test_tvdpp_loss_lowers_total_variation(target, examples, tmp_path):
    from decoding.drafters.trained import Shared, get_recipe
    from training.objectives import objectives, tvd

    recipe, knobs = get_recipe("distill"), {"draft_layers": 1}

    def mean_tvd(module):
        with torch.no_grad():
            return sum(float(tvd(t, s)) for ex in examples for s, t in objectives(recipe, module, Shared(target), ex, knobs)[0]) / len(
                examples
            )

    before = mean_tvd(recipe.build(target, knobs))
    train(TrainSpec("distill", knobs, loss="tvdpp", steps=30, batch=3, lr=1e-2), target, examples, tmp_path, "t", progress=False)
    after = mean_tvd(load_artifact(str(tmp_path), target).module)
    assert after < 0.9 * before, (before, after)


def test_resume_after_interruption_matches_an_uninterrupted_run(target, examples, tmp_path):
    spec = TrainSpec("hydra", {"num_heads": 2}, steps=8, batch=2, lr=1e-2, checkpoint_every=2)

    def stop_at_5(step, row):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(spec, target, examples, tmp_path / "a", "t", progress=False, on_step=stop_at_5)
    first = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)
    assert first["step"] == 5 and first["seconds"] > 0
    resumed = train(spec, target, examples, tmp_path / "a", "t", progress=False)
    assert resumed["train_seconds"] >= first["seconds"] + resumed["train_seconds_this_run"] - 0.1  # both legs counted
    train(spec, target, examples, tmp_path / "b", "t", progress=False)
    a, b = load_artifact(str(tmp_path / "a"), target), load_artifact(str(tmp_path / "b"), target)
    for k, v in a.module.state_dict().items():
        assert torch.allclose(v, b.module.state_dict()[k], atol=1e-6), k
    assert resumed["steps"] == 8 and len(json.loads((tmp_path / "a" / "history.json").read_text())) == 8


def test_generate_data_resumes_and_adds_layers(tmp_path, monkeypatch):
    from decoding.config import SpecConfig
    from decoding.in_process import SpecDecoder
    from evaluation.workloads import load_prompts

    monkeypatch.setenv("SPECRAY_HOME", str(tmp_path / "home"))
    model = build_tiny_model(tmp_path / "m", layers=3)
    prompts = load_prompts(write_prompts(tmp_path / "p.jsonl", n_per_cat=2))  # 6 prompts
    dec = SpecDecoder(SpecConfig(model=str(model), dtype="float32"))
    d = tmp_path / "data"
    meta = generate_data(dec, prompts, [3], d, max_new_tokens=8, shard_size=4, window=16)
    assert meta["sequences"] == 6 and len(list(d.glob("part-*.parquet"))) == 2
    first = load_examples(d, [3])
    # an interruption after the first shard: meta and the second shard are gone; rerunning redoes only that shard
    (d / "meta.json").unlink()
    (d / "part-00001.parquet").unlink()
    mtime = (d / "part-00000.parquet").stat().st_mtime_ns
    generate_data(dec, prompts, [3], d, max_new_tokens=8, shard_size=4, window=16)
    assert (d / "part-00000.parquet").stat().st_mtime_ns == mtime
    again = load_examples(d, [3])
    assert [e["tokens"].tolist() for e in again] == [e["tokens"].tolist() for e in first]
    # a recipe needing another layer extends the same data set
    assert generate_data(dec, prompts, [1, 3], d, max_new_tokens=8)["layers"] == [1, 3]
    ex = load_examples(d, [1, 3])[0]
    assert ex["hidden"][1].shape == ex["hidden"][3].shape == (min(16, ex["tokens"].shape[0]), 64)
    assert torch.equal(ex["hidden"][3], first[0]["hidden"][3])
    assert read_meta(d)["sequences"] == 6


def test_training_over_a_token_subset(target, examples, tmp_path):
    """--train-vocab: losses over the most frequent tokens only; the held-out agreement (full vocabulary) still rises."""
    spec = TrainSpec("medusa", {"num_heads": 2}, steps=24, batch=3, lr=1e-2, train_vocab=8)
    training = train(spec, target, examples, tmp_path, "tiny", progress=False)
    assert training["loss_last"] < training["loss_first"]
    assert sum(training["eval_agreement"]) > sum(training["eval_agreement_before"])


@pytest.mark.parametrize("recipe,knobs", [("eagle", {"draft_vocab": 10}), ("distill", {"draft_layers": 1, "draft_vocab": 10})])
def test_training_on_the_fly_from_token_ids(target, recipe, knobs, tmp_path):
    """Token-id examples only (what ``specray distill`` writes): the target's hidden states are computed per window as
    training draws it; the loss falls, the held-out agreement rises, and the losses count the answers only."""
    from training.features import TargetFeatures

    adapter, g = ModelAdapter(target), torch.Generator().manual_seed(1)
    rows = []
    for _ in range(10):
        prompt = torch.randint(0, 12, (1, 6), generator=g)
        answer = generate(adapter, prompt, max_new_tokens=30).token_ids
        rows.append({"tokens": torch.cat([prompt[0], torch.tensor(answer)]), "answer_from": 6})
    spec = TrainSpec(recipe, knobs, steps=30, batch=2, lr=1e-2, window=24, checkpoint_every=100)
    from decoding.drafters.trained import get_recipe

    layers = get_recipe(recipe).data_layers(get_recipe(recipe).check(knobs, 3), 3)
    features = TargetFeatures(target, layers)
    training = train(spec, target, rows[:8], tmp_path, "tiny", progress=False, features=features, eval_examples=rows[8:])
    assert training["loss_last"] < 0.8 * training["loss_first"]
    assert training["eval_agreement"][0] > training["eval_agreement_before"][0]
    assert features.tokens_run > 30 * 2 * 6  # the target really ran for every draw
    art = load_artifact(str(tmp_path), target)
    assert art.module.lm_head.vocab.shape == (10,)


def test_features_with_a_capped_context(target):
    """max_context: the target sees at most that many tokens up to the window's end; positions start there."""
    from training.features import TargetFeatures

    tokens = torch.randint(0, 12, (60,), generator=torch.Generator().manual_seed(3))
    capped = TargetFeatures(target, [3], max_context=30).example({"tokens": tokens, "answer_from": 50}, window=16)
    assert capped["tokens"].tolist() == tokens[30:].tolist() and capped["start"] == 14 and capped["answer_from"] == 20
    full = TargetFeatures(target, [3]).example({"tokens": tokens[30:], "answer_from": 20}, window=16)
    assert torch.equal(capped["hidden"][3], full["hidden"][3])  # the same as a text that began there


def test_stop_head_learns_the_drafts_agreement(target, examples, tmp_path):
    """SpecDec++'s head: its label is whether the source drafter's top-1 equals the target's (here the target's own head
    on its exit layers), it trains with the plain trainer, and its artifact is a few hundred bytes that loads back."""
    from decoding.drafters.stop_head import exit_layers, stop_features
    from decoding.drafters.trained import Shared
    from training.objectives import stop_objectives

    shared, head = Shared(target), RECIPES["stop"].build(target, KNOBS["stop"])
    ((student, teacher),) = stop_objectives(head, shared, examples[0], {})[0]
    final = shared.logits(examples[0]["hidden"][3])
    layer = exit_layers(3)[examples[0]["start"] % len(exit_layers(3))]  # one exit per window
    exits = shared.logits(examples[0]["hidden"][layer])
    agree = exits.argmax(-1) == final.argmax(-1)  # every row answers (no answer_from)
    assert torch.equal(teacher.argmax(-1).bool(), agree) and 0 < agree.float().mean() < 1
    assert torch.allclose(student[:, 1], head(stop_features(exits)), atol=1e-6)
    spec = TrainSpec("stop", KNOBS["stop"], steps=12, batch=3, lr=3e-2, checkpoint_every=100)
    training = train(spec, target, examples, tmp_path, "tiny", progress=False)
    assert training["eval_agreement"][0] > 0.5  # at least the majority class on the held-out sequence
    assert (tmp_path / "drafter.safetensors").stat().st_size < 2048  # no VocabTrim ranking stored with it
    art = load_artifact(str(tmp_path), target)
    assert art.recipe.name == "stop" and art.knobs == {"source": "exit", "hidden": 8}
    with pytest.raises(Exception, match="not a drafter"):
        art.drafter()


@pytest.mark.parametrize("recipe", list(KNOBS))
def test_a_batch_of_windows_scores_what_each_window_scores(target, examples, recipe):
    """One forward over right-padded windows of different lengths and starts gives every window's pairs, in order:
    the padding changes no row (what lets a training step run its sequences as one batch)."""
    from decoding.drafters.trained import Shared, get_recipe
    from training.objectives import Windows, objectives

    r = get_recipe(recipe)
    torch.manual_seed(0)
    knobs = r.check(KNOBS[recipe], 3)
    module = r.build(target, knobs).float().eval()
    shared = Shared(target)
    a, b = examples[0], examples[1]  # hidden states stored in float16: windows hold float32
    a = {**a, "hidden": {k: v.float() for k, v in a["hidden"].items()}, "answer_from": 4}
    b = {**b, "tokens": b["tokens"][:20], "start": 5, "hidden": {k: v[3:18].float() for k, v in b["hidden"].items()}, "answer_from": 9}
    with torch.no_grad():
        together, _ = objectives(r, module, shared, Windows.of([a, b]), knobs)
        alone = [objectives(r, module, shared, ex, knobs)[0] for ex in (a, b)]
    assert len(together) == len(alone[0]) > 0
    for head, (student, teacher) in enumerate(together):
        assert student.shape[0] == sum(pairs[head][0].shape[0] for pairs in alone) > 0
        assert torch.allclose(student, torch.cat([pairs[head][0] for pairs in alone]), atol=1e-5), (recipe, head)
        assert torch.allclose(teacher, torch.cat([pairs[head][1] for pairs in alone]), atol=1e-5), (recipe, head)


def test_features_of_a_batch_are_each_windows_features(target):
    """TargetFeatures.batch runs the target once over right-padded texts; it draws the same windows from the same
    generator as one-by-one examples, and each window's hidden states are the example's (a capped context included)."""
    from training.features import TargetFeatures
    from training.objectives import Windows

    g = torch.Generator().manual_seed(5)
    texts = [{"tokens": torch.randint(0, 12, (n,), generator=g), "answer_from": a} for n, a in ((60, 50), (14, 4), (33, 10))]
    feats = TargetFeatures(target, [1, 3], max_context=40)
    one_by_one = torch.Generator().manual_seed(7)
    alone = Windows.of([feats.example(ex, 16, one_by_one) for ex in texts])
    batch = feats.batch(texts, 16, torch.Generator().manual_seed(7))
    assert batch.length.tolist() == alone.length.tolist() == [16, 14, 16]
    for name in ("tokens", "start", "answer_from"):
        assert torch.equal(getattr(batch, name), getattr(alone, name)), name
    for layer in (1, 3):
        assert torch.allclose(batch.hidden[layer], alone.hidden[layer], rtol=1e-4, atol=1e-4), (
            (batch.hidden[layer] - alone.hidden[layer]).abs().max()
        )


@pytest.mark.parametrize("recipe", ["eagle", "distill"])
def test_training_as_stored_computes_with_the_stored_weights_and_updates_the_trained_ones(target, examples, recipe, tmp_path):
    """``as_stored``: each forward sees the matrices as the artifact stores them, the optimiser moves the float weights,
    and what training measured is what the artifact computes with."""
    from decoding.drafters.artifacts import stored_copy
    from decoding.drafters.storage import Storage
    from training.trainer import StoredView

    storage = Storage(group=8)
    spec = TrainSpec(recipe, KNOBS[recipe], steps=24, batch=3, lr=1e-2, checkpoint_every=100, as_stored=True)
    training = train(spec, target, examples, tmp_path, "tiny", progress=False, storage=storage)
    history = json.loads((tmp_path / "history.json").read_text())
    assert sum(h["loss"] for h in history[-4:]) < 0.8 * sum(h["loss"] for h in history[:4])
    assert training["eval_agreement"] == training["eval_agreement_stored"]  # trained as stored: nothing lost to storage

    module = load_artifact(str(tmp_path), target).module.float()
    trained = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["module"]
    module.load_state_dict(trained)
    view = StoredView(module, recipe, KNOBS[recipe], target, storage)
    stored = stored_copy(module, recipe, KNOBS[recipe], target, storage).state_dict()
    with view.swapped():
        inside = {k: v.clone() for k, v in module.state_dict().items()}
    moved = [k for k in view.matrices if not torch.equal(inside[k], trained[k])]
    assert moved and all(torch.equal(inside[k], stored[k]) for k in inside)  # the forward's weights: the stored ones
    assert all(torch.equal(v, trained[k]) for k, v in module.state_dict().items())  # and the trained ones back after it
