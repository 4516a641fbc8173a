"""Search space -> SpecConfig: conditional knobs, depth bounds, invalid combinations, both searchers' views."""

from __future__ import annotations

import optuna
import pytest

from decoding.config import SpecConfig
from decoding.errors import ConfigError
from tuning.space import Knob, SearchSpace, knob_fields, parse_range
from tuning.trainable import TrialSetup, trial_config


def test_conditional_knobs_only_apply_to_their_method():
    space = SearchSpace.build(["ngram", "early-exit"], depth=6)
    base = SpecConfig(exit_layer=24, ngram_max=3)
    sample = {"method": "ngram", "ngram": {"k": 7, "ngram_max": 4, "ngram_min": 2}, "early-exit": {"k": 2, "exit_layer": 5}}
    cfg = space.to_config(sample, base)
    assert (cfg.method, cfg.k, cfg.ngram_max, cfg.ngram_min) == ("ngram", 7, 4, 2)
    assert cfg.exit_layer == 24  # the early-exit knob did not leak into an ngram config
    cfg = space.to_config({"method": "early-exit", "early-exit/k": 2, "early-exit/exit_layer": 5, "ngram/k": 8}, base)
    assert (cfg.method, cfg.k, cfg.exit_layer, cfg.ngram_max) == ("early-exit", 2, 5, 3)


def test_layer_knobs_are_bounded_by_the_model_depth():
    space = SearchSpace.build(["early-exit", "sps"], depth=4)
    by_field = {m: {k.field: k for k in ks} for m, ks in space.knobs.items()}
    assert (by_field["early-exit"]["exit_layer"].low, by_field["early-exit"]["exit_layer"].high) == (1, 3)
    assert by_field["sps"]["draft_layers"].high == 3
    # a sample beyond the depth (a stale or hand-made one) is clamped, never handed to a trial as is
    cfg = space.to_config({"method": "early-exit", "early-exit": {"exit_layer": 30, "k": 0}}, SpecConfig())
    assert cfg.exit_layer == 3 and cfg.k == 1
    # a user range beyond the depth is cut to it
    narrowed = SearchSpace.build(["early-exit"], depth=4, ranges={"exit_layer": {"low": 2, "high": 12}})
    knob = {k.field: k for k in narrowed.knobs["early-exit"]}["exit_layer"]
    assert (knob.low, knob.high) == (2, 3)


def test_a_one_layer_model_drops_the_layer_methods():
    space = SearchSpace.build(["ngram", "early-exit", "sps"], depth=1)
    assert space.methods == ("ngram",)
    assert any("early-exit dropped" in n for n in space.notes)
    with pytest.raises(ConfigError, match="early-exit dropped"):
        SearchSpace.build(["early-exit"], depth=1)
    # with a separate draft model sps needs no layer of the target, and draft_layers is not searched
    sps = SearchSpace.build(["sps"], depth=1, draft_model="/some/draft")
    assert [k.field for k in sps.knobs["sps"]] == ["k", "confidence_threshold", "tree", "tree_budget", "stop_threshold"]


def test_ngram_min_above_max_is_resolved_not_an_error():
    space = SearchSpace.build(["ngram"], depth=2)
    cfg = space.to_config({"method": "ngram", "ngram": {"ngram_min": 3, "ngram_max": 1, "k": 2}}, SpecConfig())
    assert (cfg.ngram_min, cfg.ngram_max) == (1, 3)
    # one side fixed by the user (--set ngram_max=2), the other searched above it
    fixed = SearchSpace.build(["ngram"], depth=2, fixed=["ngram_max"])
    assert "ngram_max" not in [k.field for k in fixed.knobs["ngram"]]
    cfg = fixed.to_config({"method": "ngram", "ngram": {"ngram_min": 3}}, SpecConfig(ngram_max=2))
    assert (cfg.ngram_min, cfg.ngram_max) == (2, 2)


