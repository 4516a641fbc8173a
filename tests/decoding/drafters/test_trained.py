"""Trained drafters on a tiny random model: lossless (greedy equality, sampled distribution), artifacts, fingerprints."""

import pytest
import torch
from conftest import tiny_llama
from tests_support import generate

from decoding import accel
from decoding.config import SpecConfig
from decoding.drafters.artifacts import load_artifact, save_artifact, stored_copy
from decoding.drafters.trained import RECIPES, get_recipe
from decoding.errors import ConfigError
from decoding.loop.metrics import chi_square_pvalue
from decoding.model.adapter import ModelAdapter
from decoding.model.loading import model_fingerprint
from decoding.trees.shapes import Dynamic, Tree
from kernels import cpu_int4
from tests.decoding.loop.test_loop import N_TOKENS, PROMPT, SAMPLING, exact_joint, sample_counts

KNOBS = {
    "kangaroo": {"exit_layer": 1},
    "distill": {"draft_layers": 1},
    "medusa": {"num_heads": 3},
    "hydra": {"num_heads": 3},
    "feature": {"feature_weight_pct": 100},
    "eagle": {"draft_vocab": 12},
}


def perturbed(model, recipe, seed=0):
    """The recipe's module with its trained parts moved off their initialisation (so drafts differ from the target)."""
    module = get_recipe(recipe).build(model, KNOBS[recipe])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return module.eval().requires_grad_(False)


def drafter(model, recipe, threshold=0.0):
    return get_recipe(recipe).drafter(perturbed(model, recipe), KNOBS[recipe], threshold)


def test_every_recipe_is_tested():
    assert set(KNOBS) == {name for name, r in RECIPES.items() if r.drafts}  # the stop head's: tests/training/test_train.py


@pytest.mark.parametrize("recipe", list(KNOBS))
@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_greedy_equals_ar(tiny_model, recipe, threshold):
    target = ModelAdapter(tiny_model)
    g = torch.Generator().manual_seed(1)
    accepted = 0
    for _ in range(4):
        prompt = torch.randint(0, 12, (1, 5), generator=g)
        ref = generate(target, prompt, max_new_tokens=20).token_ids
        out = generate(target, prompt, drafter=drafter(tiny_model, recipe, threshold), k=3, max_new_tokens=20)
        assert out.token_ids == ref
        accepted += sum(s.accepted for s in out.steps)
    assert accepted > 0  # some drafts were accepted, so the drafter's own cache bookkeeping was exercised


@pytest.mark.parametrize("recipe", list(KNOBS))
def test_sampled_distribution_matches_target(tiny_model, recipe):
    counts = sample_counts(tiny_model, drafter(tiny_model, recipe), SAMPLING, k=2, draws=300)
    p = chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, SAMPLING))
    assert p > 1e-4, f"{recipe}: sampled tokens do not follow the target (p={p:.2e})"


def test_artifact_round_trip_and_wrong_target(tiny_model, tmp_path):
    module = perturbed(tiny_model, "hydra")
    save_artifact(tmp_path / "h", "hydra", {"num_heads": 3}, module, tiny_model, "tiny", training={"steps": 0})
    art = load_artifact(str(tmp_path / "h"), tiny_model)
    assert art.knobs == {"num_heads": 3} and art.description["target"]["name"] == "tiny"
    kept = stored_copy(module, "hydra", {"num_heads": 3}, tiny_model)  # Hydra's layers start random or at zero: 8 bits
    for k, v in module.state_dict().items():
        assert torch.equal(art.module.state_dict()[k], kept.state_dict()[k]), k
        assert torch.allclose(art.module.state_dict()[k], v, atol=0.01 * float(v.abs().max())), k
    other = tiny_llama(seed=1)
    with pytest.raises(ConfigError) as e:
        load_artifact(str(tmp_path / "h"), other)
    assert e.value.field == "drafter" and "fingerprint" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_artifact(str(tmp_path / "missing"), tiny_model)
    assert e.value.field == "drafter"


