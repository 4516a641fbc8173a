"""PEARL and two-sided SpS as pure schedules: scripted sides, then the tiny model (greedy identity, exact distributions)."""

import time

import pytest
import torch
from tests_support import generate

from decoding.loop.metrics import chi_square_pvalue
from decoding.loop.prefill import ContextTooLong
from decoding.model.adapter import ModelAdapter
from decoding.model.costs import CostModel
from decoding.sampling import SamplingParams
from decoding.schedules import two_sided
from decoding.schedules.two_sided import (
    GREEDY,
    DraftSide,
    LocalExecutor,
    PearlSchedule,
    VerifySide,
    _ScriptedDraft,
    _ScriptedTarget,
    generate_two_sided,
    round_summary,
)

TEXT = "abcdefghijklmnopqrstuvwxyz"


pytestmark = pytest.mark.usefixtures("one_thread")


def run(script, schedule="pearl", k=3, max_new=12, eos=(), text=TEXT):
    t, d = _ScriptedTarget(text), _ScriptedDraft(list(script))
    out = generate_two_sided(LocalExecutor(t, d), [[0]], schedule=schedule, k=k, max_new_tokens=max_new, eos_token_ids=eos)
    return out, t, d


def as_text(ids):
    return "".join(map(chr, ids))


# ---- scripted sides: the state machine itself --------------------------------------------------


def test_pre_verify_rejects_every_first_draft():
    out, t, d = run(["xyz"] * 20, max_new=6)
    assert as_text(out.token_ids) == "abcdef"
    assert [r.mode for r in out.rounds] == ["pre-verify"] * 5
    assert all(len(ids) == 1 for ids in t.calls)  # the target only ever ran the one-token pre-verify forward
    # (the last round drafts nothing: one token is left, the target supplies it)
    # after each rejection the draft drops all its drafts and appends the target's token
    assert [(r.keep, r.append) for r in d.calls[1:]] == [(2 + i, [ord(TEXT[i + 1])]) for i in range(4)]
    assert out.schedule_counts["first_draft_checks"] == 4 and out.schedule_counts["first_draft_accepted"] == 0


def test_post_verify_accepts_all_and_keeps_drafting():
    # a perfect draft: each call drafts the next 3 tokens after everything drafted so far
    script = ["bcd", "efg", "hij", "klm", "nop"]
    out, t, d = run(script, max_new=13)
    assert as_text(out.token_ids) == TEXT[:13]
    assert [r.mode for r in out.rounds] == ["pre-verify"] + ["post-verify"] * 4
    assert all(r.append == [] for r in d.calls[1:])  # never rolled back: the draft run chains across rounds
    assert t.calls[1] == [ord(c) for c in "bcd"]  # pending b, then the unverified c d
    assert out.stats.target_forwards == 6 and out.stats.mean_accepted_tokens > 2.0


def test_post_verify_rejects_inside_unverified_drafts():
    # b accepted (pre-verify); in post-verify c ok, X rejected: commit c + target's d, drop the drafts made meanwhile
    out, t, d = run(["bcX", "QQQ", "efg", "hij"], max_new=9)
    assert as_text(out.token_ids) == TEXT[:9]
    assert [r.mode for r in out.rounds][:3] == ["pre-verify", "post-verify", "pre-verify"]
    third = d.calls[2]
    assert (third.keep, third.append) == (4, [ord("d")])  # prompt 1 + a b c kept, X and QQQ dropped


def test_first_new_draft_rejected_after_all_accepted():
    # D = c d accepted, but the new X[0] is wrong: commit D + the target's e, next round is pre-verify
    out, t, d = run(["bcd", "Zzz", "fgh", "ijk"], max_new=10)
    assert as_text(out.token_ids) == TEXT[:10]
    assert [r.mode for r in out.rounds][:3] == ["pre-verify", "post-verify", "pre-verify"]
    assert (d.calls[2].keep, d.calls[2].append) == (5, [ord("e")])


@pytest.mark.parametrize("schedule", ["pearl", "sps"])
@pytest.mark.parametrize("max_new", [1, 2, 5, 11])
def test_max_new_tokens_exact(schedule, max_new):
    out, _, _ = run(["bcd", "efg", "hij", "klm", "nop"] * 3, schedule=schedule, max_new=max_new)
    assert as_text(out.token_ids) == TEXT[:max_new] and out.finish_reason == "length"


