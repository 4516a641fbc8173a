"""What the HTTP path costs: the same generation in-process and through the Serve app, interleaved.

    python -m serving.bench --model smollm2-135m --tokens 32 --repeats 5 --load 32

Starts an embedded Ray with the app on a free loopback port, then for each
repeat runs one in-process ``SpecDecoder`` generation and one HTTP completion
(non-streaming and streaming) of the same prompt and configuration (greedy,
same dtype and torch threads), checks they return the same text, and prints
median wall times and the HTTP / in-process ratio. ``--load N`` then sends N
concurrent streaming requests with distinct prompts and reports requests/s and
tokens/s. Prints one JSON object at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m serving.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="ar", help="ar (plain model id) or a method served through a temporary registry entry")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads, in-process and in the replica")
    p.add_argument("--load", type=int, default=0, help="concurrent streaming requests for the throughput run (0: skip)")
    p.add_argument("--load-tokens", type=int, default=None)
    p.add_argument("--max-ongoing-requests", type=int, default=4)
    p.add_argument("--verbose", action="store_true", help="show the replicas' logs")
    p.add_argument("--prompt", default="Write a short paragraph about the history of the bicycle.")
    args = p.parse_args(argv)

    import httpx
    import ray
    import torch
    from ray import serve

    from cluster.registry import Entry, open_registry
    from decoding.config import SpecConfig
    from decoding.engine import SpecDecoder
    from serving.app import build_app
    from serving.settings import ServeSettings

    cfg = SpecConfig(method=args.method, model=args.model, dtype=args.dtype, max_new_tokens=args.tokens)
    reg_dir = tempfile.mkdtemp(prefix="specray-bench-reg-")
    name = args.model
    if args.method != "ar":
        name = f"bench/{args.method}"
        open_registry(reg_dir).put(Entry(name, cfg))

    torch.set_num_threads(args.threads)
    dec = SpecDecoder(cfg)
    torch.set_num_threads(args.threads)

    def in_process(prompt: str, n: int) -> tuple[str, float]:
        t0 = time.perf_counter()
        out = dec.generate_ids(dec.encode(prompt, chat=True), max_new_tokens=n)
        return dec.decode(out.token_ids), time.perf_counter() - t0

    port = _free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=args.verbose)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        settings = ServeSettings(
            registry=reg_dir,
            base_model=args.model,
            dtype=args.dtype,
            num_replicas=1,
            threads=args.threads,
            max_ongoing_requests=args.max_ongoing_requests,
            max_queued_requests=max(64, args.load + 8),
            preload=[name],
        )
        serve.run(build_app(settings), name="specray", route_prefix="/")
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
        body = {"model": name, "messages": [{"role": "user", "content": args.prompt}], "max_tokens": args.tokens, "temperature": 0}

        def http(stream: bool) -> tuple[str, float]:
            t0 = time.perf_counter()
            if not stream:
                r = client.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                return r.json()["choices"][0]["message"]["content"], time.perf_counter() - t0
            parts = []
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        ch = json.loads(line[6:])["choices"]
                        if ch:
                            parts.append(ch[0]["delta"].get("content") or "")
            return "".join(parts), time.perf_counter() - t0

        http(False)  # warm-up both paths
        in_process(args.prompt, args.tokens)
        times = {"in_process": [], "http": [], "http_stream": []}
        for _ in range(args.repeats):
            ref, t = in_process(args.prompt, args.tokens)
            times["in_process"].append(t)
            text, t = http(False)
            times["http"].append(t)
            assert text == ref, (text, ref)
            text, t = http(True)
            times["http_stream"].append(t)
            assert text == ref, (text, ref)
        med = {k: statistics.median(v) for k, v in times.items()}
        result = {
            "model": args.model,
            "method": args.method,
            "dtype": args.dtype,
            "tokens": args.tokens,
            "threads": args.threads,
            "repeats": args.repeats,
            "median_s": med,
            "all_s": times,
            "ratio_http": med["http"] / med["in_process"],
            "ratio_http_stream": med["http_stream"] / med["in_process"],
            "overhead_ms_http": (med["http"] - med["in_process"]) * 1000,
            "identical_text": True,
        }
        print(
            f"in-process {med['in_process'] * 1000:.0f} ms, HTTP {med['http'] * 1000:.0f} ms (x{result['ratio_http']:.3f}), "
            f"HTTP stream {med['http_stream'] * 1000:.0f} ms (x{result['ratio_http_stream']:.3f}) for {args.tokens} tokens",
            file=sys.stderr,
        )
        if args.load:
            result["load"] = asyncio.run(_load(port, name, args.load, args.load_tokens or args.tokens))
            ld = result["load"]
            print(
                f"load: {ld['requests']} streams in {ld['wall_s']:.1f}s = {ld['requests_per_s']:.2f} req/s, {ld['tokens_per_s']:.1f} tok/s",
                file=sys.stderr,
            )
        print(json.dumps(result))
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


async def _load(port: int, model: str, n: int, tokens: int) -> dict:
    import httpx

    async def one(ac, i):
        body = {
            "model": model,
            "prompt": f"Request {i}: a few words about the number {i}.",
            "max_tokens": tokens,
            "stream": True,
            "temperature": 0,
        }
        got = 0
        t0 = time.perf_counter()
        ttft = None
        async with ac.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    d = json.loads(line[6:])
                    if d.get("usage"):
                        got = d["usage"]["completion_tokens"]
                    elif ttft is None and d["choices"] and d["choices"][0]["text"]:
                        ttft = time.perf_counter() - t0
        return got, ttft

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=900, limits=httpx.Limits(max_connections=n + 4)) as ac:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(ac, i) for i in range(n)))
        wall = time.perf_counter() - t0
    toks = sum(r[0] for r in res)
    ttfts = sorted(r[1] for r in res if r[1] is not None)
    return {
        "requests": n,
        "tokens": toks,
        "wall_s": wall,
        "requests_per_s": n / wall,
        "tokens_per_s": toks / wall,
        "ttft_median_s": statistics.median(ttfts) if ttfts else None,
        "ttft_max_s": ttfts[-1] if ttfts else None,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
