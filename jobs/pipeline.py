"""`specray pipeline` / `python -m jobs.pipeline`: the whole path on the embedded default, step by step.

1. bench    a small benchmark of every method against AR on Spec-Bench prompts
2. tune     a short Ray Tune search over the n-gram and early-exit knobs
3. publish  the winner into the registry (files under $SPECRAY_HOME unless --registry)
4. serve    the Ray Serve app with the registry's configurations
5. request  one chat completion through the `openai` client, checked against in-process greedy output

Each step prints what it did; a failing step stops the pipeline with its exit code.
"""

from __future__ import annotations

import sys
import time

from jobs.common import Parser, command, fail, output_dir

QUESTION = "Summarize in two sentences: the Moon is Earth's only natural satellite. It formed about 4.5 billion years ago."


def build_parser() -> Parser:
    p = Parser(prog="specray pipeline", description="bench -> tune -> publish -> serve -> one OpenAI request, on the embedded default")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--categories", default="summarization,rag")
    p.add_argument("--limit", type=int, default=1, help="prompts per category for bench and tune (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--num-samples", type=int, default=4, help="tune trials (default 4)")
    p.add_argument("--registry", help="registry URL or directory (default SPECRAY_REDIS_URL, else $SPECRAY_HOME/registry)")
    p.add_argument("--name", default="pipeline", help="registry name of the winner is <model>/<name>/best")
    p.add_argument("--out", default="runs/pipeline", help="bench and tune outputs (default runs/pipeline)")
    return p


def step(n: int, title: str) -> float:
    print(f"\n=== step {n}/5: {title} ===", flush=True)
    return time.perf_counter()


def done(t0: float, what: str) -> None:
    print(f"--- {what} ({time.perf_counter() - t0:.0f}s)", flush=True)


def main_with_args(args) -> int:
    from jobs import bench, tune

    out = output_dir(args.out, "--out")
    for flag, value in (("--limit", args.limit), ("--max-new-tokens", args.max_new_tokens), ("--num-samples", args.num_samples)):
        if value < 1:
            fail(f"{flag} must be >= 1, got {value}")
    tune.check_publish_name(f"{args.model}/{args.name}/best", args.registry, "--name")  # before the bench, not after the search
    common = ["--model", args.model, "--dtype", args.dtype, "--categories", args.categories, "--limit", str(args.limit)]
    common += ["--max-new-tokens", str(args.max_new_tokens)]
    registry = ["--registry", args.registry] if args.registry else []
    entry = f"{args.model}/{args.name}/best"

    t = step(1, "bench: every method against AR, side by side")
    rc = bench.main(["--methods", "ar,ngram,sps,early-exit", *common, "--out", str(out / "bench")])
    if rc:
        return rc
    done(t, f"bench written to {out / 'bench'}")

    t = step(2, f"tune: {args.num_samples} trials over n-gram and early-exit knobs, then step 3: publish as {entry}")
    rc = tune.main(
        ["--methods", "ngram,early-exit", *common, "--num-samples", str(args.num_samples), "--out", str(out / "tune"), "--name", "search"]
        + ["--publish", entry, *registry, "--verbose", "0"]
    )
    if rc:
        return rc
    done(t, f"tuned and published {entry}")

    t = step(4, "serve: Ray Serve with the registry's configurations")
    from ray import serve

    from cluster.runtime import connect, free_port, shutdown_if_started_here
    from serving.app import start
    from serving.settings import ServeSettings

    connect(None)
    try:
        settings = ServeSettings(registry=args.registry, base_model=args.model, dtype=args.dtype, num_replicas=1)
        base_url = start(settings, port=free_port()) + "/v1"
        done(t, f"serving at {base_url}")

        t = step(5, f"request: one chat completion to {entry} through the openai client")
        from openai import OpenAI

        client = OpenAI(base_url=base_url, api_key="unused", timeout=600)
        names = [m.id for m in client.models.list().data]
        print(f"/v1/models lists {len(names)} models, including {entry}: {entry in names}")
        if entry not in names:
            fail(f"{entry} was published but the server does not list it")
        messages = [{"role": "user", "content": QUESTION}]
        reply = client.chat.completions.create(model=entry, messages=messages, max_tokens=args.max_new_tokens, temperature=0)
        text = reply.choices[0].message.content
        print(f"reply: {text!r}")
        stats = reply.model_extra.get("specray", {}) if reply.model_extra else {}
        print(f"usage: {reply.usage.completion_tokens} tokens; specray stats: {stats}")

        from cluster.registry import open_registry
        from decoding.in_process import SpecDecoder

        local = SpecDecoder(open_registry(args.registry).get(entry).config)
        ids = local.generate_ids(local.encode(QUESTION, chat=True), max_new_tokens=args.max_new_tokens).token_ids
        same = local.decode(ids) == text
        print(f"identical to in-process greedy generation: {same}")
        done(t, "request answered")
        return 0 if same else 1
    finally:
        serve.shutdown()
        shutdown_if_started_here()


main = command(build_parser, main_with_args)


if __name__ == "__main__":
    sys.exit(main())