def test_fingerprint_ignores_dtype_not_weights(tiny_model):
    import copy

    bf16 = copy.deepcopy(tiny_model).to(torch.bfloat16)
    assert model_fingerprint(bf16) == model_fingerprint(tiny_model)
    assert model_fingerprint(tiny_llama(seed=1)) != model_fingerprint(tiny_model)


def test_config_needs_a_drafter_for_trained():
    with pytest.raises(ConfigError) as e:
        SpecConfig(method="trained")
    assert e.value.field == "drafter"
    assert SpecConfig().for_method("trained:x") == SpecConfig(method="trained", drafter="x")
    with pytest.raises(ConfigError) as e:
        get_recipe("kangaroo").check({"exit_layer": 3}, depth=3)
    assert e.value.field == "exit_layer"


@pytest.mark.parametrize("recipe", list(KNOBS))
def test_vocab_trimmed_drafters_stay_lossless(tiny_model, recipe, tmp_path):
    """VocabTrim: drafting over 6 of the 12 tokens; greedy equals AR and sampling follows the target."""
    module = perturbed(tiny_model, recipe)
    save_artifact(tmp_path, recipe, KNOBS[recipe], module, tiny_model, "tiny", training={}, vocab=torch.tensor([3, 7, 1, 0, 5, 9, 2]))
    art = load_artifact(str(tmp_path), tiny_model)
    target = ModelAdapter(tiny_model)
    prompt = torch.tensor([[3, 7, 3, 7, 3]])
    d = art.drafter(0.0, draft_vocab=6)
    drafted, propose = [], d.propose

    def recording(state, k):
        p = propose(state, k)
        drafted.extend(p.tokens[0].tolist())
        return p

    d.propose = recording
    out = generate(target, prompt, drafter=d, k=3, max_new_tokens=16)
    assert out.token_ids == generate(target, prompt, max_new_tokens=16).token_ids
    assert drafted and set(drafted) <= {3, 7, 1, 0, 5, 9}
    counts = sample_counts(tiny_model, art.drafter(0.0, draft_vocab=6), SAMPLING, k=2, draws=300)
    assert chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, SAMPLING)) > 1e-4


TREE_RECIPES = ["medusa", "hydra", "distill", "eagle"]
TREE_SHAPES = {
    "static": Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
    "dyspec": Dynamic(6),
}


def tree_drafter(model, recipe, shape):
    return get_recipe(recipe).drafter(perturbed(model, recipe), KNOBS[recipe], 0.0, TREE_SHAPES[shape])


@pytest.mark.parametrize("recipe", TREE_RECIPES)
@pytest.mark.parametrize("shape", list(TREE_SHAPES))
def test_tree_drafts_greedy_equal_ar(tiny_model, recipe, shape):
    """Medusa / Hydra / distilled drafts as token trees: greedy equals AR, and proposals really are trees."""
    target = ModelAdapter(tiny_model)
    d = tree_drafter(tiny_model, recipe, shape)
    widths, propose = [], d.propose

    def recording(state, k):
        p = propose(state, k)
        assert p.tree is not None and p.tree.size == p.tokens.shape[1] + 1
        widths.append(p.tokens.shape[1] - int(p.tree.depth.max()))  # > 0: some node has a sibling
        return p

    d.propose = recording
    g = torch.Generator().manual_seed(3)
    accepted = 0
    for _ in range(3):
        prompt = torch.randint(0, 12, (1, 5), generator=g)
        out = generate(target, prompt, drafter=d, k=3, max_new_tokens=20)
        assert out.token_ids == generate(target, prompt, max_new_tokens=20).token_ids
        accepted += sum(s.accepted for s in out.steps)
    assert accepted > 0 and max(widths) > 0


@pytest.mark.parametrize("recipe", ["medusa", "hydra", "eagle"])
@pytest.mark.parametrize("shape", list(TREE_SHAPES))
def test_tree_drafts_sample_the_target(tiny_model, recipe, shape):
    counts = sample_counts(tiny_model, tree_drafter(tiny_model, recipe, shape), SAMPLING, k=2, draws=300)
    p = chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, SAMPLING))
    assert p > 1e-4, f"{recipe} {shape}: sampled tokens do not follow the target (p={p:.2e})"


