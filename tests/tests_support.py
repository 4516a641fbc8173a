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


def compare_with_ar(decoder, prompts: list[dict], reference: dict) -> tuple[list, float]:
    """Run ``decoder`` on the prompts: (question ids whose output differs from ``reference``, tokens per target forward)."""
    mismatched, forwards, tokens = [], 0, 0
    for q in prompts:
        out = decoder.generate_ids(decoder.encode(q["turns"][0], chat=True))
        if out.token_ids != reference[q["question_id"]]:
            mismatched.append(q["question_id"])
        forwards += out.stats.target_forwards
        tokens += out.stats.new_tokens
    return mismatched, tokens / forwards
