"""Helpers the tests import (pytest runs with --import-mode=importlib, tests/ is on the path)."""

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPEC_BENCH = REPO / "data" / "spec_bench" / "question.jsonl"


def spec_bench_prompts(per_category: int, categories=None) -> list[dict]:
    rows, seen = [], {}
    for line in SPEC_BENCH.read_text().splitlines():
        q = json.loads(line)
        if categories and q["category"] not in categories:
            continue
        if seen.get(q["category"], 0) < per_category:
            seen[q["category"]] = seen.get(q["category"], 0) + 1
            rows.append(q)
    return rows
