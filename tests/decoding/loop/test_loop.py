"""The decoding loop on a tiny random model: exact distributions, EOS, lengths, cache rollback."""

import itertools

import pytest
import torch
from tests_support import always_drafting_del, confidence_head, generate

from decoding.drafters.draft_model import DraftModelDrafter
from decoding.drafters.early_exit import EarlyExitDrafter
from decoding.drafters.ngram import NgramDrafter
from decoding.drafters.stop_head import AcceptanceStop
from decoding.drafters.swift import LayerSearch, SwiftDrafter
from decoding.loop import step as loop_module
from decoding.loop.metrics import chi_square_pvalue
from decoding.loop.verify import verify_speculative
from decoding.model.adapter import ModelAdapter
from decoding.sampling import SamplingParams, sample_from, warp

PROMPT = torch.tensor([[3, 7, 3, 7, 3]])  # repeats, so prompt lookup has something to propose
N_TOKENS = 3  # joint distribution of the first 3 new tokens (tokens 2 and 3 come from speculative steps)
# Draws per distribution test: the broken rule below gives p ~ 4e-6 at 300 draws, well under the 1e-4 the right rules must
# pass; the control itself runs CONTROL_DRAWS and must reach 1e-6 (4e-8 at 400).
DRAWS, CONTROL_DRAWS = 300, 400


def drafters(model):
    return {
        "ar": None,
        "sps": DraftModelDrafter(ModelAdapter(model, num_layers=1)),
        "early-exit": EarlyExitDrafter(exit_layer=1),
        "ngram": NgramDrafter(ngram_max=2, ngram_min=1),
        "swift": SwiftDrafter(LayerSearch(model.config.num_hidden_layers, 0.5, trials=0)),
        "del": always_drafting_del(model.config.num_hidden_layers),
        # SpecDec++'s stop head on chains of each kind of model drafter
        "sps+stop": with_rule(DraftModelDrafter(ModelAdapter(model, num_layers=1))),
        "early-exit+stop": with_rule(EarlyExitDrafter(exit_layer=1)),
        "swift+stop": with_rule(SwiftDrafter(LayerSearch(model.config.num_hidden_layers, 0.5, trials=0))),
        "del+stop": with_rule(always_drafting_del(model.config.num_hidden_layers)),
    }


def with_rule(drafter):
    drafter.threshold = AcceptanceStop(confidence_head(), stop_threshold=0.5)
    return drafter


def exact_joint(model, prompt, n, sampling):
    """P(first n new tokens) under plain sampling from the target, by enumeration: [V] * n."""
    v = model.config.vocab_size
    joint = torch.ones([v] * 0, dtype=torch.float64)
    with torch.inference_mode():
        for depth in range(n):
            prefixes = list(itertools.product(range(v), repeat=depth))
            ids = torch.tensor([list(prompt[0]) + list(p) for p in prefixes])
            probs = warp(model(input_ids=ids).logits[:, -1], sampling).double()  # [V^depth, V]
            joint = joint.reshape(-1, 1) * probs
    return joint.reshape([v] * n)


def sample_counts(model, drafter, sampling, k=2, draws=DRAWS, seed=0):
    target = ModelAdapter(model)
    v = model.config.vocab_size
    counts = torch.zeros([v] * N_TOKENS, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(draws):
        out = generate(target, PROMPT, drafter=drafter, k=k, sampling=sampling, max_new_tokens=N_TOKENS + 1, generator=gen)
        counts[tuple(out.token_ids[:N_TOKENS])] += 1
    return counts


SAMPLING = SamplingParams(temperature=1.0)
WARPED = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)


@pytest.mark.parametrize(
    "method", ["ar", "sps", "early-exit", "ngram", "swift", "del", "sps+stop", "early-exit+stop", "swift+stop", "del+stop"]
)
def test_sampled_distribution_matches_target(tiny_model, method):
    counts = sample_counts(tiny_model, drafters(tiny_model)[method], SAMPLING)
    p = chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, SAMPLING))
    assert p > 1e-4, f"{method}: sampled tokens do not follow the target (p={p:.2e})"


def test_sampled_distribution_with_top_k_top_p(tiny_model):
    counts = sample_counts(tiny_model, drafters(tiny_model)["sps"], WARPED, k=3)
    assert chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, WARPED)) > 1e-4


