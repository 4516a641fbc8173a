"""The lossless rules, tested as pure functions on many rows at once."""

import pytest
import torch

from decoding.loop.metrics import chi_square_pvalue
from decoding.loop.verify import verify_greedy, verify_speculative
from decoding.sampling import SamplingParams, sample_from, warp

ROWS = 200_000
ALPHA = 1e-4  # a correct rule fails with this probability per test (fixed seeds: never, in practice)


def _tables(v=6, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, v, generator=g) * 2, -1)  # target p_1..p_{k+1}
    q = torch.softmax(torch.randn(k, v, generator=g) * 2, -1)  # draft q_1..q_k, different from p
    return p, q


def _speculate(p, q, rule=verify_speculative, rows=ROWS, seed=1):
    """Drafts x_i ~ q_i independent of context (a fixed table), then the rule; returns committed tokens."""
    g = torch.Generator().manual_seed(seed)
    k, v = q.shape
    drafts = torch.stack([sample_from(q[i].expand(rows, v), torch.rand(rows, generator=g)) for i in range(k)], 1)
    verdict = rule(
        drafts,
        q.expand(rows, k, v),
        p.expand(rows, k + 1, v),
        torch.rand(rows, k, generator=g),
        torch.rand(rows, generator=g),
    )
    return verdict


def _first_token_pvalue(verdict, p):
    # whatever happened, the first committed token is distributed as p_1 under a lossless rule
    first = verdict.tokens[:, 0]
    return chi_square_pvalue(torch.bincount(first, minlength=p.shape[1]), p[0])


def test_first_token_follows_target():
    p, q = _tables()
    assert _first_token_pvalue(_speculate(p, q), p) > ALPHA


def test_second_token_follows_target_when_first_was_accepted():
    # with context-free tables, token 2 (when committed) must follow p_2 regardless of how token 1 came about
    p, q = _tables()
    v = _speculate(p, q)
    committed2 = v.num_accepted >= 1
    second = v.tokens[committed2, 1]
    assert chi_square_pvalue(torch.bincount(second, minlength=p.shape[1]), p[1]) > ALPHA


def test_deterministic_drafter_is_lossless():
    p, _ = _tables()
    rows, k, v = ROWS, 3, p.shape[1]
    g = torch.Generator().manual_seed(3)
    drafts = torch.randint(0, v, (rows, k), generator=g)  # arbitrary deterministic proposals
    verdict = verify_speculative(drafts, None, p.expand(rows, k + 1, v), torch.rand(rows, k, generator=g), torch.rand(rows, generator=g))
    assert _first_token_pvalue(verdict, p) > ALPHA


def _wrong_resample_from_p(drafts, q, p, u_accept, u_sample):
    """Correct acceptance, but on rejection resample from p instead of the residual (a classic bug)."""
    verdict = verify_speculative(drafts, q, p, u_accept, u_sample)
    rows = torch.arange(drafts.shape[0])
    m = verdict.num_accepted
    verdict.tokens[rows, m] = sample_from(p[rows, m], u_sample)
    return verdict


def _wrong_accept_if_q_smaller(drafts, q, p, u_accept, u_sample):
    """Acceptance without the ratio: accept whenever p(x) >= q(x)*0.5, a plausible-looking wrong rule."""
    bsz, k = drafts.shape
    px = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    qx = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    fake_u = torch.where(px >= 0.5 * qx, torch.zeros_like(u_accept), torch.ones_like(u_accept))
    return verify_speculative(drafts, q, p, fake_u, u_sample)


@pytest.mark.parametrize("rule", [_wrong_resample_from_p, _wrong_accept_if_q_smaller])
def test_wrong_rules_are_caught(rule):
    p, q = _tables()
    assert _first_token_pvalue(_speculate(p, q, rule=rule), p) < 1e-9


def test_all_accepted_draws_bonus_from_last_distribution():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])  # p_1, p_2, p_3 are point masses
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    v = verify_speculative(torch.tensor([[1, 2]]), q[None], p[None], torch.tensor([[0.99, 0.99]]), torch.tensor([0.5]))
    assert v.num_accepted.tolist() == [2]
    assert v.tokens.tolist() == [[1, 2, 0]]


def test_rejection_excludes_rejected_token():
    # p_1 = (0.5, 0.5, 0); draft proposes token 0 with q = 1: accept with prob 0.5, else residual = token 1 only
    p = torch.tensor([[[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]]])
    v = verify_speculative(torch.tensor([[0]]), None, p, torch.tensor([[0.9]]), torch.tensor([0.0]))
    assert v.num_accepted.tolist() == [0] and v.tokens[0, 0].item() == 1


def test_greedy_prefix_and_correction():
    logits = torch.tensor([[[0.0, 9, 0], [0, 0, 9], [9, 0, 0], [0, 9, 0]]])  # argmax 1, 2, 0, 1
    v = verify_greedy(torch.tensor([[1, 2, 2]]), logits)
    assert v.num_accepted.tolist() == [2]
    assert v.tokens[0, :3].tolist() == [1, 2, 0]
    v0 = verify_greedy(torch.zeros(1, 0, dtype=torch.long), logits[:, :1])
    assert v0.num_accepted.tolist() == [0] and v0.tokens[0, 0].item() == 1


def test_greedy_is_batched():
    logits = torch.tensor([[[0.0, 9], [9, 0], [0, 9]], [[9.0, 0], [9, 0], [0, 9]]])
    v = verify_greedy(torch.tensor([[1, 0], [1, 0]]), logits)
    assert v.num_accepted.tolist() == [2, 0]


def test_warp_top_k_top_p_temperature():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.allclose(warp(logits, SamplingParams(1.0)), logits.softmax(-1))
    top2 = warp(logits, SamplingParams(1.0, top_k=2))
    assert (top2[0, 2:] == 0).all() and torch.isclose(top2.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)[0]
    # top_p just above p(0) keeps tokens 0 and 1; exactly p(0) keeps token 0 alone
    keep2 = warp(logits, SamplingParams(1.0, top_p=float(full[0]) + 1e-3))
    assert (keep2[0, :2] > 0).all() and (keep2[0, 2:] == 0).all()
    keep1 = warp(logits, SamplingParams(1.0, top_p=float(full[0]) - 1e-3))
    assert keep1[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    cold = warp(logits, SamplingParams(0.5))
    assert cold[0, 0] > full[0]


def test_sample_from_never_returns_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]]).expand(5, 4)
    u = torch.tensor([0.0, 0.25, 0.5, 0.75, 0.999999])
    assert set(sample_from(probs, u).tolist()) <= {1, 3}
