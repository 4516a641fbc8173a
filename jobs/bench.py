"""`specray bench` / `python -m jobs.bench`: every method on a Spec-Bench prompt set, side by side.

    specray bench --methods ar,sps,ngram,early-exit --categories summarization,rag --limit 2 \\
        --max-new-tokens 64 --dtype bfloat16 --peer hf --out bench-out

For each prompt every method runs back to back, in an order rotated per prompt,
so machine noise does not favour one side; ``ar`` (always included) is the
denominator of every speedup. After each prompt its per-step traces and
per-generation records are appended to Parquet datasets::

    OUT/traces/run=<id>/method=<m>/part-<n>.parquet       one row per decoding step
    OUT/generations/run=<id>/method=<m>/part-<n>.parquet  one row per generation

The summary (``OUT/summary.json`` and the printed table) and the plots
(``OUT/plots/*.png``) are computed from those files, so a run stopped with
Ctrl-C still reports what finished. ``--peer hf`` adds Hugging Face
``generate()`` on the same model object (plain, prompt lookup, a shallow
assistant made of the target's first layers, early exit). ``--on-cluster`` fans
the prompts out over Ray actors, one model per actor.

Bad input (missing prompt file, unknown category, malformed JSONL line) prints
one line naming the file and line and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path

from decoding.config import METHODS, SpecConfig
from evaluation import benchmark as bm
from evaluation.workloads import DEFAULT_PROMPTS, Prompt, WorkloadError, load_prompts, long_context_prompt, select
from jobs.common import Parser, add_config_args, config_from_args, fail, output_dir, parse_ints, run_cli

SHORT_CONTEXT = 16  # the reference context of a decoding forward whose time is (almost) all weights
PEER_MODES = (
    "hf-plain",
    "hf-prompt-lookup",
    "hf-prompt-lookup-default",
    "hf-assistant",
    "hf-assistant-default",
    "hf-early-exit",
    "hf-early-exit-default",
)
# Hugging Face's own settings for its assisted modes (the prompt-lookup guide's prompt_lookup_num_tokens=10, the
# generation config's num_assistant_tokens=20, constant schedule, assistant_confidence_threshold=0.4)
HF_PROMPT_LOOKUP_DEFAULT = {"prompt_lookup_num_tokens": 10}
HF_ASSIST_DEFAULT = {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.4}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or Parser(prog="specray bench", description="Benchmark speculative methods against AR (and Hugging Face generate).")
    p.add_argument(
        "--methods",
        default=",".join(m for m in METHODS if m != "trained"),
        help=f"comma list from {', '.join(METHODS)} or trained:NAME (a trained drafter); ar is always added (default: all untrained)",
    )
    add_config_args(p, method=False)
    p.add_argument("--prompts", help=f"Spec-Bench style JSONL (question_id, category, turns); default {DEFAULT_PROMPTS}")
    p.add_argument("--categories", help="comma list of categories to run (default: all in the file)")
    p.add_argument("--limit", type=int, help="at most N prompts per category (with --context-tokens: prompts per length, default 1)")
    p.add_argument(
        "--context-tokens",
        help="comma list of prompt lengths, e.g. 2048,4096,8192: long prompts built from the summarization and RAG prompts "
        "(documents concatenated, then a question), capped at the model's context minus --max-new-tokens",
    )
    p.add_argument("--repeats", type=int, default=1, help="run the whole prompt set R times and report the spread")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up generations per method before measuring (default 1)")
    p.add_argument("--peer", choices=["hf"], help="also run Hugging Face generate() (plain and assisted) on the same model")
    p.add_argument("--on-cluster", action="store_true", help="fan prompts out over Ray actors (RAY_ADDRESS, else a local Ray)")
    p.add_argument("--workers", type=int, help="with --on-cluster: number of actors (default: the cluster's CPUs)")
    p.add_argument("--out", default="bench-out", help="output directory (default ./bench-out)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    return p


# ---- the measurement: one prompt, every method ----------------------------------
class Runner:
    """The specray decoders (``evaluation.runner.PromptRunner``, one per method, sharing one loaded model) plus the
    HF peer; runs a prompt through all of them in an order rotated per prompt."""

    def __init__(self, cfg: SpecConfig, methods: list[str], peer: str | None = None, worker: str = "local"):
        from evaluation.runner import PromptRunner  # heavy imports after the cheap checks

        self.cfg, self.worker = cfg, worker
        self.specray = PromptRunner({m: cfg.for_method(m) for m in methods}, worker=worker)
        self.decoders = self.specray.decoders
        self.ar = self.specray.ar
        self.configs = self.specray.configs
        self.chat = self.specray.chat
        self.peer = HFPeer(self.ar, cfg) if peer == "hf" else None
        self.names = list(methods) + (list(self.peer.modes) if self.peer else [])

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

    def run_prompt(self, prompt: Prompt, index: int, repeat: int = 0) -> tuple[list[dict], list[dict]]:
        ids = self.encode(prompt)
        results = {}
        for name in bm.method_order(self.names, index):
            if name in self.decoders:
                results[name] = self.specray.generate(name, ids)
            else:
                tokens, wall_s = self.peer.generate(name, ids, self.cfg.max_new_tokens)
                results[name] = ("peer", tokens, wall_s)
        return self.specray.rows(prompt, ids, results, self.names, repeat, describe_peer=self.peer.describe if self.peer else None)


class HFPeer:
    """Hugging Face ``generate()`` on the very model object specray uses, in its plain and assisted modes.

    Each assisted mode runs twice: with specray's knobs (draft length k, n-gram
    size, draft layers, exit layer; constant draft length, no confidence stop),
    so the two sides draft the same way, and as ``*-default`` with HF's own
    documented settings (``HF_PROMPT_LOOKUP_DEFAULT``, ``HF_ASSIST_DEFAULT``; the
    assistant and exit layer stay specray's, HF has no default for them). Every
    "over HF" figure divides by the best of these modes.
    """

    def __init__(self, decoder, cfg: SpecConfig):
        self.model = decoder.loaded.model
        self.cfg = cfg
        self.eos = decoder.loaded.eos_token_ids
        depth = len(decoder.target.layers)
        assist = {"num_assistant_tokens": cfg.k, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
        self.modes = {
            "hf-plain": {},
            "hf-prompt-lookup": {"prompt_lookup_num_tokens": cfg.k, "max_matching_ngram_size": cfg.ngram_max},
            "hf-prompt-lookup-default": dict(HF_PROMPT_LOOKUP_DEFAULT),
        }
        self.assistants = {}
        if cfg.draft_layers < depth:
            for mode, knobs in (("hf-assistant", assist), ("hf-assistant-default", HF_ASSIST_DEFAULT)):
                self.assistants[mode] = shallow_assistant(self.model, cfg.draft_layers)
                self.assistants[mode].generation_config.update(**knobs)
                self.modes[mode] = {"assistant_model": self.assistants[mode]}
        if cfg.exit_layer < depth:
            self.modes["hf-early-exit"] = {"assistant_early_exit": cfg.exit_layer, "_assist": assist}
            self.modes["hf-early-exit-default"] = {"assistant_early_exit": cfg.exit_layer, "_assist": dict(HF_ASSIST_DEFAULT)}

    @property
    def assistant(self):  # the assistant at specray's knobs
        return self.assistants.get("hf-assistant")

    def describe(self, mode: str) -> str:
        kw = {k: v for k, v in self.modes[mode].items() if k != "assistant_model"}
        if mode in self.assistants:
            kw["assistant_model"] = f"first {self.cfg.draft_layers} layers of the target"
            kw["_assist"] = {k: getattr(self.assistants[mode].generation_config, k) for k in HF_ASSIST_DEFAULT}
        return json.dumps(kw, sort_keys=True, default=str)

    def probe(self, ids, max_new_tokens: int) -> dict:
        skipped = {}
        for mode in list(self.modes):
            try:
                self.generate(mode, ids, max_new_tokens)
            except Exception as e:  # an assisted mode this model or transformers version does not support
                skipped[mode] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                del self.modes[mode]
        return skipped

    def generate(self, mode: str, ids, max_new_tokens: int) -> tuple[list[int], float]:
        import torch

        kw = dict(self.modes[mode])
        assist = kw.pop("_assist", None)
        sampling = (
            {"do_sample": True, "temperature": self.cfg.temperature, "top_p": self.cfg.top_p, "top_k": self.cfg.top_k or None}
            if self.cfg.temperature > 0
            else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        )
        gen_cfg = self.model.generation_config
        saved = {k: getattr(gen_cfg, k, None) for k in (assist or {})}
        if assist:  # early exit drafts with the model itself, so the knobs live on its own generation config
            gen_cfg.update(**assist)
        ids = ids.to(self.model.device)  # the model's device (SpecConfig.device); prompts are encoded on the CPU
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    eos_token_id=self.eos,
                    pad_token_id=self.eos[0] if self.eos else None,
                    **sampling,
                    **kw,
                )
                tokens = out[0, ids.shape[1] :].tolist()  # reading the tokens waits for a GPU, so the time is the generation's
            wall = time.perf_counter() - t0
        finally:
            for k, v in saved.items():
                setattr(gen_cfg, k, v)
        return tokens, wall


def shallow_assistant(model, num_layers: int):
    """A causal LM made of the target's first ``num_layers`` layers, final norm and head; weights are shared, not copied."""
    import torch

    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:num_layers]
    with torch.device("meta"):
        asst = type(model)(cfg)
    base, src = asst.model, model.model
    base.embed_tokens, base.norm, base.rotary_emb = src.embed_tokens, src.norm, src.rotary_emb
    base.layers = torch.nn.ModuleList(list(src.layers[:num_layers]))
    asst.lm_head = model.lm_head
    asst.generation_config = copy.deepcopy(model.generation_config)
    asst.eval()
    left = [n for n, t in list(asst.named_parameters()) + list(asst.named_buffers()) if t.is_meta]
    if left:
        raise TypeError(f"cannot build a shallow assistant for {type(model).__name__}: unshared tensors {left[:3]}")
    return asst


