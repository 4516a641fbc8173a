"""Where specray keeps its files. Torch-free, so light commands can import it."""

from __future__ import annotations

import os
from pathlib import Path


def specray_home() -> Path:
    """``$SPECRAY_HOME``, default ``~/.specray``: converted models, the file registry, run outputs."""
    return Path(os.environ.get("SPECRAY_HOME") or Path.home() / ".specray")
