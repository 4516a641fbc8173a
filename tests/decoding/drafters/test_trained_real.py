"""Greedy equality against AR for every trained-drafter recipe on the real SmolLM2 (float32, 3 prompts x 32 tokens).

The modules are untrained initialisations (a copy of target layers, zero-initialised heads): losslessness does not
depend on what a drafter learned, only on the drafter's cache bookkeeping, which these runs exercise. The feature
head's initialisation drafts nothing acceptable, so it is first fitted for a few steps on these very AR outputs
(over-fitting is the point: accepted drafts exercise its cache bookkeeping). The EAGLE head runs as shipped for the
bundled model (method ``eagle``'s default drafter).
"""

import pytest
from tests_support import spec_bench_prompts

from decoding.config import SpecConfig
from decoding.drafters.artifacts import save_artifact
from decoding.drafters.trained import RECIPES, get_recipe
from decoding.in_process import SpecDecoder

PROMPTS = spec_bench_prompts(per_category=1, categories=["writing", "coding", "summarization"])
BASE = SpecConfig(dtype="float32", max_new_tokens=32, adaptive_k=False)  # fixed k: these check that drafts are accepted
KNOBS = {
    "kangaroo": {"exit_layer": 12},
    "medusa": {"num_heads": 3},
    "hydra": {"num_heads": 3},
    "feature": {},
    "distill": {"draft_layers": 4},
    "eagle": {},  # the shipped head of the bundled model (method eagle's default drafter)
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ar_outputs(ar_greedy):
    return {q["question_id"]: ar_greedy(q, BASE.max_new_tokens) for q in PROMPTS}


def test_every_recipe_is_covered():
    assert set(KNOBS) == {name for name, recipe in RECIPES.items() if recipe.drafts}  # 'stop' drafts no tokens


def fit_briefly(loaded, ar_outputs, out):
    import torch

    from decoding.model.adapter import ModelAdapter
    from training.data import extract_hidden
    from training.trainer import TrainSpec, train

    dec, examples = SpecDecoder(BASE), []
    for q in PROMPTS:
        tokens = torch.cat([dec.encode(q["turns"][0], chat=True)[0], torch.tensor(ar_outputs[q["question_id"]])])
        start = tokens.shape[0] - 48
        hidden = extract_hidden(ModelAdapter(loaded.model), tokens, [30], start)
        examples.append({"tokens": tokens, "start": start, "hidden": {30: torch.from_numpy(hidden[30])}})
    spec = TrainSpec("feature", KNOBS["feature"], steps=30, batch=3, lr=3e-3, window=48, train_vocab=2048)
    train(spec, loaded.model, examples * 2, out, "smollm2-135m", progress=False)


@pytest.mark.parametrize("recipe", list(KNOBS))
def test_trained_drafter_is_token_identical_to_ar(recipe, ar_outputs, smollm2_fp32, tmp_path):
    if recipe == "eagle":
        dec = SpecDecoder(BASE.replace(method="eagle"))
    else:
        if recipe == "feature":
            fit_briefly(smollm2_fp32, ar_outputs, tmp_path)
        else:
            module = get_recipe(recipe).build(smollm2_fp32.model, KNOBS[recipe])
            save_artifact(tmp_path, recipe, KNOBS[recipe], module, smollm2_fp32.model, "smollm2-135m", training={"steps": 0})
        threshold = 0.1 if recipe == "kangaroo" else 0.0
        dec = SpecDecoder(BASE.replace(method="trained", drafter=str(tmp_path), k=3, confidence_threshold=threshold))
    accepted = 0
    for q in PROMPTS:
        out = dec.generate_ids(dec.encode(q["turns"][0], chat=True))
        assert out.token_ids == ar_outputs[q["question_id"]], f"{recipe} diverged from AR on question {q['question_id']}"
        accepted += sum(s.accepted for s in out.steps)
    assert accepted > 0