@pytest.mark.parametrize("schedule", ["pearl", "sps"])
def test_stops_right_after_eos(schedule):
    out, _, _ = run(["bcd", "efg", "hij"], schedule=schedule, max_new=20, eos=[ord("f")])
    assert as_text(out.token_ids) == "abcdef" and out.finish_reason == "stop"


@pytest.mark.parametrize("schedule", ["pearl", "sps"])
def test_on_step_stops_with_its_reason(schedule):
    # the loop's Output: a string from on_step ends the generation after those tokens, with exact stats
    seen = []

    def stop_at_five(tokens):
        seen.extend(tokens)
        return "stopped" if len(seen) >= 5 else None

    t, d = _ScriptedTarget(TEXT), _ScriptedDraft(["bcd", "efg", "hij", "klm"])
    out = generate_two_sided(LocalExecutor(t, d), [[0]], schedule=schedule, k=3, max_new_tokens=20, on_step=stop_at_five)
    assert out.finish_reason == "stopped" and out.token_ids == seen and 5 <= len(seen) < 20
    assert as_text(out.token_ids) == TEXT[: len(seen)] and out.stats.new_tokens == len(seen)


def test_context_check_is_the_loops():
    t, d = _ScriptedTarget(TEXT), _ScriptedDraft([])
    with pytest.raises(ContextTooLong, match=r"prompt \(3 tokens\) \+ max_new_tokens \(8\) exceeds the model's context of 10"):
        generate_two_sided(LocalExecutor(t, d), [[0, 1, 2]], max_new_tokens=8, max_context=10)
    assert t.prompt_len == 0 and not t.calls  # refused before the prefill


def test_sequential_schedule_is_plain_sps():
    out, t, d = run(["bcX", "efX", "hij"], schedule="sps", k=3, max_new=9)
    assert as_text(out.token_ids) == TEXT[:9]
    assert [r.mode for r in out.rounds] == ["sequential"] * len(out.rounds)
    assert [s.accepted for s in out.steps] == [2, 2, 1]  # the last step may only draft one (max_new_tokens)
    assert (d.calls[1].keep, d.calls[1].append) == (4, [ord("d")])


def test_round_summary_overhead():
    rec = [two_sided.RoundRecord("pre-verify", 0.010, 0.007, 0.008, True)]
    s = round_summary(rec)
    assert s["rounds"] == 1 and abs(s["overhead_ms"] - 2.0) < 1e-9
    seq = two_sided.RoundRecord("sequential", 0.020, 0.007, 0.008, False)
    assert abs(seq.overhead_s - 0.005) < 1e-12


# ---- the real sides on the tiny model -----------------------------------------------------------

PROMPT = torch.tensor([[3, 7, 3, 7, 3]])


def sides(model, sampling=GREEDY, draft_layers=1):
    draft = DraftSide.of_model(ModelAdapter(model, num_layers=draft_layers), sampling)
    return LocalExecutor(VerifySide(ModelAdapter(model), sampling), draft)


@pytest.mark.parametrize("schedule", ["pearl", "sps"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_equals_ar_on_tiny_model(tiny_model, schedule, k):
    ref = generate(ModelAdapter(tiny_model), PROMPT, max_new_tokens=30).token_ids
    out = generate_two_sided(sides(tiny_model), PROMPT, schedule=schedule, k=k, max_new_tokens=30)
    assert out.token_ids == ref
    if schedule == "pearl":
        assert out.schedule_counts["first_draft_checks"] > 0


def test_greedy_with_the_target_as_its_own_draft_is_all_post_verify(tiny_model):
    # draft = all target layers: every draft is accepted, so after the first round PEARL never leaves post-verify
    ref = generate(ModelAdapter(tiny_model), PROMPT, max_new_tokens=25).token_ids
    out = generate_two_sided(sides(tiny_model, draft_layers=3), PROMPT, schedule="pearl", k=3, max_new_tokens=25)
    assert out.token_ids == ref
    assert out.schedule_counts["pre_verify_rounds"] == 1
    assert out.stats.target_forwards <= 1 + 25 // 3 + 1


N_TOKENS, DRAWS = 3, 300  # the broken first-draft rule below is caught at p < 1e-16 from 150 draws
SAMPLING = SamplingParams(temperature=1.0)
WARPED = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)


def exact_joint(model, prompt, n, sampling):
    import itertools

    from decoding.sampling import warp

    v = model.config.vocab_size
    joint = torch.ones([], dtype=torch.float64)
    with torch.inference_mode():
        for depth in range(n):
            prefixes = list(itertools.product(range(v), repeat=depth))
            ids = torch.tensor([list(prompt[0]) + list(p) for p in prefixes])
            probs = warp(model(input_ids=ids).logits[:, -1], sampling).double()
            joint = joint.reshape(-1, 1) * probs
    return joint.reshape([v] * n)


def sample_counts(model, schedule, sampling, k=2, draws=DRAWS):
    ex = sides(model, sampling)
    v = model.config.vocab_size
    counts = torch.zeros([v] * N_TOKENS, dtype=torch.long)
    checks = 0
    for i in range(draws):
        out = generate_two_sided(ex, PROMPT, schedule=schedule, k=k, sampling=sampling, max_new_tokens=N_TOKENS + 1, seed=i)
        counts[tuple(out.token_ids[:N_TOKENS])] += 1
        checks += out.schedule_counts.get("first_draft_checks", 0)
    return counts, checks


@pytest.mark.parametrize(("schedule", "sampling"), [("pearl", SAMPLING), ("pearl", WARPED), ("sps", SAMPLING)])
def test_sampled_distribution_matches_target(tiny_model, schedule, sampling):
    counts, checks = sample_counts(tiny_model, schedule, sampling)
    p = chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, sampling))
    assert p > 1e-4, f"{schedule}: sampled tokens do not follow the target (p={p:.2e})"
    if schedule == "pearl":
        assert checks > DRAWS  # the first-draft check (the PEARL-specific rule) ran and mattered


