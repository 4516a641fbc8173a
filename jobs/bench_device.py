"""``specray bench-device``: the figures of one device side by side in one run, in process (no Ray, no HTTP).

What a GPU node's user asks first, and what the CPU must not lose:

1. one stream: AR tokens/s, against transformers ``generate()`` on the same model object (``--peer-modes``: plain
   and its fast mode ``hf-static``, a static cache whose forward transformers compiles on CUDA), on the same
   Spec-Bench prompts, back to back in an order rotated per prompt;
2. batched AR: tokens/s at 1, 2, 4, ... ``--rows`` rows (a continuous batch of as many prompts), and each drafting
   method of ``--methods`` at ``--spec-rows`` rows against batched AR at the same rows;
3. the host: the device's name, dtype, the forward's implementation (``layers-graphs`` on a GPU), threads.

Every ratio divides two figures of this run. ``--out`` keeps ``device.json``; ``--readme FILE`` rewrites the block
between ``<!-- device-results:NAME -->`` markers (NAME from ``--block``, default the device type) with the table
and the command. The 13-category table of a device is ``specray bench --set device=...`` (docs/benchmarks.md).

On a GPU machine: ``python -m jobs.bench_device --device cuda --readme README.md --block gpu``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jobs.common import Parser, command, fail, output_dir, output_file, parse_ints

DEFAULT_ROWS = "1,2,4,8,16,32,64,128"


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or Parser(
        prog="specray bench-device",
        description="One device's figures side by side: AR vs transformers, batched AR, speculation under load.",
    )
    p.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=4, help="Spec-Bench prompts of the one-stream comparison (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rows", default=DEFAULT_ROWS, help=f"batched AR sweep (default {DEFAULT_ROWS})")
    p.add_argument("--methods", default="ngram,eagle", help="drafting methods measured at --spec-rows rows (default ngram,eagle)")
    p.add_argument("--spec-rows", type=int, default=16, help="rows of the speculation-under-load figure (default 16)")
    p.add_argument("--peer-modes", default="hf-plain,hf-static", help="transformers generate() modes (default hf-plain,hf-static)")
    p.add_argument("--threads", type=int, help="torch threads (CPU)")
    p.add_argument("--out", default="bench-device", help="output directory (default ./bench-device)")
    p.add_argument("--readme", help="rewrite this file's device-results block")
    p.add_argument("--block", help="the block's name (default the device type: cpu, cuda)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument(
        "--from-json",
        metavar="DEVICE_JSON",
        help="measure nothing: render a device.json written earlier (on a GPU machine) into --readme's block",
    )
    p.add_argument(
        "--categories",
        metavar="SUMMARY_JSON",
        help="with --from-json: add the per-category tables of a bench summary.json from the same machine (the GPU "
        "script's bench-summary.json) under the device's tables",
    )
    return p


def command_line(argv: list[str]) -> str:
    """The command that ran this job, as a user would type it ("" when it ran some other way, e.g. inside a test).

    >>> command_line(["/usr/bin/specray", "bench-device", "--rows", "1,4"])
    'specray bench-device --rows 1,4'
    >>> command_line(["jobs/bench_device.py", "--rows", "1,4"]), command_line(["pytest", "-q"])
    ('specray bench-device --rows 1,4', '')
    """
    if argv[0].endswith("specray"):  # the CLI's own argv names the subcommand
        return " ".join(["specray", *argv[1:]])
    return " ".join(["specray bench-device", *argv[1:]]) if argv[0].endswith("bench_device.py") else ""


def main_with_args(args) -> int:
    if args.readme:
        output_file(args.readme, "--readme")
    if args.from_json:
        return render_saved(Path(args.from_json), args)
    if args.categories:
        fail("--categories renders a bench summary.json beside a device.json: it needs --from-json")
    rows = parse_ints(args.rows, "--rows", 1)
    if args.prompts < 1 or args.max_new_tokens < 1 or args.spec_rows < 1:
        fail("--prompts, --max-new-tokens and --spec-rows must be >= 1")
    from jobs.bench import parse_peer_modes

    peer_modes = parse_peer_modes("hf", args.peer_modes) if args.peer_modes else []
    from decoding.config import SpecConfig

    base = SpecConfig(model=args.model, dtype=args.dtype, device=args.device, max_new_tokens=args.max_new_tokens, threads=args.threads)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        base.replace(method=m)  # an unknown method fails here, naming the field
    out = output_dir(args.out, "--out")
    summary = measure(base, methods, rows, args.spec_rows, args.prompts, peer_modes)
    Path(out).mkdir(parents=True, exist_ok=True)
    summary["command"] = command_line(sys.argv)
    (Path(out) / "device.json").write_text(json.dumps(summary, indent=1))
    block = args.block or summary["device_type"]
    text = markdown(summary, summary["command"])
    if args.readme:
        write_block(Path(args.readme), block, text)
    print(json.dumps(summary) if args.json else text)
    return 0


def render_saved(path: Path, args) -> int:
    """Print (and with ``--readme`` write) the tables of a ``device.json`` measured earlier, under the command that
    measured it."""
    try:
        summary = json.loads(path.read_text())
        text = markdown(summary, summary.get("command", ""))
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"--from-json: {path} is not a bench-device summary ({type(e).__name__}: {e})")
    if args.categories:
        text += "\n\n" + categories_markdown(Path(args.categories))
    if args.readme:
        write_block(Path(args.readme), args.block or summary["device_type"], text)
    print(json.dumps(summary) if args.json else text)
    return 0


def categories_markdown(path: Path) -> str:
    """A bench summary's (``jobs.bench_variants``' summary.json) speedups over its baseline as one row per method and
    one column per category, with the mean of categories, the run over all tokens, tau and the share of steps that
    drafted, under a line naming the run: what the GPU script's bench stage measured on the machine of device.json."""
    from evaluation.bench_report import category_mean, drafted_cell
    from evaluation.markdown import markdown_table

    try:
        bench = json.loads(path.read_text())
        base, methods, cats = bench["baseline"], bench["methods"], bench["categories"]
        rows = []
        for m in bench["methods_order"]:
            if m == base:
                continue
            v = methods[m]
            speedups = [f"{cats[c][m]['speedup']:.2f}" for c in cats]
            mean = category_mean(bench, m)
            figures = [f"**{mean:.2f}**", f"{v['speedup']:.2f}", f"{v['mean_accepted_tokens']:.2f}", drafted_cell(v)]
            rows.append([m, *speedups, *figures])
        ar = methods[base]
        head = ["method", *cats, "mean", "all tokens", "tau", "steps drafted"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"--categories: {path} is not a bench summary.json ({type(e).__name__}: {e})")
    line = f"Spec-Bench categories, one stream, speedup over {base} ({ar['prompts']} prompts, {ar['tokens_per_s']:.0f} tokens/s):"
    return line + "\n\n" + markdown_table(head, rows)


