"""Tune searches a trained drafter's knobs: draft length (heads used), confidence stop and which artifact."""

import pytest

from decoding.config import ConfigError, SpecConfig
from tuning.space import SearchSpace, parse_range


def test_trained_space_searches_artifacts_and_knobs():
    space = SearchSpace.build(["trained"], depth=30, ranges=dict([parse_range("drafter=kangaroo-l6,kangaroo-l10")]))
    assert [k.field for k in space.knobs["trained"]] == ["k", "confidence_threshold", "drafter", "draft_vocab"]
    cfg = space.to_config({"method": "trained", "trained": {"k": 3, "confidence_threshold": 0.3, "drafter": "kangaroo-l10"}}, SpecConfig())
    assert (cfg.method, cfg.k, cfg.confidence_threshold, cfg.drafter) == ("trained", 3, 0.3, "kangaroo-l10")


def test_trained_space_keeps_the_fixed_artifact():
    space = SearchSpace.build(["trained"], depth=30)
    point = space.default_points(SpecConfig(drafter="medusa-4"))[0]
    assert space.to_config(point, SpecConfig(drafter="medusa-4")).drafter == "medusa-4"
    with pytest.raises(ConfigError) as e:  # no artifact anywhere: an invalid trial, named
        space.to_config(point, SpecConfig())
    assert e.value.field == "drafter"
