"""The winner measured again outside Tune, in this process: against AR and against its method's untuned defaults.

On the held-out prompts when there are any (``evaluation.workloads.split_held_out``), ``repeats`` passes, so each
figure comes with its noise band (the slowest and fastest pass); the winner ``beats_defaults`` only when its band
lies above the defaults'.
"""

from __future__ import annotations

import sys

from decoding.config import SpecConfig


def verify(winner: SpecConfig, space, base: SpecConfig, prompts, warmup: int, repeats: int = 1, held_out: bool = False) -> dict:
    """The winner vs AR, and the untuned defaults of its method vs AR, measured again here (interleaved per prompt),
    on the held-out prompts when there are any, ``repeats`` passes: each figure comes with its noise band (the
    slowest and fastest pass), and the winner ``beats_defaults`` only when its band lies above the defaults'."""
    from tuning.resources import hosts_actors
    from tuning.trainable import measure

    default = next(p for p in space.default_points(base) if p["method"] == winner.method)
    default_cfg = space.to_config(default, base).replace(threads=winner.threads, device=winner.device)  # same host, same device
    extra = {"defaults": default_cfg} if default_cfg != winner else {}
    if extra and hosts_actors(winner.to_dict()) and not _room_for_two_pairs(winner):
        print("the cluster holds one draft/target worker pair at a time: the defaults are not re-measured", file=sys.stderr)
        extra = {}
    split = "held-out" if held_out else "tuning"
    if not held_out:
        print("no held-out prompts (--holdout 0, or no category has 2 prompts): re-measuring on the tuning prompts", file=sys.stderr)
    print(f"verifying the winner outside Tune on {len(prompts)} {split} prompts, {repeats} pass(es)...", file=sys.stderr)
    m = measure(winner, prompts, warmup=warmup, extra=extra, repeats=repeats)
    d = m.get("extra", {}).get("defaults", m)
    keys = (
        "speedup",
        "speedup_band_low",
        "speedup_band_high",
        "tokens_per_s",
        "ar_tokens_per_s",
        "mean_accepted_tokens",
        "identical_fraction",
        "suspicious",
        "fidelity_ok",
    )
    beats = None
    if extra and m.get("speedup_band_low") is not None and d.get("speedup_band_high") is not None:
        beats = m["speedup_band_low"] > d["speedup_band_high"]
    return {
        "prompts": split,
        "prompt_count": len(prompts),
        "repeats": repeats,
        "winner": {k: m.get(k) for k in keys},
        "defaults": {"config": default_cfg.to_dict(), **{k: d.get(k) for k in keys}},
        "winner_is_defaults": not extra,
        "winner_over_defaults": (m["speedup"] / d["speedup"]) if m.get("speedup") and d.get("speedup") else None,
        "beats_defaults": beats,
    }


def _room_for_two_pairs(cfg: SpecConfig) -> bool:
    import ray

    from cluster.placement import PlacementError, plan_placement

    try:
        plan = plan_placement(cfg, ray.nodes())
    except PlacementError:
        return False
    need = sum(b.get("CPU", 0.0) for b in plan.bundles)
    return ray.available_resources().get("CPU", 0.0) >= 2 * need
