"""The host's share of a batched AR step: a tiny random model (its forward nearly free), one torch thread, so the
milliseconds of a decoding step are mostly the loop's own per-row work. With ``--against DIR`` (another checkout of
the project, e.g. ``git worktree add /tmp/old HEAD~1``) the two trees run alternately in one run, and the ratio is
printed per row count.

    python tests/decoding/loop/bench_batch_host.py --against /tmp/old
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ONE_TREE = r"""
import json, sys, torch
sys.path[:0] = ["tests", "."]
torch.set_num_threads(1)
from conftest import tiny_llama
from decoding.loop.batch import Sequence, batch_phases, generate_many
from decoding.model.adapter import ModelAdapter
target, out = ModelAdapter(tiny_llama(vocab=12, layers=2)), {}
for rows in json.loads(sys.argv[1]):
    seqs = lambda: [Sequence(torch.tensor([[i % 12, (i * 7) % 12, 3]]), max_new_tokens=48) for i in range(rows)]
    generate_many(target, seqs(), max_rows=rows)  # warm
    best = None
    for _ in range(3):
        b = dict(batch_phases()); generate_many(target, seqs(), max_rows=rows); a = batch_phases()
        ms = 1e3 * (a["decode_s"] - b["decode_s"]) / (a["steps"] - b["steps"])
        best = ms if best is None else min(best, ms)
    out[rows] = best
print(json.dumps(out))
"""


def measure(root: Path, rows: list[int]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", ONE_TREE, json.dumps(rows)], cwd=root, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{root}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'failed'}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16,64,128")
    p.add_argument("--against", type=Path, help="another checkout, run alternately with this one")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    trees = {"this": ROOT} | ({"against": args.against.resolve()} if args.against else {})
    best: dict[str, dict[str, float]] = {name: {} for name in trees}
    for _ in range(args.rounds):
        for name, root in trees.items():
            for r, ms in measure(root, rows).items():
                best[name][r] = min(ms, best[name].get(r, ms))
    for r in map(str, rows):
        line = f"rows {r:>4}: ms a batched AR step, this tree {best['this'][r]:.2f}"
        if args.against:
            line += f", against {best['against'][r]:.2f} ({best['against'][r] / best['this'][r]:.2f}x)"
        print(line)


if __name__ == "__main__":
    main()