# ---- Parquet -------------------------------------------------------------------------
def _schemas():
    import pyarrow as pa

    s, i, f, b = pa.string(), pa.int32(), pa.float64(), pa.bool_()
    gen = pa.schema(
        [
            ("kind", s),
            ("prompt_id", s),
            ("category", s),
            ("repeat", i),
            ("worker", s),
            ("new_tokens", i),
            ("wall_s", f),
            ("prefill_s", f),
            ("draft_s", f),
            ("verify_s", f),
            ("target_forwards", i),
            ("steps", i),
            ("identical", b),
            ("first_diff", i),
            ("margin", f),
            ("suspicious", b),
            ("finish_reason", s),
            ("config", s),
            ("peak_rss_mb", f),
            ("levels", s),
        ]
    )
    step = pa.schema(
        [
            ("prompt_id", s),
            ("category", s),
            ("repeat", i),
            ("worker", s),
            ("step", i),
            ("drafted", i),
            ("accepted", i),
            ("draft_s", f),
            ("verify_s", f),
            ("config", s),
        ]
    )
    return {"generations": gen, "traces": step}


def _partitioning():
    import pyarrow as pa
    import pyarrow.dataset as ds

    return ds.partitioning(pa.schema([("run", pa.string()), ("method", pa.string())]), flavor="hive")


