"""The measurement a trial makes, and the Tune function trainable around it.

:func:`measure` is pure of Ray: it runs a candidate ``SpecConfig`` and AR (the
same model, dtype and threads, one loaded copy) on each prompt back to back, in
an order alternating per prompt, and after every prompt hands the running
figures to a callback. The trainable (:func:`trainable`) maps Tune's sample to
a config with the search space and reports those figures with
``training_iteration`` = prompts done, which is what ASHA's milestones count.

Figures (all over the prompts done so far):

- ``tokens_per_s`` / ``ar_tokens_per_s``: total new tokens / total wall seconds;
- ``speedup``: their ratio (AR measured in the same trial, interleaved);
- ``mean_accepted_tokens``: tokens committed per decoding target forward (tau);
- fidelity under greedy decoding: ``identical_fraction`` (outputs token-identical
  to AR's) and ``suspicious`` (divergences at an AR logit margin wider than the
  dtype's rounding, see ``evaluation.bench_figures.compare_to_reference``).
  ``fidelity_ok`` = no suspicious divergence; with sampling it is not checked
  (``fidelity_checked`` false) and counts as ok.
- ``score``: the speedup when ``fidelity_ok``, else 0: a config that diverges
  suspiciously can never win (and :func:`tuning.results.select_best` filters it too).
- ``lossy`` (EAD: unverified tokens): never ``fidelity_ok``, score 0; its ``differ_share`` and ``large_share``
  are measured; only ``specray tune --allow-lossy`` lets it be the winner, labelled lossy.

A config that cannot run (``ConfigError``: e.g. a knob the model rejects) is
reported once as ``valid = False`` with score 0 and its reason; the trial ends
normally, so a bad corner of the space never crashes the search.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import kernels
from actors.devices import placed
from decoding.config import SpecConfig
from decoding.errors import ConfigError
from evaluation import bench_figures as bm
from evaluation.workloads import Prompt

CANDIDATE = "candidate"
METRIC = "score"

# every report carries these keys (None where not measured), so result tables have one schema; the type is the
# column type of the results table (tuning/results.py)
METRIC_TYPES: dict[str, type] = {
    "valid": bool,
    "invalid_reason": str,
    "prompts": int,
    "prompts_total": int,
    "complete": bool,
    "tokens_per_s": float,
    "ar_tokens_per_s": float,
    "speedup": float,
    "speedup_median": float,
    "speedup_band_low": float,
    "speedup_band_high": float,
    "mean_accepted_tokens": float,
    "acceptance_rate": float,
    "target_forwards_per_token": float,
    "new_tokens": int,
    "compared": int,
    "identical": int,
    "identical_fraction": float,
    "suspicious": int,
    "fidelity_checked": bool,
    "fidelity_ok": bool,
    "lossy": bool,  # unverified tokens (EAD): never fidelity_ok; a winner only with specray tune --allow-lossy
    "differ_share": float,  # lossy: share of tokens that differ from AR's (greedy)
    "large_share": float,  # lossy: share of tokens the target produced
    "score": float,
    "threads": int,
    "config_json": str,
}
METRIC_KEYS = tuple(METRIC_TYPES)


def figures(gen_rows: Sequence[dict], step_rows: Sequence[dict], prompts_total: int, cfg: SpecConfig, threads: int | None = None) -> dict:
    """The trial's metrics from benchmark rows of ``ar`` and ``candidate`` (see the module docstring)."""
    s = bm.summarize_methods(gen_rows, step_rows, order=[bm.BASELINE, CANDIDATE])
    cand, ar = s["methods"].get(CANDIDATE, {}), s["methods"].get(bm.BASELINE, {})
    ident = cand.get("identity") or {}
    compared = ident.get("compared", 0)
    checked = cfg.temperature == 0
    suspicious = ident.get("suspicious", 0) if checked else None
    lossy = bool(cand.get("lossy"))  # a lossy method never passes the fidelity check, whatever it diverged by
    fidelity_ok = ((suspicious == 0) if checked else True) and not lossy
    div = cand.get("divergence") or {}
    speedup = cand.get("speedup")
    q = cand.get("speedup_per_prompt")
    passes = cand.get("speedup_per_repeat")
    return {
        "valid": True,
        "invalid_reason": None,
        "prompts": s["runs_complete"],
        "prompts_total": prompts_total,
        "complete": s["runs_complete"] >= prompts_total,
        "tokens_per_s": cand.get("tokens_per_s"),
        "ar_tokens_per_s": ar.get("tokens_per_s"),
        "speedup": speedup,
        "speedup_median": q["median"] if q else None,
        "speedup_band_low": passes["min"] if passes else None,  # the slowest and fastest whole pass (repeats > 1)
        "speedup_band_high": passes["max"] if passes else None,
        "mean_accepted_tokens": cand.get("mean_accepted_tokens"),
        "acceptance_rate": cand.get("acceptance_rate"),
        "target_forwards_per_token": cand.get("target_forwards_per_token"),
        "new_tokens": cand.get("new_tokens"),
        "compared": compared if checked else None,
        "identical": ident.get("identical") if checked else None,
        "identical_fraction": ident.get("fraction") if checked else None,
        "suspicious": suspicious,
        "fidelity_checked": checked,
        "fidelity_ok": fidelity_ok,
        "lossy": lossy,
        "differ_share": div.get("differ_share"),
        "large_share": div.get("large_share"),
        "score": float(speedup) if (fidelity_ok and speedup is not None) else 0.0,
        "threads": threads,
        "config_json": cfg.to_json(),
    }


