"""Measure two-actor schedules against their in-process forms and AR in one run (not a test; run it by hand).

    python tests/actors/bench_pearl.py --prompts 5 --max-new-tokens 64 [--synthetic-alpha 0.8] [--transport calls]
    python tests/actors/bench_pearl.py --method triforce --context-tokens 4096 --prompts 2 --max-new-tokens 128

``--method pearl`` (default): PEARL (k=auto, and a fixed k) and SpS over two actors vs in-process SpS vs AR.
``--method triforce``: TriForce with its middle and bottom levels in the draft
actor, under the sequential and the PEARL schedule, vs in-process TriForce vs
AR, on long-context prompts of ``--context-tokens`` tokens.

Draft and target workers get one core each (placement on a 2-CPU local Ray);
the in-process methods run in this process with ``--threads`` torch threads
while the workers sit idle. ``--synthetic-alpha A`` (pearl) adds a labelled run with a
*synthetic* draft: it does the shallow draft's real compute, then replaces its
tokens by AR's own continuation with probability A per token (a stand-in for a
trained draft with acceptance ~A at the shallow draft's cost).
"""

from __future__ import annotations

import argparse
import json
import random
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", choices=["pearl", "triforce"], default="pearl")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", type=int, default=None, help="draft length (default: 4 for pearl, 6 for triforce)")
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--transport", default="calls")
    ap.add_argument("--synthetic-alpha", type=float, default=0.0)
    ap.add_argument("--categories", default="writing,coding,summarization,rag,math_reasoning,translation")
    ap.add_argument("--context-tokens", type=int, default=4096, help="triforce: prompt length")
    ap.add_argument("--triforce-budget", type=int, default=512)
    args = ap.parse_args()
    args.k = args.k or (6 if args.method == "triforce" else 4)

    from tests_support import spec_bench_prompts

    import kernels
    from actors.driver import ActorDecoder
    from cluster.placement import place_workers
    from cluster.runtime import connect
    from decoding.config import SpecConfig
    from decoding.in_process import SpecDecoder
    from evaluation.workloads import load_prompts

    kernels.install()  # the in-process decoders run the kernels the actors run (actors.model_actor), as users' do
    base = SpecConfig(dtype=args.dtype, max_new_tokens=args.max_new_tokens, k=args.k, draft_layers=args.draft_layers)
    connect(num_cpus=2)
    if args.method == "pearl":
        actor_cfg = base.replace(method="pearl", placement="actors", actor_transport=args.transport)
        variants = {
            "pearl[actors]": actor_cfg,  # k=auto (the default): drafting stops in the rounds where it does not pay
            "pearl[actors,rounds]": actor_cfg,  # the same, its idle stretches a round a token (runs=False)
            "pearl[actors,fixed-k]": actor_cfg.replace(adaptive_k=False),
            "sps[actors]": actor_cfg.replace(method="sps"),
        }
        local_cfgs = {"ar": base, "sps": base.replace(method="sps")}
    else:
        tri = dict(method="triforce", triforce_budget=args.triforce_budget)
        actor_cfg = base.replace(placement="actors", actor_transport=args.transport, **tri)
        variants = {f"triforce-{s}[actors]": actor_cfg.replace(triforce_schedule=s) for s in ("sps", "pearl")}
        local_cfgs = {"ar": base, "triforce": actor_cfg.replace(placement="local")}
    target, draft, placement, cleanup = place_workers(actor_cfg)
    decs = {name: ActorDecoder(cfg, target, draft, placement) for name, cfg in variants.items()}
    if "pearl[actors,rounds]" in decs:
        decs["pearl[actors,rounds]"].runs = False  # k=auto's idle stretches as before the target's runs alone
    local = {name: SpecDecoder(cfg.replace(threads=args.threads)) for name, cfg in local_cfgs.items()}
    enc = local["ar"]
    if args.method == "pearl":
        texts = [q["turns"][0] for q in spec_bench_prompts(per_category=1, categories=args.categories.split(","))[: args.prompts]]
    else:
        from evaluation.bench_run import long_prompts

        texts = [p.prompt for p in long_prompts(load_prompts(), [args.context_tokens], args.prompts, base)]
    ids = [enc.encode(t, chat=True) for t in texts]
    warm = enc.encode("Say hi.", chat=True)
    for d in list(decs.values()) + list(local.values()):
        d.generate_ids(warm, max_new_tokens=8)

    totals = {name: dict(tokens=0, wall=0.0, prefill=0.0, forwards=0, identical=0, rounds=[], levels=[]) for name in [*local, *decs]}
    refs = []
    for x in ids:
        ref = None
        for name in [*local, *decs]:  # ar first: the reference
            dec = local.get(name) or decs[name]
            out = dec.generate_ids(x)
            ref = out.token_ids if name == "ar" else ref
            t = totals[name]
            t["tokens"] += out.stats.new_tokens
            t["wall"] += out.stats.wall_s
            t["prefill"] += out.stats.prefill_s
            t["forwards"] += out.stats.target_forwards
            t["identical"] += out.token_ids == ref
            t["rounds"] += getattr(out, "rounds", [])
            if name in decs and args.method == "triforce":
                stats = dec.stats(out)
                t["levels"].append(stats["levels"])
                t["rss"] = stats["peak_rss_mb"]
        refs.append(ref)

    from decoding.schedules.two_sided import round_summary

    probe = next(iter(decs.values())).rpc_probe(50)
    rows = {}

    def decode_tps(t):  # tokens after the first over the time after prefill (long prompts: prefill dominates wall)
        return (t["tokens"] - len(ids)) / (t["wall"] - t["prefill"])

    ar_tps = totals["ar"]["tokens"] / totals["ar"]["wall"]
    for name, t in totals.items():
        tps = t["tokens"] / t["wall"]
        rows[name] = {
            "tokens_per_s": round(tps, 2),
            "speedup_vs_ar": round(tps / ar_tps, 3),
            "decode_speedup_vs_ar": round(decode_tps(t) / decode_tps(totals["ar"]), 3),
            "prefill_s": round(t["prefill"], 2),
            "tokens_per_target_forward": round(t["tokens"] / t["forwards"], 3),
            "identical_to_ar": f"{t['identical']}/{len(ids)}",
            **({"per_round_ms": {k: round(v, 2) for k, v in round_summary(t["rounds"]).items()}} if t["rounds"] else {}),
        }
        if t["levels"]:
            drafted = sum(lv["middle_drafted"] for lv in t["levels"])
            rows[name]["middle_acceptance"] = round(sum(lv["middle_accepted"] for lv in t["levels"]) / max(drafted, 1), 3)
            rows[name]["peak_rss_mb_last_prompt"] = {k: round(v or 0) for k, v in t["rss"].items()}
    if args.method == "pearl":
        rows["pearl_over_sps_actors"] = round(rows["pearl[actors]"]["tokens_per_s"] / rows["sps[actors]"]["tokens_per_s"], 3)
    rows["prompt_tokens"] = [int(x.shape[1]) for x in ids]
    rows["rpc_probe_ms"] = {k: round(v, 3) for k, v in probe.items()}

    print(json.dumps(rows, indent=1), flush=True)
    if args.synthetic_alpha > 0 and args.method == "pearl":
        rows["synthetic"] = synthetic_run(args, actor_cfg, target, draft, ids, refs, local["ar"], totals)
    cleanup()
    print(json.dumps({"config": vars(args), "placement": {k: placement[k] for k in ("strategy", "bundles", "reason")}, **rows}, indent=1))