class TraceWriter:
    """Appends one Parquet part per (table, method) per flush: OUT/<table>/run=<id>/method=<m>/part-<n>.parquet."""

    def __init__(self, out: Path, run_id: str):
        self.out, self.run_id, self.part = Path(out), run_id, 0
        self.schemas = _schemas()

    def write(self, gen_rows: list[dict], step_rows: list[dict]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        for table, rows in (("generations", gen_rows), ("traces", step_rows)):
            schema = self.schemas[table]
            for method in dict.fromkeys(r["method"] for r in rows):
                mine = [r for r in rows if r["method"] == method]
                d = self.out / table / f"run={self.run_id}" / f"method={method}"
                d.mkdir(parents=True, exist_ok=True)
                t = pa.Table.from_pylist([{k: r[k] for k in schema.names} for r in mine], schema=schema)
                tmp = d / f".part-{self.part:05d}.parquet.tmp"
                pq.write_table(t, tmp)
                os.replace(tmp, d / f"part-{self.part:05d}.parquet")  # a reader never sees half a file
        self.part += 1


def read_run(out: Path, run_id: str, table: str) -> list[dict]:
    """Rows of one run from OUT/<table> (hive-partitioned by run and method), as dicts with a ``method`` key."""
    import pyarrow as pa
    import pyarrow.dataset as ds

    root = Path(out) / table / f"run={run_id}"
    if not root.is_dir():
        return []
    schema = pa.unify_schemas([_schemas()[table], pa.schema([("run", pa.string()), ("method", pa.string())])])
    dataset = ds.dataset(Path(out) / table, format="parquet", partitioning=_partitioning(), schema=schema)
    rows = dataset.to_table(filter=ds.field("run") == run_id).to_pylist()
    for r in rows:
        del r["run"]
    rows.sort(key=lambda r: (r["repeat"], r["prompt_id"], r["method"], r.get("step", 0)))
    return rows


# ---- plots (from the Parquet files) --------------------------------------------------------
def make_plots(out: Path, run_id: str, order=()) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gens, steps = read_run(out, run_id, "generations"), read_run(out, run_id, "traces")
    if not gens:
        return []
    s = bm.summarize_methods(gens, steps, order=order)
    plots = Path(out) / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    written = []

    cats = list(s["categories"]) + ["overall"]
    methods = [m for m in s["methods_order"] if m != s["baseline"]]
    fig, ax = plt.subplots(figsize=(min(16, 4 + 0.35 * len(cats) * max(1, len(methods))), 4.5))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        vals = [(s["categories"][c][m]["speedup"] if c != "overall" else s["methods"][m]["speedup"]) or 0.0 for c in cats]
        ax.bar([i + (j - (len(methods) - 1) / 2) * width for i in range(len(cats))], vals, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label=f"{s['baseline']} (1.0)")
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    ax.set_ylabel(f"speedup over {s['baseline']} (tokens/s ratio)")
    ax.set_title(f"speedup by category, run {run_id}")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = plots / "speedup_by_category.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for m, v in s["methods"].items():
        if v["per_position_acceptance"]:
            xs = range(1, len(v["per_position_acceptance"]) + 1)
            ax.plot(xs, v["per_position_acceptance"], marker="o", label=m)
    ax.set_xlabel("draft position i")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("P(draft i accepted | proposed)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"per-position acceptance, run {run_id}")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = plots / "acceptance_by_position.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


# ---- the report -----------------------------------------------------------------------------
def _f(x, fmt="{:.2f}", none="-"):
    return none if x is None else fmt.format(x)


def report_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    head = [
        "method",
        "prompts",
        "tok/s",
        "speedup",
        "per-prompt med [min, max]",
        "tau",
        "fwd/tok",
        "draft ms/step",
        "verify ms/step",
        "identical",
        "suspicious",
    ]
    rows = []
    for m, v in summary["methods"].items():
        q = v["speedup_per_prompt"]
        ident = v["identity"]
        rows.append(
            [
                m,
                str(v["prompts"]),
                _f(v["tokens_per_s"], "{:.1f}"),
                _f(v["speedup"]),
                f"{q['median']:.2f} [{q['min']:.2f}, {q['max']:.2f}]" if q else "-",
                _f(v["mean_accepted_tokens"]),
                _f(v["target_forwards_per_token"], "{:.3f}"),
                _f(v["draft_ms_per_step"], "{:.1f}"),
                _f(v["verify_ms_per_step"], "{:.1f}"),
                f"{ident['identical']}/{ident['compared']}" if ident and ident["compared"] else "-",
                str(ident["suspicious"]) if ident and ident["compared"] else "-",
            ]
        )
    return head, rows


def render(summary: dict, file=None) -> None:
    file = file or sys.stdout
    head, rows = report_rows(summary)
    methods = summary["methods_order"]
    cat_head = ["category"] + methods
    cat_rows = [[c] + [_f(v[m]["speedup"]) for m in methods] for c, v in summary["categories"].items()]
    over = summary.get("over_best_peer")
    ours = [m for m in methods if summary["methods"][m]["kind"] == "specray"]
    peer_head = ["category", "best HF"] + ours
    peer_rows = (
        [[c, v["best_peer"]] + [_f(v[m]) for m in ours] for c, v in {**over["categories"], "overall": over["overall"]}.items()]
        if over
        else []
    )
    worker_rows = (
        [[w] + [_f(v[m]["speedup"]) for m in methods] for w, v in summary["workers"].items()] if len(summary["workers"]) > 1 else []
    )
    title = (
        f"specray bench {summary['run_id']}: {summary['model']} {summary['dtype']}, {summary['threads']} threads, "
        f"max_new_tokens {summary['max_new_tokens']}, {summary['runs_complete']} prompt runs"
        + (" (INTERRUPTED)" if summary["interrupted"] else "")
    )
    notes = _notes(summary)
    ctx_head, ctx_rows = context_rows(summary)
    if file.isatty():
        from rich.console import Console
        from rich.table import Table

        console = Console(file=file)
        for t_title, h, rs in (
            (title, head, rows),
            ("speedup over ar by category", cat_head, cat_rows),
            ("tokens/s over HF's best mode by category", peer_head, peer_rows),
            ("speedup over ar by worker", ["worker"] + methods, worker_rows),
            ("long contexts", ctx_head, ctx_rows),
        ):
            if not rs:
                continue
            t = Table(title=t_title)
            for c in h:
                t.add_column(c, justify="left" if c in ("method", "category", "worker") else "right")
            for r in rs:
                t.add_row(*r)
            console.print(t)
        for n in notes:
            console.print(n, highlight=False)
        return
    print(title, file=file)
    for h, rs in ((head, rows), (cat_head, cat_rows), (peer_head, peer_rows), (["worker"] + methods, worker_rows), (ctx_head, ctx_rows)):
        if not rs:
            continue
        widths = [max(len(str(x)) for x in col) for col in zip(h, *rs, strict=False)]
        print("", file=file)
        for r in [h] + rs:
            print(
                "  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(r, widths, strict=False))),
                file=file,
            )
    print("", file=file)
    for n in notes:
        print(n, file=file)


def context_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """One row per (context length, method): speedups, acceptance at each level, memory, the attention share."""
    head = ["context", "method", "speedup", "decode speedup", "top acc", "middle acc", "peak RSS MB", "KV MB top/mid/bottom", "attn share"]
    rows = []
    for cat, c in summary.get("contexts", {}).items():
        for m, v in c["methods"].items():
            kv = v["kv_mb"]
            rows.append(
                [
                    cat,
                    m,
                    _f(v["speedup"]),
                    _f(v["decode_speedup"]),
                    _f(v["top_acceptance"]),
                    _f(v["middle_acceptance"]),
                    _f(v["peak_rss_mb"], "{:.0f}"),
                    "/".join(_f(kv.get(level), "{:.1f}") for level in ("top", "middle", "bottom")),
                    _f(c["attention_share"]),
                ]
            )
    return head, rows


def _notes(summary: dict) -> list[str]:
    notes = []
    p = summary.get("peer")
    if p:
        if p["ar_vs_plain"] is not None:
            notes.append(f"specray ar vs {p['plain_peer']}: {p['ar_vs_plain']:.2f}x")
        notes.append(f"best specray ({p['best_specray']}) vs best HF ({p['best_peer']}): {_f(p['best_vs_best'])}x")
    for mode, err in summary.get("peer_skipped", {}).items():
        notes.append(f"peer mode {mode} skipped: {err}")
    for m, v in summary["methods"].items():
        ident = v["identity"]
        if ident and ident["suspicious"]:
            worst = max((d for d in ident["divergences"] if d["suspicious"]), key=lambda d: d["margin"] or 0)
            notes.append(
                f"SUSPICIOUS: {m} diverged from ar on {ident['suspicious']} prompt(s) at margins above "
                f"{bm.margin_tolerance(summary['dtype'])} (worst: prompt {worst['prompt_id']} position {worst['first_diff']}, "
                f"margin {worst['margin']:.3f})"
            )
    if summary["runs_incomplete"]:
        notes.append(f"{summary['runs_incomplete']} prompt run(s) left out: not every method finished them")
    notes.append(f"traces: {summary['traces']}  summary: {summary['summary_path']}")
    return notes


# ---- driving a run ------------------------------------------------------------------------------
def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    for m in methods:
        if m.partition(":")[0] not in METHODS:
            fail(f"--methods: unknown method {m!r}; choose from {', '.join(METHODS)}")
        if ":" in m and ("/" in m or "\\" in m):  # the label names a Parquet partition directory
            fail(f"--methods: {m!r}: name an artifact under $SPECRAY_HOME/drafters, or use trained with --set drafter=PATH")
    if not methods:
        fail("--methods: no method given")
    return list(dict.fromkeys([bm.BASELINE] + methods))


def parse_context_tokens(text: str | None) -> list[int]:
    if not text:
        return []
    return list(dict.fromkeys(parse_ints(text, "--context-tokens", 64, " tokens")))


def load_workload(args, cfg: SpecConfig | None = None) -> list[Prompt]:
    source = args.prompts or DEFAULT_PROMPTS
    wanted = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    lengths = parse_context_tokens(getattr(args, "context_tokens", None))
    try:
        if lengths:
            if wanted:
                fail("--categories and --context-tokens exclude each other (long prompts are built from summarization and rag)")
            if args.limit is not None and args.limit < 1:
                fail(f"--limit must be >= 1, got {args.limit}")
            return long_prompts(load_prompts(source), lengths, args.limit or 1, cfg)
        return select(load_prompts(source), wanted, args.limit, source=str(source))
    except WorkloadError as e:
        fail(str(e))


def long_prompts(prompts: list[Prompt], lengths: list[int], per_length: int, cfg: SpecConfig) -> list[Prompt]:
    """``per_length`` long-context prompts per length, counted in the tokens the decoders will see (chat template included)."""
    from decoding.engine import SpecDecoder

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


def run_local(cfg, methods, peer, jobs, writer, new_progress, on_prompt_done, warmup, meta) -> None:
    runner = Runner(cfg, methods, peer)
    meta["chat_template"] = runner.chat
    meta["threads"] = runner.ar.threads
    meta["device"] = str(runner.ar.device)
    meta["peer_skipped"] = runner.warmup(jobs[0][1], warmup)  # also drops peer modes that fail on this model
    meta["peer_modes"] = {m: runner.peer.describe(m) for m in runner.peer.modes} if runner.peer else {}
    progress = new_progress()
    for index, (repeat, prompt) in enumerate(jobs):
        gens, steps = runner.run_prompt(prompt, index, repeat)
        writer.write(gens, steps)
        progress.update(1)
        if on_prompt_done:
            on_prompt_done(index, prompt)
    lengths = sorted({int(p.category.removeprefix("ctx-")) for _, p in jobs if p.category.startswith("ctx-")})
    if lengths:  # where a decoding step's time goes at each context length: weights (short context) vs attention
        meta["forward_s"] = {n: bm.decode_forward_seconds(runner.ar.target, n) for n in [SHORT_CONTEXT] + lengths}


class BenchWorker:
    """The Ray actor body: loads the model once, runs every method on the prompts it is handed."""

    def __init__(self, cfg_json: str, methods: list[str], peer: str | None, worker: str, warmup_prompt: Prompt, warmup: int):
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

    def run(self, prompt: Prompt, index: int, repeat: int):
        return self.runner.run_prompt(prompt, index, repeat)


def run_cluster(cfg, methods, peer, jobs, writer, new_progress, on_prompt_done, warmup, meta, workers=None) -> None:
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
        pending = {actors[i % n].run.remote(prompt, i, repeat): (i, prompt) for i, (repeat, prompt) in enumerate(jobs)}
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


def run_bench(args, on_prompt_done: Callable[[int, Prompt], None] | None = None) -> tuple[int, dict]:
    """Run the benchmark the parsed ``args`` describe; returns (exit code, summary)."""
    base = config_from_args(args)
    methods = parse_methods(args.methods)
    if args.repeats < 1:
        fail(f"--repeats must be >= 1, got {args.repeats}")
    if args.warmup < 0:
        fail(f"--warmup must be >= 0, got {args.warmup}")
    if args.workers is not None and args.workers < 1:
        fail(f"--workers must be >= 1, got {args.workers}")
    output_dir(args.out, "--out")  # before any work: a file or an unwritable place fails here
    prompts = load_workload(args, base)
    if not prompts:
        fail("no prompts selected")
    for m in methods:  # check every method's config before loading anything
        cfg = base.for_method(m)
        if cfg.method == "trained":
            from decoding.artifacts import read_description

            read_description(cfg.drafter)

    out = Path(args.out)
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(2)
    writer = TraceWriter(out, run_id)
    jobs = [(r, p) for r in range(args.repeats) for p in prompts]
    meta = {
        "run_id": run_id,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": base.model,
        "dtype": base.dtype,
        "max_new_tokens": base.max_new_tokens,
        "threads": base.threads,
        "config": base.to_dict(),
        "specray_methods": methods,
        "prompts_file": str(args.prompts or DEFAULT_PROMPTS),
        "categories_run": list(dict.fromkeys(p.category for p in prompts)),
        "prompts_selected": len(prompts),
        "repeats": args.repeats,
        "peer": args.peer,
        "peer_skipped": {},
        "on_cluster": bool(args.on_cluster),
        "host": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
    }
    from tqdm import tqdm

    interrupted = False
    bars = []

    def new_progress():  # started once the models are loaded, so a setup error stays one line
        bars.append(tqdm(total=len(jobs), desc="bench", unit="prompt", file=sys.stderr, dynamic_ncols=True))
        return bars[-1]

    try:
        runner = run_cluster if args.on_cluster else run_local
        extra = {"workers": args.workers} if args.on_cluster else {}
        runner(base, methods, args.peer, jobs, writer, new_progress, on_prompt_done, args.warmup, meta, **extra)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        for bar in bars:
            bar.close()

    summary = finish(out, run_id, meta, interrupted)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        render(summary)
    return (130 if interrupted else 0), summary


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


def main_with_args(args) -> int:
    code, _ = run_bench(args)
    return code


def main(argv=None) -> int:
    return run_cli(build_parser(), main_with_args, argv)


if __name__ == "__main__":
    sys.exit(main())
