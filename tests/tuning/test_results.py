"""The fidelity rule, winner selection, Pareto front, Parquet schema and plot, and the pure measurement."""

from __future__ import annotations

import json

import pytest

from decoding.config import SpecConfig
from decoding.loop.metrics import StepRecord
from evaluation import bench_figures as bm
from tuning import results as res
from tuning.resources import bundles_for, max_concurrent
from tuning.trainable import CANDIDATE, METRIC_KEYS, figures, invalid

PNG = b"\x89PNG\r\n\x1a\n"


def row(tid, speedup, tau=2.0, fidelity_ok=True, complete=True, valid=True, error=None, method="ngram", k=4):
    cfg = SpecConfig(method=method, k=k)
    r = res.row_from_result(
        {
            "trial_id": tid,
            "valid": valid,
            "complete": complete,
            "prompts": 3 if complete else 1,
            "prompts_total": 3,
            "speedup": speedup,
            "mean_accepted_tokens": tau,
            "fidelity_ok": fidelity_ok,
            "fidelity_checked": True,
            "suspicious": 0 if fidelity_ok else 2,
            "identical_fraction": 1.0 if fidelity_ok else 0.3,
            "score": speedup if (fidelity_ok and valid) else 0.0,
            "config_json": cfg.to_json(),
            "training_iteration": 3 if complete else 1,
        },
        None,
        error,
    )
    return r


# ---- the fidelity rule: a diverging config never wins ------------------------------------------------


def test_a_suspiciously_diverging_config_never_wins():
    rows = [row("fast-but-wrong", 5.0, tau=6.0, fidelity_ok=False), row("ok", 1.3), row("ok2", 1.1)]
    best = res.select_best(rows)
    assert best["trial_id"] == "ok"
    assert res.select_best([row("wrong", 9.0, fidelity_ok=False)]) is None
    assert all(r["trial_id"] != "fast-but-wrong" for r in res.pareto_front(rows))


def test_invalid_errored_and_early_stopped_trials_rank_behind():
    rows = [
        row("invalid", None, valid=False),
        row("errored", 4.0, error="RayActorError: died"),
        row("stopped-early", 3.0, complete=False),
        row("complete", 1.2),
    ]
    assert res.select_best(rows)["trial_id"] == "complete"  # early-stopped figures cover fewer prompts
    assert res.select_best(rows[:3])["trial_id"] == "stopped-early"  # but count when nothing finished


def test_figures_force_the_score_of_a_suspicious_divergence_to_zero():
    g = bm.gen_row
    gens = [
        g("ar", 1, "qa", new_tokens=10, wall_s=1.0, target_forwards=10),
        g(CANDIDATE, 1, "qa", new_tokens=10, wall_s=0.25, target_forwards=3, identical=False, first_diff=4, margin=3.0, suspicious=True),
        g("ar", 2, "qa", new_tokens=10, wall_s=1.0, target_forwards=10),
        g(CANDIDATE, 2, "qa", new_tokens=10, wall_s=0.25, target_forwards=3, identical=False, first_diff=2, margin=0.1, suspicious=False),
    ]
    steps = bm.step_rows(CANDIDATE, 1, "qa", [StepRecord(3, 2, 0.01, 0.02)])
    f = figures(gens, steps, prompts_total=2, cfg=SpecConfig(method="ngram"))
    assert f["speedup"] == pytest.approx(4.0)
    assert f["suspicious"] == 1 and f["identical"] == 0 and f["identical_fraction"] == 0.0
    assert f["fidelity_ok"] is False and f["score"] == 0.0
    assert set(f) == set(METRIC_KEYS) and f["mean_accepted_tokens"] == pytest.approx(3.0)
    # the near-tie divergence alone is numerics: fidelity holds and the score is the speedup
    f2 = figures(gens[2:], [], prompts_total=1, cfg=SpecConfig(method="ngram"))
    assert f2["fidelity_ok"] is True and f2["score"] == pytest.approx(4.0) and f2["identical_fraction"] == 0.0
    # sampling: identity is not the test; it is reported as not checked, and does not fail the trial
    f3 = figures(gens, [], prompts_total=2, cfg=SpecConfig(method="ngram", temperature=0.7))
    assert f3["fidelity_checked"] is False and f3["fidelity_ok"] is True and f3["suspicious"] is None


