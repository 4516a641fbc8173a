"""Per-step costs of drafting and verification on one prompt, each drafter with its draft loop replayed as one CUDA
graph and without (``decoding.model.graphs.LoopGraphs``): what a step of each method costs on this device.

    PYTHONPATH=$PWD python tests/gpu/probe.py --device cuda --out probe.json      # on a GPU machine (tests/gpu/run.sh)
    PYTHONPATH=$PWD python tests/gpu/probe.py --device cpu --new 16               # a dry run here (the loop on static buffers)

Each configuration decodes the prompt twice with a fixed k (the second run is reported: graphs are captured in the
first) and prints tokens/s, tokens per step (tau), draft and verification milliseconds per step, and whether its
output is AR's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

CONFIGS = {
    "ar": {"method": "ar"},
    "eagle k=4": {"method": "eagle", "k": 4},
    "eagle levels-32 k=6": {"method": "eagle", "k": 6, "tree": "levels", "tree_budget": 32},
    "distill k=4": {"method": "trained", "drafter": "smollm2-135m/distill", "k": 4},
}


def main(argv=None) -> int:
    import kernels
    from decoding.config import SpecConfig
    from decoding.in_process import SpecDecoder
    from decoding.model.graphs import LoopGraphs
    from evaluation.workloads import load_prompts

    kernels.install()  # the kernels users' decoders run (jobs.common), on this device

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--new", type=int, default=128, help="new tokens per run")
    p.add_argument("--prompt", type=int, default=0, help="index of the Spec-Bench question")
    p.add_argument("--only", help="comma list of configurations (default all): " + ", ".join(CONFIGS))
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)
    text = load_prompts()[args.prompt].turns[0]
    rows, ar_tokens = [], None
    names = [n.strip() for n in args.only.split(",")] if args.only else list(CONFIGS)
    for name in names:
        knobs = CONFIGS[name]
        dec = SpecDecoder(SpecConfig(model="smollm2-135m", dtype=args.dtype, device=args.device, adaptive_k=False, **knobs))
        ids = dec.encode([{"role": "user", "content": text}], chat=True)
        modes = (None,) if dec.drafter is None or not hasattr(dec.drafter, "loops") else (False, True)
        for loops in modes:
            if loops is not None:  # the same drafter object with its loop graphs on or off
                dec.drafter.loops = (dec.drafter.loops or LoopGraphs(dec.target.device)) if loops else None
            for _ in range(2):
                if dec.target.device.type == "cuda":
                    torch.cuda.synchronize()
                begin = time.perf_counter()
                gen = dec.generate_ids(ids, max_new_tokens=args.new)
                if dec.target.device.type == "cuda":
                    torch.cuda.synchronize()
                wall = time.perf_counter() - begin
            steps = max(1, len(gen.steps))
            ar_tokens = gen.token_ids if name == "ar" else ar_tokens
            row = {
                "config": name,
                "draft_loop_graph": loops,
                "tokens_per_s": round(len(gen.token_ids) / wall, 1),
                "tau": round(len(gen.token_ids) / steps, 2),
                "draft_ms": round(1000 * sum(s.draft_s for s in gen.steps) / steps, 3),
                "verify_ms": round(1000 * sum(s.verify_s for s in gen.steps) / steps, 3),
                "wall_ms_per_step": round(1000 * wall / steps, 3),
                "same_as_ar": gen.token_ids == ar_tokens,
                "loop_replays": getattr(getattr(dec.drafter, "loops", None), "replays", None),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "dtype": args.dtype, "new_tokens": args.new, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
