"""Running a bench: every method (and the HF peer) on each prompt back to back, in process or fanned out over
Ray actors, traces appended per prompt, and the summary and plots computed from the traces."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path

from decoding.config import SpecConfig
from evaluation import bench_figures as bm
from evaluation.bench_report import make_plots
from evaluation.hf_peer import HFPeer
from evaluation.traces import read_run
from evaluation.workloads import Prompt, long_context_prompt

SHORT_CONTEXT = 16  # the reference context of a decoding forward whose time is (almost) all weights


class Runner:
    """The specray decoders (``evaluation.prompt_runner.PromptRunner``, one per method, sharing one loaded model) plus the
    HF peer; runs a prompt through all of them in an order rotated per prompt."""

    def __init__(self, cfg: SpecConfig, methods: list[str], peer: list[str] | None = None, worker: str = "local"):
        """``peer``: the HF modes to run beside specray's methods (None: no peer)."""
        from evaluation.prompt_runner import PromptRunner  # heavy imports after the cheap checks

        self.cfg, self.worker = cfg, worker
        self.specray = PromptRunner({m: cfg.for_method(m) for m in methods}, worker=worker)
        self.decoders = self.specray.decoders
        self.ar = self.specray.ar
        self.configs = self.specray.configs
        self.chat = self.specray.chat
        self.peer = HFPeer(self.ar, cfg, modes=peer) if peer else None
        self.names = list(methods) + (list(self.peer.modes) if self.peer else [])
        self.repeat = 0  # the repeat of the prompt set running now (each starts with drafters that saw none of it)

    def encode(self, prompt: Prompt):
        return self.specray.encode(prompt)

    def warmup(self, prompt: Prompt, n: int = 1) -> dict:
        """Untimed generations; returns the peer modes that failed (mode -> error), which are dropped."""
        self.specray.warmup(prompt, n)
        skipped = {}
        if self.peer:
            skipped = self.peer.probe(self.encode(prompt), min(8, self.cfg.max_new_tokens))
            self.names = [m for m in self.names if m not in skipped]
        return skipped

    def run_prompt(self, prompt: Prompt, index: int, repeat: int = 0, peers: bool = True) -> tuple[list[dict], list[dict]]:
        """Every method on the prompt; ``peers=False`` leaves the HF modes out (a repeat past ``--peer-repeats``)."""
        if repeat != self.repeat:
            self.specray.forget_text()
            self.repeat = repeat
        ids = self.encode(prompt)
        results = {}
        for name in bm.method_order(self.names, index):
            if name not in self.decoders and not peers:
                continue
            if name in self.decoders:
                results[name] = self.specray.generate(name, ids)
            else:
                tokens, wall_s = self.peer.generate(name, ids, self.cfg.max_new_tokens)
                results[name] = ("peer", tokens, wall_s)
        names = [n for n in self.names if n in results]
        return self.specray.rows(prompt, ids, results, names, repeat, describe_peer=self.peer.describe if self.peer else None)


def long_prompts(prompts: list[Prompt], lengths: list[int], per_length: int, cfg: SpecConfig) -> list[Prompt]:
    """``per_length`` long-context prompts per length, counted in the tokens the decoders will see (chat template included)."""
    from decoding.in_process import SpecDecoder

    enc = SpecDecoder(cfg.replace(method="ar"))  # the model load is cached: the runner reuses it
    chat = bool(getattr(enc.tokenizer, "chat_template", None))
    room = enc.loaded.max_context - cfg.max_new_tokens
    out = []
    for n in lengths:
        if n > room:
            print(f"note: --context-tokens {n} capped at {room} (context {enc.loaded.max_context} - max_new_tokens)", file=sys.stderr)
        for i in range(per_length):
            out.append(long_context_prompt(prompts, min(n, room), lambda text: enc.encode(text, chat=chat).shape[1], index=i))
    return out


def run_local(cfg, methods, peer, jobs, writer, new_progress, on_prompt_done, warmup, meta, peer_repeats=None) -> None:
    """Every (repeat, prompt) job in this process; the HF peer runs in the first ``peer_repeats`` repeats (None: all)."""
    runner = Runner(cfg, methods, peer)
    meta["chat_template"] = runner.chat
    meta["threads"] = runner.ar.threads
    meta["device"] = str(runner.ar.device)
    meta["peer_skipped"] = runner.warmup(jobs[0][1], warmup)  # also drops peer modes that fail on this model
    meta["peer_modes"] = {m: runner.peer.describe(m) for m in runner.peer.modes} if runner.peer else {}
    progress = new_progress()
    for index, (repeat, prompt) in enumerate(jobs):
        gens, steps = runner.run_prompt(prompt, index, repeat, peers=peer_repeats is None or repeat < peer_repeats)
        writer.write(gens, steps)
        progress.update(1)
        if on_prompt_done:
            on_prompt_done(index, prompt)
    lengths = sorted({int(p.category.removeprefix("ctx-")) for _, p in jobs if p.category.startswith("ctx-")})
    if lengths:  # where a decoding step's time goes at each context length: weights (short context) vs attention
        meta["forward_s"] = {n: bm.decode_forward_seconds(runner.ar.target, n) for n in [SHORT_CONTEXT] + lengths}


