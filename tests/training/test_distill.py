"""Self-distillation data (training/corpus.py, training/distill_data.py, jobs/distill.py).

Fast tier: the corpus (coverage, no Spec-Bench prompt, stable ids and splits) and one shard in process on a tiny
model. Cluster tier: the job on a multi-node test cluster: shards split across the nodes' workers, a worker
killed mid-shard has its shard redone, and a resumed run writes nothing twice.
"""

from __future__ import annotations

import os

import pytest
from tests_support import assert_one_line_error, multinode_cluster

from decoding.errors import ConfigError
from training import corpus
from training.distill_data import DistillSpec, phase_prompts, read_manifest, read_rows, run_shard, shard_path, shards_of, write_shard

TINY = dict(per_kind=2, questions=4, articles=2, german=2, max_new_tokens={"1": 6, "2": 6, "3": 6}, shard_size=6, rows=4)


def test_corpus_covers_every_kind_and_is_deterministic():
    seed_material = [
        {"id": "seed-german-00000", "kind": "translation", "source": "model-german", "text": "Der Hund schläft im Garten."},
        {"id": "seed-question-00000", "kind": "qa", "source": "model-question", "text": "Who built the first bicycle?"},
    ]
    a = corpus.first_turn_prompts(seed=1, per_kind=3, material=seed_material)
    b = corpus.first_turn_prompts(seed=1, per_kind=3, material=seed_material)
    assert a == b
    assert {p["kind"] for p in a} == set(corpus.KINDS)
    assert len({p["id"] for p in a}) == len(a)
    assert {p["source"] for p in a} >= {"template", "python-docs", "model-question", "model-german"}
    assert all(p["split"] in ("train", "heldout") for p in a)
    big = corpus.first_turn_prompts(seed=0, per_kind=400)
    share = sum(p["split"] == "heldout" for p in big) / len(big)
    assert 0.03 < share < 0.08  # about HELDOUT_FRACTION, by a hash of the id


def test_second_turns_keep_their_first_turns_split():
    first = corpus.first_turn_prompts(seed=0, per_kind=20)
    rows = [{**p, "answer_text": "An answer."} for p in first]
    second = corpus.second_turn_prompts(rows, seed=0, fraction=1.0)
    by_id = {p["id"]: p for p in first}
    assert second and all(p["id"].endswith("/t2") for p in second)
    assert all(p["split"] == by_id[p["id"][:-3]]["split"] for p in second)
    assert all(p["kind"] in corpus.MULTI_TURN and len(p["messages"]) == 3 for p in second)
    assert all(p["messages"][1] == {"role": "assistant", "content": "An answer."} for p in second)


def test_no_spec_bench_prompt_enters_the_corpus(tmp_path):
    from evaluation.workloads import load_prompts

    turns = [t for p in load_prompts() for t in p.turns]
    spec = DistillSpec(model="unused", **TINY)
    prompts = phase_prompts(spec, 1, tmp_path, turns) + corpus.first_turn_prompts(seed=0, per_kind=400)
    assert not corpus.spec_bench_overlap(prompts, turns)
    # the filter does catch one: a Spec-Bench question slipped into the corpus is reported
    planted = {"id": "x", "kind": "qa", "messages": [{"role": "user", "content": "Please answer: " + turns[5]}]}
    assert corpus.spec_bench_overlap([planted], turns) == [planted]


def test_one_shard_in_process(tiny_model_dir):
    from decoding.config import SpecConfig
    from decoding.in_process import SpecDecoder

    spec = DistillSpec(model=str(tiny_model_dir), dtype="float32", **TINY)
    dec = SpecDecoder(SpecConfig(model=spec.model, dtype="float32", threads=1))
    prompts = corpus.first_turn_prompts(seed=0, per_kind=1)[:5]
    counted = []
    rows = run_shard(dec, prompts, 2, spec, counted.append)
    assert [r["id"] for r in rows] == [p["id"] for p in prompts]
    done = [r for r in rows if r["finish_reason"] != "skipped"]
    assert done and sum(len(r["answer_ids"]) for r in done) == sum(counted)
    for r in done:  # greedy rows are what AR alone gives for the prompt
        if r["temperature"] == 0:
            ids = dec.encode(next(p for p in prompts if p["id"] == r["id"])["messages"])
            assert dec.generate_ids(ids, 6).token_ids == r["answer_ids"]
            assert r["prompt_ids"] == ids[0].tolist()


def test_spec_of_a_resumed_run_must_match(tmp_path):
    from training.distill_data import _check_resume, _write_manifest

    spec = DistillSpec(model="m", **TINY)
    _write_manifest(tmp_path, {"spec": spec.to_dict(), "shards": {}, "phases": {}})
    assert _check_resume(tmp_path, spec)["spec"] == spec.to_dict()
    with pytest.raises(ConfigError, match="per_kind"):
        _check_resume(tmp_path, DistillSpec(model="m", **{**TINY, "per_kind": 3}))


def test_shards_round_trip(tmp_path):
    rows = [
        dict(id=f"a-{i}", kind="qa", source="template", phase=2, turn=1, split="train", prompt_ids=[1, 2], answer_ids=[3] * i)
        | dict(finish_reason="stop", temperature=0.0, answer_text="x")
        for i in range(3)
    ]
    write_shard(shard_path(tmp_path, 2, 0), rows)
    assert read_rows(tmp_path, phase=2) == rows
    assert [len(s) for s in shards_of([{"id": str(i), "kind": "k"} for i in range(7)], 3)] == [3, 3, 1]


