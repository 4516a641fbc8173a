"""SWIFT, DEL, SpecDec++'s stop head and EAD on tiny random models: lossless where they must be, and each doing what it
says (the search keeps the better layer set, the exit choice follows the tracked acceptance, the stop head shortens
chains, EAD's switch and catch-up match a token-by-token reference)."""

import pytest
import torch
from conftest import tiny_llama
from tests_support import always_drafting_del, confidence_head, generate

from decoding.drafters.draft_model import DraftModelDrafter
from decoding.drafters.dynamic_exit import DECAY, TRACK_EVERY, DynamicExitDrafter, candidate_exits, choose_exit
from decoding.drafters.ead import EadDrafter, EntropySwitch
from decoding.drafters.early_exit import EarlyExitDrafter
from decoding.drafters.stop_head import AcceptanceStop, StopHead, stop_features
from decoding.drafters.swift import LayerSearch, SwiftDrafter, expected_speed, first_skip_set, kept_segments
from decoding.model.adapter import ModelAdapter
from decoding.sampling import SamplingParams

PROMPT = torch.tensor([[3, 7, 3, 7, 3]])


def quiet_layers(model, layers, scale=0.02):
    """Make ``layers`` nearly the identity (their attention and MLP outputs scaled down): skipping them, or exiting
    before them, changes the prediction little. Returns the model."""
    with torch.no_grad():
        for i in layers:
            model.model.layers[i].self_attn.o_proj.weight.mul_(scale)
            model.model.layers[i].mlp.down_proj.weight.mul_(scale)
    return model


@pytest.fixture(scope="module")
def deep():
    """6 layers whose 2nd and 3rd barely matter: the layer set SWIFT should find is (1, 2)."""
    return quiet_layers(tiny_llama(layers=6, seed=1), [1, 2])


@pytest.fixture(scope="module")
def top_quiet():
    """6 layers whose top three barely matter: an exit after layer 3 nearly always agrees."""
    return quiet_layers(tiny_llama(layers=6, seed=2), [3, 4, 5], scale=0.05)


# ---- SWIFT --------------------------------------------------------------------------------------------------------
def test_swift_layer_sets():
    assert first_skip_set(30, 0.4) == tuple(range(10, 21))  # 11 of the 28 skippable layers, around the middle
    assert kept_segments(first_skip_set(30, 0.4), 30) == [(0, 10), (21, 30)]
    assert expected_speed(0.0, 28, 30, 1.0, 8.0, 4) < 1.0  # drafting that is never accepted loses
    assert expected_speed(0.95, 10, 30, 1.0, 8.0, 6) > expected_speed(0.95, 20, 30, 1.0, 8.0, 6) > 1.0  # cheaper wins


def test_swift_is_greedy_lossless_and_its_search_finds_the_quiet_layers(deep):
    target = ModelAdapter(deep)
    ref = generate(target, PROMPT, max_new_tokens=120).token_ids
    search = LayerSearch(6, 0.5, trials=24, seed=0)
    assert search.best == (2, 3) and search.speed is None
    out = generate(target, PROMPT, drafter=SwiftDrafter(search), k=3, max_new_tokens=120)
    assert out.token_ids == ref  # the trials save and restore the window's KV: the output is AR's
    assert search.history and search.trials_left < 24
    assert search.best == (1, 2), search.history  # skip both quiet layers, no loud one: agrees best for what it costs
    assert search.speed > 1.0 and search.length >= 1
    again = generate(target, PROMPT, drafter=SwiftDrafter(search), k=3, max_new_tokens=60)
    assert again.token_ids == ref[:60] and again.stats.mean_accepted_tokens > 2.0  # found set: most drafts accepted


def test_swift_searches_in_the_steps_that_do_not_draft(deep):
    """The trials run after each step's verdict, drafted or not: k=auto may give SWIFT no budget for a whole request,
    and the search must not wait for its probes (one 60 ms trial each, spread over later requests)."""
    target = ModelAdapter(deep)
    search = LayerSearch(6, 0.5, trials=12, seed=0)
    out = generate(target, PROMPT, drafter=SwiftDrafter(search), k=0, max_new_tokens=60)
    assert out.token_ids == generate(target, PROMPT, max_new_tokens=60).token_ids
    assert all(step.drafted == 0 for step in out.steps)
    assert search.trials_left == 0 and search.history and search.speed is not None


def test_swift_takes_plain_steps_where_no_skipped_set_pays():
    loud = quiet_layers(tiny_llama(layers=6, seed=4), range(1, 5), scale=6.0)  # every skippable layer matters
    target = ModelAdapter(loud)
    search = LayerSearch(6, 0.5, trials=8, seed=0)
    out = generate(target, PROMPT, drafter=SwiftDrafter(search), k=3, max_new_tokens=80)
    assert out.token_ids == generate(target, PROMPT, max_new_tokens=80).token_ids
    assert search.history and search.speed is not None and search.speed < 1.0
    scored = len(out.steps) - 8  # after the first trials
    assert all(step.drafted == 0 for step in out.steps[scored:])


