"""`python -m jobs.bench_variants`: named configurations side by side against AR in one run, several of one method
included (a drafter with a fixed k, with a confidence threshold, with the stop head; EAD at several thresholds).

    python -m jobs.bench_variants --variant eagle-k3=eagle:k=3 --variant eagle-conf=eagle:k=6,confidence_threshold=0.4 \\
        --variant eagle-stop=eagle:k=8,stop_threshold=0.6 --categories writing,coding --limit 2 --max-new-tokens 128

    python -m jobs.bench_variants --variant ead-1.0=ead:ead_threshold=1.0 --variant ead-2.0=ead:ead_threshold=2.0 \\
        --variant ead-3.0=ead:ead_threshold=3.0 --plot-lossy docs/bench/ead.png

A variant is ``NAME=METHOD`` or ``NAME=METHOD:KEY=VALUE,KEY=VALUE`` over the base config (``--set`` and the common
flags). Every prompt runs ``ar`` and every variant back to back, in an order rotated per prompt
(``evaluation.prompt_runner.PromptRunner``); greedy outputs are compared with AR's. Printed: the bench's table (tokens/s,
speedup, tau, identity; for a lossy variant its divergence from AR); written: ``OUT/summary.json``; with
``--plot-lossy PATH`` the lossy variants' speedup over AR against the share of tokens that differ from AR's
(:func:`evaluation.bench_report.plot_lossy`). Bad input prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from decoding.errors import ConfigError
from jobs.bench import add_workload_args, load_workload
from jobs.common import Parser, add_config_args, command, config_from_args, fail, output_dir


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m jobs.bench_variants", description="Named configurations side by side against ar.")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=METHOD[:KEY=VALUE,...]", help="a configuration to run")
    add_config_args(p, method=False)
    add_workload_args(p)
    p.add_argument("--plot-lossy", metavar="PATH", help="plot the lossy variants' speedup against their divergence from ar")
    p.add_argument("--out", default="bench-variants", help="output directory for summary.json (default ./bench-variants)")
    return p


def parse_variant(text: str, base):
    """(name, config) of ``NAME=METHOD[:KEY=VALUE,...]`` over ``base``.

    >>> from decoding.config import SpecConfig
    >>> name, cfg = parse_variant("eagle-stop=eagle:k=8,stop_threshold=0.6", SpecConfig())
    >>> name, cfg.method, cfg.k, cfg.stop_threshold
    ('eagle-stop', 'eagle', 8, 0.6)
    """
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not name or name == "ar" or "/" in name:
        fail(f"--variant: expected NAME=METHOD[:KEY=VALUE,...] with a NAME other than ar, got {text!r}")
    method, _, sets = rest.partition(":")
    try:
        return name, base.with_overrides([s for s in sets.split(",") if s.strip()], method=method.strip())
    except ConfigError as e:
        fail(f"--variant {name}: {e}")


def main_with_args(args) -> int:
    base = config_from_args(args)
    output_dir(args.out, "--out")
    if not args.variant:
        fail("--variant: give at least one")
    configs = {"ar": base.replace(method="ar")}
    for text in args.variant:
        name, cfg = parse_variant(text, base)
        if name in configs:
            fail(f"--variant: {name!r} given twice")
        configs[name] = cfg
    prompts = load_workload(args)
    if not prompts:
        fail("no prompts selected")
    from evaluation import bench_figures as bm  # heavy imports after the cheap checks
    from evaluation.bench_report import plot_lossy, report_rows
    from evaluation.prompt_runner import PromptRunner

    runner = PromptRunner(configs)
    try:
        gens, steps = runner.run_all(prompts, args.warmup)
    finally:
        runner.close()
    summary = bm.summarize_methods(gens, steps, order=list(configs))
    summary["configs"] = runner.configs
    head, rows = report_rows(summary)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=False)]
    for r in [head, *rows]:
        print("  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(r, widths, strict=False))))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot_lossy:
        summary["plot_lossy"] = str(plot_lossy(summary, Path(args.plot_lossy)))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"summary: {out / 'summary.json'}" + (f", plot: {summary['plot_lossy']}" if args.plot_lossy else ""))
    return 0


main = command(build_parser, main_with_args)


if __name__ == "__main__":
    sys.exit(main())
