"""Tune searches a trained drafter's knobs: draft length (heads used), confidence stop and which artifact."""

import pytest

from decoding.config import SpecConfig
from decoding.errors import ConfigError
from tuning.space import SearchSpace, parse_range


def test_trained_space_searches_artifacts_and_knobs():
    space = SearchSpace.build(["trained"], depth=30, ranges=dict([parse_range("drafter=kangaroo-l6,kangaroo-l10")]))
    fields = ["k", "confidence_threshold", "drafter", "draft_vocab", "tree", "tree_budget", "stop_threshold"]
    assert [k.field for k in space.knobs["trained"]] == fields
    cfg = space.to_config({"method": "trained", "trained": {"k": 3, "confidence_threshold": 0.3, "drafter": "kangaroo-l10"}}, SpecConfig())
    assert (cfg.method, cfg.k, cfg.confidence_threshold, cfg.drafter) == ("trained", 3, 0.3, "kangaroo-l10")


def test_trained_space_keeps_the_fixed_artifact():
    space = SearchSpace.build(["trained"], depth=30)
    point = space.default_points(SpecConfig(drafter="medusa-4"))[0]
    assert space.to_config(point, SpecConfig(drafter="medusa-4")).drafter == "medusa-4"
    with pytest.raises(ConfigError) as e:  # no artifact anywhere: an invalid trial, named
        space.to_config(point, SpecConfig())
    assert e.value.field == "drafter"


def test_trained_trials_search_trees_only_for_tree_recipes(tiny_model, tmp_path):
    """Medusa / Hydra / distilled artifacts take the sampled tree; a Kangaroo trial gets a chain, not a failed trial."""
    from decoding.drafters.artifacts import save_artifact
    from decoding.drafters.trained import get_recipe

    for recipe, knobs in (("medusa", {"num_heads": 2}), ("kangaroo", {"exit_layer": 1})):
        module = get_recipe(recipe).build(tiny_model, knobs)
        save_artifact(tmp_path / recipe, recipe, knobs, module, tiny_model, "tiny", training={})
    space = SearchSpace.build(["trained"], depth=2)
    sample = {"method": "trained", "trained": {"k": 2, "tree": "dyspec", "tree_budget": 6}}
    medusa = space.to_config(sample, SpecConfig(drafter=str(tmp_path / "medusa")))
    assert (medusa.tree, medusa.tree_budget) == ("dyspec", 6)
    kangaroo = space.to_config(sample, SpecConfig(drafter=str(tmp_path / "kangaroo")))
    assert (kangaroo.tree, kangaroo.k) == ("chain", 2)
