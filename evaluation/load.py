"""Many users at once: load through real HTTP against OpenAI endpoints, and the in-process figures beside it.

The harness of ``specray bench-serve`` (``jobs/bench_serve.py`` starts the server and hands this module its URL).
For each level of a sweep (C concurrent streams) and each served model it sends C streaming chat completions at
once with the ``openai`` client (Spec-Bench prompts taken a category at a time, so any C requests span the
categories; greedy), in back-to-back waves until the level has ``min_requests``; in Poisson mode it sends
``requests`` requests with exponential gaps of mean ``1/rate`` instead. Per (method, level): aggregate tokens/s,
requests/s, time to first token and inter-token latency p50/p99, goodput (tokens/s of the requests that met the
TTFT and ITL objectives) and the speedup over batched AR at the same level. Any OpenAI-compatible server (llama.cpp's,
vLLM, another specray) runs the same prompts as a peer, after specray and with the same client
(:func:`peer_base_url`, :func:`peer_model`). Beside it, in process: specray's
batched AR and transformers' ``generate()`` on a left-padded batch of the same prompts
(:func:`evaluation.hf_peer.padded_batch_tokens_per_s`), and each prompt's own greedy output (the reference a
stream is checked against).

Writes ``load.parquet`` (one row per method and level), ``requests.parquet`` (one row per request),
``summary.json`` and ``load.png`` (throughput and p99 latency against concurrency).
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from decoding.errors import ConfigError
from evaluation.markdown import markdown_table, replace_block


def percentile(values: list[float], q: float, digits: int | None = None) -> float | None:
    """The q-th percentile (0..100) by linear interpolation, rounded to ``digits`` when given; None for no values.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([1.0, 2.0, 3.0, 4.0], 99, digits=6)
    (2.5, 3.97)
    """
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    value = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return value if digits is None else round(value, digits)


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


def fitting_prompts(dec, prompts: list[str], max_tokens: int) -> tuple[list[str], list]:
    """The prompts whose chat encoding plus ``max_tokens`` fits the model's context, with those encodings.

    A prompt that cannot fit would only ever come back as a 400, so it is left out (and said so on stderr) rather
    than counted as a failed request; no prompt fitting at all is a ConfigError on ``max_tokens``.
    """
    context = dec.target.max_context
    kept, chats = [], []
    for p in prompts:
        ids = dec.encode(p, chat=True)
        if ids.shape[-1] + max_tokens <= context:
            kept.append(p)
            chats.append(ids)
    if not kept:
        raise ConfigError("max_tokens", f"no prompt fits the model's context of {context} tokens with {max_tokens} new tokens")
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


# ---- the load ---------------------------------------------------------------------------------------------------------
@dataclass
class LoadPlan:
    """What one run sends: a sweep over ``levels`` (concurrent streams; ``min_requests`` per level in back-to-back
    waves), or with ``rate`` a single level of ``requests`` Poisson arrivals."""

    levels: list[int]
    max_tokens: int = 64
    min_requests: int = 4
    rate: float | None = None
    requests: int = 32
    slo_ttft_s: float = 10.0
    slo_itl_s: float = 0.5

    def __post_init__(self) -> None:
        if self.rate is not None and self.rate <= 0:
            raise ConfigError("rate", f"must be > 0, got {self.rate}")
        if min(self.max_tokens, self.requests, self.min_requests, *self.levels) < 1:
            raise ConfigError("max_tokens", "max tokens, requests, min requests and every level must be >= 1")
        if min(self.slo_ttft_s, self.slo_itl_s) <= 0:
            raise ConfigError("slo", f"the SLOs must be > 0 s, got ttft {self.slo_ttft_s:g} and itl {self.slo_itl_s:g}")
        if self.rate is not None:
            self.levels = [self.requests]

    @property
    def mode(self) -> str:
        return "sweep" if self.rate is None else f"poisson@{self.rate}"

    def waves_of(self, level: int) -> int:
        return 1 if self.rate is not None else -(-max(level, self.min_requests) // level)

    @property
    def prompts_needed(self) -> int:
        """How many distinct prompts the largest level sends."""
        return max(c * self.waves_of(c) for c in self.levels)


def stream_chat(client, model: str, prompt: str, max_tokens: int, start_at: float | None = None) -> dict:
    """One streaming chat completion: text, tokens, TTFT and the gaps between content chunks.

    ``tokens`` is the server's ``usage.completion_tokens`` (asked for with ``stream_options.include_usage``); a
    server that does not report it (``usage`` False) is counted by its content chunks, one token each as
    llama.cpp's and vLLM's servers stream them."""
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.perf_counter()))
    t0 = time.perf_counter()
    parts, ttft, last, itl, tokens, usage = [], None, None, [], 0, False
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
                tokens, usage = chunk.usage.completion_tokens, True
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                if ttft is None:
                    ttft = now - t0
                elif last is not None:
                    itl.append(now - last)
                last = now
        e2e, tokens = time.perf_counter() - t0, tokens if usage else len(parts)
        return {"ok": True, "text": "".join(parts), "tokens": tokens, "usage": usage, "ttft_s": ttft, "itl_s": itl, "e2e_s": e2e}
    except Exception as e:  # counted, never hidden
        return {"ok": False, "text": "", "tokens": 0, "ttft_s": None, "itl_s": [], "e2e_s": time.perf_counter() - t0, "error": str(e)[:200]}


def wave(client, model: str, prompts: list[str], max_tokens: int, rate: float | None) -> list[dict]:
    """All prompts at once (rate None) or with exponential gaps of mean 1/rate; one thread per request."""
    results: list[dict | None] = [None] * len(prompts)
    rng = random.Random(0)
    t, starts = time.perf_counter(), []
    for _ in prompts:
        starts.append(t)
        if rate:
            t += rng.expovariate(rate)

    def one(i):
        results[i] = stream_chat(client, model, prompts[i], max_tokens, starts[i] if rate else None)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results


def run_load(client, names: dict[str, str], prompts: list[str], plan: LoadPlan, reference: dict | None = None) -> tuple[list, list]:
    """Every level of ``plan`` for every method of ``names`` (method -> the model name to ask for): (one row per
    method and level, one row per request). ``reference``: prompt index -> the text each stream must say."""
    for served in names.values():  # warm-up: loads, calibrates, compiles
        stream_chat(client, served, prompts[0], 4)
    rows, request_rows = [], []
    for c in plan.levels:
        for method, served in names.items():
            reqs, wall = [], 0.0
            for w in range(plan.waves_of(c)):  # back-to-back waves of c: at least min_requests per level
                index = list(range(w * c, w * c + c))
                t0 = time.perf_counter()
                got = wave(client, served, [prompts[i] for i in index], plan.max_tokens, plan.rate)
                wall += time.perf_counter() - t0
                reqs += [dict(r, index=i) for i, r in zip(index, got, strict=True)]
            fig = summarize_wave(reqs, wall, plan.slo_ttft_s, plan.slo_itl_s)
            mismatched = [r["index"] for r in reqs if reference and r["ok"] and r["text"] != reference[r["index"]]]
            row = {"method": method, "concurrency": c, "mode": plan.mode, **fig}
            rows.append(dict(row, mismatched=len(mismatched) if reference else None))
            request_rows += [{"method": method, "concurrency": c, **{k: v for k, v in r.items() if k != "itl_s"}} for r in reqs]
            print(_progress(method, c, fig) + (f" mismatched {len(mismatched)}" if reference else ""), file=sys.stderr)
    return rows, request_rows


def _progress(method: str, c: int, fig: dict) -> str:
    return (
        f"{method:>10} c={c:<3} {fig['tokens_per_s']:7.1f} tok/s {fig['requests_per_s']:6.2f} req/s "
        f"TTFT p50/p99 {fig['ttft_p50_s'] or 0:.2f}/{fig['ttft_p99_s'] or 0:.2f}s "
        f"ITL p50/p99 {1000 * (fig['itl_p50_s'] or 0):.0f}/{1000 * (fig['itl_p99_s'] or 0):.0f}ms "
        f"done {fig['completed']}/{fig['requests']}"
    )


# ---- any OpenAI-compatible server as a peer --------------------------------------------------------------------------
def peer_base_url(url: str) -> str:
    """The ``/v1`` base of a peer server given by its root or its ``/v1`` URL; ConfigError unless http(s).

    >>> peer_base_url("http://127.0.0.1:8080"), peer_base_url("https://h:1/v1/")
    ('http://127.0.0.1:8080/v1', 'https://h:1/v1')
    """
    base = url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")) or len(base.split("://", 1)[1]) == 0:
        raise ConfigError("peer_url", f"expected an http(s) URL of an OpenAI-compatible server, got {url!r}")
    return base if base.endswith("/v1") else base + "/v1"


def peer_model(client, name: str | None = None) -> str:
    """The model to ask the peer for: ``name`` when given, else the first its ``GET /v1/models`` lists (llama.cpp's
    server lists the one GGUF it runs). ConfigError when the server cannot be reached or lists nothing."""
    try:
        listed = [m.id for m in client.models.list()]
    except Exception as e:  # noqa: BLE001 - any failure to reach it is the user's URL
        raise ConfigError("peer_url", f"cannot list the peer's models at {client.base_url} ({type(e).__name__}: {e})") from None
    if name:
        return name
    if not listed:
        raise ConfigError("peer_model", f"the peer at {client.base_url} lists no model; name one with --peer-model")
    return listed[0]


# ---- in process -------------------------------------------------------------------------------------------------------
def references(dec, chats: list, max_tokens: int) -> dict[int, str]:
    """Each prompt alone, in process, greedy: what every stream of it must say."""
    return {i: dec.decode(dec.generate_ids(ids, max_new_tokens=max_tokens).token_ids) for i, ids in enumerate(chats)}


def in_process_peers(dec, chats: list, levels: list[int], max_tokens: int, hf: bool = False) -> dict:
    """Per level C, tokens/s of specray's batched AR over the first C prompts (``specray_inprocess_ar``) and, with
    ``hf``, of transformers' ``generate()`` on the same prompts left-padded into one batch (``hf_padded_generate``)."""
    from evaluation.hf_peer import padded_batch_tokens_per_s

    peers: dict[str, dict[int, float]] = {}
    for c in levels:
        batch = chats[:c]
        t0 = time.perf_counter()
        gens = dec.generate_batch(batch, max_new_tokens=max_tokens, max_rows=c)
        peers.setdefault("specray_inprocess_ar", {})[c] = sum(len(g.token_ids) for g in gens) / (time.perf_counter() - t0)
        line = f"in-process c={c}: specray batched AR {peers['specray_inprocess_ar'][c]:.1f} tok/s"
        if hf:
            peers.setdefault("hf_padded_generate", {})[c] = padded_batch_tokens_per_s(dec, batch, max_tokens)
            line += f", HF padded generate {peers['hf_padded_generate'][c]:.1f} tok/s"
        print(line, file=sys.stderr)
    return peers


