"""`python -m jobs.bench_trees`: token trees vs chains at the same drafter, side by side in one run.

    python -m jobs.bench_trees --drafters sps,early-exit,ngram --chain-k 2,3,4,6 --budgets 4,8,16,32 \\
        --shapes sequoia,dyspec --categories writing,summarization,coding --limit 2 --max-new-tokens 64 \\
        --dtype bfloat16 --threads 2 --out bench-trees

Every prompt runs ``ar``, each drafter as a chain for every k in ``--chain-k`` and as a tree for every shape
and node budget, in an order rotated per prompt (``evaluation.runner.PromptRunner``). Printed: per variant
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

from decoding.config import SpecConfig
from evaluation import benchmark as bm
from jobs.bench import load_workload
from jobs.common import Parser, add_config_args, config_from_args, fail, output_dir, parse_ints, run_cli

TREE_DRAFTERS = ("sps", "early-exit", "ngram")


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
    p.add_argument("--prompts", help="Spec-Bench style JSONL (default: the bundled Spec-Bench questions)")
    p.add_argument("--categories", help="comma list of categories")
    p.add_argument("--limit", type=int, help="at most N prompts per category")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default="bench-trees", help="output directory for summary.json (default ./bench-trees)")
    return p


def variants(base: SpecConfig, drafters, chain_k, shapes, budgets, depth, acceptance: dict) -> dict[str, SpecConfig]:
    """Named configs: ar, <drafter>/chain-k<k>, <drafter>/<shape>-n<budget>."""
    out = {"ar": base.replace(method="ar")}
    for d in drafters:
        for k in chain_k:
            out[f"{d}/chain-k{k}"] = base.for_method(d).replace(k=k, tree="chain")
        for s in shapes:
            for n in budgets:
                extra = {"tree_acceptance": acceptance[d]} if s == "sequoia" and acceptance.get(d) else {}
                out[f"{d}/{s}-n{n}"] = base.for_method(d).replace(k=depth, tree=s, tree_budget=n, **extra)
    return out


def calibrate(cfg: SpecConfig, prompts, width: int, depth: int) -> list[float]:
    """Per-rank acceptance of a drafter, greedy: P(the rank-r candidate is the accepted child at a spine node)."""
    from decoding.engine import SpecDecoder

    paths = json.dumps([[0] * d + [r] for d in range(depth) for r in range(width)])
    dec = SpecDecoder(cfg.replace(tree="static", tree_paths=paths, temperature=0.0))
    inner = dec.drafter
    hits, visits = [0] * width, 0

    class Recorder:  # sees every verdict's accepted path
        def start(self, state):
            inner.start(state)

        def max_nodes(self, k):
            return inner.max_nodes(k)

        def propose(self, state, k):
            self.tree = (p := inner.propose(state, k)).tree
            return p

        def update(self, state, num_accepted):
            nonlocal visits
            path, rank = state.accepted_path or [0], self.tree.rank.tolist()
            spine_nodes = sum(1 for _ in range(self.tree.max_depth))
            for d in range(min(len(path), spine_nodes)):
                if d > 0 and rank[path[d]] != 0:
                    break  # left the spine: deeper nodes are not probed
                visits += 1
                if d + 1 < len(path):
                    hits[rank[path[d + 1]]] += 1
            inner.update(state, num_accepted)

    dec.drafter = Recorder()
    for q in prompts:
        dec.generate_ids(dec.encode(q.prompt, chat=True))
    return [round(h / max(visits, 1), 4) for h in hits]


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

    from evaluation.runner import PromptRunner

    runner = PromptRunner(configs)
    runner.warmup(prompts[0], args.warmup)
    gens, steps = [], []
    for i, prompt in enumerate(prompts):
        g, s = runner.run_prompt(prompt, i)
        gens += g
        steps += s
        print(f"prompt {i + 1}/{len(prompts)} done", file=sys.stderr)
    summary = bm.summarize_methods(gens, steps, order=list(configs))
    report = tree_report(summary, steps, drafters)
    render(summary, report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"summary": summary, "trees": report, "acceptance": acceptance}, indent=2, default=str))
    print(f"summary: {out / 'summary.json'}")
    return 0


def tree_report(summary: dict, steps: list[dict], drafters) -> dict:
    """Per drafter: best chain vs best tree (by speedup), tau ratio, and the budget where speedup peaks."""
    nodes = {}
    for s in steps:
        nodes.setdefault(s["method"], []).append(s["drafted"])
    out = {}
    for d in drafters:
        ms = {m: v for m, v in summary["methods"].items() if m.startswith(d + "/") and v["speedup"] is not None}
        chains = {m: v for m, v in ms.items() if "/chain-" in m}
        trees = {m: v for m, v in ms.items() if "/chain-" not in m}
        if not chains or not trees:
            continue
        bc = max(chains, key=lambda m: chains[m]["speedup"])
        bt = max(trees, key=lambda m: trees[m]["speedup"])
        peaks = {}
        for shape in {m.split("/")[1].split("-n")[0] for m in trees}:
            series = sorted((int(m.rsplit("-n", 1)[1]), trees[m]["speedup"]) for m in trees if m.split("/")[1].startswith(shape + "-n"))
            peaks[shape] = max(series, key=lambda x: x[1])[0]
        out[d] = {
            "best_chain": bc,
            "best_tree": bt,
            "tau_chain": chains[bc]["mean_accepted_tokens"],
            "tau_tree": trees[bt]["mean_accepted_tokens"],
            "tau_ratio": bm.ratio(trees[bt]["mean_accepted_tokens"] or 0.0, chains[bc]["mean_accepted_tokens"] or 0.0),
            "speedup_chain": chains[bc]["speedup"],
            "speedup_tree": trees[bt]["speedup"],
            "best_tau_tree": max(trees, key=lambda m: trees[m]["mean_accepted_tokens"] or 0),
            "budget_with_best_speedup": peaks,  # beyond it, verify cost outweighs the extra acceptance
            "nodes_per_step": {m: sum(nodes.get(m, [0])) / max(len(nodes.get(m, [])), 1) for m in ms},
        }
    return out


def render(summary: dict, report: dict, file=None) -> None:
    file = file or sys.stdout
    head = ["variant", "tok/s", "speedup", "tau", "nodes/step", "verify ms/step", "identical"]
    rows = []
    for m, v in summary["methods"].items():
        ident = v["identity"]
        nodes = next((r["nodes_per_step"].get(m) for r in report.values() if m in r["nodes_per_step"]), None)
        rows.append(
            [
                m,
                f"{v['tokens_per_s']:.1f}",
                "-" if v["speedup"] is None else f"{v['speedup']:.2f}",
                "-" if v["mean_accepted_tokens"] is None else f"{v['mean_accepted_tokens']:.2f}",
                "-" if nodes is None else f"{nodes:.1f}",
                "-" if v["verify_ms_per_step"] is None else f"{v['verify_ms_per_step']:.1f}",
                f"{ident['identical']}/{ident['compared']}" if ident and ident["compared"] else "-",
            ]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=False)]
    for r in [head] + rows:
        print("  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(r, widths, strict=False))), file=file)
    print("", file=file)
    for d, r in report.items():
        print(
            f"{d}: best chain {r['best_chain']} (tau {r['tau_chain']:.2f}, speedup {r['speedup_chain']:.2f}) vs best tree "
            f"{r['best_tree']} (tau {r['tau_tree']:.2f}, speedup {r['speedup_tree']:.2f}): tau x{r['tau_ratio']:.2f}; "
            f"speedup peaks at budget {r['budget_with_best_speedup']}",
            file=file,
        )


def main(argv=None) -> int:
    return run_cli(build_parser(), main_with_args, argv)


if __name__ == "__main__":
    sys.exit(main())
