"""Many users at once: a load benchmark of the Serve endpoints through real HTTP.

    specray bench-serve --methods ar,ngram --concurrency 1,2,4,8,16,32 --max-tokens 64 --peer hf
    specray bench-serve --methods ar,ngram --rate 2 --requests 32          # Poisson arrivals at 2 req/s

Starts an embedded Ray with the app on a free loopback port (``--address`` /
``RAY_ADDRESS`` joins a cluster instead) and a temporary registry with one entry
per method (``ar`` is the plain model id: batched AR, the denominator). For
each concurrency C of the sweep and each method it sends C streaming chat
completions at once (Spec-Bench prompts taken a category at a time, so any C
requests span the categories; one per request, greedy) with the
``openai`` client, in back-to-back waves until the level has ``--min-requests``; with ``--rate`` it sends ``--requests`` requests with
exponential gaps instead. Reported per (method, C): aggregate tokens/s,
requests/s, time to first token and inter-token latency p50/p99, goodput
(tokens/s of the requests that met ``--slo-ttft-s`` and ``--slo-itl-s``), and the
speedup over batched AR at the same C. ``--check`` compares each stream's text
with its own in-process greedy output (float32 makes it exact; in bfloat16
near-ties may differ and are counted, not hidden). ``--peer hf`` runs
transformers' ``generate()`` on a left-padded batch of the same prompts (same
model object, dtype and threads) next to specray's in-process batched AR.

Writes ``OUT/load.parquet`` (one row per method and concurrency),
``OUT/requests.parquet`` (one row per request), ``OUT/summary.json`` and
``OUT/load.png`` (throughput and p99 latency against concurrency).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from evaluation.report import markdown_table, replace_block
from jobs.common import Parser, fail, parse_ints, run_cli


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="specray bench-serve", description="Load benchmark of the OpenAI endpoints: concurrency sweep or Poisson arrivals.")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--methods", default="ar,ngram", help="comma-separated; ar is the plain model (batched AR)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config field for the method entries (default k=auto)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated concurrent streams (the sweep)")
    p.add_argument("--rate", type=float, help="Poisson mode: mean requests per second (instead of the sweep)")
    p.add_argument("--requests", type=int, default=32, help="Poisson mode: how many requests")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-requests", type=int, default=4, help="sweep: back-to-back waves until a level has this many requests")
    p.add_argument("--prompts", help="Spec-Bench JSONL (default: the bundled questions)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the replica and of the in-process peers")
    p.add_argument("--max-batch-rows", type=int, default=32)
    p.add_argument("--slo-ttft-s", type=float, default=10.0)
    p.add_argument("--slo-itl-s", type=float, default=0.5)
    p.add_argument("--check", action="store_true", help="compare every stream with its in-process greedy output")
    p.add_argument("--peer", choices=["hf"], help="also run transformers generate() on a padded batch")
    p.add_argument("--out", default="runs/load", help="output folder")
    p.add_argument("--readme", metavar="README.md", help="also rewrite the load table between its <!-- load-results --> markers")
    p.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local Ray)")
    return p


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50)
    2.5
    """
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def interleave_categories(prompts) -> list[str]:
    """First prompts of every category, then the second ones, ...: any first C requests span the categories.

    >>> from evaluation.workloads import Prompt
    >>> interleave_categories([Prompt(1, "a", ("a1",)), Prompt(2, "a", ("a2",)), Prompt(3, "b", ("b1",))])
    ['a1', 'b1', 'a2']
    """
    by_category: dict[str, list[str]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p.prompt)
    rounds = itertools.zip_longest(*by_category.values())
    return [text for group in rounds for text in group if text is not None]


def fitting_prompts(dec, prompts: list[str], max_tokens: int) -> tuple[list[str], list[list[int]]]:
    """The prompts whose chat encoding plus ``max_tokens`` fits the model's context, with those encodings.

    A prompt that cannot fit would only ever come back as a 400, so it is left out (and said so on stderr) rather
    than counted as a failed request; no prompt fitting at all is a one-line error.
    """
    context = dec.target.max_context
    kept, chats = [], []
    for p in prompts:
        ids = dec.encode(p, chat=True)
        if ids.shape[-1] + max_tokens <= context:
            kept.append(p)
            chats.append(ids)
    if not kept:
        fail(f"no prompt fits the model's context of {context} tokens with --max-tokens {max_tokens}")
    if len(kept) < len(prompts):
        print(
            f"left out {len(prompts) - len(kept)} of {len(prompts)} prompts: with --max-tokens {max_tokens} they "
            f"exceed the model's context of {context} tokens",
            file=sys.stderr,
        )
    return kept, chats


