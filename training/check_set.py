"""Checking a trained drafter on prompts of the benchmark's kinds that neither its data nor the benchmark's runs use.

The held-out split of the self-distillation data comes from the same corpus as the training split (templates, the
model's own articles), so its agreement measures how well a drafter learnt that corpus, not how well it predicts the
target on real prompts. Measured on SmolLM2-135M's eagle head (teacher-forced top-1 agreement of the first draft,
bfloat16, the target's greedy answers of up to 128 tokens): 0.567 on the held-out split, 0.36 on the last eight
first turns of every Spec-Bench category, 0.40 on the first two (0.26 on summarization, 0.29 on translation, 0.31 on
RAG, whose documents are real articles; 0.51-0.55 on math). A head trained further was 0.018 above it on the
held-out split and 0.023 above it on the last eight (0.011 when stored in 3.3 MB, its output rows' change in 2 bits);
decoded at runtime (a 3-token chain every step, 84 prompts: the first four of each category and the second turns) it
drafted 1.487 tokens per step against 1.457 (1.456 in 3.3 MB), where 26 prompts had put the 3.3 MB copy below (1.43).

So a retrained drafter is also checked here before it is shipped: the **check set** is the last ``per_category``
first turns of each category of the Spec-Bench file (its questions are listed by category; the benchmark takes the
first ``--limit`` of each, the README's runs the first 4 of the smallest categories' 10, so the two never meet);
the target answers them greedily (:func:`check_examples`), and each drafter's teacher-forced agreement per draft
depth is measured on those answers exactly as training measures its held-out agreement (:func:`check_agreement`).
The new drafter replaces the shipped one when the sum of its agreements over the draft depths (about the tokens a
chain of that many drafts gets accepted) is not lower (:func:`better`).

The check set only chooses between two trained drafters; no drafter trains on it, and the corpus never holds a
Spec-Bench prompt (``training.corpus.spec_bench_overlap``).
"""

from __future__ import annotations

from pathlib import Path

CHECK_PER_CATEGORY = 6  # the last 6 first turns of each category: 78 prompts, none among the README's first 4
CHECK_NEW_TOKENS = 128


def check_prompts(path: Path, per_category: int = CHECK_PER_CATEGORY) -> list[dict]:
    """The check set: the last ``per_category`` questions of each category of a Spec-Bench style JSONL file, their
    first turns as one-message chats (``training.distill_data.run_shard``'s prompts).

    >>> import json, os, tempfile
    >>> rows = [{"question_id": i, "category": c, "turns": [f"q{i}"]} for i, c in enumerate("aaab")]
    >>> f = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False); _ = f.write("\\n".join(map(json.dumps, rows))); f.close()
    >>> [(p["id"], p["kind"], p["messages"][0]["content"]) for p in check_prompts(Path(f.name), 2)]
    [('check-1', 'a', 'q1'), ('check-2', 'a', 'q2'), ('check-3', 'b', 'q3')]
    >>> os.unlink(f.name)
    """
    from evaluation.workloads import load_prompts

    by_category: dict[str, list] = {}
    for q in load_prompts(path):  # parsed and checked as the benchmark reads it (a bad file: WorkloadError)
        by_category.setdefault(q.category, []).append(q)
    out = []
    for category, questions in by_category.items():
        for q in questions[-per_category:]:
            out.append(
                {"id": f"check-{q.question_id}", "kind": category, "source": "spec-bench", "phase": 2, "split": "check"}
                | {"messages": [{"role": "user", "content": q.turns[0]}]}
            )
    return out


def check_examples(model: str, prompts: list[dict], device: str = "auto", max_new_tokens: int = CHECK_NEW_TOKENS) -> list[dict]:
    """The target's greedy answers to ``prompts`` (bfloat16, its weights as it runs), as training examples."""
    from decoding.config import SpecConfig
    from decoding.in_process import SpecDecoder
    from training.distill_data import DistillSpec, run_shard
    from training.features import examples_from_rows

    decoder = SpecDecoder(SpecConfig(model=model, dtype="bfloat16", device=device))
    spec = DistillSpec(model=model, sample_fraction=0.0, max_new_tokens={"2": max_new_tokens}, rows=8)
    try:
        return examples_from_rows(run_shard(decoder, prompts, 2, spec))
    finally:
        decoder.close()


def check_agreement(artifacts: dict[str, Path], model: str, examples: list[dict], device: str = "auto") -> dict[str, dict]:
    """Per artifact: its teacher-forced top-1 agreement per draft depth on ``examples`` (``agreement``), the first
    depth's per category (``by_category``) and the answer tokens scored (``tokens``)."""
    import copy

    from decoding.drafters.artifacts import load_artifact
    from decoding.drafters.trained import Shared
    from decoding.model.loading import load_model
    from training.features import TargetFeatures
    from training.runs import DataRun
    from training.trainer import agreement_of, agreement_sums

    target = load_model(model, "float32", device).model
    features_model = load_model(model, "bfloat16", device, "auto").model
    dev = next(target.parameters()).device
    shared = Shared(target)
    out = {}
    for name, path in artifacts.items():
        art = load_artifact(str(path), target)
        module = copy.deepcopy(art.module).float()  # the weights as stored, in float: what training's evaluation runs
        run = DataRun(art.recipe.name)
        features = TargetFeatures(features_model, art.recipe.data_layers(art.knobs, target.config.num_hidden_layers), run.max_context)

        def prepare(ex, window, generator, device, features=features):
            return features.example(ex, window, generator, device)

        by_category = {}
        for kind in sorted({e["kind"] for e in examples}):
            subset = [e for e in examples if e["kind"] == kind]
            by_category[kind] = agreement_sums(art.recipe, module, shared, subset, art.knobs, run.window, dev, prepare)
        sums = [sum(x) for x in zip(*(s for s, _ in by_category.values()), strict=True)]
        rows = [sum(x) for x in zip(*(r for _, r in by_category.values()), strict=True)]
        out[name] = {
            "agreement": [round(a, 4) for a in agreement_of(sums, rows)],
            "by_category": {k: round(agreement_of(*v)[0], 4) for k, v in by_category.items()},
            "tokens": sum(int(e["tokens"].shape[0]) - e["answer_from"] for e in examples),
        }
    return out


def better(new: list[float], shipped: list[float]) -> bool:
    """Whether a new drafter's check agreements (per depth) are at least the shipped one's, summed over the depths
    (the expected accepted tokens of a chain, to first order).

    >>> better([0.40, 0.30], [0.38, 0.31]), better([0.36, 0.29], [0.38, 0.30])
    (True, False)
    """
    return sum(new) >= sum(shipped)
