"""`specray soak` / `python -m jobs.soak`: steady load through real HTTP with faults injected, and nothing lost.

    specray soak --duration-s 1800 --repeats 2 --out runs/soak --docs docs/soak --readme docs/soak.md
    specray soak --duration-s 120 --schedule 20:replica_kill,40:worker_kill --model /path/to/hf-model

Builds its own test cluster on this machine (``evaluation.soak.services.SoakCluster``: a head that keeps Serve's
controller, proxy, ingress and the engine replica; four 1-CPU worker nodes for the actor entry's placement group
and a spare) and a persistent redis-server holding the registry, with three entries besides the plain model (the
base model as AR, ``soak/ngram``, ``soak/suffix`` and ``soak/pearl`` on two model workers), all in float32 so every
completed greedy answer can be checked against the same request run alone in this process. Then it runs
``evaluation.soak.harness.Soak`` for ``--duration-s`` (Poisson arrivals at ``--rate`` plus a floor of ``--min-streams``,
under ``--max-streams``) with the faults of ``--faults`` at evenly spread times (``--repeats`` each) or at the times
of ``--schedule``, and prints one progress line every ``--progress-s``.

Writes under ``--out``: ``requests.parquet``, ``processes.parquet``, ``faults.parquet``, ``summary.json``,
``report.md`` and ``soak.png``; ``--docs DIR`` copies them there and ``--readme FILE``
rewrites the ``<!-- soak-results -->`` block of a Markdown file (docs/soak.md). Exit 0 when no request was lost, hung, answered twice,
mixed or wrong and the service drained at the end; 1 otherwise; 2 (one line) on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from jobs.common import Parser, fail, finite_float, output_dir, parse_ints, run_cli

APP = "specray"


def build_parser() -> argparse.ArgumentParser:
    from evaluation.soak.plan import FAULTS

    p = Parser(prog="specray soak", description="Faults under load: steady HTTP load with chaos, checking that nothing is lost.")
    p.add_argument("--duration-s", type=finite_float, default=1800.0, help="how long the load runs (default 1800)")
    p.add_argument("--model", default="smollm2-135m", help="the model served (default smollm2-135m), float32")
    p.add_argument("--min-streams", type=int, default=8, help="the concurrency floor (default 8)")
    p.add_argument("--max-streams", type=int, default=16, help="the ceiling of concurrent streams (default 16)")
    p.add_argument("--rate", type=finite_float, default=1.0, help="Poisson arrivals per second on top of the floor (default 1)")
    p.add_argument("--max-tokens", default="16,32,48", help="max_tokens values the requests draw from (default 16,32,48)")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma list of faults, or none (default all: {', '.join(FAULTS)})")
    p.add_argument("--repeats", type=int, default=2, help="times each fault is injected, evenly spread (default 2)")
    p.add_argument("--schedule", metavar="T:FAULT,...", help="explicit fault times in seconds instead of --faults/--repeats")
    p.add_argument("--first-fault-s", type=finite_float, help="when the first fault comes (default: a tenth of the run)")
    p.add_argument(
        "--tail-s", type=finite_float, help="fault-free time at the end (default: a twentieth of the run, 60 s to a quarter of it)"
    )
    p.add_argument(
        "--fault-gap-s", type=finite_float, default=10.0, help="a fault waits for the previous one's recovery plus this (default 10)"
    )
    p.add_argument("--overlap", action="store_true", help="inject each fault at its time, not after the previous one recovered")
    p.add_argument("--recovery-wait-s", type=finite_float, default=120.0, help="the longest wait for a fault's recovery (default 120)")
    p.add_argument(
        "--node-return-s", type=finite_float, default=10.0, help="a new node joins this long after a removal's recovery (default 10)"
    )
    p.add_argument("--stall-s", type=finite_float, default=15.0, help="how long the slow reader stalls on its stream (default 15)")
    p.add_argument("--request-timeout-s", type=finite_float, default=180.0, help="a request not ended by then is hung (default 180)")
    p.add_argument("--max-queued-requests", type=int, default=24, help="the ingress's admission limit (default 24)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the engine replica (default 2)")
    p.add_argument("--pool", type=int, default=12, help="distinct prompts the requests draw from (default 12)")
    p.add_argument("--max-prompt-tokens", type=int, default=160, help="the longest prompt of the pool, in tokens (default 160)")
    p.add_argument("--sample-s", type=finite_float, default=5.0, help="seconds between samples of every process's RSS and fds (default 5)")
    p.add_argument("--progress-s", type=finite_float, default=30.0, help="seconds between progress lines (default 30)")
    p.add_argument("--window-s", type=finite_float, default=60.0, help="p99 windows before and after a fault (default 60)")
    p.add_argument("--growth-from-s", type=finite_float, default=300.0, help="RSS/fd growth is measured from here to the end (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/soak", help="output folder (default runs/soak)")
    p.add_argument("--docs", metavar="DIR", help="also copy the report, the plot, the summary and the Parquet files here (e.g. docs/soak)")
    p.add_argument("--readme", metavar="FILE", help="also rewrite the <!-- soak-results --> block of this Markdown file (docs/soak.md)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON at the end")
    return p


def _plan(args):
    from evaluation.soak.plan import FAULTS, SoakPlan, even_schedule, parse_schedule

    if args.duration_s < 10:
        fail(f"--duration-s: at least 10 seconds, got {args.duration_s:g}")
    if args.min_streams < 1 or args.max_streams < args.min_streams:
        fail(f"--min-streams/--max-streams: need 1 <= min <= max, got {args.min_streams} and {args.max_streams}")
    if args.rate < 0:
        fail(f"--rate: must be >= 0, got {args.rate:g}")
    for flag in ("request_timeout_s", "sample_s", "progress_s", "window_s", "recovery_wait_s"):
        if getattr(args, flag) <= 0:
            fail(f"--{flag.replace('_', '-')}: must be > 0, got {getattr(args, flag):g}")
    for flag in ("fault_gap_s", "node_return_s", "stall_s", "growth_from_s", "first_fault_s", "tail_s"):
        if getattr(args, flag) is not None and getattr(args, flag) < 0:
            fail(f"--{flag.replace('_', '-')}: must be >= 0, got {getattr(args, flag):g}")
    if min(args.max_queued_requests, args.threads, args.pool, args.max_prompt_tokens) < 1 or args.repeats < 0:
        fail("--max-queued-requests, --threads, --pool and --max-prompt-tokens must be >= 1 and --repeats >= 0")
    if args.max_queued_requests <= args.max_streams:
        fail(
            f"--max-queued-requests ({args.max_queued_requests}) must exceed --max-streams ({args.max_streams}): "
            "the steady load alone would be refused"
        )
    if args.schedule:
        try:
            schedule = parse_schedule(args.schedule)
        except ValueError as e:
            fail(f"--schedule: {e}")
        if schedule and schedule[-1][0] >= args.duration_s:
            fail(f"--schedule: a fault at {schedule[-1][0]:g}s is past the end of the run ({args.duration_s:g}s)")
    else:
        names = [] if args.faults.strip() in ("", "none") else [x.strip() for x in args.faults.split(",") if x.strip()]
        unknown = [n for n in names if n not in FAULTS]
        if unknown:
            fail(f"--faults: unknown fault {unknown[0]!r}; choose from {', '.join(FAULTS)} (or none)")
        first = args.first_fault_s if args.first_fault_s is not None else args.duration_s / 10
        tail = args.tail_s if args.tail_s is not None else min(max(60.0, args.duration_s / 20), args.duration_s / 4)
        if names and first >= args.duration_s - tail:
            fail(f"--first-fault-s/--tail-s: no room for faults between {first:g}s and {args.duration_s - tail:g}s")
        schedule = even_schedule(names, args.repeats, first, args.duration_s - tail)
    return SoakPlan(
        duration_s=args.duration_s,
        min_streams=args.min_streams,
        max_streams=args.max_streams,
        rate=args.rate,
        request_timeout_s=args.request_timeout_s,
        schedule=schedule,
        window_s=args.window_s,
        sample_s=args.sample_s,
        progress_s=args.progress_s,
        max_queued_requests=args.max_queued_requests,
        fault_gap_s=args.fault_gap_s,
        overlap=args.overlap,
        recovery_wait_s=args.recovery_wait_s,
        node_return_s=args.node_return_s,
        slow_stall_s=args.stall_s,
        seed=args.seed,
    )


class References:
    """The float32 greedy answer of every (endpoint, prompt) run alone in this process, up to the longest max_tokens;
    a request for fewer tokens is checked against the prefix (greedy decoding does not look ahead), one for more
    only when the answer ended before (EOS)."""

    def __init__(self, dec, prompts: list[str], max_tokens: int, long_tokens: int):
        self.dec, self.ids = dec, {}
        t0 = time.monotonic()
        for i, prompt in enumerate(prompts):
            for endpoint in ("completions", "chat"):
                self._run(endpoint, i, prompt, max_tokens)
            print(f"soak: references {i + 1}/{len(prompts)} ({time.monotonic() - t0:.0f}s)", file=sys.stderr, flush=True)
        # the slow and the hung-up stream: a completion that runs to long_tokens without ending early
        self.long_prompt = next(
            (i for i in range(len(prompts)) if len(self._run("completions", i, prompts[i], long_tokens)) >= long_tokens), 0
        )

    def _run(self, endpoint: str, i: int, prompt: str, n: int) -> list[int]:
        ids = self.dec.encode(prompt, chat=endpoint == "chat")
        out = self.dec.generate_ids(ids, max_new_tokens=n).token_ids
        self.ids[endpoint, i] = (out, n)
        return out

    def __call__(self, rec) -> str | None:
        ids, asked = self.ids.get((rec.endpoint, rec.prompt_idx), (None, 0))
        if ids is None or (rec.max_tokens > asked and len(ids) >= asked):
            return None
        return self.dec.decode(ids[: rec.max_tokens])


def pick_prompts(dec, pool: int, max_prompt_tokens: int, room: int) -> list[str]:
    """``pool`` Spec-Bench first turns, one category after another, each short enough (``max_prompt_tokens`` with the chat
    template) to leave ``room`` tokens of the model's context."""
    from evaluation.workloads import load_prompts

    by_cat: dict[str, list[str]] = {}
    for p in load_prompts():
        by_cat.setdefault(p.category, []).append(p.prompt)
    out = []
    limit = min(max_prompt_tokens, dec.target.max_context - room)
    for round_ in range(max(len(v) for v in by_cat.values())):
        for texts in by_cat.values():
            if round_ < len(texts) and len(out) < pool and dec.encode(texts[round_], chat=True).shape[1] <= limit:
                out.append(texts[round_])
    if not out:
        fail(f"no prompt fits --max-prompt-tokens {max_prompt_tokens} and the model's context of {dec.target.max_context} tokens")
    return out