def measure(base, methods: list[str], rows: list[int], spec_rows: int, n_prompts: int, peer_modes: list[str]) -> dict:
    import torch

    from decoding.in_process import SpecDecoder
    from decoding.timing import device_name, synchronize
    from evaluation.workloads import load_prompts

    ar = SpecDecoder(base)
    device = ar.device
    questions = load_prompts()
    need = max(n_prompts, max(rows), spec_rows)
    chats = [questions[i % len(questions)].prompt for i in range(need)]
    prompts = [ar.encode(c, chat=True) for c in chats]
    summary = {
        "device": device_name(device),
        "device_type": device.type,
        "dtype": base.dtype,
        "implementation": ar.target.implementation,
        "threads": torch.get_num_threads(),
        "max_new_tokens": base.max_new_tokens,
    }

    def timed(fn):
        synchronize(device)
        begin = time.perf_counter()
        tokens = fn()
        synchronize(device)
        return tokens / (time.perf_counter() - begin)

    # 1. one stream, against transformers
    from evaluation.hf_peer import HFPeer

    peer = HFPeer(ar, base, modes=peer_modes)
    ar.generate_ids(prompts[0], max_new_tokens=8)  # warm-up (graphs captured, kernels loaded)
    for mode in list(peer.modes):
        peer.generate(mode, prompts[0].cpu(), 8)
    one: dict[str, list[float]] = {"specray-ar": [], **{m: [] for m in peer.modes}}
    for i, ids in enumerate(prompts[:n_prompts]):
        order = list(one)
        order = order[i % len(order) :] + order[: i % len(order)]
        for name in order:
            if name == "specray-ar":
                one[name].append(timed(lambda ids=ids: len(ar.generate_ids(ids).token_ids)))
            else:
                one[name].append(timed(lambda ids=ids, name=name: len(peer.generate(name, ids.cpu(), base.max_new_tokens)[0])))
    summary["one_stream"] = {name: sum(v) / len(v) for name, v in one.items()}
    # 2. batched AR, and speculation under load
    from decoding.loop.batch import batch_phases
    from decoding.model.graphs import capture_seconds

    sweep, captured, phases = {}, {}, {}
    for r in rows:
        ar.generate_batch(prompts[:r], max_new_tokens=4, max_rows=r)  # warm-up at this batch size
        before, began = capture_seconds(), batch_phases()
        sweep[r] = timed(lambda r=r: sum(len(g.token_ids) for g in ar.generate_batch(prompts[:r], max_rows=r)))
        captured[r] = round(capture_seconds() - before, 3)
        phases[r] = {k: round(v - began[k], 4) for k, v in batch_phases().items()}
    summary["batched_ar"] = sweep
    # seconds of CUDA graph capture inside each timed batch (rows join and leave: new row buckets; 0 on a CPU)
    summary["batched_capture_s"] = captured
    # where each timed batch's time went: filling prompts, decoding steps (decoding.loop.batch.batch_phases)
    summary["batched_phases"] = phases

    summary["spec_rows"] = spec_rows
    summary["under_load"] = under_load(ar, base, methods, prompts[:spec_rows])
    return summary