def test_swift_confidence_stop_drafts_less(deep):
    target = ModelAdapter(deep)
    plain = generate(target, PROMPT, drafter=SwiftDrafter(LayerSearch(6, 0.5, 0)), k=4, max_new_tokens=40)
    stopped = generate(target, PROMPT, drafter=SwiftDrafter(LayerSearch(6, 0.5, 0), confidence_threshold=0.9), k=4, max_new_tokens=40)
    assert stopped.token_ids == plain.token_ids
    assert sum(s.drafted for s in stopped.steps) < sum(s.drafted for s in plain.steps)


# ---- DEL ----------------------------------------------------------------------------------------------------------
def test_del_choice_is_tokens_per_layer():
    assert candidate_exits(6) == [3, 4] and candidate_exits(2) == [1]
    assert choose_exit([0.0, 0.0], [3, 4], depth=6, head=0.1, k=4) == (4, 0)  # nothing pays: a plain step
    exit_layer, j = choose_exit([0.97, 0.99], [3, 4], depth=6, head=0.1, k=4)
    assert exit_layer == 3 and j == 4  # nearly as good and cheaper: the lower exit, long drafts


def test_del_is_greedy_lossless_and_drafts_where_an_exit_agrees(top_quiet):
    target = ModelAdapter(top_quiet)
    ref = generate(target, PROMPT, max_new_tokens=80).token_ids
    drafter = DynamicExitDrafter(candidate_exits(6))
    out = generate(target, PROMPT, drafter=drafter, k=4, max_new_tokens=80)
    assert out.token_ids == ref
    alphas = drafter.alphas()
    assert alphas[0] > 0.8, alphas  # exit 3 agrees with the full model: tracked from the verification's features
    drafted = [c for c in drafter.choices if c[1] > 0]
    assert drafted and drafted[-1][0] == 3 and out.stats.mean_accepted_tokens > 2.0
    assert drafter.choices[0][1] == 0  # the first step knows nothing yet: a plain step


def test_del_where_no_exit_agrees_falls_back_to_plain_steps():
    model = quiet_layers(tiny_llama(layers=4, seed=0), [3], scale=6.0)  # a loud top layer: exiting before it disagrees
    target = ModelAdapter(model)
    drafter = DynamicExitDrafter(candidate_exits(4))
    out = generate(target, PROMPT, drafter=drafter, k=4, max_new_tokens=40)
    assert out.token_ids == generate(target, PROMPT, max_new_tokens=40).token_ids
    assert drafter.alphas()[0] < 0.2 and all(j == 0 for _, j in drafter.choices)

    # plain steps track ever more rarely while no exit pays (after 4, 8, 16 ...): the others' verifications capture
    # no candidate exit and score nothing
    assert drafter.plain_steps == len(out.steps)
    assert drafter.seen[0] < sum(DECAY**i for i in range(len(out.steps) // TRACK_EVERY + 2))  # every step would give ~20
    seen_layers, plain_step = [], drafter._plain_step

    def noting():
        plain_step()
        seen_layers.append(drafter.feature_layers)  # what the next step's verification captures

    drafter._plain_step = noting
    generate(target, PROMPT, drafter=drafter, k=4, max_new_tokens=40)
    tracked = [i for i, f in enumerate(seen_layers[:39]) if f]
    assert tracked == [0, TRACK_EVERY, 3 * TRACK_EVERY, 7 * TRACK_EVERY], tracked  # spacing 4, 8, 16


# ---- the stop head ------------------------------------------------------------------------------------------------
def test_stop_features_and_rule():
    f = stop_features(torch.tensor([[2.0, 1.0, 0.0, 0.0, float("-inf")]]))
    p = torch.tensor([2.0, 1.0, 0.0, 0.0]).softmax(-1)
    assert torch.allclose(f[0, :4], p) and torch.isclose(f[0, 7], p[0] - p[1])
    rule = AcceptanceStop(StopHead(hidden=4), stop_threshold=0.3)
    sure = torch.tensor([[8.0, 0.0, 0.0]])
    a = float(rule.accept_probability(sure))
    stops = [rule.stop(sure, i) for i in range(6)]
    assert stops == [1 - a ** (i + 1) > 0.3 for i in range(6)]  # 1 - prod a_j > h, restarted at i = 0
    with pytest.raises(Exception, match="stop_threshold"):
        AcceptanceStop(StopHead(), 0.0)


@pytest.mark.parametrize("name", ["sps", "early-exit", "swift", "del"])
def test_drafters_with_the_stop_head_are_greedy_lossless_and_draft_less(tiny_model, name):
    target = ModelAdapter(tiny_model)
    make = {
        "sps": lambda: DraftModelDrafter(ModelAdapter(tiny_model, num_layers=1)),
        "early-exit": lambda: EarlyExitDrafter(exit_layer=1),
        "swift": lambda: SwiftDrafter(LayerSearch(3, 0.5, trials=0)),
        "del": lambda: always_drafting_del(3),
    }[name]
    ref = generate(target, PROMPT, max_new_tokens=40).token_ids
    plain, stopped = make(), make()
    stopped.threshold = AcceptanceStop(confidence_head(), stop_threshold=0.5)
    out_plain = generate(target, PROMPT, drafter=plain, k=6, max_new_tokens=40)
    out = generate(target, PROMPT, drafter=stopped, k=6, max_new_tokens=40)
    assert out.token_ids == ref == out_plain.token_ids
    drafted = [s.drafted for s in out.steps]
    assert sum(drafted) < sum(s.drafted for s in out_plain.steps) and max(drafted) >= 1  # it stops, and it drafts


# ---- EAD ----------------------------------------------------------------------------------------------------------
def ead_reference(model, small, prompt, n, threshold, window, k):
    """EAD token by token, without caches: the window holds the entropy of the model that wrote each position; the
    small model writes while the window's mean with its entropy stays at or under the threshold, and is not asked while
    the mean is above it; a run of k small tokens ends with a large-model token (the loop's step)."""
    switch = EntropySwitch(threshold, window)
    ids = prompt[0].tolist()
    with torch.inference_mode():
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))  # the prefill's token is the target's
        run, large, sat_out = 0, 1, 0
        while len(ids) - prompt.shape[1] < n:
            ask = run < k and switch.small_may_write()  # a check that fails backs off: asked once a position
            sat_out += run < k and not ask
            if ask:
                logits = small(torch.tensor([ids]))[-1:]  # [1, V]
                if not switch.stop(logits, run):
                    ids.append(int(logits.argmax()))
                    run += 1
                    continue
            logits = model(torch.tensor([ids])).logits[0, -1]
            switch.large_wrote(logits)
            ids.append(int(logits.argmax()))
            run, large = 0, large + 1
    return ids[prompt.shape[1] :][:n], large, sat_out


