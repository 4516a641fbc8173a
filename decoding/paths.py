"""Where specray keeps its files, and how a committed record names them. Torch-free, so light commands can import it."""

from __future__ import annotations

import os
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent  # the checkout: data/, docs/, the shipped drafters


def specray_home() -> Path:
    """``$SPECRAY_HOME``, default ``~/.specray``: converted models, the file registry, run outputs."""
    return Path(os.environ.get("SPECRAY_HOME") or Path.home() / ".specray")


def portable(path: str | os.PathLike) -> str:
    """``path`` as a record that may be committed names it: relative to the project when inside it, as
    ``$SPECRAY_HOME/...`` when under specray's home, else as given (a relative path is taken from the working
    directory). Never the project's or the home's absolute place on this machine.

    >>> portable(PROJECT / "data" / "spec_bench" / "question.jsonl")
    'data/spec_bench/question.jsonl'
    >>> portable(specray_home() / "ship" / "eagle")
    '$SPECRAY_HOME/ship/eagle'
    """
    p = Path(path).resolve()
    for root, name in ((PROJECT, None), (specray_home().resolve(), "$SPECRAY_HOME")):
        if p.is_relative_to(root):
            rel = p.relative_to(root).as_posix()
            return rel if name is None else f"{name}/{rel}"
    return os.fspath(path)


def local(record: str) -> Path:
    """The place on this machine a record written by :func:`portable` names (the inverse of ``portable``).

    >>> local(portable(specray_home() / "ship" / "eagle")) == (specray_home() / "ship" / "eagle").resolve()
    True
    """
    if record.startswith("$SPECRAY_HOME/"):
        return specray_home().resolve() / record[len("$SPECRAY_HOME/") :]
    p = Path(record)
    return p if p.is_absolute() else PROJECT / p