LOAD_ROUNDS = 3  # rotated rounds of the speculation-under-load figure


def under_load(ar, base, methods: list[str], prompts: list) -> dict[str, float]:
    """Tokens/s of one batch of ``prompts`` (all rows at once) per decoder: batched AR and each method at its own
    config (k=auto where it is the default). Each decoder first runs one whole batch untimed (its calibration, and what
    k=auto learns of acceptance and costs: a server's state after its first requests), then ``LOAD_ROUNDS`` timed
    rounds, the order rotated each round, side by side (before 2026-11-29: one batch each, fresh after four tokens of
    warm-up, its k=auto still learning what the batch's first steps cost)."""
    from decoding.in_process import SpecDecoder
    from decoding.timing import synchronize

    decs = {"ar": ar, **{m: SpecDecoder(base.replace(method=m)) for m in methods}}

    def batch_of(dec) -> int:
        return sum(len(g.token_ids) for g in dec.generate_batch(prompts, max_rows=len(prompts)))

    for dec in decs.values():
        batch_of(dec)
    tokens, seconds = dict.fromkeys(decs, 0), dict.fromkeys(decs, 0.0)
    for r in range(LOAD_ROUNDS):
        names = list(decs)[r % len(decs) :] + list(decs)[: r % len(decs)]
        for name in names:
            synchronize(ar.device)
            begin = time.perf_counter()
            tokens[name] += batch_of(decs[name])
            synchronize(ar.device)
            seconds[name] += time.perf_counter() - begin
    return {name: tokens[name] / seconds[name] for name in decs}


