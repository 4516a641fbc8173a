"""A tiny random model and prompt file for the tuning tests (built once per session)."""

from __future__ import annotations

import pytest
from tiny_models import build_tiny_model, write_prompts


@pytest.fixture(scope="session")
def tiny_tune(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-tune")
    return {
        "model": str(build_tiny_model(root / "model")),
        "prompts": str(write_prompts(root / "q.jsonl", n_per_cat=2, cats=("writing", "qa"))),
        "root": root,
    }