def test_wrong_first_draft_rule_is_caught(tiny_model, monkeypatch):
    def always_accept(self, x1, t, d):
        return True, x1

    monkeypatch.setattr(PearlSchedule, "_check_first", always_accept)
    counts, _ = sample_counts(tiny_model, "pearl", SAMPLING, draws=400)
    assert chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, SAMPLING)) < 1e-6


# ---- k=auto: the round gate stops drafting where it does not pay, and the output stays the target's ----------------


class _Slow:
    """A scripted side that also takes ``seconds`` per call (a draft side: per call that drafts)."""

    def __init__(self, side, seconds):
        self.side, self.seconds = side, seconds

    def prefill(self, *args, **kwargs):
        return self.side.prefill(*args, **kwargs)

    def verify(self, req, chained=None):
        time.sleep(self.seconds)
        return self.side.verify(req, chained)

    def draft(self, req):
        time.sleep(self.seconds if req.k > 0 else 0.0)
        return self.side.draft(req)

    def run(self, req):  # the target alone: its seconds per token
        out = self.side.run(req)
        time.sleep(self.seconds * len(out.tokens))
        return out


@pytest.mark.parametrize("schedule", ["pearl", "sps"])
def test_the_gate_stops_a_draft_that_does_not_pay_and_keeps_one_that_does(schedule):
    # a wrong, slow draft (20 ms a call against 2 ms a verification): drafting turns off, probes now and then
    t, d = _ScriptedTarget(TEXT), _ScriptedDraft(["zzz"] * 100)
    ex = LocalExecutor(_Slow(t, 0.002), _Slow(d, 0.020))
    out = generate_two_sided(ex, [[0]], schedule=schedule, k=3, max_new_tokens=25, adaptive=True)
    assert as_text(out.token_ids) == TEXT[:25]
    drafted = sum(r.k > 0 for r in d.calls)
    assert drafted <= 8, f"{drafted} of {len(out.rounds)} rounds drafted"  # the first judge + one probe at most
    alone = out.schedule_counts["alone"]  # idle stretches: the target decodes alone, several tokens a call
    assert out.schedule_counts["plain_rounds"] + alone["calls"] == len(out.rounds) - drafted
    assert alone["tokens"] >= 16 and alone["calls"] <= 3, alone
    # the control: a fixed k drafts every round but the last
    t, d = _ScriptedTarget(TEXT), _ScriptedDraft(["zzz"] * 100)
    generate_two_sided(LocalExecutor(t, d), [[0]], schedule=schedule, k=3, max_new_tokens=25)
    assert sum(r.k > 0 for r in d.calls) >= 20
    # a right, cheap draft pays: after the first (plain) round every round drafts
    t = _ScriptedTarget(TEXT)
    d = _ScriptedDraft([])  # it drafts the target's next tokens after whatever sequence the request leaves it
    d.draft = lambda req: two_sided.DraftResult(tokens=[ord(c) for c in TEXT[req.keep + len(req.append) - 1 :][: req.k]])
    out = generate_two_sided(
        LocalExecutor(_Slow(t, 0.010), _Slow(d, 0.001)), [[0]], schedule=schedule, k=3, max_new_tokens=25, adaptive=True
    )
    assert as_text(out.token_ids) == TEXT[:25]
    assert len(out.rounds) <= 10, f"{len(out.rounds)} rounds for 25 tokens: the gate stopped a draft that pays"