class BenchWorker:
    """The Ray actor body: loads the model once, runs every method on the prompts it is handed."""

    def __init__(self, cfg_json: str, methods: list[str], peer: list[str] | None, worker: str, warmup_prompt: Prompt, warmup: int):
        from actors.devices import placed

        self.runner = Runner(placed(SpecConfig.from_json(cfg_json)), methods, peer, worker=worker)
        self.skipped = self.runner.warmup(warmup_prompt, warmup)

    def info(self) -> dict:
        peer = self.runner.peer
        return {
            "threads": self.runner.ar.threads,
            "device": str(self.runner.ar.device),
            "chat_template": self.runner.chat,
            "peer_skipped": self.skipped,
            "peer_modes": {m: peer.describe(m) for m in peer.modes} if peer else {},
            "host": platform.node(),
            "pid": os.getpid(),
        }

    def run(self, prompt: Prompt, index: int, repeat: int, peers: bool = True):
        return self.runner.run_prompt(prompt, index, repeat, peers)


def run_cluster(cfg, methods, peer, jobs, writer, new_progress, on_prompt_done, warmup, meta, peer_repeats=None, workers=None) -> None:
    import ray  # only here: decoding/ never sees Ray

    from cluster.runtime import connect

    connect(None, log_to_driver=False)  # RAY_ADDRESS, else an embedded Ray on loopback
    n = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
    n = min(n, len(jobs))
    # GPUs in the cluster are shared out between the workers (unless the config says cpu); device=auto then finds them
    gpus = ray.cluster_resources().get("GPU", 0.0) if cfg.device != "cpu" else 0.0
    actor_cls = ray.remote(num_cpus=1, num_gpus=min(1.0, gpus / n) if gpus else 0)(BenchWorker)
    # one torch thread per actor unless the user asked otherwise: the actors share the machine's cores
    wcfg = cfg if cfg.threads else cfg.replace(threads=1)
    actors = [actor_cls.remote(wcfg.to_json(), methods, peer, f"worker-{i}", jobs[0][1], warmup) for i in range(n)]
    try:
        infos = ray.get([a.info.remote() for a in actors])
        meta["worker_info"] = {f"worker-{i}": info for i, info in enumerate(infos)}
        meta["threads"] = infos[0]["threads"]
        meta["chat_template"] = infos[0]["chat_template"]
        meta["peer_skipped"] = infos[0]["peer_skipped"]
        meta["peer_modes"] = infos[0]["peer_modes"]
        progress = new_progress()
        pending = {
            actors[i % n].run.remote(prompt, i, repeat, peer_repeats is None or repeat < peer_repeats): (i, prompt)
            for i, (repeat, prompt) in enumerate(jobs)
        }
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            index, prompt = pending.pop(done[0])
            gens, steps = ray.get(done[0])
            writer.write(gens, steps)
            progress.update(1)
            if on_prompt_done:
                on_prompt_done(index, prompt)
    finally:
        for a in actors:
            with contextlib.suppress(Exception):
                ray.kill(a)


def finish(out: Path, run_id: str, meta: dict, interrupted: bool) -> dict:
    """Summary and plots from the Parquet files of the run, written even after an interruption."""
    gens, steps = read_run(out, run_id, "generations"), read_run(out, run_id, "traces")
    summary = {**meta, "interrupted": interrupted, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    summary.update(bm.summarize_methods(gens, steps, order=meta["specray_methods"] + list(meta.get("peer_modes", {}))))
    summary["contexts"] = bm.context_summary(gens, steps, {int(n): t for n, t in meta.get("forward_s", {}).items()}, SHORT_CONTEXT)
    summary["traces"] = str(out / "traces" / f"run={run_id}")
    summary["generations"] = str(out / "generations" / f"run={run_id}")
    summary["summary_path"] = str(out / "summary.json")
    summary["plots"] = [str(p) for p in make_plots(out, run_id, summary["methods_order"])]
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    os.replace(tmp, out / "summary.json")
    return summary