def test_invalid_report_has_every_key_and_zero_score():
    r = invalid("exit_layer: must be below the model's 4 layers", 3)
    assert set(r) == set(METRIC_KEYS) and r["score"] == 0.0 and r["valid"] is False and r["prompts_total"] == 3


# ---- files ----------------------------------------------------------------------------------------------


def test_parquet_has_one_row_per_trial_and_the_schema(tmp_path):
    import pyarrow.parquet as pq

    rows = [row("a", 1.5, tau=2.5), row("b", 1.2, tau=3.0, method="early-exit"), row("c", 4.0, fidelity_ok=False)]
    out = res.write_outputs(rows, tmp_path, {"title": "t"})
    t = pq.read_table(out["paths"]["parquet"])
    assert t.num_rows == 3
    assert t.schema == res.schema()
    for col in ("trial_id", "method", "k", "exit_layer", "ngram_max", "speedup", "mean_accepted_tokens", "fidelity_ok", "suspicious"):
        assert col in t.column_names
    back = {r["trial_id"]: r for r in t.to_pylist()}
    assert back["a"]["best"] is True and back["c"]["best"] is False and back["c"]["fidelity_ok"] is False
    assert back["a"]["ngram_max"] == 3 and back["a"]["exit_layer"] is None  # knobs a method does not read are null
    assert back["b"]["exit_layer"] == 6 and back["b"]["ngram_max"] is None
    assert {k for k, r in back.items() if r["pareto"]} == {"a", "b"}  # a: faster, b: more accepted tokens
    png = out["paths"]["pareto"].read_bytes()
    assert png[:8] == PNG and len(png) > 5000
    best = json.loads(out["paths"]["best_json"].read_text())
    assert best["best"]["trial_id"] == "a" and best["best"]["config"]["method"] == "ngram"


def test_plot_with_no_measured_trial_still_writes_a_png(tmp_path):
    p = res.plot_pareto([row("x", None, valid=False)], tmp_path / "p.png")
    assert p.read_bytes()[:8] == PNG


# ---- resources ------------------------------------------------------------------------------------------


def test_trial_resources_and_concurrency():
    assert bundles_for({"method": "early-exit"}, cpus_per_trial=1) == [{"CPU": 1.0}]
    assert bundles_for({"method": "ngram"}, 2, gpus_per_trial=0.5) == [{"CPU": 2.0, "GPU": 0.5}]
    assert bundles_for({"method": "pearl"}, 1) == [{"CPU": 1.0}, {"CPU": 1.0}]  # trial + target worker, draft worker
    assert max_concurrent({"CPU": 2.0}, 1) == 2 and max_concurrent({"CPU": 16.0, "GPU": 2.0}, 2, 1.0) == 2


# ---- the pure measurement on a tiny model (no Ray) ----------------------------------------------------------


def test_measure_reports_after_every_prompt(tiny_tune):
    from evaluation.workloads import load_prompts
    from tuning.trainable import measure

    prompts = load_prompts(tiny_tune["prompts"])[:2]
    cfg = SpecConfig(model=tiny_tune["model"], method="ngram", k=3, dtype="float32", max_new_tokens=8, threads=1)
    seen = []
    final = measure(cfg, prompts, on_prompt=lambda n, m: seen.append((n, m["prompts"], m["complete"])), warmup=0)
    assert seen == [(1, 1, False), (2, 2, True)]
    assert final["speedup"] > 0 and final["tokens_per_s"] > 0 and final["ar_tokens_per_s"] > 0
    assert final["compared"] == 2 and final["suspicious"] == 0 and final["fidelity_ok"] is True  # float32: lossless
    assert final["mean_accepted_tokens"] >= 1.0
    assert json.loads(final["config_json"])["k"] == 3
