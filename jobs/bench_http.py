"""`specray bench-http` / `python -m jobs.bench_http`: what the HTTP path costs over in-process generation.

    python -m jobs.bench_http --model smollm2-135m --tokens 32 --repeats 5 --load 32

Starts an embedded Ray with the app on a free loopback port (``--address`` / ``RAY_ADDRESS`` joins a cluster
instead), then for each repeat runs one in-process generation and one HTTP chat completion (plain and streamed) of
the same prompt and configuration (greedy, same dtype and torch threads), checks they say the same, and prints the
median wall times and the HTTP / in-process ratios (``evaluation.load.http_overhead``). ``--load N`` then sends N
concurrent streams of distinct prompts and reports their throughput. Prints one JSON object at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

from jobs.common import Parser, command, fail


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="specray bench-http", description="What the HTTP path costs over in-process generation.")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="ar", help="ar (plain model id) or a method served through a temporary registry entry")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads, in-process and in the replica")
    p.add_argument("--load", type=int, default=0, help="concurrent streaming requests for the throughput run (0: skip)")
    p.add_argument("--max-ongoing-requests", type=int, default=4)
    p.add_argument("--prompt", default="Write a short paragraph about the history of the bicycle.")
    p.add_argument("--verbose", action="store_true", help="show the replicas' logs")
    p.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local Ray)")
    return p


def main_with_args(args) -> int:
    import openai
    import torch
    from ray import serve

    from cluster.registry import Entry, open_registry
    from cluster.runtime import connect, free_port, shutdown_if_started_here
    from decoding.config import SpecConfig
    from decoding.in_process import SpecDecoder
    from evaluation import load
    from serving.app import start
    from serving.settings import ServeSettings

    if min(args.tokens, args.repeats) < 1 or args.load < 0:
        fail(f"--tokens and --repeats must be >= 1 and --load >= 0, got {args.tokens}, {args.repeats} and {args.load}")
    cfg = SpecConfig(method=args.method, model=args.model, dtype=args.dtype, max_new_tokens=args.tokens, threads=args.threads)
    reg_dir, name = tempfile.mkdtemp(prefix="specray-bench-reg-"), args.model
    if args.method != "ar":
        name = f"bench/{args.method}"
        open_registry(reg_dir).put(Entry(name, cfg))
    dec = SpecDecoder(cfg)
    torch.set_num_threads(args.threads)
    settings = ServeSettings(registry=reg_dir, base_model=args.model, dtype=args.dtype, num_replicas=1, threads=args.threads)
    settings = settings.replace(max_ongoing_requests=args.max_ongoing_requests, max_queued_requests=max(64, args.load + 8), preload=[name])
    connect(args.address, num_cpus=2, log_to_driver=args.verbose)
    try:
        client = openai.OpenAI(base_url=start(settings, port=free_port()) + "/v1", api_key="unused", timeout=900, max_retries=0)
        result = {"model": args.model, "method": args.method, "dtype": args.dtype, "tokens": args.tokens, "threads": args.threads}
        result |= load.http_overhead(dec, client, name, args.prompt, args.tokens, args.repeats)
        med = result["median_s"]
        print(
            f"in-process {med['in_process'] * 1000:.0f} ms, HTTP {med['http'] * 1000:.0f} ms (x{result['ratio_http']:.3f}), "
            f"HTTP stream {med['http_stream'] * 1000:.0f} ms (x{result['ratio_http_stream']:.3f}) for {args.tokens} tokens",
            file=sys.stderr,
        )
        if args.load:
            prompts = [f"Request {i}: a few words about the number {i}." for i in range(args.load)]
            t0 = time.perf_counter()
            streams = load.wave(client, name, prompts, args.tokens, None)
            result["load"] = load.summarize_wave(streams, time.perf_counter() - t0, float("inf"), float("inf"))
            print(f"load: {args.load} streams, {result['load']['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    finally:
        serve.shutdown()
        shutdown_if_started_here()
    print(json.dumps(result))
    return 0


main = command(build_parser, main_with_args)


if __name__ == "__main__":
    sys.exit(main())