@pytest.mark.parametrize("recipe", ["kangaroo", "feature"])
def test_chain_only_recipes_reject_trees(tiny_model, recipe):
    with pytest.raises(ConfigError) as e:
        tree_drafter(tiny_model, recipe, "dyspec")
    assert e.value.field == "tree" and "chains only" in str(e.value)


TRIMMED = [("kangaroo", {"exit_layer": 1, "draft_vocab": 8}), ("distill", {"draft_layers": 1, "draft_vocab": 8})]


@pytest.mark.parametrize("recipe,knobs", TRIMMED)
def test_trained_trimmed_heads_stay_lossless(tiny_model, recipe, knobs, tmp_path):
    """A distilled draft or Kangaroo adapter with its own trained head over 8 tokens: saved, loaded, greedy equals
    AR, sampling follows the target, and its drafts stay inside its tokens."""
    r = get_recipe(recipe)
    module = r.build(tiny_model, r.check(knobs, 3))
    r.prepare(module, torch.tensor([3, 7, 1, 0, 5, 9, 2, 4, 6]))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    save_artifact(tmp_path, recipe, r.check(knobs, 3), module, tiny_model, "tiny", training={})
    art = load_artifact(str(tmp_path), tiny_model)
    assert art.module.lm_head.vocab.tolist() == [3, 7, 1, 0, 5, 9, 2, 4]
    target = ModelAdapter(tiny_model)
    prompt = torch.tensor([[3, 7, 3, 7, 3]])
    d = art.drafter(0.0)
    drafted, propose = [], d.propose

    def recording(state, k):
        p = propose(state, k)
        drafted.extend(p.tokens[0].tolist())
        return p

    d.propose = recording
    assert generate(target, prompt, drafter=d, k=3, max_new_tokens=16).token_ids == generate(target, prompt, max_new_tokens=16).token_ids
    assert drafted and set(drafted) <= {3, 7, 1, 0, 5, 9, 2, 4}
    counts = sample_counts(tiny_model, art.drafter(0.0), SAMPLING, k=2, draws=300)
    assert chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, SAMPLING)) > 1e-4


def test_a_broken_rule_is_caught_with_the_feature_head(tiny_model, monkeypatch):
    """The control for the eagle drafter's distribution test: the same counts under a wrong rule (rejection draws
    from p instead of the residual) fail it."""
    import decoding.loop.step as loop_module
    from decoding.loop.verify import verify_speculative
    from decoding.sampling import sample_from

    def resample_from_p(drafts, q, p, u_accept, u_sample, *rest):
        verdict = verify_speculative(drafts, q, p, u_accept, u_sample, *rest)
        rows = torch.arange(drafts.shape[0])
        verdict.tokens[rows, verdict.num_accepted] = sample_from(p[rows, verdict.num_accepted], u_sample)
        return verdict

    monkeypatch.setattr(loop_module, "verify_speculative", resample_from_p)
    counts = sample_counts(tiny_model, drafter(tiny_model, "eagle"), SAMPLING, k=2, draws=800)  # p ~ 5e-10 here; right rule 0.99
    assert chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, SAMPLING)) < 1e-6


PACKED_DRAFTERS = [
    ("eagle", {"draft_vocab": 16}),
    ("kangaroo", {"exit_layer": 1, "draft_vocab": 16}),
    ("distill", {"draft_layers": 2, "draft_vocab": 16}),
]