def test_local_run_without_ray_stops_at_its_deadline_and_resumes(tiny_model_dir, tmp_path):
    """``--local``: one engine in this process (a GPU machine without Ray); a deadline stops it between shards and a
    rerun finishes the phase without writing a shard twice."""
    import time

    from jobs.distill import main
    from training.distill_data import distill

    spec = DistillSpec(model=str(tiny_model_dir), dtype="float32", **TINY)
    out = tmp_path / "d"
    manifest = distill(spec, out, phases=(1,), progress=False, local=True, deadline=time.time() - 1)
    assert manifest["shards"] == {} and "1" not in manifest["phases"]  # stopped before its first shard
    manifest = distill(spec, out, phases=(1,), progress=False, local=True)
    shards = sorted(manifest["shards"])
    assert shards and all(v["node"] == "local" for v in manifest["shards"].values())
    stamps = {name: shard_path(out, 1, int(name.split("-")[1])).stat().st_mtime_ns for name in shards}
    assert manifest["phases"]["1"]["sequences"] == len(read_rows(out, phase=1)) > 0
    rc = main(
        [
            "--out",
            str(out),
            "--model",
            spec.model,
            "--dtype",
            "float32",
            "--phases",
            "1",
            "--local",
            "--no-progress",
            *(f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k != "max_new_tokens"),
            "--max-new-tokens",
            "6,6,6",
        ]
    )
    assert rc == 0
    assert {n: shard_path(out, 1, int(n.split("-")[1])).stat().st_mtime_ns for n in shards} == stamps  # nothing written twice


def test_local_worker_processes_write_what_one_engine_writes(tiny_model_dir, tmp_path):
    """``--local --workers 2``: two engine processes share the device; the shards (greedy and seeded sampled answers)
    are those one engine writes, each written once, by the worker processes."""
    from training.distill_data import distill

    spec = DistillSpec(model=str(tiny_model_dir), dtype="float32", **TINY)
    one = distill(spec, tmp_path / "one", phases=(1,), progress=False, local=True)
    two = distill(spec, tmp_path / "two", phases=(1,), progress=False, local=True, workers=2)
    assert sorted(one["shards"]) == sorted(two["shards"]) and len(two["shards"]) >= 2
    pids = {v["pid"] for v in two["shards"].values()}
    # shards go to whichever process is ready: on a loaded machine one may start (load its model) after the other ran
    # every tiny shard, so the manifest names one or both, never this process
    assert 1 <= len(pids) <= 2 and os.getpid() not in pids
    assert read_rows(tmp_path / "one", phase=1) == read_rows(tmp_path / "two", phase=1)
    assert two["phases"]["1"]["sequences"] == one["phases"]["1"]["sequences"]


def test_bad_commands_fail_in_one_line(tmp_path, capsys):
    from jobs.distill import main

    for argv, needle in (
        (["--out", str(tmp_path), "--phases", "3,1"], "--phases"),
        (["--out", str(tmp_path), "--max-new-tokens", "8,8"], "--max-new-tokens"),
        (["--out", str(tmp_path), "--quant", "q3"], "quant"),
        (["--out", str(tmp_path), "--model", "no/such/model"], "model"),
        (["--out", str(tmp_path), "--shard-size", "0"], "shard_size"),
        (["--out", str(tmp_path), "--max-minutes", "5"], "--max-minutes"),
    ):
        rc = main(argv)
        assert_one_line_error(rc, capsys.readouterr().err, needle)


# ---- on a multi-node test cluster -----------------------------------------------------------------------------------


@pytest.mark.cluster
def test_distill_on_a_multinode_cluster_survives_a_killed_worker_and_resumes(tiny_model_dir, tmp_path):
    import ray

    from training.distill_data import distill

    spec = DistillSpec(model=str(tiny_model_dir), dtype="float32", **{**TINY, "max_new_tokens": {"1": 24, "2": 24, "3": 24}})
    out = tmp_path / "data"
    killed = []

    def kill_when_busy(name, actor):
        # killed as its first shard is handed over, so that it cannot finish that shard first (waiting for its first
        # tokens raced with the shard's end on a fast machine)
        if not killed:
            killed.append(name)
            ray.kill(actor, no_restart=True)

    with multinode_cluster([1, 1]):
        manifest = distill(spec, out, workers=2, threads=1, phases=(1, 2), progress=False, on_dispatch=kill_when_busy)
        shards = manifest["shards"]
        assert manifest["shards"][killed[0]]["attempts"] == 2  # the killed worker's shard ran again
        assert len({s["node"] for s in shards.values()}) == 2  # work went to both worker nodes
        files = sorted(out.glob("phase-*/shard-*.parquet"))
        assert len(files) == len(shards) and manifest["phases"]["2"]["sequences"] > 0
        ids = [r["id"] for r in read_rows(out)]
        assert len(ids) == len(set(ids))  # no prompt twice
        before = {f: f.stat().st_mtime_ns for f in files}
        dispatched = []
        again = distill(spec, out, workers=2, threads=1, phases=(1, 2), progress=False, on_dispatch=lambda n, a: dispatched.append(n))
        assert dispatched == []  # resumed: every shard was on disk
        assert {f: f.stat().st_mtime_ns for f in sorted(out.glob("phase-*/shard-*.parquet"))} == before
        assert again["shards"] == shards
    assert read_manifest(out)["phases"]["1"]["nodes"] >= 1