def test_drafts_are_actually_rejected_sometimes(tiny_model):
    # the distribution tests only mean something if drafts and target disagree
    target = ModelAdapter(tiny_model)
    gen = torch.Generator().manual_seed(0)
    rates = []
    for _ in range(50):
        out = generate(target, PROMPT, drafter=drafters(tiny_model)["sps"], k=3, sampling=SAMPLING, max_new_tokens=8, generator=gen)
        rates.append(out.stats.acceptance_rate)
    mean = sum(rates) / len(rates)
    assert 0.1 < mean < 0.9, mean


def test_wrong_rule_is_caught_end_to_end(tiny_model, monkeypatch):
    def resample_from_p(drafts, q, p, u_accept, u_sample, *rest):  # rejection draws from p, not the residual
        verdict = verify_speculative(drafts, q, p, u_accept, u_sample, *rest)
        rows = torch.arange(drafts.shape[0])
        m = verdict.num_accepted
        verdict.tokens[rows, m] = sample_from(p[rows, m], u_sample)
        return verdict

    monkeypatch.setattr(loop_module, "verify_speculative", resample_from_p)
    counts = sample_counts(tiny_model, drafters(tiny_model)["sps"], SAMPLING, draws=CONTROL_DRAWS)
    assert chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, SAMPLING)) < 1e-6


@pytest.mark.parametrize("method", ["ar", "sps", "early-exit", "ngram"])
@pytest.mark.parametrize("max_new", [1, 2, 5, 9])
def test_max_new_tokens_exact(tiny_model, method, max_new):
    out = generate(ModelAdapter(tiny_model), PROMPT, drafter=drafters(tiny_model)[method], k=4, max_new_tokens=max_new)
    assert len(out.token_ids) == max_new and out.finish_reason == "length"


@pytest.mark.parametrize("method", ["ar", "sps", "early-exit", "ngram"])
def test_greedy_equals_ar_on_tiny_model(tiny_model, method):
    target = ModelAdapter(tiny_model)
    ref = generate(target, PROMPT, max_new_tokens=30).token_ids
    out = generate(target, PROMPT, drafter=drafters(tiny_model)[method], k=3, max_new_tokens=30)
    assert out.token_ids == ref


@pytest.mark.parametrize("method", ["ar", "sps", "early-exit", "ngram"])
def test_stops_right_after_eos(tiny_model, method):
    target = ModelAdapter(tiny_model)
    ref = generate(target, PROMPT, max_new_tokens=30).token_ids
    eos = ref[6]  # pretend the 7th token is EOS; stop at its first occurrence
    cut = ref.index(eos) + 1
    out = generate(target, PROMPT, drafter=drafters(tiny_model)[method], k=4, max_new_tokens=30, eos_token_ids=[eos])
    assert out.token_ids == ref[:cut] and out.finish_reason == "stop"


def test_greedy_matches_transformers_generate(tiny_model):
    ref = tiny_model.generate(PROMPT, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)[0, PROMPT.shape[1] :]
    assert generate(ModelAdapter(tiny_model), PROMPT, max_new_tokens=20).token_ids == ref.tolist()


def test_cache_rollback_is_a_pointer_move(tiny_model):
    a = ModelAdapter(tiny_model)
    seq = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    straight = a.new_cache(1, 16)
    a.forward(straight, 0, input_ids=seq[:, :5])
    expected = a.forward(straight, 5, input_ids=seq[:, 5:])
    cache = a.new_cache(1, 16)
    a.forward(cache, 0, input_ids=seq[:, :5])
    a.forward(cache, 5, input_ids=torch.tensor([[9, 9, 9, 9]]))  # a rejected branch, written past 5
    cache.rollback(5)
    again = a.forward(cache, 5, input_ids=seq[:, 5:])
    assert torch.equal(again, expected)  # the rejected branch left no trace
    # and the same as one forward over the whole sequence, up to float32 rounding of other shapes
    torch.testing.assert_close(again, a.forward(a.new_cache(1, 16), 0, input_ids=seq)[:, 5:], rtol=1e-4, atol=1e-4)


def test_partial_layers_compose(tiny_model):
    a = ModelAdapter(tiny_model)
    seq = torch.tensor([[4, 1, 5, 9, 2]])
    full = a.forward(a.new_cache(1, 8), 0, input_ids=seq)
    cache = a.new_cache(1, 8)
    mid = a.forward(cache, 0, input_ids=seq, last=1)
    torch.testing.assert_close(a.forward(cache, 0, hidden=mid, first=1), full)


def test_bad_inputs(tiny_model):
    a = ModelAdapter(tiny_model)
    with pytest.raises(ValueError, match="empty prompt"):
        generate(a, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="context"):
        generate(a, PROMPT, max_new_tokens=1000)
    with pytest.raises(ValueError, match="num_layers"):
        ModelAdapter(tiny_model, num_layers=9)