def test_every_optuna_sample_maps_to_a_valid_config():
    space = SearchSpace.build(["ngram", "early-exit", "sps", "ar"], depth=3)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=1))
    seen_methods, suggested = set(), []
    for _ in range(60):
        trial = study.ask()
        space(trial)
        cfg = space.to_config(trial.params, SpecConfig())  # flat "method/knob" names
        seen_methods.add(cfg.method)
        suggested.append(set(trial.params))
        assert 1 <= cfg.exit_layer and (cfg.method != "early-exit" or cfg.exit_layer <= 2)
        assert cfg.ngram_min <= cfg.ngram_max
        study.tell(trial, 1.0)
    assert seen_methods == {"ngram", "early-exit", "sps", "ar"}
    # define-by-run: an ngram trial is never asked for an early-exit knob
    for params in suggested:
        methods = {p.split("/")[0] for p in params if "/" in p}
        assert len(methods) <= 1


def test_tune_random_space_samples_map_to_configs():
    from ray.tune.search.variant_generator import generate_variants

    space = SearchSpace.build(["ngram", "early-exit"], depth=4)
    for _ in range(10):
        for _, sample in generate_variants(space.tune_space()):
            cfg = space.to_config(sample, SpecConfig())
            assert cfg.method in ("ngram", "early-exit") and 1 <= cfg.k <= 8
            assert cfg.method != "early-exit" or 1 <= cfg.exit_layer <= 3
            assert cfg.ngram_min <= cfg.ngram_max


def test_default_points_are_the_untuned_defaults_clamped():
    space = SearchSpace.build(["ngram", "early-exit"], depth=4)
    points = space.default_points(SpecConfig())
    assert points[0] == {
        "method": "ngram",
        "ngram/k": 4,
        "ngram/ngram_max": 3,
        "ngram/ngram_min": 1,
        "ngram/tree": "chain",
        "ngram/tree_budget": 16,
    }
    assert points[1]["early-exit/exit_layer"] == 3  # SpecConfig's 24 clamped below the 4-layer model
    cfgs = [space.to_config(p, SpecConfig()) for p in points]
    assert [c.method for c in cfgs] == ["ngram", "early-exit"]


def test_bad_spaces_fail_with_the_field_named():
    with pytest.raises(ConfigError, match="medusa"):
        SearchSpace.build(["medusa"], depth=4)
    with pytest.raises(ConfigError, match="exit_layer"):
        SearchSpace.build(["ngram"], depth=4, ranges={"exit_layer": {"low": 1, "high": 2}})
    with pytest.raises(ConfigError, match="both fixed"):
        SearchSpace.build(["ngram"], depth=4, fixed=["k"], ranges={"k": {"low": 1, "high": 2}})
    space = SearchSpace.build(["early-exit"], depth=4, fixed=["exit_layer"])
    with pytest.raises(ConfigError, match="exit_layer"):
        space.check_base(SpecConfig(exit_layer=9))
    with pytest.raises(ConfigError, match="not in the space"):
        space.to_config({"method": "ngram"}, SpecConfig())
    with pytest.raises(ConfigError, match="not a SpecConfig field"):
        Knob("tree_shape", "choice", choices=("a",))


def test_parse_range_and_choices():
    assert parse_range("confidence_threshold=0.1:0.5:0.1") == ("confidence_threshold", {"low": 0.1, "high": 0.5, "step": 0.1})
    key, spec = parse_range("k=2,4")
    space = SearchSpace.build(["ngram"], depth=2, ranges={key: spec})
    knob = space.knobs["ngram"][0]
    assert knob.kind == "choice" and knob.choices == (2, 4)
    with pytest.raises(ConfigError, match="LO > HI"):
        parse_range("k=5:2")


def test_trial_threads_follow_the_trial_cpus_unless_set():
    space = SearchSpace.build(["ngram"], depth=2)
    sample = {"method": "ngram", "ngram": {"k": 3}}
    assert trial_config(sample, TrialSetup(space, SpecConfig(), [], cpus_per_trial=2)).threads == 2
    assert trial_config(sample, TrialSetup(space, SpecConfig(threads=1), [], cpus_per_trial=2)).threads == 1


def test_pearl_searches_its_draft_and_drops_on_a_one_layer_model():
    space = SearchSpace.build(["pearl"], depth=4)
    cfg = space.to_config(space.default_points(SpecConfig())[0], SpecConfig())
    assert cfg.method == "pearl" and cfg.draft_layers < 4
    with pytest.raises(ConfigError, match="pearl dropped"):
        SearchSpace.build(["pearl"], depth=1)  # no layer below the top to draft from
    assert SearchSpace.build(["pearl"], depth=1, draft_model="other").methods == ("pearl",)