def summarize_wave(requests: list[dict], wall: float, slo_ttft: float, slo_itl: float) -> dict:
    """Aggregate figures of one wave of requests (each: tokens, ttft_s, itl_s list, ok)."""
    done = [r for r in requests if r["ok"]]
    tokens = sum(r["tokens"] for r in done)
    itls = [x for r in done for x in r["itl_s"]]
    ttfts = [r["ttft_s"] for r in done if r["ttft_s"] is not None]
    good = [
        r
        for r in done
        if r["ttft_s"] is not None and r["ttft_s"] <= slo_ttft and (not r["itl_s"] or statistics.mean(r["itl_s"]) <= slo_itl)
    ]
    return {
        "requests": len(requests),
        "completed": len(done),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "requests_per_s": len(done) / wall if wall > 0 else 0.0,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
        "goodput_tokens_per_s": sum(r["tokens"] for r in good) / wall if wall > 0 else 0.0,
    }


def run(args) -> dict:
    import openai
    import ray
    import torch
    from ray import serve

    from cluster.registry import Entry, open_registry
    from decoding.config import SpecConfig
    from decoding.engine import SpecDecoder
    from decoding.errors import ConfigError
    from evaluation.workloads import WorkloadError, load_prompts
    from serving.app import build_app
    from serving.settings import ServeSettings

    concurrency = parse_ints(args.concurrency, "--concurrency", 1)
    if args.rate is not None and args.rate <= 0:
        fail(f"--rate: must be > 0, got {args.rate}")
    if min(args.max_tokens, args.requests, args.threads, args.max_batch_rows, args.min_requests) < 1:
        fail("--max-tokens, --requests, --threads, --max-batch-rows and --min-requests must be >= 1")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "ar" not in methods:
        methods.insert(0, "ar")
    try:
        prompts = interleave_categories(load_prompts(args.prompts))
        base = SpecConfig(model=args.model, dtype=args.dtype, max_new_tokens=args.max_tokens, threads=args.threads)
        entries = {m: base.for_method(m).with_overrides(args.set or ["k=auto"]) for m in methods if m != "ar"}
    except (ConfigError, WorkloadError) as e:
        fail(str(e))

    def waves_of(c: int) -> int:
        return 1 if args.rate is not None else -(-max(c, args.min_requests) // c)

    wave = max(c * waves_of(c) for c in concurrency) if args.rate is None else args.requests
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    torch.set_num_threads(args.threads)
    ar = SpecDecoder(base)
    prompts, chats = fitting_prompts(ar, prompts, args.max_tokens)
    if len(prompts) < wave:
        prompts = (prompts * (wave // len(prompts) + 1))[:wave]
        chats = (chats * (wave // len(chats) + 1))[:wave]
    chats = chats[:wave]
    reference = {}
    if args.check:  # each prompt alone, in process: what every stream must say
        for i, ids in enumerate(chats):  # (every prompt a wave sends)
            reference[i] = ar.decode(ar.generate_ids(ids, max_new_tokens=args.max_tokens).token_ids)

    peers = {}
    for c in concurrency if args.rate is None else []:
        batch = chats[:c]
        t0 = time.perf_counter()
        gens = ar.generate_batch(batch, max_new_tokens=args.max_tokens, max_rows=c)
        peers.setdefault("specray_inprocess_ar", {})[c] = sum(len(g.token_ids) for g in gens) / (time.perf_counter() - t0)
        if args.peer == "hf":
            peers.setdefault("hf_padded_generate", {})[c] = hf_padded_tokens_per_s(ar, batch, args.max_tokens)
        print(
            f"in-process c={c}: specray batched AR {peers['specray_inprocess_ar'][c]:.1f} tok/s"
            + (f", HF padded generate {peers['hf_padded_generate'][c]:.1f} tok/s" if args.peer else ""),
            file=sys.stderr,
        )

    reg_dir = tempfile.mkdtemp(prefix="specray-load-reg-")
    reg = open_registry(reg_dir)
    for m, cfg in entries.items():
        reg.put(Entry(f"load/{m}", cfg))
    settings = ServeSettings(
        registry=reg_dir,
        base_model=args.model,
        dtype=args.dtype,
        num_replicas=1,
        model_num_cpus=0,
        threads=args.threads,
        max_batch_rows=args.max_batch_rows,
        max_ongoing_requests=max(64, wave + 8),
        max_queued_requests=max(64, wave + 8),
        preload=[f"load/{m}" for m in entries],
    )
    from cluster.runtime import connect

    connect(args.address)
    port = _free_port()
    rows, request_rows = [], []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(settings), name="specray-load", route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=1800, max_retries=0)
        names = {m: (args.model if m == "ar" else f"load/{m}") for m in methods}
        _stream(client, names["ar"], prompts[0], 4, None)  # warm-up: loads, calibrates, compiles
        for m in methods[1:]:
            _stream(client, names[m], prompts[0], 4, None)
        levels = concurrency if args.rate is None else [args.requests]
        for c in levels:
            for m in methods:
                reqs, wall = [], 0.0
                for w in range(waves_of(c)):  # back-to-back waves of c: at least --min-requests requests per level
                    index = list(range(w * c, w * c + c))
                    t0 = time.perf_counter()
                    got = _wave(client, names[m], [prompts[i] for i in index], args.max_tokens, args.rate)
                    wall += time.perf_counter() - t0
                    reqs += [dict(r, index=i) for i, r in zip(index, got, strict=True)]
                fig = summarize_wave(reqs, wall, args.slo_ttft_s, args.slo_itl_s)
                mismatched = [r["index"] for r in reqs if reference and r["ok"] and r["text"] != reference[r["index"]]]
                row = {"method": m, "concurrency": c, "mode": "sweep" if args.rate is None else f"poisson@{args.rate}", **fig}
                row["mismatched"] = len(mismatched) if reference else None
                rows.append(row)
                for r in reqs:
                    request_rows.append({"method": m, "concurrency": c, **{k: v for k, v in r.items() if k != "itl_s"}})
                print(
                    f"{m:>10} c={c:<3} {fig['tokens_per_s']:7.1f} tok/s {fig['requests_per_s']:6.2f} req/s "
                    f"TTFT p50/p99 {fig['ttft_p50_s'] or 0:.2f}/{fig['ttft_p99_s'] or 0:.2f}s "
                    f"ITL p50/p99 {1000 * (fig['itl_p50_s'] or 0):.0f}/{1000 * (fig['itl_p99_s'] or 0):.0f}ms "
                    f"done {fig['completed']}/{fig['requests']}" + (f" mismatched {len(mismatched)}" if reference else ""),
                    file=sys.stderr,
                )
    finally:
        serve.shutdown()
        ray.shutdown()
    ar_by_c = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["method"] == "ar"}
    one = ar_by_c.get(1)
    for r in rows:
        r["speedup_vs_batched_ar"] = r["tokens_per_s"] / ar_by_c[r["concurrency"]] if ar_by_c.get(r["concurrency"]) else None
        r["vs_one_stream_ar"] = r["tokens_per_s"] / one if one else None
    summary = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "max_batch_rows": args.max_batch_rows,
        "entries": {m: cfg.to_dict() for m, cfg in entries.items()},
        "rows": rows,
        "in_process": {k: {str(c): v for c, v in d.items()} for k, d in peers.items()},
    }
    if "hf_padded_generate" in peers:
        summary["batched_ar_vs_hf"] = {
            str(c): peers["specray_inprocess_ar"][c] / peers["hf_padded_generate"][c] for c in peers["hf_padded_generate"]
        }
    write_outputs(out, summary, request_rows)
    if args.readme:
        update_readme(Path(args.readme), summary, out / "load.png")
    return summary


def results_table(summary: dict) -> str:
    """The Markdown table of a run: one row per concurrency, tokens/s per method and the ratios that matter."""
    rows = summary["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    levels = sorted({r["concurrency"] for r in rows})
    by = {(r["method"], r["concurrency"]): r for r in rows}
    inproc = summary.get("in_process", {})
    head = ["streams"] + [f"{m} tok/s" for m in methods] + [f"{m} / AR" for m in methods if m != "ar"]
    head += ["AR vs 1 stream", "AR TTFT p99 s", "AR ITL p99 ms"]
    if "hf_padded_generate" in inproc:
        head += ["in-process batched AR / HF padded"]
    lines = []
    for c in levels:
        ar = by.get(("ar", c), {})
        cells = [str(c)] + [f"{by[(m, c)]['tokens_per_s']:.1f}" if (m, c) in by else "" for m in methods]
        cells += [f"{by[(m, c)]['speedup_vs_batched_ar']:.2f}x" if (m, c) in by else "" for m in methods if m != "ar"]
        cells += [f"{ar.get('vs_one_stream_ar') or 0:.2f}x", f"{ar.get('ttft_p99_s') or 0:.2f}", f"{1000 * (ar.get('itl_p99_s') or 0):.0f}"]
        if "hf_padded_generate" in inproc:
            spec, hf = inproc["specray_inprocess_ar"].get(str(c)), inproc["hf_padded_generate"].get(str(c))
            cells.append(f"{spec / hf:.2f}x" if spec and hf else "")
        lines.append(cells)
    return markdown_table(head, lines)


def update_readme(readme: Path, summary: dict, plot_path: Path) -> None:
    knobs = "; ".join(f"{m}: k={c['k']}, adaptive_k={c['adaptive_k']}" for m, c in summary["entries"].items()) or "ar only"
    caption = (
        f"{summary['model']} {summary['dtype']}, {summary['threads']} threads, {summary['max_tokens']} tokens per request "
        f"({knobs}); plot: `{plot_path}`."
    )
    try:
        replace_block(readme, "load-results", f"{results_table(summary)}\n\n{caption}")
    except ValueError as e:
        fail(str(e))


def hf_padded_tokens_per_s(dec, batch, max_new_tokens: int) -> float:
    """transformers generate() on the prompts left-padded into one batch (greedy); tokens up to each row's EOS / wall."""
    import torch

    model, tok = dec.loaded.model, dec.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else dec.loaded.eos_token_ids[0]
    width = max(ids.shape[1] for ids in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, ids in enumerate(batch):
        input_ids[i, width - ids.shape[1] :] = ids[0]
        mask[i, width - ids.shape[1] :] = 1
    eos = list(dec.loaded.eos_token_ids)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad
        )
    wall = time.perf_counter() - t0
    new = out[:, width:].tolist()
    tokens = sum(next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) for row in new)
    return tokens / wall


def _stream(client, model: str, prompt: str, max_tokens: int, start_at: float | None) -> dict:
    """One streaming chat completion: text, tokens, TTFT and the gaps between content chunks per token."""
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.perf_counter()))
    t0 = time.perf_counter()
    parts, ttft, last, itl, tokens = [], None, None, [], 0
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                if ttft is None:
                    ttft = now - t0
                elif last is not None:
                    itl.append(now - last)
                last = now
        return {"ok": True, "text": "".join(parts), "tokens": tokens, "ttft_s": ttft, "itl_s": itl, "e2e_s": time.perf_counter() - t0}
    except Exception as e:  # counted, never hidden
        return {"ok": False, "text": "", "tokens": 0, "ttft_s": None, "itl_s": [], "e2e_s": time.perf_counter() - t0, "error": str(e)[:200]}