def small_of(model, layers):
    a = ModelAdapter(model, num_layers=layers, fast=False)
    return lambda ids: a.logits(a.forward(a.new_cache(1, ids.shape[1]), 0, input_ids=ids))[0]


def test_ead_matches_the_token_by_token_reference(tiny_model):
    target = ModelAdapter(tiny_model)
    sat_outs = []
    for threshold in (1.2, 1.4):
        drafter = EadDrafter(ModelAdapter(tiny_model, num_layers=1), threshold, window=3)
        out = generate(target, PROMPT, drafter=drafter, k=6, max_new_tokens=60)
        ref, large, sat_out = ead_reference(tiny_model, small_of(tiny_model, 1), PROMPT, 60, threshold, 3, 6)
        assert out.token_ids[:50] == ref[:50], threshold  # the last step's run is cut by max_new_tokens, the reference's is not
        assert 10 <= large <= 50, (threshold, large)  # both models wrote a fair share: the switch went both ways
        sat_outs.append(sat_out)
    assert sum(sat_outs) >= 10, sat_outs  # positions where the small model was not asked (asked, it could have written them)


def test_ead_extremes_and_its_shares(tiny_model):
    target = ModelAdapter(tiny_model)
    ar = generate(target, PROMPT, max_new_tokens=40).token_ids
    never = generate(target, PROMPT, drafter=EadDrafter(ModelAdapter(tiny_model, num_layers=1), 0.0, 2), k=8, max_new_tokens=40)
    assert never.token_ids == ar and all(s.drafted == 0 for s in never.steps)  # entropy is never under 0: all large
    # the small model is the target itself: whatever it writes is what the target would have written
    same = generate(target, PROMPT, drafter=EadDrafter(ModelAdapter(tiny_model), 99.0, 2), k=8, max_new_tokens=40)
    assert same.token_ids == ar and same.stats.mean_accepted_tokens > 5
    weak = generate(target, PROMPT, drafter=EadDrafter(ModelAdapter(tiny_model, num_layers=1), 99.0, 2), k=8, max_new_tokens=40)
    assert weak.token_ids != ar  # unverified: lossy
    from evaluation.bench_figures import large_share

    assert 0.0 < large_share(len(weak.token_ids), weak.steps) <= 1 / 9 + 0.05  # one large token per run of 8


def test_ead_samples_with_its_own_generator(tiny_model):
    target = ModelAdapter(tiny_model)
    outs = [
        generate(
            target,
            PROMPT,
            drafter=EadDrafter(ModelAdapter(tiny_model, num_layers=1), 1.2, 3),
            k=6,
            sampling=SamplingParams(temperature=1.0),
            max_new_tokens=30,
            generator=torch.Generator().manual_seed(seed),
        ).token_ids
        for seed in (0, 0, 1)
    ]
    assert outs[0] == outs[1] != outs[2]
