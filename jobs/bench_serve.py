"""`specray bench-serve` / `python -m jobs.bench_serve`: many users at once, a load benchmark through real HTTP.

    specray bench-serve --methods ar,ngram --concurrency 1,2,4,8,16,32 --max-tokens 64 --peer hf
    specray bench-serve --methods ar,ngram --rate 2 --requests 32          # Poisson arrivals at 2 req/s
    specray bench-serve --methods ar --peer-url http://127.0.0.1:8080 --peer-label llama.cpp   # any OpenAI server beside

Starts an embedded Ray with the app on a free loopback port (``--address`` / ``RAY_ADDRESS`` joins a cluster
instead) and a temporary registry with one entry per method (``ar`` is the plain model id: batched AR, the
denominator), then runs the load of ``evaluation.load`` against it. ``--check`` compares each stream's text with
its own in-process greedy output (float32 makes it exact; in bfloat16 near-ties may differ and are counted, not
hidden). ``--peer hf`` runs transformers' ``generate()`` on a left-padded batch of the same prompts next to
specray's in-process batched AR. ``--peer-url`` runs the same prompts, levels and client against any
OpenAI-compatible server (llama.cpp's, vLLM, another specray; ``--peer-model``, else the first model it lists) after
specray's server has stopped, as one more method named ``--peer-label`` (``--check`` counts its mismatches too).
Writes ``load.parquet``, ``requests.parquet``, ``summary.json`` and ``load.png`` under ``--out``; ``--readme``
rewrites the README's ``<!-- load-results -->`` block.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from jobs.common import Parser, check_readme, fail, finite_float, output_dir, parse_ints, run_cli


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="specray bench-serve", description="Load benchmark of the OpenAI endpoints: concurrency sweep or Poisson arrivals.")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--methods", default="ar,ngram", help="comma-separated; ar is the plain model (batched AR)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config field for the method entries (default k=auto)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated concurrent streams (the sweep)")
    p.add_argument("--rate", type=finite_float, help="Poisson mode: mean requests per second (instead of the sweep)")
    p.add_argument("--requests", type=int, default=32, help="Poisson mode: how many requests")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-requests", type=int, default=4, help="sweep: back-to-back waves until a level has this many requests")
    p.add_argument("--prompts", help="Spec-Bench JSONL (default: the bundled questions)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the replica and of the in-process peers")
    p.add_argument("--max-batch-rows", type=int, default=32)
    p.add_argument("--slo-ttft-s", type=finite_float, default=10.0)
    p.add_argument("--slo-itl-s", type=finite_float, default=0.5)
    p.add_argument("--check", action="store_true", help="compare every stream with its in-process greedy output")
    p.add_argument("--peer", choices=["hf"], help="also run transformers generate() on a padded batch")
    p.add_argument("--peer-url", metavar="URL", help="also measure this OpenAI-compatible server (its root or /v1 URL) on the same prompts")
    p.add_argument("--peer-model", metavar="NAME", help="the model to ask the peer for (default: the first its /v1/models lists)")
    p.add_argument("--peer-label", default="peer", help="the peer's name in the rows and the table, e.g. llama.cpp (default peer)")
    p.add_argument("--peer-api-key", default="unused", help="the peer's API key, if it wants one")
    p.add_argument("--out", default="runs/load", help="output folder")
    p.add_argument("--readme", metavar="README.md", help="also rewrite the load table between its <!-- load-results --> markers")
    p.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local Ray)")
    return p


def plan_from_args(args):
    """The load plan, the method entries (method -> SpecConfig; ``ar`` is the plain model) and the base config."""
    from decoding.config import SpecConfig
    from evaluation.load import LoadPlan

    if min(args.threads, args.max_batch_rows) < 1:
        fail("--threads and --max-batch-rows must be >= 1")
    output_dir(args.out, "--out")
    if args.readme:
        check_readme(args.readme, "load-results")  # the block update_readme rewrites at the end
    plan = LoadPlan(
        parse_ints(args.concurrency, "--concurrency", 1),
        args.max_tokens,
        args.min_requests,
        args.rate,
        args.requests,
        args.slo_ttft_s,
        args.slo_itl_s,
    )
    methods = list(dict.fromkeys(["ar"] + [m.strip() for m in args.methods.split(",") if m.strip()]))
    if (args.peer_model or args.peer_label != "peer") and not args.peer_url:
        fail("--peer-model and --peer-label need --peer-url")
    if args.peer_url and (args.peer_label in methods or not args.peer_label.strip()):
        fail(f"--peer-label {args.peer_label!r} must be a name of its own (not one of --methods)")
    base = SpecConfig(model=args.model, dtype=args.dtype, max_new_tokens=args.max_tokens, threads=args.threads)
    entries = {m: base.for_method(m).with_overrides(args.set or ["k=auto"]) for m in methods if m != "ar"}
    return plan, methods, entries, base


def serve_entries(args, entries: dict, wave: int) -> str:
    """The app on a free loopback port of the connected Ray, a temporary registry holding ``load/<method>``; its URL."""
    from cluster.registry import Entry, open_registry
    from cluster.runtime import connect, free_port
    from serving.app import start
    from serving.settings import ServeSettings

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
    connect(args.address)
    return start(settings, port=free_port(), name="specray-load")


def open_peer(args):
    """The peer's client and the model it is asked for (None, None without --peer-url); fails before any work when
    the peer cannot be reached."""
    if not args.peer_url:
        return None, None
    import openai

    from evaluation import load

    client = openai.OpenAI(base_url=load.peer_base_url(args.peer_url), api_key=args.peer_api_key, timeout=1800, max_retries=0)
    return client, load.peer_model(client, args.peer_model)


def run(args) -> dict:
    import openai
    import ray
    import torch
    from ray import serve

    from decoding.in_process import SpecDecoder
    from evaluation import load
    from evaluation.workloads import WorkloadError, load_prompts

    plan, methods, entries, base = plan_from_args(args)
    peer_client, peer_model = open_peer(args)
    try:
        texts = load.interleave_categories(load_prompts(args.prompts))
    except WorkloadError as e:
        fail(str(e))
    out = Path(args.out).expanduser()  # checked by plan_from_args
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    ar = SpecDecoder(base)
    prompts, chats = load.fitting_prompts(ar, texts, args.max_tokens)
    wave = plan.prompts_needed
    prompts, chats = (prompts * (wave // len(prompts) + 1))[:wave], (chats * (wave // len(chats) + 1))[:wave]
    reference = load.references(ar, chats, args.max_tokens) if args.check else None
    peers = load.in_process_peers(ar, chats, plan.levels, args.max_tokens, hf=args.peer == "hf") if args.rate is None else {}
    try:
        url = serve_entries(args, entries, wave)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=1800, max_retries=0)
        names = {m: (args.model if m == "ar" else f"load/{m}") for m in methods}
        rows, request_rows = load.run_load(client, names, prompts, plan, reference)
    finally:
        serve.shutdown()
        ray.shutdown()
    about = {"model": args.model, "dtype": args.dtype, "threads": args.threads, "max_tokens": args.max_tokens}
    if peer_client is not None:  # after specray's server has stopped: the peer has the machine to itself
        peer_rows, peer_requests = load.run_load(peer_client, {args.peer_label: peer_model}, prompts, plan, reference)
        rows, request_rows = rows + peer_rows, request_rows + peer_requests
        counted = {"usage" if r.get("usage") else "content chunks" for r in peer_requests if r["ok"]}
        counted_by = " and ".join(sorted(counted)) or "nothing (no request completed)"
        about["peer"] = {"label": args.peer_label, "url": args.peer_url, "model": peer_model, "counted_by": counted_by}
    about |= {"max_batch_rows": args.max_batch_rows, "entries": {m: cfg.to_dict() for m, cfg in entries.items()}}
    summary = load.summarize(rows, peers, about)
    load.write_outputs(out, summary, request_rows)
    if args.readme:
        try:
            load.update_readme(Path(args.readme), summary, out / "load.png")
        except (OSError, ValueError) as e:
            fail(str(e))
    return summary


def main(argv=None) -> int:
    def body(args):
        print(json.dumps(run(args)["rows"]))
        return 0

    return run_cli(build_parser(), body, argv)


if __name__ == "__main__":
    sys.exit(main())
