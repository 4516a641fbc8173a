"""The drafters shipped for the bundled model (decoding/drafters/shipped/<model>/<name>): each within the size bound,
described for its target, and fingerprinted to the bundled model as it loads."""

import json
from pathlib import Path

import pytest

from decoding.drafters.artifacts import DESCRIPTION, WEIGHTS

SHIPPED = Path(__file__).resolve().parents[3] / "decoding" / "drafters" / "shipped"
ARTIFACTS = sorted(p for p in SHIPPED.glob("*/*") if (p / DESCRIPTION).is_file())
MAX_BYTES = 30 * 2**20


def test_the_bundled_model_ships_its_drafters():
    names = {p.name for p in ARTIFACTS if p.parent.name == "smollm2-135m"}
    assert {"eagle", "distill", "kangaroo-l6", "kangaroo-l12"} <= names


@pytest.mark.parametrize("artifact", ARTIFACTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_each_artifact_is_small_and_names_its_target(artifact):
    assert (artifact / WEIGHTS).stat().st_size <= MAX_BYTES, f"{artifact} is over 30 MB"
    description = json.loads((artifact / DESCRIPTION).read_text())
    assert description["target"]["name"] == artifact.parent.name
    assert description["training"]["steps"] > 0 and description["training"]["eval_agreement"][0] > 0.2  # it learned


@pytest.mark.slow
@pytest.mark.parametrize("artifact", [p for p in ARTIFACTS if p.parent.name == "smollm2-135m"], ids=lambda p: p.name)
def test_each_artifact_matches_the_bundled_model(artifact, smollm2_fp32):
    from decoding.model.loading import model_fingerprint

    description = json.loads((artifact / DESCRIPTION).read_text())
    assert description["target"]["fingerprint"] == model_fingerprint(smollm2_fp32.model)