@pytest.mark.parametrize(("recipe", "knobs"), PACKED_DRAFTERS)
@pytest.mark.parametrize("mode", ["q4", "int8"])
def test_a_trained_drafter_runs_packed_like_its_packed_target(tmp_path, recipe, knobs, mode):
    """A target on packed kernels (quant) gets drafters whose own matrices run packed too: a one-layer drafter in the
    target's mode, a deeper one in int8; the weights as trained stay (the artifact loaded for a dense twin of the
    target holds the same tensors); and greedy output still follows AR."""
    import copy

    from decoding.drafters.eagle import EagleNet
    from decoding.model.quant import PackedLinear, quantize_model
    from evaluation.bench_figures import compare_to_reference, reference_margins

    model = tiny_llama(vocab=32).to(torch.bfloat16)
    model.specray_quant = quantize_model(model, mode)
    dense_twin = copy.deepcopy(model)  # the same (quantised) weights, run dense: the same fingerprint
    del dense_twin.specray_quant
    module = get_recipe(recipe).build(model, knobs)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.3)
    save_artifact(tmp_path, recipe, knobs, module, model, "tiny", training={})
    packed, dense = load_artifact(str(tmp_path), model), load_artifact(str(tmp_path), dense_twin)

    want = mode if len(packed.module.model.layers) == 1 else "int8"
    assert packed.module.specray_quant.mode == want and getattr(dense.module, "specray_quant", None) is None
    fast = "-fast" if want == "q4" and cpu_int4.extension() is not None else ""  # 4-bit on the CPU kernel where built
    kv = "-fused" if accel.has("attend_cpu") else "-f32kv"  # a float32 cache unless the CPU kernels attend
    assert ModelAdapter(packed.module).implementation == f"layers{kv}-{want}-dense{fast}"
    assert isinstance(packed.module.lm_head.packed, PackedLinear) and dense.module.lm_head.packed is None
    if isinstance(packed.module, EagleNet):
        assert set(packed.module.packed) == {"fc_features", "fc_in"}
    for name, tensor in dense.module.state_dict().items():
        assert torch.equal(packed.module.state_dict()[name], tensor), name

    target = ModelAdapter(model)
    prompt = torch.tensor([[3, 7, 1, 9, 4, 3, 7]])
    ar = generate(target, prompt, max_new_tokens=20).token_ids
    out = generate(target, prompt, drafter=packed.drafter(0.0), k=3, max_new_tokens=20)
    verdict = compare_to_reference(out.token_ids, ar, reference_margins(target, prompt, ar), "bfloat16")
    assert not verdict["suspicious"], verdict
    assert sum(s.drafted for s in out.steps) > 0


def test_kangaroo_catches_up_on_the_positions_of_plain_steps(tiny_model):
    """k=auto runs plain steps without asking the drafter (``step.propose`` at k=0). The Kangaroo adapter's cache must
    still hold every committed position when it next drafts: it catches up from the hidden states after L layers that
    the target's own forward kept, so its cache equals that of an adapter fed every position at once. Before, those
    positions were never fed, and it drafted over keys its cache never held."""
    from decoding.drafters.base import Proposal
    from decoding.drafters.trained import KangarooDrafter

    class OneInThree(KangarooDrafter):  # drafts on one step in three; the others are plain, as k=auto makes them
        calls = 0

        def propose(self, state, k):
            self.calls += 1
            if self.calls % 3:
                return Proposal.empty(state.tokens.shape[0], state.tokens.device)
            return super().propose(state, k)

    target = ModelAdapter(tiny_model)
    d = drafter(tiny_model, "kangaroo")
    d.__class__ = OneInThree
    prompt = torch.randint(0, 12, (1, 6), generator=torch.Generator().manual_seed(3))
    out = generate(target, prompt, drafter=d, k=3, max_new_tokens=24)
    assert out.token_ids == generate(target, prompt, max_new_tokens=24).token_ids
    assert sum(s.drafted > 0 for s in out.steps) >= 3 and sum(s.drafted == 0 for s in out.steps) >= 6
    tokens = torch.cat([prompt, torch.tensor([out.token_ids])], 1)
    fed = d.cache.length  # positions 0..fed-1 are in the adapter's cache (catch-ups after plain steps among them)
    assert fed >= prompt.shape[1] + 12
    h = target.forward(target.new_cache(1, fed), 0, input_ids=tokens[:, :fed], last=d.exit_layer)
    ref = d.net.new_cache(1, fed + 4)
    d.net.forward(ref, 0, hidden=h)
    assert torch.allclose(d.cache.k_all[..., :fed, :], ref.k_all[..., :fed, :], atol=1e-5)
    assert torch.allclose(d.cache.v_all[..., :fed, :], ref.v_all[..., :fed, :], atol=1e-5)