def synthetic_run(args, actor_cfg, target, draft, ids, refs, ar, totals):
    """PEARL and two-actor SpS with a synthetic draft (labelled): real shallow-draft compute, AR's tokens with prob alpha."""
    import ray

    from actors.driver import ActorDecoder
    from decoding.schedules.two_sided import DraftResult, DraftSide, round_summary

    @ray.remote(num_cpus=0)
    class SyntheticDraft:
        def __init__(self, cfg_json, threads, alpha):
            from decoding.config import SpecConfig
            from decoding.model.adapter import ModelAdapter
            from decoding.model.loading import load_model, set_threads

            cfg = SpecConfig.from_json(cfg_json)
            set_threads(threads)
            self.side = DraftSide.of_model(ModelAdapter(load_model(cfg.model, cfg.dtype).model, num_layers=cfg.draft_layers))
            self.alpha, self.rng, self.oracle, self.prompt_len = alpha, random.Random(0), [], 0

        def set_oracle(self, tokens):
            self.oracle = tokens

        def prefill(self, prompt, max_len, seed=0, sampling=None):
            self.prompt_len = len(prompt)
            return self.side.prefill(prompt, max_len, seed, sampling)

        def draft(self, req):
            res = self.side.draft(req)
            pos = len(self.side.tokens) - len(res.tokens) - self.prompt_len  # generated index of the first draft
            toks = []
            for i, tok in enumerate(res.tokens):
                good = self.oracle[pos + i] if pos + i < len(self.oracle) else tok
                toks.append(good if self.rng.random() < self.alpha else (good + 1) % 49152)
            self.side.tokens[len(self.side.tokens) - len(toks) :] = toks  # the sequence the next keep refers to
            return DraftResult(tokens=toks, compute_s=res.compute_s)

    # the synthetic draft takes the real draft's core: kill the real one first
    ray.kill(draft)
    time.sleep(1)
    # num_cpus=0: the placement group still holds the dead draft's CPU; this worker takes that core (1 thread)
    syn = SyntheticDraft.options(num_cpus=0).remote(actor_cfg.to_json(), 1, args.synthetic_alpha)
    out = {"label": f"SYNTHETIC draft: {args.draft_layers}-layer compute, AR's token with prob {args.synthetic_alpha}"}
    for name, cfg in [("pearl[actors]", actor_cfg), ("sps[actors]", actor_cfg.replace(method="sps"))]:
        dec = ActorDecoder(cfg, target, syn, {})
        tok = wall = fw = same = 0
        rounds = []
        for x, ref in zip(ids, refs, strict=True):
            ray.get(syn.set_oracle.remote(ref), timeout=300)
            g = dec.generate_ids(x)
            tok, wall, fw, same = tok + g.stats.new_tokens, wall + g.stats.wall_s, fw + g.stats.target_forwards, same + (g.token_ids == ref)
            rounds += g.rounds
        out[name] = {
            "tokens_per_s": round(tok / wall, 2),
            "speedup_vs_ar": round((tok / wall) / (totals["ar"]["tokens"] / totals["ar"]["wall"]), 3),
            "tokens_per_target_forward": round(tok / fw, 3),
            "identical_to_ar": f"{same}/{len(ids)}",
            "per_round_ms": {k: round(v, 2) for k, v in round_summary(rounds).items()},
        }
    out["pearl_over_sps_actors"] = round(out["pearl[actors]"]["tokens_per_s"] / out["sps[actors]"]["tokens_per_s"], 3)
    return out


if __name__ == "__main__":
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root), str(root / "tests")]
    main()
