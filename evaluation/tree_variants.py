"""Token trees vs chains at the same drafter (``python -m jobs.bench_trees``): the variants, per-rank acceptance
calibration, running them side by side, and the chain-vs-tree report."""

from __future__ import annotations

import json
import sys

from decoding.config import SpecConfig
from evaluation import bench_figures as bm

TREE_DRAFTERS = ("sps", "early-exit", "ngram")


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
    from decoding.in_process import SpecDecoder

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


def run_variants(configs: dict[str, SpecConfig], prompts, drafters, warmup: int = 1) -> tuple[dict, dict]:
    """Every variant on every prompt, back to back in an order rotated per prompt; (summary, tree report)."""
    from evaluation.prompt_runner import PromptRunner

    runner = PromptRunner(configs)
    try:
        gens, steps = runner.run_all(prompts, warmup)
    finally:
        runner.close()
    summary = bm.summarize_methods(gens, steps, order=list(configs))
    return summary, tree_report(summary, steps, drafters)


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