def test_a_gate_carried_to_the_next_generation_keeps_a_draft_that_lost_resting():
    # the first generation learns that the slow, wrong draft loses (its tries lost ~80 ms against 2 ms a plain token):
    # the next try waits until that loss is 1/32 of the time waited, so the next generation runs alone throughout
    t, d = _ScriptedTarget(TEXT), _ScriptedDraft(["zzz"] * 100)
    ex, gate = LocalExecutor(_Slow(t, 0.002), _Slow(d, 0.020)), two_sided.RoundGate()
    generate_two_sided(ex, [[0]], k=3, max_new_tokens=25, adaptive=True, gate=gate)
    asked = len(d.calls)
    assert asked >= 4 and gate.probe_every > 25 * 4, gate.probe_every
    out = generate_two_sided(ex, [[0]], k=3, max_new_tokens=25, adaptive=True, gate=gate)
    assert as_text(out.token_ids) == TEXT[:25]
    assert len(d.calls) == asked and out.schedule_counts["alone"]["tokens"] == 24  # the draft side not even synced


class _Alternating(two_sided.RoundGate):
    """A gate that drafts two rounds in three, whatever it measures: the sides must resync after every pause."""

    until_probe = 1  # each pause a run of one token alone

    def __init__(self):
        super().__init__()
        self.n = 0

    @property
    def drafts(self):
        return self.n % 3 != 0

    def observe(self, drafted, tokens, seconds):
        self.n += 1


def gated(monkeypatch, gate, model, executor, schedule, n, **kwargs):
    """AR's greedy tokens, and the schedule's generation (k=3) with every round gate replaced by ``gate``."""
    monkeypatch.setattr(two_sided, "RoundGate", gate)
    ref = generate(ModelAdapter(model), PROMPT, max_new_tokens=n).token_ids
    return ref, generate_two_sided(executor, PROMPT, schedule=schedule, k=3, max_new_tokens=n, adaptive=True, **kwargs)


@pytest.mark.parametrize("schedule", ["pearl", "sps"])
def test_drafting_paused_and_resumed_keeps_greedy_output(tiny_model, schedule, monkeypatch):
    ref, out = gated(monkeypatch, _Alternating, tiny_model, sides(tiny_model), schedule, 30)
    assert out.token_ids == ref
    drafted = [s.drafted > 0 for s in out.steps]
    assert any(drafted) and not all(drafted)


def test_drafting_paused_and_resumed_keeps_the_sampled_distribution(tiny_model, monkeypatch):
    monkeypatch.setattr(two_sided, "RoundGate", _Alternating)
    ex = sides(tiny_model, SAMPLING)
    v = tiny_model.config.vocab_size
    counts = torch.zeros([v] * N_TOKENS, dtype=torch.long)
    for i in range(DRAWS):
        out = generate_two_sided(ex, PROMPT, schedule="pearl", k=2, sampling=SAMPLING, max_new_tokens=N_TOKENS + 1, seed=i, adaptive=True)
        counts[tuple(out.token_ids[:N_TOKENS])] += 1
    p = chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, SAMPLING))
    assert p > 1e-4, f"pearl with pauses: sampled tokens do not follow the target (p={p:.2e})"


# ---- the target alone: k=auto's idle stretches as runs of the verify side, prompt lookup's chains verified -----------

FREE_WIDTH = CostModel({(1, 1): 1.0, (1, 2): 1.0, (1, 3): 1.0, (1, 4): 1.0})  # any chain pays: every lookup is verified


class _Idle(two_sided.RoundGate):
    """A gate under which drafting never pays: the whole generation runs on the target side alone."""

    drafts = False
    until_probe = 16

    def observe(self, drafted, tokens, seconds):
        pass


class _NoDrafts:
    """A draft side that must not be asked to draft (the target runs alone); it answers a prefill."""

    def prefill(self, *args, **kwargs):
        return 0.0

    def draft(self, req):
        raise AssertionError(f"the draft side was asked to draft while the target runs alone: {req}")


def alone(model, sampling=GREEDY, cost=FREE_WIDTH):
    return LocalExecutor(VerifySide(ModelAdapter(model), sampling, cost=None if cost is None else (lambda: cost)), _NoDrafts())