def summarize(rows: list[dict], peers: dict, about: dict) -> dict:
    """The run's summary: ``about`` (model, dtype, threads, max_tokens, entries, ...), the rows with their ratios to
    batched AR at the same level and to one AR stream, the in-process figures and batched AR over HF's."""
    ar_by_c = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["method"] == "ar"}
    one = ar_by_c.get(1)
    for r in rows:
        r["speedup_vs_batched_ar"] = r["tokens_per_s"] / ar_by_c[r["concurrency"]] if ar_by_c.get(r["concurrency"]) else None
        r["vs_one_stream_ar"] = r["tokens_per_s"] / one if one else None
    summary = {**about, "rows": rows, "in_process": {k: {str(c): v for c, v in d.items()} for k, d in peers.items()}}
    if "hf_padded_generate" in peers:
        hf = peers["hf_padded_generate"]
        summary["batched_ar_vs_hf"] = {str(c): peers["specray_inprocess_ar"][c] / hf[c] for c in hf}
    return summary


# ---- reports ----------------------------------------------------------------------------------------------------------
def results_table(summary: dict) -> str:
    """The Markdown table of a run: one row per concurrency, tokens/s per method and the ratios that matter."""
    rows = summary["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    levels = sorted({r["concurrency"] for r in rows})
    by = {(r["method"], r["concurrency"]): r for r in rows}
    inproc = summary.get("in_process", {})
    head = ["streams"] + [f"{m} tok/s" for m in methods] + [f"{m} / AR" for m in methods if m != "ar"]
    head += ["AR vs 1 stream", "AR TTFT p99 s", "AR ITL p99 ms"]
    peer = (summary.get("peer") or {}).get("label")
    if peer:
        head += [f"{peer} TTFT p99 s", f"{peer} ITL p99 ms"]
    if "hf_padded_generate" in inproc:
        head += ["in-process batched AR / HF padded"]
    lines = []
    for c in levels:
        ar = by.get(("ar", c), {})
        cells = [str(c)] + [f"{by[(m, c)]['tokens_per_s']:.1f}" if (m, c) in by else "" for m in methods]
        cells += [f"{by[(m, c)]['speedup_vs_batched_ar']:.2f}x" if (m, c) in by else "" for m in methods if m != "ar"]
        cells += [f"{ar.get('vs_one_stream_ar') or 0:.2f}x", f"{ar.get('ttft_p99_s') or 0:.2f}", f"{1000 * (ar.get('itl_p99_s') or 0):.0f}"]
        if peer:
            other = by.get((peer, c), {})
            cells += [f"{other.get('ttft_p99_s') or 0:.2f}", f"{1000 * (other.get('itl_p99_s') or 0):.0f}"]
        if "hf_padded_generate" in inproc:
            spec, hf = inproc["specray_inprocess_ar"].get(str(c)), inproc["hf_padded_generate"].get(str(c))
            cells.append(f"{spec / hf:.2f}x" if spec and hf else "")
        lines.append(cells)
    return markdown_table(head, lines)


def update_readme(readme: Path, summary: dict, plot_path: Path) -> None:
    """Rewrite the ``<!-- load-results -->`` block of ``readme``; ValueError when it has none."""
    knobs = "; ".join(f"{m}: k={c['k']}, adaptive_k={c['adaptive_k']}" for m, c in summary["entries"].items()) or "ar only"
    peer = summary.get("peer")
    beside = f"; {peer['label']}: `{peer['model']}` through its own OpenAI endpoint, tokens counted by {peer['counted_by']}" if peer else ""
    caption = (
        f"{summary['model']} {summary['dtype']}, {summary['threads']} threads, {summary['max_tokens']} tokens per request "
        f"({knobs}{beside}); plot: `{plot_path}`."
    )
    replace_block(readme, "load-results", f"{results_table(summary)}\n\n{caption}")


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


# ---- what the HTTP path costs -----------------------------------------------------------------------------------------
def http_overhead(dec, client, model: str, prompt: str, tokens: int, repeats: int) -> dict:
    """The same greedy chat generation in process (``dec``) and through HTTP (``client``, an ``openai`` client of the
    server that serves ``model`` with ``dec``'s configuration), plain and streamed, interleaved ``repeats`` times after
    one warm-up of each: median wall times and the HTTP / in-process ratios. The three texts must agree (ConfigError
    on ``model`` otherwise: the server does not run the configuration measured in process)."""
    messages = [{"role": "user", "content": prompt}]

    def in_process() -> str:
        return dec.decode(dec.generate_ids(dec.encode(prompt, chat=True), max_new_tokens=tokens).token_ids)

    def http() -> str:
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=tokens, temperature=0)
        return out.choices[0].message.content

    def streamed() -> str:
        return stream_chat(client, model, prompt, tokens)["text"]

    paths = {"in_process": in_process, "http": http, "http_stream": streamed}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(repeats + 1):
        texts = {}
        for name, run in paths.items():
            t0 = time.perf_counter()
            texts[name] = run()
            if r:  # the first round warms both paths up
                times[name].append(time.perf_counter() - t0)
        if len(set(texts.values())) != 1:
            raise ConfigError("model", f"the server's text differs from the in-process one: {texts}")
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "median_s": med,
        "all_s": times,
        "ratio_http": med["http"] / med["in_process"],
        "ratio_http_stream": med["http_stream"] / med["in_process"],
        "overhead_ms_http": (med["http"] - med["in_process"]) * 1000,
        "identical_text": True,
    }