def invalid(reason: str, prompts_total: int, cfg: SpecConfig | None = None) -> dict:
    """The one report of a config that cannot run."""
    out = dict.fromkeys(METRIC_KEYS)
    out.update(
        valid=False,
        invalid_reason=reason,
        prompts=0,
        prompts_total=prompts_total,
        complete=False,
        fidelity_checked=False,
        fidelity_ok=False,
        score=0.0,
        config_json=cfg.to_json() if cfg else None,
    )
    return out


def measure(
    cfg: SpecConfig,
    prompts: Sequence[Prompt],
    on_prompt: Callable[[int, dict], None] | None = None,
    warmup: int = 1,
    extra: dict[str, SpecConfig] | None = None,
    repeats: int = 1,
) -> dict:
    """Run ``cfg`` and AR on ``prompts``, interleaved; returns the final figures (see :func:`figures`).

    With ``repeats`` > 1 the prompt set runs that many times and the figures carry ``speedup_band_low`` and ``_high``: the lowest
    and highest speedup of one whole pass (the noise band of the measurement).

    ``on_prompt(n, figures)`` is called after each prompt with the figures over
    the first ``n`` prompts. ``extra`` adds named configs run in the same rotation
    (the returned dict then has ``extra`` = name -> their figures); the driver's
    re-measurement uses it to compare the winner with the untuned defaults. Each config runs on the decoder
    ``cluster.decoders.open_decoder`` gives it: ``pearl`` / ``placement=actors`` on two model workers in the trial's
    own placement group (the target beside the trial in bundle 0, the draft in bundle 1; see :mod:`tuning.resources`),
    or in a new group outside a trial.
    """
    from evaluation.prompt_runner import PromptRunner

    if not prompts:
        raise ConfigError("prompts", "no prompts to measure on")
    configs = {bm.BASELINE: cfg.replace(method=bm.BASELINE, placement="local"), CANDIDATE: cfg, **(extra or {})}
    runner = PromptRunner(configs)
    try:
        threads = runner.ar.threads
        if warmup:
            runner.warmup(prompts[0], warmup)
        gens, steps = [], []
        result: dict = {}
        runs = [(r, prompt) for r in range(repeats) for prompt in prompts]
        for i, (r, prompt) in enumerate(runs):
            g, s = runner.run_prompt(prompt, i, repeat=r)
            gens += g
            steps += s
            result = _with_extra(gens, steps, len(runs), cfg, threads, extra)
            if on_prompt is not None:
                on_prompt(i + 1, result)
        return result
    finally:
        runner.close()


def _with_extra(gens, steps, total, cfg, threads, extra) -> dict:
    main = [r for r in gens if r["method"] in (bm.BASELINE, CANDIDATE)]
    out = figures(main, [s for s in steps if s["method"] == CANDIDATE], total, cfg, threads)
    if extra:
        out["extra"] = {}
        for name, ecfg in extra.items():
            rows = [dict(r, method=CANDIDATE) if r["method"] == name else r for r in gens if r["method"] in (bm.BASELINE, name)]
            esteps = [dict(s, method=CANDIDATE) for s in steps if s["method"] == name]
            out["extra"][name] = figures(rows, esteps, total, ecfg, threads)
    return out


# ---- the Tune side -----------------------------------------------------------------------------
@dataclass
class TrialSetup:
    """What every trial shares: the space, the base config, the prompts. Passed with ``tune.with_parameters``."""

    space: object  # tuning.space.SearchSpace
    base: SpecConfig
    prompts: list = field(default_factory=list)
    warmup: int = 1
    cpus_per_trial: int = 1


def trial_config(sample: dict, setup: TrialSetup) -> SpecConfig:
    """The config a trial runs: the space's mapping, with torch threads = the trial's CPUs unless the user set them."""
    cfg = setup.space.to_config(sample, setup.base)
    if cfg.threads is None:
        cfg = cfg.replace(threads=setup.cpus_per_trial)
    return cfg


def trainable(config: dict, setup: TrialSetup) -> None:
    """Tune function trainable: one report per prompt (``training_iteration`` = prompts done)."""
    from ray import tune

    kernels.install()
    total = len(setup.prompts)
    try:
        cfg = placed(trial_config(config, setup))  # device=auto: the trial's GPU if Tune gave it one, else CPU
    except ConfigError as e:
        tune.report(invalid(str(e), total))
        return
    try:
        measure(cfg, setup.prompts, on_prompt=lambda n, m: tune.report(m), warmup=setup.warmup)
    except ConfigError as e:  # a knob only the loaded model can check (build_drafter)
        tune.report(invalid(str(e), total, cfg))