def markdown(summary: dict, cmd: str) -> str:
    """The three figures as short tables, one row of values each (the README keeps them on a screen).

    >>> print(markdown({"device": "X", "dtype": "bfloat16", "implementation": "layers", "threads": 2, "max_new_tokens": 8,
    ...     "one_stream": {"specray-ar": 50.0, "hf-plain": 25.0}, "batched_ar": {"1": 50.0, "4": 150.0},
    ...     "spec_rows": 4, "under_load": {"ar": 150.0, "ngram": 180.0}}, ""))
    Device: X (bfloat16, forward: layers, 2 threads), 8 new tokens.
    <BLANKLINE>
    | one stream, tokens/s | specray-ar | hf-plain |
    |---|---|---|
    | tokens/s (specray AR over it) | 50.0 (1.00x) | 25.0 (2.00x) |
    <BLANKLINE>
    | batched AR, rows | 1 | 4 |
    |---|---|---|
    | tokens/s (over 1 row) | 50 (1.0x) | 150 (3.0x) |
    <BLANKLINE>
    | at 4 rows | ar | ngram |
    |---|---|---|
    | tokens/s (over batched AR) | 150 (1.00x) | 180 (1.20x) |
    """
    one, load = summary["one_stream"], summary["under_load"]
    sweep = {int(r): v for r, v in summary["batched_ar"].items()}  # rows are strings once read back from JSON
    ar, first = one["specray-ar"], sweep[min(sweep)]

    def table(head: str, cells: dict, row: str) -> list[str]:
        return [
            f"| {head} | " + " | ".join(map(str, cells)) + " |",
            "|---" * (len(cells) + 1) + "|",
            f"| {row} | " + " | ".join(cells.values()) + " |",
        ]

    lines = [
        f"Device: {summary['device']} ({summary['dtype']}, forward: {summary['implementation']}, {summary['threads']} threads), "
        f"{summary['max_new_tokens']} new tokens.",
        "",
        *table("one stream, tokens/s", {n: f"{v:.1f} ({ar / v:.2f}x)" for n, v in one.items()}, "tokens/s (specray AR over it)"),
        "",
        *table("batched AR, rows", {r: f"{v:.0f} ({v / first:.1f}x)" for r, v in sweep.items()}, "tokens/s (over 1 row)"),
        *phase_rows(summary.get("batched_phases"), list(sweep)),
        "",
        *table(
            f"at {summary['spec_rows']} rows",
            {m: f"{v:.0f} ({v / load['ar']:.2f}x)" for m, v in load.items()},
            "tokens/s (over batched AR)",
        ),
    ]
    if cmd:
        lines += ["", f"Command: `{cmd}`"]
    return "\n".join(lines)


def phase_rows(phases: dict | None, rows: list[int]) -> list[str]:
    """Two more rows of the batched table: the share of each batch's time spent filling prompts, and the milliseconds
    of one decoding step (none for a summary saved before they were measured).

    >>> phase_rows({"1": {"prefill_s": 0.1, "decode_s": 0.9, "steps": 100}, "4": {"prefill_s": 0.5, "decode_s": 1.5,
    ...     "steps": 100}}, [1, 4])
    ['| prefill share of the batch | 10% | 25% |', '| ms a decoding step | 9.0 | 15.0 |']
    >>> phase_rows(None, [1, 4])
    []
    """
    if not phases:
        return []
    cells = [phases.get(str(r)) or phases.get(r) for r in rows]  # rows are strings once read back from JSON
    share = [f"{c['prefill_s'] / max(c['prefill_s'] + c['decode_s'], 1e-9):.0%}" if c else "-" for c in cells]
    step = [f"{1e3 * c['decode_s'] / max(c['steps'], 1):.1f}" if c else "-" for c in cells]
    return ["| prefill share of the batch | " + " | ".join(share) + " |", "| ms a decoding step | " + " | ".join(step) + " |"]


def write_block(path: Path, name: str, text: str) -> None:
    """Replace the text between ``<!-- device-results:NAME -->`` and ``<!-- /device-results:NAME -->`` (appended at the
    end of the file when the markers are missing)."""
    begin, end = f"<!-- device-results:{name} -->", f"<!-- /device-results:{name} -->"
    doc = path.read_text() if path.exists() else ""
    block = f"{begin}\n{text}\n{end}"
    if begin in doc and end in doc:
        doc = doc[: doc.index(begin)] + block + doc[doc.index(end) + len(end) :]
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(doc)


main = command(build_parser, main_with_args)

if __name__ == "__main__":
    sys.exit(main())