def _wave(client, model: str, prompts: list[str], max_tokens: int, rate: float | None) -> list[dict]:
    """All prompts at once (rate None) or with exponential gaps of mean 1/rate; one thread per request."""
    results: list[dict | None] = [None] * len(prompts)
    rng = random.Random(0)
    t, starts = time.perf_counter(), []
    for _ in prompts:
        starts.append(t if rate is None else t)
        if rate:
            t += rng.expovariate(rate)

    def one(i):
        results[i] = _stream(client, model, prompts[i], max_tokens, starts[i] if rate else None)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results


def write_outputs(out: Path, summary: dict, request_rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(summary["rows"]), out / "load.parquet")
    if request_rows:
        pq.write_table(pa.Table.from_pylist(request_rows), out / "requests.parquet")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(summary, out / "load.png")


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for m in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == m), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        a.plot(xs, [r["tokens_per_s"] for r in mine], marker="o", label=m)
        b.plot(xs, [1000 * (r["itl_p99_s"] or 0) for r in mine], marker="o", label=f"{m} ITL p99")
        b.plot(xs, [1000 * (r["ttft_p99_s"] or 0) for r in mine], marker="x", linestyle="--", label=f"{m} TTFT p99")
    for name, by_c in summary.get("in_process", {}).items():
        xs = sorted(int(c) for c in by_c)
        a.plot(xs, [by_c[str(c)] for c in xs], linestyle=":", marker=".", label=name.replace("_", " "))
    a.set(xscale="log", xlabel="concurrent streams", ylabel="aggregate tokens/s", title="throughput")
    b.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="ms", title="p99 latency")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{summary['model']} {summary['dtype']}, {summary['threads']} threads, {summary['max_tokens']} tokens per request")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    def body(args):
        print(json.dumps(run(args)["rows"]))
        return 0

    return run_cli(build_parser(), body, argv)


if __name__ == "__main__":
    sys.exit(main())
