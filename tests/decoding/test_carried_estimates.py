"""k=auto across requests: a decoder's later request starts from what its earlier ones measured of the drafter.

Without it every request starts at the prior (acceptance 0.5, drafts free) and a drafter that does not pay drafts its
first steps of every request at a loss (on this CPU the early-exit adapter, the distilled draft and eagle lost 1-4%
over the hard Spec-Bench categories so).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from decoding.config import SpecConfig
from decoding.in_process import SpecDecoder
from decoding.loop.goodput import PROBE_EVERY, Acceptance

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = torch.tensor([[3, 7, 3, 7, 3]])


def decoder(tiny_model_dir, **changes):
    cfg = SpecConfig(model=str(tiny_model_dir), dtype="float32", method="sps", draft_layers=1, k=3, max_new_tokens=24)
    return SpecDecoder(cfg.replace(**changes))


def test_a_later_request_starts_from_the_earlier_ones_estimates(tiny_model_dir):
    dec = decoder(tiny_model_dir)
    first = dec.sequence(PROMPT)
    prior = Acceptance.of_drafter(model_free=False).alpha
    assert first.adaptive and first.acceptance.alpha == prior and first.draft_cost(2) == 0.0  # the prior
    dec.run(first)
    assert first.draft_cost.n > 0  # it drafted (at least its first steps, on the prior)
    first.acceptance.probe_every = 4 * PROBE_EVERY  # as after probes that lost
    second = dec.sequence(PROMPT)
    assert second.acceptance is not first.acceptance and second.draft_cost is not first.draft_cost
    # a model drafter's rows share its record: the second starts from it, not from the first row's own steps
    assert second.acceptance.pool is first.acceptance.pool and second.acceptance.alpha == pytest.approx(first.acceptance.pool.hopeful)
    assert second.acceptance.pool.alpha != pytest.approx(prior)
    assert second.draft_cost(2) == pytest.approx(first.draft_cost(2)) and second.draft_cost(2) > 0
    assert second.acceptance.probe_every == 4 * PROBE_EVERY  # a model drafter's probes cost a step: the wait carries
    # greedy: what was carried changes when it drafts, never what it says
    assert dec.run(second).token_ids == dec.run(decoder(tiny_model_dir, method="ar").sequence(PROMPT)).token_ids
    # the decoder keeps the estimators, not the sequence (whose state holds its cache's storage, which a GPU pool
    # recycles, graphs and all, once it is gone)
    gone = weakref.ref(second)
    del first, second
    gc.collect()
    assert gone() is None


def test_model_free_rows_carry_acceptance_but_probe_soon(tiny_model_dir):
    dec = decoder(tiny_model_dir, method="ngram")
    first = dec.sequence(PROMPT)
    first.acceptance.observe(drafted=3, accepted=0)
    first.acceptance.probe_every = 8 * PROBE_EVERY
    second = dec.sequence(PROMPT)
    assert second.acceptance.alpha == pytest.approx(first.acceptance.alpha) and first.acceptance.alpha < 0.5
    assert second.acceptance.probe_every == PROBE_EVERY  # what a prompt offers to copy is the prompt's


@pytest.mark.parametrize("changes", [dict(draft_memory="cold"), dict(adaptive_k=False)])
def test_nothing_is_carried_for_cold_memory_or_a_fixed_k(tiny_model_dir, changes):
    dec = decoder(tiny_model_dir, **changes)
    first = dec.sequence(PROMPT)
    for _ in range(5):
        first.acceptance.observe(drafted=3, accepted=0)
    later = dec.sequence(PROMPT).acceptance
    assert later.alpha == Acceptance.of_drafter(model_free=False).alpha and later.pool is not first.acceptance.pool


@pytest.mark.parametrize("method", ["suffix", "hybrid"])
def test_forgetting_the_text_of_earlier_requests_keeps_what_they_measured(tiny_model_dir, method):
    """A decoder's suffix cache (and Token Recycling's adjacency) drafts a prompt run again from its own earlier answer:
    a benchmark's repeats must not (``SpecDecoder.forget_text``, called by the bench between repeats and after the
    warm-up). A fixed k makes the steps a function of what the drafter knows: after forgetting, suffix decoding runs the
    prompt again step for step as the first time; the hybrid keeps what it measured (its calibration, the ranks' record),
    which shapes its trees, but no longer copies itself."""
    dec = decoder(tiny_model_dir, method=method, k=4, adaptive_k=False, max_new_tokens=32)
    prompt = torch.tensor([[11, 5, 42, 9, 17, 3]])
    steps = lambda g: [(s.drafted, s.accepted) for s in g.steps]  # noqa: E731
    first = dec.generate_ids(prompt)
    again = dec.generate_ids(prompt)
    assert again.token_ids == first.token_ids and len(again.steps) < len(first.steps)  # it copied its own answer
    kept = set(dec.memory._stores)
    dec.forget_text()
    left = set(dec.memory._stores)
    assert left < kept and not any(k[0] in ("suffix-cache", "adjacency") for k in left if isinstance(k, tuple))
    after = dec.generate_ids(prompt)
    assert after.token_ids == first.token_ids and len(after.steps) > len(again.steps)
    if method == "suffix":
        assert steps(after) == steps(first)
