"""tests/gpu/: the real CUDA path. Every test here is skipped, with the reason, on a machine without a CUDA GPU."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    reason = f"no CUDA GPU here (torch {torch.__version__}, cuda build {torch.version.cuda}): run tests/gpu/ on a GPU machine"
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=reason))