@pytest.mark.parametrize("schedule", ["pearl", "sps"])
def test_the_target_alone_verifies_looked_up_chains_and_keeps_greedy_output(tiny_model, schedule, monkeypatch):
    ref, out = gated(monkeypatch, _Idle, tiny_model, alone(tiny_model), schedule, 40)
    assert out.token_ids == ref
    assert out.schedule_counts["alone"] == {"calls": 3, "tokens": 39, "looked_up": sum(s.accepted for s in out.steps)}
    looked = [s for s in out.steps if s.looked]
    assert looked and sum(s.accepted for s in looked) >= 5, "prompt lookup's chains were not verified, or never accepted"
    assert out.stats.target_forwards < 40  # accepted chains saved forwards
    # no cost model (or glance off): plain steps, one a token
    plain = generate_two_sided(alone(tiny_model, cost=None), PROMPT, schedule=schedule, k=3, max_new_tokens=40, adaptive=True)
    assert plain.token_ids == ref and not any(s.drafted for s in plain.steps) and plain.stats.target_forwards == 40
    off = generate_two_sided(alone(tiny_model), PROMPT, schedule=schedule, k=3, max_new_tokens=40, adaptive=True, glance=False)
    assert off.token_ids == ref and off.stats.target_forwards == 40


def test_a_run_alone_stops_at_eos_and_within_max_new_tokens(tiny_model, monkeypatch):
    monkeypatch.setattr(two_sided, "RoundGate", _Idle)
    ref = generate(ModelAdapter(tiny_model), PROMPT, max_new_tokens=40).token_ids
    eos = ref[12]
    out = generate_two_sided(alone(tiny_model), PROMPT, k=3, max_new_tokens=40, eos_token_ids=(eos,), adaptive=True)
    assert out.token_ids == ref[: ref.index(eos) + 1] and out.finish_reason == "stop"
    out = generate_two_sided(alone(tiny_model), PROMPT, k=3, max_new_tokens=21, adaptive=True)
    assert out.token_ids == ref[:21] and out.finish_reason == "length"


def alone_counts(model, draws):
    ex = alone(model, SAMPLING)
    v = model.config.vocab_size
    counts = torch.zeros([v] * N_TOKENS, dtype=torch.long)
    looked = 0
    for i in range(draws):
        out = generate_two_sided(ex, PROMPT, k=2, sampling=SAMPLING, max_new_tokens=N_TOKENS + 1, seed=i, adaptive=True)
        counts[tuple(out.token_ids[:N_TOKENS])] += 1
        looked += sum(s.accepted for s in out.steps[:2])
    return counts, looked


def test_runs_alone_keep_the_sampled_distribution_and_a_wrong_rule_is_caught(tiny_model, monkeypatch):
    monkeypatch.setattr(two_sided, "RoundGate", _Idle)
    counts, looked = alone_counts(tiny_model, DRAWS)
    p = chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, SAMPLING))
    assert p > 1e-4, f"runs alone: sampled tokens do not follow the target (p={p:.2e})"
    assert looked > DRAWS // 10  # looked-up drafts were accepted within the tested tokens
    # a wrong rule: a looked-up chain's drafts committed unverified
    verify = VerifySide.verify

    def unverified(self, req, chained=None):
        res = verify(self, req, chained)
        if len(req.ids) > 1:
            res.tokens, res.num_accepted = [*req.ids[1:], res.tokens[-1]], len(req.ids) - 1
        return res

    monkeypatch.setattr(VerifySide, "verify", unverified)
    counts, _ = alone_counts(tiny_model, 3 * DRAWS)
    assert chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, SAMPLING)) < 1e-6


@pytest.mark.parametrize("schedule", ["pearl", "sps"])
def test_the_target_prefills_on_the_shared_threads_and_the_draft_catches_up_when_it_first_drafts(tiny_model, schedule, monkeypatch):
    ex = sides(tiny_model)
    ex.prefill(PROMPT[0].tolist(), 64, 0, GREEDY, threads=2)
    assert not ex.draft.started  # deferred: nothing of the prompt in the draft's cache yet
    ref, out = gated(monkeypatch, _Alternating, tiny_model, ex, schedule, 30, run_threads=2)
    assert out.token_ids == ref
    assert any(s.drafted for s in out.steps) and out.schedule_counts["alone"]["calls"]
    assert torch.get_num_threads() == 1  # the fixture's: the runs and the prefill on 2 threads set it back