def entries(model: str, depth: int) -> dict:
    from decoding.config import SpecConfig

    f32 = {"model": model, "dtype": "float32", "max_new_tokens": 64}
    return {
        "soak/ngram": SpecConfig(method="ngram", k=4, **f32),
        "soak/suffix": SpecConfig(method="suffix", k=4, **f32),
        "soak/pearl": SpecConfig(
            method="pearl", k=4, draft_layers=max(1, min(8, depth // 4)), target_threads=1, draft_threads=1, rpc_timeout_s=30, **f32
        ),
    }


def head_pinned(settings_cls):
    """Serve settings whose ingress and engine replica ask for the head's resource (the node a soak never removes)."""
    from evaluation.soak.services import HEAD_RESOURCE

    class HeadPinned(settings_cls):
        def ingress_deployment_options(self) -> dict:
            opts = super().ingress_deployment_options()
            opts["ray_actor_options"] = {**opts["ray_actor_options"], "resources": {HEAD_RESOURCE: 0.01}}
            return opts

        def model_deployment_options(self) -> dict:
            opts = super().model_deployment_options()
            opts["ray_actor_options"] = {**opts["ray_actor_options"], "resources": {HEAD_RESOURCE: 0.01}}
            return opts

    return HeadPinned


def deploy(registry_url: str, model: str, threads: int, max_queued: int, preload: list[str]) -> str:
    """The Serve app on the connected cluster (proxy on the head only); returns its base URL."""
    from cluster.runtime import free_port
    from serving.app import start
    from serving.settings import ServeSettings

    settings = head_pinned(ServeSettings)(
        registry=registry_url,
        base_model=model,
        dtype="float32",
        num_replicas=1,
        model_num_cpus=0,
        threads=threads,
        max_ongoing_requests=64,
        max_queued_requests=max_queued,
        placed_replica_num_cpus=1,
        drain_timeout_s=2,
        preload=preload,
    )
    return start(settings, port=free_port(), name=APP, proxy_location="HeadOnly")


def warm_up(url: str, models: list[str], prompt: str, timeout_s: float = 300.0) -> None:
    """One request per model before the clock starts: the engine's cost model, the tree calibration, the actor entry's workers."""
    import httpx

    for m in models:
        t0 = time.monotonic()
        while True:
            try:
                r = httpx.post(
                    url + "/v1/completions", json={"model": m, "prompt": prompt, "max_tokens": 8, "temperature": 0}, timeout=timeout_s
                )
                if r.status_code == 200:
                    break
                why = r.text[:200]
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"the warm-up request to {m} never succeeded: {why}")
            time.sleep(2)
        print(f"soak: warmed up {m} in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)


def publisher(registry_url: str, config: dict):
    """The publish the Redis fault runs: ``specray registry put`` of a result kept on disk (config and figures)."""

    def argv(name: str, results: Path) -> list[str]:
        results.mkdir(parents=True, exist_ok=True)
        cfg, metrics = results / "best_config.json", results / "metrics.json"
        if not cfg.exists():
            cfg.write_text(json.dumps(config, indent=1))
            metrics.write_text(json.dumps({"speedup": 1.0, "source": "specray soak"}))
        return [
            sys.executable,
            "-m",
            "jobs.registry",
            "put",
            name,
            "--config",
            str(cfg),
            "--metrics",
            str(metrics),
            "--registry",
            registry_url,
        ]

    return argv


def results_block(summary: dict, command: str) -> str:
    from evaluation.soak.outputs import report_markdown

    return report_markdown(summary, plot_name=None) + f"\n\nRegenerate with:\n\n```\n{command}\n```"


def prepare(args):
    """Everything checked and computed before the cluster starts: the plan, the outputs, the prompts and their float32
    greedy answers alone (the reference of every greedy request), the entries."""
    from types import SimpleNamespace

    plan = _plan(args)
    max_tokens = parse_ints(args.max_tokens, "--max-tokens", 1)
    out = output_dir(args.out, "--out")
    docs = output_dir(args.docs, "--docs") if args.docs else None
    if args.readme:
        from evaluation.markdown import check_block

        try:
            check_block(Path(args.readme), "soak-results")
        except (OSError, ValueError) as e:
            fail(f"--readme: {e}")
    if shutil.which("redis-server") is None:
        fail("redis-server is not installed (apt-get install -y redis-server): the soak's registry runs on it")
    from decoding.config import ConfigError, SpecConfig
    from decoding.in_process import SpecDecoder

    t_start = time.monotonic()
    try:
        dec = SpecDecoder(SpecConfig(model=args.model, dtype="float32", threads=args.threads))
    except ConfigError as e:
        fail(str(e))
    prompts = pick_prompts(dec, args.pool, args.max_prompt_tokens, max(max(max_tokens), plan.slow_max_tokens))
    print(
        f"soak: {len(prompts)} prompts; computing their float32 greedy answers alone (the reference of every greedy request)",
        file=sys.stderr,
    )
    refs = References(dec, prompts, max(max_tokens), plan.slow_max_tokens)
    plan.slow_prompt_idx = refs.long_prompt
    print(f"soak: references ready after {time.monotonic() - t_start:.0f}s", file=sys.stderr)
    configs = entries(args.model, len(dec.loaded.model.model.layers))
    return SimpleNamespace(plan=plan, max_tokens=max_tokens, out=out, docs=docs, prompts=prompts, refs=refs, configs=configs)


def run_soak(args, prep):
    """The soak on its own cluster and redis: deploy, warm up, load with faults; both are stopped however it ends."""
    from cluster.registry import Entry, open_registry
    from cluster.runtime import PATIENT_SERVE
    from evaluation.soak.harness import Soak
    from evaluation.soak.plan import Mix
    from evaluation.soak.services import RedisServer, SoakCluster

    for key, value in PATIENT_SERVE.items():  # a busy machine starts Serve's proxy slowly (read by the cluster's processes)
        os.environ.setdefault(key, value)
    redis, cluster = RedisServer(), SoakCluster()
    try:
        redis.start()
        with open_registry(redis.url) as reg:
            for name, cfg in prep.configs.items():
                reg.put(Entry(name, cfg, metrics={"speedup": 1.0}, source={"tool": "specray soak"}))
        t0 = time.monotonic()
        cluster.start()
        print(f"soak: cluster of {1 + cluster.worker_nodes} nodes up in {time.monotonic() - t0:.0f}s; deploying the app", file=sys.stderr)
        engine = [args.model, "soak/ngram", "soak/suffix"]
        url = deploy(redis.url, args.model, args.threads, args.max_queued_requests, ["soak/ngram", "soak/suffix"])
        warm_up(url, engine + ["soak/pearl"], prep.prompts[0])
        print(
            f"soak: serving at {url} after {time.monotonic() - t0:.0f}s; load for {prep.plan.duration_s:.0f}s, "
            f"{len(prep.plan.schedule)} fault(s)",
            file=sys.stderr,
        )
        mix = Mix(
            models={args.model: 0.3, "soak/ngram": 0.3, "soak/suffix": 0.25, "soak/pearl": 0.15},
            placed=("soak/pearl",),
            max_tokens=tuple(prep.max_tokens),
        )
        publish = publisher(redis.url, prep.configs["soak/ngram"].to_dict())
        kw = {"engine": engine, "placed": ["soak/pearl"], "expected": prep.refs, "publish": publish, "workdir": prep.out / "publish"}
        return Soak(url, prep.plan, mix, prep.prompts, cluster, redis, **kw).run()
    finally:  # the whole test cluster goes (Serve's actors with it), then redis
        t_down = time.monotonic()
        cluster.shutdown()
        redis.close()
        print(f"soak: cluster and redis stopped in {time.monotonic() - t_down:.0f}s", file=sys.stderr)


def report(args, argv: list[str], soak, prep) -> int:
    """The analysis, its files, the docs copy and the README block; exit 0 when nothing was lost and the service drained."""
    from evaluation.markdown import replace_block
    from evaluation.soak.analysis import analyse
    from evaluation.soak.outputs import report_markdown, write_outputs

    summary = analyse(soak, growth_from_s=args.growth_from_s)
    summary["run"]["model"] = args.model
    summary["run"]["command"] = "specray soak " + " ".join(argv)
    paths = write_outputs(soak, summary, prep.out)
    print(report_markdown(summary, plot_name=None))
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    if prep.docs is not None:
        prep.docs.mkdir(parents=True, exist_ok=True)
        for key in ("report", "plot", "summary", "requests", "processes", "faults"):
            shutil.copy(paths[key], prep.docs / paths[key].name)
    if args.readme:
        body = results_block(summary, summary["run"]["command"])
        if prep.docs is not None:
            plot = os.path.relpath(prep.docs / "soak.png", Path(args.readme).resolve().parent)
            body += f"\n\n![latency, RSS and fds over the soak]({plot})"
        replace_block(Path(args.readme), "soak-results", body)
    if args.json:
        print(json.dumps(summary, default=str))
    checks = summary["checks"]
    return 0 if checks["violations"] == 0 and checks["drained"] else 1


def main_with_args(args, argv: list[str]) -> int:
    prep = prepare(args)
    try:
        soak = run_soak(args, prep)
    except RuntimeError as e:  # the cluster, redis or the app did not come up
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 1
    return report(args, argv, soak, prep)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_cli(build_parser(), lambda args: main_with_args(args, argv), argv)


if __name__ == "__main__":
    sys.exit(main())
