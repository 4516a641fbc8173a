"""What a tree description in a configuration may say, parsed and checked: rank paths (``tree_paths``) and a per-rank
acceptance vector (``tree_acceptance``). Pure Python, ground level: ``decoding.config`` checks a config with it and
``decoding.trees.shapes`` builds trees from what it returns.
"""

from __future__ import annotations

import json


class TreeError(ValueError):
    """A malformed tree description (the config layer names the field)."""


def validate_paths(paths) -> list[list[int]]:
    """Check a path list: non-empty lists of non-negative ints whose parent path and previous sibling are present.

    >>> validate_paths([[0], [0, 1]])
    Traceback (most recent call last):
    ...
    decoding.treespec.TreeError: path [0, 1] needs its previous sibling [0, 0]
    """
    if not isinstance(paths, list | tuple) or not paths:
        raise TreeError("expected a non-empty list of paths, e.g. [[0], [1], [0, 0]]")
    seen = set()
    for p in paths:
        if not isinstance(p, list | tuple) or not p:
            raise TreeError(f"every path is a non-empty list of child ranks, got {p!r}")
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in p):
            raise TreeError(f"ranks are integers, got {p!r}")
        if any(r < 0 for r in p):
            raise TreeError(f"ranks are >= 0, got {list(p)}")
        seen.add(tuple(p))
    for p in seen:
        if len(p) > 1 and p[:-1] not in seen:
            raise TreeError(f"path {list(p)} has no parent path {list(p[:-1])}")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
            raise TreeError(f"path {list(p)} needs its previous sibling {list(p[:-1] + (p[-1] - 1,))}")
    return [list(p) for p in paths]


def parse_paths(text: str) -> list[list[int]]:
    """Paths from JSON text (the config's ``tree_paths``); raises TreeError."""
    try:
        paths = json.loads(text)
    except json.JSONDecodeError as e:
        raise TreeError(f"not valid JSON ({e})") from None
    return validate_paths(paths)


def parse_acceptance(text: str) -> list[float]:
    """A per-rank acceptance vector from JSON or comma text: ``[0.6, 0.1]`` or ``0.6,0.1``; raises TreeError.

    >>> parse_acceptance("0.6, 0.1")
    [0.6, 0.1]
    """
    try:
        values = json.loads(text) if text.strip().startswith("[") else [float(x) for x in text.split(",") if x.strip()]
    except (json.JSONDecodeError, ValueError):
        raise TreeError(f"expected numbers like [0.6, 0.1], got {text!r}") from None
    if not values or not all(isinstance(v, int | float) and 0.0 <= v <= 1.0 for v in values):
        raise TreeError(f"expected probabilities in [0, 1], got {text!r}")
    if sum(values) > 1.0 + 1e-6:
        raise TreeError(f"per-rank acceptance probabilities sum to {sum(values):.3f} > 1")
    return [float(v) for v in values]
