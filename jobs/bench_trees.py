"""`python -m jobs.bench_trees`: token trees vs chains at the same drafter, side by side in one run.

    python -m jobs.bench_trees --drafters sps,early-exit,ngram --chain-k 2,3,4,6 --budgets 4,8,16,32 \\
        --shapes sequoia,dyspec --categories writing,summarization,coding --limit 2 --max-new-tokens 64 \\
        --dtype bfloat16 --threads 2 --out bench-trees

Every prompt runs ``ar``, each drafter as a chain for every k in ``--chain-k`` and as a tree for every shape
and node budget, in an order rotated per prompt (``evaluation.prompt_runner.PromptRunner``). Printed: per variant
tokens/s, speedup over ar, tau (mean tokens committed per target forward), nodes per step and verify ms per
step; per drafter the best chain and the best tree by speedup and their tau ratio (the issue's figure), and
the node budget beyond which the verify cost outweighs the extra acceptance (the budget after which speedup
falls). ``--calibrate`` first measures each model drafter's per-rank acceptance (greedy, with a probe tree of
``--probe-width`` ranks at every depth) and uses it as ``tree_acceptance`` for ``sequoia``.
Other config fields: ``--set KEY=VALUE`` (e.g. ``--set draft_layers=8 --set exit_layer=20``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from evaluation.tree_variants import TREE_DRAFTERS, calibrate, render, run_variants, variants
from jobs.bench import add_workload_args, load_workload
from jobs.common import Parser, add_config_args, command, config_from_args, fail, output_dir, parse_ints


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m jobs.bench_trees", description="Token trees vs chains per drafter, against ar.")
    p.add_argument(
        "--drafters",
        default="sps,early-exit,ngram",
        help="comma list from sps, early-exit, ngram and trained:NAME (a Medusa, Hydra or distilled drafter artifact)",
    )
    p.add_argument("--chain-k", default="2,4,6", help="chain draft lengths (default 2,4,6)")
    p.add_argument("--shapes", default="sequoia,dyspec", help="tree shapes: sequoia, dyspec (default both)")
    p.add_argument("--budgets", default="4,8,16,32", help="tree node budgets (default 4,8,16,32)")
    p.add_argument("--depth", type=int, default=4, help="tree depth limit k (default 4)")
    p.add_argument("--calibrate", action="store_true", help="measure each drafter's per-rank acceptance for sequoia first")
    p.add_argument("--probe-width", type=int, default=6, help="ranks per depth of the calibration probe tree (default 6)")
    add_config_args(p, method=False)
    add_workload_args(p)
    p.add_argument("--out", default="bench-trees", help="output directory for summary.json (default ./bench-trees)")
    return p


def main_with_args(args) -> int:
    base = config_from_args(args)
    output_dir(args.out, "--out")
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    for d in drafters:
        name = d[len("trained:") :] if d.startswith("trained:") else None
        if d not in TREE_DRAFTERS and not name:
            fail(f"--drafters: {d!r} does not draft trees; choose from {', '.join(TREE_DRAFTERS)} or trained:NAME")
        if name and "/" in name:
            fail(f"--drafters: {d!r}: name an artifact under $SPECRAY_HOME/drafters (a path would break the variant labels)")
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in ("sequoia", "dyspec"):
            fail(f"--shapes: unknown shape {s!r}; choose from sequoia, dyspec")
    chain_k, budgets = parse_ints(args.chain_k, "--chain-k", 1), parse_ints(args.budgets, "--budgets", 1)
    prompts = load_workload(args)
    if not prompts:
        fail("no prompts selected")
    acceptance = {}
    if args.calibrate:
        for d in drafters:
            if d != "ngram":
                acc = calibrate(base.for_method(d).replace(k=args.depth), prompts[:2], args.probe_width, args.depth)
                acceptance[d] = json.dumps(acc)
                print(f"calibrated per-rank acceptance of {d}: {acc}", file=sys.stderr)
    configs = variants(base, drafters, chain_k, shapes, budgets, args.depth, acceptance)

    summary, report = run_variants(configs, prompts, drafters, args.warmup)
    render(summary, report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"summary": summary, "trees": report, "acceptance": acceptance}, indent=2, default=str))
    print(f"summary: {out / 'summary.json'}")
    return 0


main = command(build_parser, main_with_args)


if __name__ == "__main__":
    sys.exit(main())
