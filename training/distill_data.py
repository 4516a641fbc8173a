"""Self-distillation data as a cluster job: the target answers the prompt corpus with the batched engine.

The corpus (``training.corpus``) comes in three phases, each the input of the next: the model writes questions,
articles and German passages (phase 1); first turns from templates and that material (phase 2); second turns
after the first answers (phase 3). Each phase is cut into shards of ``shard_size`` prompts; Ray workers (one
engine each: a ``SpecDecoder`` of method ``ar`` whose continuous batch fills ``rows`` rows) take shards until
none is left. The driver writes each finished shard once::

    OUT/phase-1/shard-00000.parquet ...   id, kind, source, phase, turn, split, prompt_ids, answer_ids,
    OUT/phase-2/...                        finish_reason, temperature, answer_text
    OUT/phase-3/...
    OUT/manifest.json                      the spec, and per shard: prompts, tokens, seconds, worker, node, attempts

A rerun with the same spec resumes: shards already on disk are not run again, nothing is written twice. A worker
that dies (killed, its node lost) loses only its shard in flight, which another worker runs again. Token ids are
int32 lists (small: a million tokens is a few MB), so the data is committed and training reproduces without
generating again; hidden states are never stored (training computes them at prefill speed).

>>> spec = DistillSpec(model="m", per_kind=1)
>>> DistillSpec.from_dict(spec.to_dict()) == spec
True
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from decoding.errors import ConfigError
from training import corpus

PHASES = (1, 2, 3)
COLUMNS = (
    "id",
    "kind",
    "source",
    "phase",
    "turn",
    "split",
    "prompt_ids",
    "answer_ids",
    "finish_reason",
    "temperature",
    "answer_text",
)


@dataclass(frozen=True)
class DistillSpec:
    """What the data set is: the target, the corpus sizes, lengths and sampling. Part of the manifest; a resumed
    run must have the same spec (a different one is refused, naming the first differing field)."""

    model: str = "smollm2-135m"
    dtype: str = "bfloat16"
    quant: str = "auto"
    seed: int = 0
    per_kind: int = 400  # template / document prompts per kind (phase 2)
    questions: int = 600  # phase 1: questions the model writes
    articles: int = 300  # phase 1: articles (documents for summaries, extraction, RAG)
    german: int = 150  # phase 1: German passages to translate
    second_fraction: float = 0.5  # multi-turn first turns that get a second turn
    max_new_tokens: dict = field(default_factory=lambda: {"1": 160, "2": 256, "3": 192})
    sample_fraction: float = 0.15  # prompts answered by sampling (the rest greedy)
    temperature: float = 0.8
    shard_size: int = 32
    rows: int = 16  # rows of each worker's continuous batch

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DistillSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(unknown[0], f"not a field of the distillation spec; fields: {', '.join(sorted(known))}")
        return cls(**data)

    def check(self) -> None:
        for name in ("per_kind", "questions", "articles", "german"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("shard_size", "rows"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.sample_fraction <= 1 or not 0 <= self.second_fraction <= 1:
            raise ConfigError("sample_fraction", "sample_fraction and second_fraction must be in [0, 1]")
        if self.temperature <= 0:
            raise ConfigError("temperature", f"must be > 0 (the sampled share), got {self.temperature}")
        for phase in PHASES:
            if int(self.max_new_tokens.get(str(phase), 0)) < 1:
                raise ConfigError("max_new_tokens", f"needs a length >= 1 for phase {phase}, got {self.max_new_tokens}")


def _unit(text: str) -> float:
    """A stable number in [0, 1) from a string (which prompts are sampled, and their seeds)."""
    return int(hashlib.sha1(text.encode()).hexdigest()[:8], 16) / 0x100000000


# ---- the prompts of each phase (deterministic from the spec and the earlier phases' shards) -------------------------


def phase_prompts(spec: DistillSpec, phase: int, out: Path, spec_bench_turns: list[str] | None = None) -> list[dict]:
    """The prompts of ``phase``; phases 2 and 3 read the answers of the phase before from ``out``.

    Prompts sharing a run of 8 words with a Spec-Bench turn are dropped (``spec_bench_turns``).
    """
    if phase == 1:
        prompts = corpus.seed_prompts(spec.seed, spec.questions, spec.articles, spec.german)
    elif phase == 2:
        material = corpus.material_from_answers(read_rows(out, phase=1))
        prompts = corpus.first_turn_prompts(spec.seed, spec.per_kind, material)
    elif phase == 3:
        first = [r for r in read_rows(out, phase=2) if r["finish_reason"] in ("stop", "length")]
        by_id = {p["id"]: p for p in phase_prompts(spec, 2, out, spec_bench_turns)}
        rows = [{**by_id[r["id"]], "answer_text": r["answer_text"]} for r in first if r["id"] in by_id]
        prompts = corpus.second_turn_prompts(rows, spec.seed, spec.second_fraction)
    else:
        raise ValueError(f"no phase {phase}")
    if spec_bench_turns:
        dropped = {p["id"] for p in corpus.spec_bench_overlap(prompts, spec_bench_turns)}
        prompts = [p for p in prompts if p["id"] not in dropped]
    return prompts


def shards_of(prompts: list[dict], size: int) -> list[list[dict]]:
    """Shards of ``size`` prompts, kinds interleaved so that every shard (and any prefix of the data) covers them all.

    >>> ps = [{"id": f"{k}-{i}", "kind": k} for k in "ab" for i in range(3)]
    >>> [[p["id"] for p in s] for s in shards_of(ps, 4)]
    [['a-0', 'b-0', 'a-1', 'b-1'], ['a-2', 'b-2']]
    """
    by_kind: dict[str, deque] = {}
    for p in sorted(prompts, key=lambda p: p["id"]):
        by_kind.setdefault(p["kind"], deque()).append(p)
    order = []
    while by_kind:
        for kind in list(by_kind):
            order.append(by_kind[kind].popleft())
            if not by_kind[kind]:
                del by_kind[kind]
    return [order[i : i + size] for i in range(0, len(order), size)]


# ---- one shard, in process ------------------------------------------------------------------------------------------


def run_shard(decoder, prompts: list[dict], phase: int, spec: DistillSpec, on_tokens: Callable[[int], None] | None = None) -> list[dict]:
    """Answer ``prompts`` with ``decoder`` (an ``ar`` SpecDecoder) in one continuous batch; one row per prompt.

    Greedy, except the ``sample_fraction`` of prompts picked by a hash of their id, which sample at
    ``temperature`` with a seed from the id. A prompt too long for the context gets ``finish_reason`` ``skipped``.
    """
    from decoding.loop.batch import generate_many

    max_new = int(spec.max_new_tokens[str(phase)])
    context = decoder.loaded.max_context
    sampled = decoder.fork(temperature=spec.temperature)
    seqs, rows = [], []
    for p in prompts:
        ids = decoder.encode(p["messages"])
        temperature = spec.temperature if _unit("sample:" + p["id"]) < spec.sample_fraction else 0.0
        row = {k: p[k] for k in ("id", "kind", "source", "phase", "split")}
        row.update(turn=sum(m["role"] == "user" for m in p["messages"]), prompt_ids=ids[0].tolist(), temperature=temperature)
        rows.append(row)
        if ids.shape[1] + max_new > context:
            row.update(answer_ids=[], finish_reason="skipped", answer_text="")
            continue
        dec = sampled if temperature > 0 else decoder
        seed = int(_unit("seed:" + p["id"]) * 2**31)
        seqs.append((row, dec.sequence(ids, max_new, seed=seed, on_step=_counter(on_tokens))))
    if seqs:
        generate_many(decoder.target, [s for _, s in seqs], max_rows=spec.rows)
    for row, seq in seqs:
        gen = seq.result()
        row.update(answer_ids=list(gen.token_ids), finish_reason=gen.finish_reason, answer_text=decoder.decode(gen.token_ids))
    return rows


def _counter(on_tokens):
    if on_tokens is None:
        return None

    def step(tokens: list[int]) -> None:
        on_tokens(len(tokens))

    return step


# ---- files ------------------------------------------------------------------------------------------------------------


def shard_path(out: Path, phase: int, index: int) -> Path:
    return Path(out) / f"phase-{phase}" / f"shard-{index:05d}.parquet"


def write_shard(path: Path, rows: list[dict]) -> None:
    """Write a shard atomically (a half-written shard is never read, and never counts as done)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("id", pa.string()),
            ("kind", pa.string()),
            ("source", pa.string()),
            ("phase", pa.int8()),
            ("turn", pa.int8()),
            ("split", pa.string()),
            ("prompt_ids", pa.list_(pa.int32())),
            ("answer_ids", pa.list_(pa.int32())),
            ("finish_reason", pa.string()),
            ("temperature", pa.float32()),
            ("answer_text", pa.string()),
        ]
    )
    table = pa.table({c: [r[c] for r in rows] for c in COLUMNS}, schema=schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    pq.write_table(table, tmp, compression="zstd", compression_level=19)  # token ids: about 1 byte each
    os.replace(tmp, path)


def read_rows(out: Path, phase: int | None = None, split: str | None = None, columns: list[str] | None = None) -> list[dict]:
    """The rows of every shard on disk (of one phase, one split), in shard order."""
    import pyarrow.parquet as pq

    phases = [phase] if phase is not None else list(PHASES)
    rows = []
    for ph in phases:
        for path in sorted((Path(out) / f"phase-{ph}").glob("shard-*.parquet")):
            table = pq.read_table(path, columns=columns)
            rows += [r for r in table.to_pylist() if split is None or r.get("split", split) == split]
    return rows


def read_manifest(out: Path) -> dict | None:
    try:
        return json.loads((Path(out) / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _write_manifest(out: Path, manifest: dict) -> None:
    path = Path(out) / "manifest.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, path)


# ---- the cluster job --------------------------------------------------------------------------------------------------


class DistillWorker:
    """One engine: the target loaded once, answering shards (a Ray actor in :func:`distill`)."""

    def __init__(self, spec: dict, threads: int, device: str = "auto"):
        import torch

        from decoding.config import SpecConfig
        from decoding.in_process import SpecDecoder

        self.spec = DistillSpec.from_dict(spec)
        cfg = SpecConfig(model=self.spec.model, dtype=self.spec.dtype, quant=self.spec.quant, threads=threads, device=device)
        self.decoder = SpecDecoder(cfg)
        device = self.decoder.target.device
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        self.tokens = 0
        self.current: str | None = None

    def where(self) -> dict:
        try:
            import ray

            node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        except ImportError:  # in process on a machine without Ray (``distill(..., local=True)``)
            node = "local"
        return {"node": node, "pid": os.getpid(), "device": self.device_name}

    def run(self, name: str, prompts: list[dict], phase: int) -> tuple[list[dict], dict]:
        self.current = name
        start, before = time.perf_counter(), self.tokens
        rows = run_shard(self.decoder, prompts, phase, self.spec, self._add)
        seconds = time.perf_counter() - start
        self.current = None
        return rows, {"tokens": self.tokens - before, "seconds": round(seconds, 2), **self.where()}

    def _add(self, n: int) -> None:
        self.tokens += n

    def progress(self) -> int:
        return self.tokens


def _check_resume(out: Path, spec: DistillSpec) -> dict:
    manifest = read_manifest(out)
    if manifest is None:
        return {"spec": spec.to_dict(), "shards": {}, "phases": {}}
    before = manifest.get("spec", {})
    for key, value in spec.to_dict().items():
        if before.get(key) != value:
            raise ConfigError(key, f"{out} holds data of another spec ({key}={before.get(key)!r}, asked {value!r}); use another --out")
    return manifest


def distill(
    spec: DistillSpec,
    out: Path,
    workers: int | None = None,
    threads: int = 1,
    phases: tuple[int, ...] = PHASES,
    spec_bench_turns: list[str] | None = None,
    progress: bool = True,
    max_attempts: int = 3,
    on_dispatch: Callable[[str, object], None] | None = None,
    device: str = "auto",
    local: bool = False,
    deadline: float | None = None,
) -> dict:
    """Run (or resume) the phases over Ray workers; returns the manifest. Ray must be connected (``cluster.runtime``).

    ``workers`` engines (default: the cluster's CPUs / ``threads``) of ``threads`` torch threads each, spread over
    the nodes. ``on_dispatch(shard, actor)`` is called as each shard is handed to a worker (tests kill workers there).
    ``local``: no Ray (a GPU machine without a cluster): one engine in this process, or with ``workers`` > 1 that
    many engine processes on the one device (a small model's batched decoding is bound by the host's work per
    step, which processes spread over the cores while they share the GPU); ``deadline`` (``time.time()``) then stops
    dispatching shards, every finished shard kept for the next run to resume from.
    """
    spec.check()
    if spec_bench_turns is None:  # the evaluation set never enters the data
        from evaluation.workloads import load_prompts

        spec_bench_turns = [turn for p in load_prompts() for turn in p.turns]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = _check_resume(out, spec)
    if local:
        pool = _LocalPool(spec, threads, device, workers or 1)
        try:
            for phase in phases:
                if not _run_phase_here(spec, phase, out, spec_bench_turns, manifest, pool, progress, deadline):
                    break
        finally:
            pool.close()
        return manifest
    import ray

    if workers is None:
        workers = max(1, int(ray.cluster_resources().get("CPU", 1)) // threads)
    worker_cls = ray.remote(num_cpus=threads, max_restarts=0, max_concurrency=2)(DistillWorker)
    pool: list = []

    def new_actor():
        return worker_cls.options(scheduling_strategy="SPREAD").remote(spec.to_dict(), threads, device)

    try:
        for phase in phases:
            _run_phase(spec, phase, out, spec_bench_turns, manifest, pool, new_actor, workers, progress, max_attempts, on_dispatch)
    finally:
        for actor in pool:
            ray.kill(actor)
    return manifest


def _run_phase(
    spec,
    phase: int,
    out: Path,
    spec_bench_turns,
    manifest: dict,
    pool: list,
    new_actor,
    workers: int,
    progress: bool,
    max_attempts: int,
    on_dispatch,
) -> None:
    """One phase's shards over the worker pool (``pool``, grown with ``new_actor`` up to ``workers``): each finished shard
    written once and entered in the manifest; a lost worker is replaced and its shard run again (``max_attempts``)."""
    import ray

    prompts = phase_prompts(spec, phase, out, spec_bench_turns)
    shards = shards_of(prompts, spec.shard_size)
    todo = deque(i for i in range(len(shards)) if not shard_path(out, phase, i).exists())
    t0 = time.time()
    done_prompts = sum(len(shards[i]) for i in range(len(shards)) if i not in todo)
    bar = _Bar(len(prompts), done_prompts, f"phase {phase}", progress)
    while len(pool) < min(workers, len(todo)):
        pool.append(new_actor())
    idle, running, attempts = list(pool), {}, {}
    base_tokens: dict = {}
    while todo or running:
        while idle and todo:
            index = todo.popleft()
            actor = idle.pop()
            name = f"{phase}-{index:05d}"
            attempts[name] = attempts.get(name, 0) + 1
            running[actor.run.remote(name, shards[index], phase)] = (index, actor)
            if on_dispatch is not None:
                on_dispatch(name, actor)
        ready, _ = ray.wait(list(running), num_returns=1, timeout=2.0)
        for ref in ready:
            index, actor = running.pop(ref)
            name = f"{phase}-{index:05d}"
            try:
                rows, stats = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                if attempts[name] >= max_attempts:
                    raise RuntimeError(f"shard {name} failed {attempts[name]} times; last: {str(e).splitlines()[0]}") from None
                pool.remove(actor)
                replacement = new_actor()
                pool.append(replacement)
                idle.append(replacement)
                todo.appendleft(index)
                bar.note(f"worker lost on shard {name}: redone")
                continue
            path = shard_path(out, phase, index)
            if not path.exists():  # written once
                write_shard(path, rows)
            manifest["shards"][name] = {"prompts": len(rows), "attempts": attempts[name], **stats}
            _write_manifest(out, manifest)
            idle.append(actor)
            bar.advance(len(rows))
        bar.tokens(_poll(pool, base_tokens), time.time() - t0)
    bar.close()
    _summarise_phase(manifest, phase, out)
    _write_manifest(out, manifest)


def _run_phase_here(spec, phase: int, out: Path, spec_bench_turns, manifest: dict, pool: _LocalPool, progress: bool, deadline) -> bool:
    """One phase's shards on the local engines (``pool``), in order, each written as it finishes; False when
    ``deadline`` stopped the dispatch before the phase's end (the shards already running still finish)."""
    prompts = phase_prompts(spec, phase, out, spec_bench_turns)
    shards = shards_of(prompts, spec.shard_size)
    todo = deque(i for i in range(len(shards)) if not shard_path(out, phase, i).exists())
    bar = _Bar(len(prompts), len(prompts) - sum(len(shards[i]) for i in todo), f"phase {phase}", progress)
    t0, tokens, stopped = time.time(), 0, False
    while todo or pool.running:
        while todo and pool.idle and not stopped:
            if deadline is not None and time.time() > deadline:
                stopped = True
                print(f"distill: stopped by the time limit before shard {phase}-{todo[0]:05d}; rerun to resume", file=sys.stderr)
                break
            index = todo.popleft()
            pool.submit(f"{phase}-{index:05d}", shards[index], phase)
        if not pool.running:
            break
        name, rows, stats = pool.next_done()
        write_shard(shard_path(out, phase, int(name.split("-")[1])), rows)
        manifest["shards"][name] = {"prompts": len(rows), "attempts": 1, **stats}
        _write_manifest(out, manifest)
        tokens += stats["tokens"]
        bar.advance(len(rows))
        bar.tokens(tokens, time.time() - t0)
    bar.close()
    if todo:
        return False
    _summarise_phase(manifest, phase, out)
    _write_manifest(out, manifest)
    return True


class _LocalPool:
    """The engines of a run without Ray: one :class:`DistillWorker` in this process, or ``workers`` processes (spawned:
    CUDA does not survive a fork), each with its own worker, running one shard at a time."""

    def __init__(self, spec: DistillSpec, threads: int, device: str, workers: int):
        self.workers, self.running = workers, {}
        self.done: deque = deque()
        if workers == 1:
            self.here, self.executor = DistillWorker(spec.to_dict(), threads, device), None
        else:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self.here = None
            self.executor = ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_local,
                initargs=(spec.to_dict(), threads, device),
            )

    @property
    def idle(self) -> bool:
        return len(self.running) < self.workers

    def submit(self, name: str, prompts: list[dict], phase: int) -> None:
        if self.executor is None:  # in this process: run it now, hand it out at the next ``next_done``
            self.running[name] = None
            self.done.append((name, *self.here.run(name, prompts, phase)))
            return
        self.running[name] = self.executor.submit(_run_local, name, prompts, phase)

    def next_done(self) -> tuple[str, list[dict], dict]:
        """The first shard to finish: (name, rows, stats)."""
        if not self.done:
            from concurrent.futures import FIRST_COMPLETED, wait

            finished, _ = wait([f for f in self.running.values() if f is not None], return_when=FIRST_COMPLETED)
            for name, future in list(self.running.items()):
                if future in finished:
                    self.done.append((name, *future.result()))
        name, rows, stats = self.done.popleft()
        del self.running[name]
        return name, rows, stats

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)


_LOCAL_WORKER: DistillWorker | None = None


def _start_local(spec: dict, threads: int, device: str) -> None:
    global _LOCAL_WORKER
    _LOCAL_WORKER = DistillWorker(spec, threads, device)


def _run_local(name: str, prompts: list[dict], phase: int) -> tuple[list[dict], dict]:
    return _LOCAL_WORKER.run(name, prompts, phase)


def _poll(pool, base: dict) -> int:
    """Tokens generated by the live workers since they were first polled in this phase."""
    import ray

    total = 0
    for actor in pool:
        try:
            now = ray.get(actor.progress.remote(), timeout=5)
        except Exception:  # a dying worker: its tokens are counted again when its shard is redone
            continue
        key = id(actor)  # the pool keeps the same handle objects
        base.setdefault(key, now)
        total += now - base[key]
    return total


def _summarise_phase(manifest: dict, phase: int, out: Path) -> None:
    rows = read_rows(out, phase=phase, columns=["prompt_ids", "answer_ids", "split", "finish_reason"])
    shards = {k: v for k, v in manifest["shards"].items() if k.startswith(f"{phase}-")}
    workers: dict = {}
    for s in shards.values():
        w = workers.setdefault(f"{s.get('node', '?')[:8]}:{s.get('pid', '?')}", {"tokens": 0, "seconds": 0.0, "shards": 0})
        w["tokens"] += s.get("tokens", 0)
        w["seconds"] += s.get("seconds", 0.0)
        w["shards"] += 1
    for w in workers.values():
        w["tokens_per_s"] = round(w["tokens"] / w["seconds"], 1) if w["seconds"] else None
    manifest["phases"][str(phase)] = {
        "sequences": len(rows),
        "answer_tokens": sum(len(r["answer_ids"]) for r in rows),
        "prompt_tokens": sum(len(r["prompt_ids"]) for r in rows),
        "heldout": sum(r["split"] == "heldout" for r in rows),
        "skipped": sum(r["finish_reason"] == "skipped" for r in rows),
        "shards": len(shards),
        "nodes": len({s.get("node") for s in shards.values()}),
        "workers": workers,
    }


class _Bar:
    """tqdm over prompts with tokens/s in the postfix (to stderr), or nothing."""

    def __init__(self, total: int, initial: int, desc: str, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="prompt", file=sys.stderr, dynamic_ncols=True)

    def advance(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def tokens(self, tokens: int, seconds: float) -> None:
        if self.bar is not None and seconds > 0:
            self.bar.set_postfix(tokens=tokens, tok_s=f"{tokens / seconds:.0f}", refresh=False)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
