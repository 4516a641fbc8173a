"""The bench's figures, the pure half of the benchmark: its rows, run order, greedy identity with AR, and the summary
maths.

Everything here works on plain Python rows (dicts, as ``pyarrow.Table.to_pylist``
returns them) or on torch tensors. The other bench modules: ``evaluation.prompt_runner`` (configurations back to
back on a prompt), ``evaluation.bench_run`` (a run, in process or over Ray actors, and its files),
``evaluation.bench_report`` (tables, plots, the README's Results), ``evaluation.tree_variants`` (trees against
chains); the command lines are ``jobs/bench.py`` and ``jobs/bench_trees.py``.

Two tables describe a run:

* generation rows, one per (prompt, repeat, method): ``GEN_COLUMNS``;
* step rows, one per decoding step of a specray method: ``STEP_COLUMNS``.

Speedup is tokens/s of a method over tokens/s of the baseline (``ar``), each
aggregated as total new tokens / total wall seconds over the same prompts
(the prompts every method finished), overall and per category. The per-prompt
ratio (method tokens/s / AR tokens/s on one prompt and repeat) gives the spread.

>>> rows = [gen_row("ar", 1, "qa", new_tokens=10, wall_s=1.0), gen_row("ngram", 1, "qa", new_tokens=10, wall_s=0.5)]
>>> s = summarize_methods(rows, [])
>>> s["methods"]["ngram"]["speedup"], s["methods"]["ar"]["tokens_per_s"]
(2.0, 10.0)
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch

from decoding.loop.metrics import StepRecord, peak_rss_mb, per_position_acceptance, reset_peak_rss  # noqa: F401  (re-exported)
from decoding.model.adapter import ModelAdapter

BASELINE = "ar"

# generation rows: one per (prompt, repeat, method)
GEN_COLUMNS = (
    "method",  # specray method ("ar", "ngram", ...) or a peer mode ("hf-plain", ...)
    "kind",  # "specray" or "peer"
    "prompt_id",  # str(question_id)
    "category",
    "repeat",
    "worker",  # "local" or the Ray worker that ran it
    "new_tokens",
    "wall_s",  # prefill + decoding, what tokens/s divides by
    "prefill_s",
    "draft_s",
    "verify_s",
    "target_forwards",  # including the prefill forward; None for peers
    "steps",
    "identical",  # greedy output token-identical to AR's on the same prompt and repeat; None = not compared
    "first_diff",  # first differing position (0-based, among the new tokens); None when identical
    "margin",  # AR's top-1 minus top-2 target logit at first_diff
    "suspicious",  # the divergence sits on a margin wider than the dtype's rounding (never for a lossy method)
    "lossy",  # the method commits unverified tokens (EAD): its divergence from AR is measured, not a bug
    "differ_share",  # greedy: share of the new tokens that differ from AR's at the same position; None = not compared
    "large_share",  # a lossy method: share of the new tokens the target (the large model) produced
    "finish_reason",
    "config",  # SpecConfig JSON (or the peer's generate kwargs)
    "peak_rss_mb",  # the process's peak resident set during this generation (Linux; None elsewhere)
    "levels",  # JSON: KV bytes per level ({"top", "middle", "bottom"}) and a hierarchical drafter's middle-level steps
)

# step rows: one per decoding step of a specray method
# k: the draft budget of the step (k=auto: the goodput choice); rows: sequences that shared its target forward
STEP_COLUMNS = (
    "method",
    "prompt_id",
    "category",
    "repeat",
    "worker",
    "step",
    "drafted",
    "accepted",
    "draft_s",
    "verify_s",
    "k",
    "rows",
    "looked",  # the drafts were prompt lookup's, a model drafter's row's fallback under k=auto (glance)
    "config",
)

# A divergence at a margin up to this is numerics (one or two rounding steps of the dtype), above it a bug.
MARGIN_TOLERANCE = {"bfloat16": 0.5, "float16": 0.05, "float32": 1e-3}


def gen_row(method: str, prompt_id, category: str, **fields) -> dict:
    """A generation row with every column present (missing ones are None; defaults for the rest)."""
    row = dict.fromkeys(GEN_COLUMNS)
    row.update(method=method, kind="specray", prompt_id=str(prompt_id), category=category, repeat=0, worker="local")
    row.update(fields)
    unknown = set(row) - set(GEN_COLUMNS)
    if unknown:
        raise KeyError(f"unknown generation columns: {sorted(unknown)}")
    return row


def step_rows(method: str, prompt_id, category: str, steps: Iterable[StepRecord], repeat=0, worker="local", config="") -> list[dict]:
    return [
        {
            "method": method,
            "prompt_id": str(prompt_id),
            "category": category,
            "repeat": repeat,
            "worker": worker,
            "step": i,
            "drafted": s.drafted,
            "accepted": s.accepted,
            "draft_s": s.draft_s,
            "verify_s": s.verify_s,
            "k": s.k,
            "rows": s.rows,
            "looked": s.looked,
            "config": config,
        }
        for i, s in enumerate(steps)
    ]


# ---- run order -------------------------------------------------------------
def method_order(methods: Sequence[str], index: int) -> list[str]:
    """The methods rotated by ``index``: prompt i starts with method i mod n, so no method always runs first.

    >>> [method_order(["ar", "ngram", "sps"], i) for i in range(4)]
    [['ar', 'ngram', 'sps'], ['ngram', 'sps', 'ar'], ['sps', 'ar', 'ngram'], ['ar', 'ngram', 'sps']]
    """
    n = len(methods)
    if n == 0:
        return []
    r = index % n
    return list(methods[r:]) + list(methods[:r])


# ---- fidelity ----------------------------------------------------------------
def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """First position where two token lists differ (a length difference counts); None when equal.

    >>> first_divergence([1, 2, 3], [1, 2, 3]), first_divergence([1, 5, 3], [1, 2, 3]), first_divergence([1, 2], [1, 2, 3])
    (None, 1, 2)
    """
    for i, (a, b) in enumerate(zip(tokens, reference, strict=False)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit along the last dim. logits: [..., V] -> [...]."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


@torch.inference_mode()
def reference_margins(target: ModelAdapter, prompt_ids: torch.Tensor, new_tokens: Sequence[int]) -> list[float]:
    """The target's top-1 minus top-2 logit at each generated position, from one forward over prompt + tokens.

    prompt_ids: [1, T]. Entry i is the margin of the distribution that chose ``new_tokens[i]``
    (the logits at sequence index T - 1 + i).
    """
    n = len(new_tokens)
    if n == 0:
        return []
    t = prompt_ids.shape[1]
    seq = torch.cat([prompt_ids.cpu(), torch.tensor([list(new_tokens)], dtype=prompt_ids.dtype)], dim=1).to(target.device)
    cache = target.new_cache(1, t + n)
    h = target.forward(cache, 0, input_ids=seq[:, : t + n - 1])  # the last token's logits are never used
    return top2_margin(target.logits(h[:, t - 1 :]))[0].tolist()


def margin_tolerance(dtype: str) -> float:
    return MARGIN_TOLERANCE.get(str(dtype).removeprefix("torch."), MARGIN_TOLERANCE["float32"])


def compare_to_reference(
    tokens: Sequence[int], reference: Sequence[int], margins: Sequence[float], dtype: str, lossy: bool = False
) -> dict:
    """Identity with the reference (AR) output; for a divergence its position, AR's margin there, whether it is
    suspicious (never for a ``lossy`` method: it diverges by design) and the share of positions that differ.

    >>> compare_to_reference([1, 2, 9], [1, 2, 3], [5.0, 4.0, 0.125], "bfloat16")
    {'identical': False, 'first_diff': 2, 'margin': 0.125, 'suspicious': False, 'differ_share': 0.3333333333333333}
    >>> compare_to_reference([7, 2, 3], [1, 2, 3], [5.0, 4.0, 0.125], "bfloat16")["suspicious"]
    True
    """
    pos = first_divergence(tokens, reference)
    if pos is None:
        return {"identical": True, "first_diff": None, "margin": None, "suspicious": False, "differ_share": 0.0}
    margin = float(margins[pos]) if pos < len(margins) else None
    suspicious = margin is not None and margin > margin_tolerance(dtype) and not lossy
    return {
        "identical": False,
        "first_diff": pos,
        "margin": margin,
        "suspicious": suspicious,
        "differ_share": differ_share(tokens, reference),
    }


def differ_share(tokens: Sequence[int], reference: Sequence[int]) -> float:
    """Share of positions whose tokens differ (a position only one output reaches differs).

    >>> differ_share([1, 2, 3, 4], [1, 5, 3]), differ_share([], [])
    (0.5, 0.0)
    """
    n = max(len(tokens), len(reference))
    if n == 0:
        return 0.0
    same = sum(a == b for a, b in zip(tokens, reference, strict=False))
    return (n - same) / n


def large_share(new_tokens: int, steps: Iterable[StepRecord]) -> float | None:
    """A lossy (unverified) method's share of the new tokens the target produced: all but the drafts it committed.

    >>> large_share(10, [StepRecord(4, 4, 0, 0), StepRecord(0, 0, 0, 0), StepRecord(3, 3, 0, 0)])
    0.3
    """
    if new_tokens <= 0:
        return None
    small = sum(s.accepted for s in steps)
    return max(0.0, new_tokens - small) / new_tokens


# ---- summary maths -------------------------------------------------------------
def quantiles(values: Iterable[float]) -> dict | None:
    """min / p25 / median / p75 / max with linear interpolation (numpy's default); None for no values.

    >>> quantiles([4.0, 1.0, 3.0, 2.0])
    {'n': 4, 'min': 1.0, 'p25': 1.75, 'median': 2.5, 'p75': 3.25, 'max': 4.0}
    """
    xs = sorted(float(v) for v in values)
    if not xs:
        return None

    def q(p):
        pos = p * (len(xs) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"n": len(xs), "min": xs[0], "p25": q(0.25), "median": q(0.5), "p75": q(0.75), "max": xs[-1]}


def _rate(rows) -> float:
    secs = sum(r["wall_s"] for r in rows)
    return sum(r["new_tokens"] for r in rows) / secs if secs > 0 else 0.0


def ratio(a: float, b: float) -> float | None:
    """a / b, or None when b is not positive (no baseline figure to compare with)."""
    return a / b if b > 0 else None


def _key(r) -> tuple:
    return (r["prompt_id"], r["repeat"])


def complete_keys(gen_rows: Sequence[dict], methods: Sequence[str]) -> set:
    """(prompt_id, repeat) pairs that every method finished."""
    done = defaultdict(set)
    for r in gen_rows:
        done[_key(r)].add(r["method"])
    return {k for k, ms in done.items() if set(methods) <= ms}


def _matched(base_rows: list, mrows: list) -> list:
    """The baseline's rows of the (prompt, repeat) pairs a method ran: a peer that ran fewer repeats
    (``--peer-repeats``) is compared with AR on those only."""
    mine = {_key(r) for r in mrows}
    return [b for b in base_rows if _key(b) in mine]


def _speedups(rows_by_method: dict, baseline_rows: list, methods) -> dict:
    return {m: ratio(_rate(rows_by_method.get(m, [])), _rate(_matched(baseline_rows, rows_by_method.get(m, [])))) for m in methods}


def summarize_methods(gen_rows: Sequence[dict], step_rows: Sequence[dict], baseline: str = BASELINE, order: Sequence[str] = ()) -> dict:
    """Everything the report shows, from the two tables (see the module docstring).

    Only (prompt, repeat) pairs that every specray method finished count, so an interrupted
    run compares like with like; a peer's rows count on those of the pairs it ran (it may run fewer repeats),
    against the baseline's rows of the same pairs. Per-step figures come from the step rows of the same pairs.
    ``order`` lists methods in the order the report shows them (others follow in row order).
    """
    present = set(r["method"] for r in gen_rows)
    methods = list(dict.fromkeys([m for m in order if m in present] + [r["method"] for r in gen_rows]))
    if methods and baseline not in methods:
        raise ValueError(f"no {baseline!r} rows: the speedup needs the baseline")
    peers = {r["method"] for r in gen_rows if r["kind"] == "peer"}
    keys = complete_keys(gen_rows, [m for m in methods if m not in peers])
    all_keys = {_key(r) for r in gen_rows}
    rows = [r for r in gen_rows if _key(r) in keys]
    steps = [s for s in step_rows if _key(s) in keys]
    by_method = defaultdict(list)
    for r in rows:
        by_method[r["method"]].append(r)
    steps_by_method = defaultdict(list)
    for s in steps:
        steps_by_method[s["method"]].append(s)
    base_rows = by_method.get(baseline, [])
    repeats = sorted({r["repeat"] for r in rows})

    out_methods = {m: _method_figures(by_method[m], steps_by_method[m], base_rows, m == baseline) for m in methods}
    categories, workers = _by_column(rows, "category", methods, baseline), _by_column(rows, "worker", methods, baseline)

    return {
        "baseline": baseline,
        "methods_order": methods,
        "prompts_complete": len({k[0] for k in keys}),
        "runs_complete": len(keys),
        "runs_incomplete": len(all_keys - keys),
        "repeats": len(repeats),
        "methods": out_methods,
        "categories": categories,
        "workers": workers,
        "peer": peer_comparison(out_methods, baseline),
        "over_best_peer": over_best_peer(out_methods, categories),
    }


def _method_figures(mrows: list, msteps: list, base_rows: list, is_baseline: bool) -> dict:
    """One method's figures in the summary, from its rows and the baseline's over the same (prompt, repeat) pairs."""
    base_by_key = {_key(r): r for r in base_rows}
    base_rows = _matched(base_rows, mrows)
    rate = _rate(mrows)
    per_prompt = []
    for r in mrows:
        b = base_by_key[_key(r)]
        if r["wall_s"] > 0 and b["wall_s"] > 0 and b["new_tokens"] > 0:
            per_prompt.append((r["new_tokens"] / r["wall_s"]) / (b["new_tokens"] / b["wall_s"]))
    repeats = sorted({r["repeat"] for r in mrows})
    per_repeat = [ratio(_rate([r for r in mrows if r["repeat"] == k]), _rate([r for r in base_rows if r["repeat"] == k])) for k in repeats]
    n_steps = len(msteps)
    accepted = sum(s["accepted"] for s in msteps)
    drafted = sum(s["drafted"] for s in msteps)
    forwards = [r["target_forwards"] for r in mrows if r["target_forwards"] is not None]
    new_tokens = sum(r["new_tokens"] for r in mrows)
    lossy = any(bool(r.get("lossy")) for r in mrows)
    return {
        "kind": mrows[0]["kind"] if mrows else None,
        "prompts": len(mrows),
        "new_tokens": new_tokens,
        "wall_s": sum(r["wall_s"] for r in mrows),
        "tokens_per_s": rate,
        "speedup": ratio(rate, _rate(base_rows)),
        "speedup_per_prompt": quantiles(per_prompt),
        "speedup_per_repeat": quantiles(x for x in per_repeat if x is not None) if len(repeats) > 1 else None,
        "steps": n_steps,
        "mean_accepted_tokens": (accepted + n_steps) / n_steps if n_steps else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        # the share of steps that drafted at all (k=auto stops drafting where it does not pay)
        "steps_drafted": sum(s["drafted"] > 0 for s in msteps) / n_steps if n_steps else None,
        # of them, the steps that drafted prompt lookup's chain in place of a model drafter's own (glance)
        "steps_looked": sum(bool(s.get("looked")) for s in msteps) / n_steps if n_steps else None,
        "per_position_acceptance": per_position_acceptance([StepRecord(s["drafted"], s["accepted"], 0.0, 0.0) for s in msteps])
        if msteps
        else [],
        "target_forwards_per_token": sum(forwards) / new_tokens if forwards and new_tokens else None,
        "draft_ms_per_step": 1e3 * sum(s["draft_s"] for s in msteps) / n_steps if n_steps else None,
        "verify_ms_per_step": 1e3 * sum(s["verify_s"] for s in msteps) / n_steps if n_steps else None,
        "identity": None if is_baseline else _identity(mrows),
        "lossy": lossy,
        "divergence": divergence(mrows) if lossy else None,
    }


def _identity(mrows: list) -> dict:
    """How many of a method's greedy outputs were compared with the baseline's and identical, and its divergences."""
    compared = [r for r in mrows if r["identical"] is not None]
    divergences = [
        {k: r[k] for k in ("prompt_id", "category", "repeat", "first_diff", "margin", "suspicious")} for r in compared if not r["identical"]
    ]
    return {
        "compared": len(compared),
        "identical": sum(bool(r["identical"]) for r in compared),
        "fraction": sum(bool(r["identical"]) for r in compared) / len(compared) if compared else None,
        "suspicious": sum(bool(d["suspicious"]) for d in divergences),
        "divergences": divergences,
    }


def _by_column(rows: list, column: str, methods: list, baseline: str) -> dict:
    """Per value of the column: every method's prompts, tokens/s and speedup over them."""
    out = {}
    for value in dict.fromkeys(r[column] for r in rows):
        mine = defaultdict(list)
        for r in rows:
            if r[column] == value:
                mine[r["method"]].append(r)
        sp = _speedups(mine, mine[baseline], methods)
        out[value] = {
            m: {"prompts": len({r["prompt_id"] for r in mine[m]}), "runs": len(mine[m]), "tokens_per_s": _rate(mine[m]), "speedup": sp[m]}
            for m in methods
        }
    return out


def divergence(rows: Sequence[dict]) -> dict:
    """A lossy method's distance from AR over its generation rows: the first divergence position (median, and how many
    outputs never diverged), the share of tokens that differ and the share the large model produced (token-weighted).

    >>> rows = [gen_row("ead", 1, "qa", new_tokens=10, identical=False, first_diff=4, differ_share=0.5, large_share=0.3),
    ...         gen_row("ead", 2, "qa", new_tokens=30, identical=True, first_diff=None, differ_share=0.0, large_share=0.1)]
    >>> d = divergence(rows); d["first_diff_median"], d["never_diverged"], d["differ_share"], round(d["large_share"], 3)
    (4.0, 1, 0.125, 0.15)
    """
    compared = [r for r in rows if r.get("differ_share") is not None]
    firsts = [r["first_diff"] for r in compared if r["first_diff"] is not None]
    q = quantiles(firsts)
    weigh = lambda key, rs: (sum(r[key] * r["new_tokens"] for r in rs) / tokens) if (tokens := sum(r["new_tokens"] for r in rs)) else None  # noqa: E731
    return {
        "compared": len(compared),
        "never_diverged": sum(bool(r["identical"]) for r in compared),
        "first_diff_median": q["median"] if q else None,
        "differ_share": weigh("differ_share", compared) if compared else None,
        "large_share": weigh("large_share", [r for r in rows if r.get("large_share") is not None]),
    }


def over_best_peer(methods: dict, categories: dict) -> dict | None:
    """Every specray method's tokens/s over the best peer mode's (HF's best, whichever mode that is), overall and per
    category (the best mode is picked per category). None without peer rows.

    >>> rag = {"ar": 10.0, "ngram": 30.0, "hf-plain": 9.0, "hf-pl": 20.0}
    >>> ms = {m: {"kind": "peer" if m.startswith("hf") else "specray", "tokens_per_s": r} for m, r in rag.items()}
    >>> over_best_peer(ms, {"rag": ms})["categories"]["rag"]
    {'best_peer': 'hf-pl', 'ar': 0.5, 'ngram': 1.5}
    """
    peers = [m for m, v in methods.items() if v["kind"] == "peer"]
    ours = [m for m, v in methods.items() if v["kind"] == "specray"]
    if not peers or not ours:
        return None

    def table(rates: dict) -> dict:
        best = max(peers, key=lambda m: rates[m] or 0.0)
        return {"best_peer": best, **{m: ratio(rates[m] or 0.0, rates[best] or 0.0) for m in ours}}

    out = {"overall": table({m: v["tokens_per_s"] for m, v in methods.items()})}
    out["categories"] = {c: table({m: v["tokens_per_s"] for m, v in cat.items()}) for c, cat in categories.items()}
    return out


def peer_comparison(methods: dict, baseline: str = BASELINE) -> dict | None:
    """specray AR vs HF plain generate, and specray's best method vs the best HF mode (None without peer rows)."""
    # the best specray method is a lossless one: a lossy method (EAD) is never the winner of a comparison
    ours = {m: v["tokens_per_s"] for m, v in methods.items() if v["kind"] == "specray" and not v.get("lossy")}
    peers = {m: v["tokens_per_s"] for m, v in methods.items() if v["kind"] == "peer"}
    if not ours or not peers:
        return None
    best_ours = max(ours, key=ours.get)
    best_peer = max(peers, key=peers.get)
    plain = next((m for m in peers if m.endswith("plain")), None)
    return {
        "best_specray": best_ours,
        "best_peer": best_peer,
        "best_vs_best": ratio(ours[best_ours], peers[best_peer]),
        "plain_peer": plain,
        "ar_vs_plain": ratio(ours.get(baseline, 0.0), peers[plain]) if plain else None,
        "peer_tokens_per_s": peers,
    }


# ---- long contexts: memory, and where a decoding step's time goes ------------------------------------------
def kv_bytes_per_token(target: ModelAdapter) -> int:
    """Bytes of keys + values one token occupies in the target's full cache (every layer)."""
    return 2 * target.num_layers * target.kv_heads * target.head_dim * torch.tensor([], dtype=target.dtype).element_size()


@torch.inference_mode()
def decode_forward_seconds(target: ModelAdapter, context: int, repeats: int = 5) -> float:
    """Median wall time of one single-token target forward with ``context`` tokens already cached.

    The cache holds zeros: the time of a forward does not depend on the values in it.
    """
    import time

    cache = target.new_cache(1, context + 1)
    token = torch.zeros(1, 1, dtype=torch.long)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        target.logits(target.forward(cache, context, input_ids=token))
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


def attention_share(long_s: float, short_s: float) -> float:
    """Share of a decoding forward at a long context spent on the context (attention over the cache), against a short one.

    The weights cost the same at any context, so (t_long - t_short) / t_long is what the cache adds.

    >>> round(attention_share(0.04, 0.03), 6)
    0.25
    """
    return max(0.0, (long_s - short_s) / long_s) if long_s > 0 else 0.0


def context_summary(
    gen_rows: Sequence[dict], step_rows: Sequence[dict], forward_s: dict, short_context: int, baseline: str = BASELINE
) -> dict:
    """Per context length (category ``ctx-N``): speedups (whole generation and decoding only), acceptance at each
    level (top: the full target's verdicts; middle: a hierarchical drafter's inner steps), peak RSS and KV bytes
    per level, and the attention share of a decoding forward (``forward_s``: N -> seconds, with
    ``short_context`` as the weights-only reference).

    >>> rows = [gen_row("ar", 1, "ctx-8", new_tokens=10, wall_s=2.0, prefill_s=1.0, peak_rss_mb=500.0, levels='{"kv_bytes": {"top": 8}}'),
    ...         gen_row("triforce", 1, "ctx-8", new_tokens=10, wall_s=1.5, prefill_s=1.0, peak_rss_mb=510.0,
    ...                 levels='{"kv_bytes": {"top": 8, "middle": 4, "bottom": 2}, "middle_drafted": 8, "middle_accepted": 6}')]
    >>> s = context_summary(rows, [], {8: 0.04, 1: 0.03}, 1)["ctx-8"]
    >>> round(s["attention_share"], 6), s["methods"]["triforce"]["decode_speedup"], s["methods"]["triforce"]["middle_acceptance"]
    (0.25, 2.0, 0.75)
    """
    import json

    out = {}
    keys = complete_keys(gen_rows, list(dict.fromkeys(r["method"] for r in gen_rows)))
    for cat in dict.fromkeys(r["category"] for r in gen_rows):
        if not str(cat).startswith("ctx-"):
            continue
        n = int(str(cat).removeprefix("ctx-"))
        rows = [r for r in gen_rows if r["category"] == cat and _key(r) in keys]
        by = defaultdict(list)
        for r in rows:
            by[r["method"]].append(r)

        def decode_rate(rs):
            secs = sum(r["wall_s"] - (r["prefill_s"] or 0.0) for r in rs)
            return sum(r["new_tokens"] - 1 for r in rs) / secs if secs > 0 else 0.0  # the first token comes from prefill

        base = by.get(baseline, [])
        methods = {}
        for m, rs in by.items():
            levels = [json.loads(r["levels"]) for r in rs if r.get("levels")]
            drafted = sum(lv.get("middle_drafted", 0) for lv in levels)
            kv = defaultdict(int)
            for lv in levels:
                for level, b in lv.get("kv_bytes", {}).items():
                    kv[level] = max(kv[level], b)
            rss = [r["peak_rss_mb"] for r in rs if r.get("peak_rss_mb") is not None]
            steps = [x for x in step_rows if x["method"] == m and x["category"] == cat and _key(x) in keys]
            top_drafted = sum(x["drafted"] for x in steps)
            methods[m] = {
                "prompts": len(rs),
                "speedup": ratio(_rate(rs), _rate(base)),
                "decode_speedup": ratio(decode_rate(rs), decode_rate(base)),
                "top_acceptance": sum(x["accepted"] for x in steps) / top_drafted if top_drafted else None,
                "middle_acceptance": sum(lv.get("middle_accepted", 0) for lv in levels) / drafted if drafted else None,
                "peak_rss_mb": max(rss) if rss else None,
                "kv_mb": {level: b / 2**20 for level, b in kv.items()},
            }
        long_s, short_s = forward_s.get(n), forward_s.get(short_context)
        out[cat] = {
            "context_tokens": n,
            "forward_ms": 1e3 * long_s if long_s else None,
            "short_forward_ms": 1e3 * short_s if short_s else None,
            "attention_share": attention_share(long_s, short_s) if long_s and short_s else None,
            "methods": methods,
        }
    return out