def test_knob_fields_cover_every_method():
    fields = {"k", "exit_layer", "confidence_threshold", "ngram_max", "ngram_min", "draft_layers", "tree", "tree_budget"}
    fields |= {"triforce_gamma", "triforce_bottom", "triforce_budget", "triforce_chunk_size", "triforce_window"}
    fields |= {"drafter", "draft_vocab"}
    fields |= {"recycle_width", "suffix_factor", "suffix_min_prob", "tree_fit"}
    fields |= {"stop_threshold", "swift_skip", "ead_threshold", "ead_window"}
    assert fields == set(knob_fields())


def test_model_free_samples_are_valid_configs():
    space = SearchSpace.build(["recycling", "suffix", "hybrid"], depth=30)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(30):
        trial = study.ask()
        space(trial)
        cfg = space.to_config(trial.params, SpecConfig())
        seen.add(cfg.method)
        assert cfg.tree_fit in ("measured", "budget") and 4 <= cfg.tree_budget <= 48
        assert cfg.method == "suffix" or 1 <= cfg.recycle_width <= 8
        study.tell(trial, 1.0)
    assert seen == {"recycling", "suffix", "hybrid"}


def test_triforce_samples_are_valid_configs():
    space = SearchSpace.build(["triforce"], depth=30)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(30):
        trial = study.ask()
        space(trial)
        cfg = space.to_config(trial.params, SpecConfig())
        assert cfg.method == "triforce" and cfg.triforce_budget >= cfg.triforce_sinks + cfg.triforce_window


def _samples(methods: list[str], n: int, seed: int = 0, depth: int = 30) -> tuple[SearchSpace, list[dict]]:
    space = SearchSpace.build(methods, depth=depth)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    samples = []
    for _ in range(n):
        trial = study.ask()
        space(trial)
        samples.append(trial.params)
        study.tell(trial, 1.0)
    return space, samples


def test_early_exit_offers_trees_only_where_its_drafter_grows_them():
    """With the shipped Kangaroo adapters (chains only) every early-exit trial drafts a chain; the README's pipeline run
    had 2 of 4 trials fail with "tree: the kangaroo drafter drafts chains" (issue 29). drafter=none (plain exits) and a
    tree-drafting artifact keep the sampled tree."""
    from decoding.drafters import artifacts

    space, samples = _samples(["early-exit"], 60)
    shipped = artifacts.shipped_exit_layers("smollm2-135m")
    assert shipped  # the bundled model ships adapters: the case the issue saw
    trees = [s["early-exit/tree"] for s in samples]
    assert {"chain", "sequoia", "dyspec"} <= set(trees)  # the space does sample trees
    for sample in samples:
        cfg = space.to_config(sample, SpecConfig())
        assert cfg.exit_layer in shipped and cfg.tree == "chain", sample
        plain = space.to_config(sample, SpecConfig(drafter="none"))
        assert plain.tree == sample["early-exit/tree"]  # no adapter: plain exits draft trees


def test_every_sample_of_the_stop_head_methods_is_valid():
    """The stop head stops chains: a sample with a tree runs without it, never an invalid trial."""
    space, samples = _samples(["sps", "eagle", "early-exit", "swift", "del", "ead"], 80, seed=3)
    seen = set()
    for sample in samples:
        cfg = space.to_config(sample, SpecConfig())
        seen.add(cfg.method)
        assert cfg.stop_threshold == 0 or cfg.tree == "chain"
    assert seen == {"sps", "eagle", "early-exit", "swift", "del", "ead"}


@pytest.mark.slow
def test_every_early_exit_sample_builds_its_drafter():
    """What a trial does first, on the bundled model: build the sampled config's drafter (no invalid trial)."""
    from decoding.in_process import build_drafter
    from decoding.model.loading import load_model

    loaded = load_model("smollm2-135m", "bfloat16")
    space, samples = _samples(["early-exit"], 24, seed=5)
    for sample in samples:
        cfg = space.to_config(sample, SpecConfig())
        assert build_drafter(cfg, loaded) is not None, sample
