"""Continuous batching on a tiny random model: every row equals its own AR run, rows join and leave,
sampling is per row and lossless in batches, k=auto drafts at low load and stops at high load."""

import time

import pytest
import torch
from tests_support import generate

from decoding.drafters.base import DecodeState, Proposal
from decoding.drafters.draft_model import DraftModelDrafter
from decoding.drafters.early_exit import EarlyExitDrafter
from decoding.drafters.ngram import NgramDrafter
from decoding.loop import batch as batch_module
from decoding.loop import prefill as prefill_module
from decoding.loop import step as step_module
from decoding.loop.batch import Batch, NotBatchable, Sequence, generate_many
from decoding.loop.metrics import chi_square_pvalue
from decoding.loop.verify import verify_speculative
from decoding.model import graphs as graphs_module
from decoding.model.adapter import ModelAdapter
from decoding.model.costs import CostModel
from decoding.sampling import GREEDY, SamplingParams, sample_from
from decoding.timing import mark
from decoding.trees.shapes import Dynamic, Tree
from tests.decoding.loop.test_loop import exact_joint

PROMPTS = [
    [3, 7, 3, 7, 3],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3],
    [5],
    [9, 9, 4, 9, 9, 4, 9],
    [2, 11, 6, 2, 11, 6, 2, 11, 6, 2, 11, 6, 2, 11, 6, 2, 11, 6, 2, 11],
    [0, 4, 8, 10],
]


def make_drafter(model, name):
    return {
        "ar": lambda: None,
        "ngram": lambda: NgramDrafter(ngram_max=2, ngram_min=1),
        "ngram-tree": lambda: NgramDrafter(ngram_max=2, ngram_min=1, tree_budget=6),
        "sps": lambda: DraftModelDrafter(ModelAdapter(model, num_layers=1)),
        "sps-tree": lambda: DraftModelDrafter(ModelAdapter(model, num_layers=1), tree=Dynamic(budget=5)),
        "sps-static": lambda: DraftModelDrafter(ModelAdapter(model, num_layers=1), tree=Tree.from_paths([[0], [1], [0, 0], [0, 1]])),
        "early-exit": lambda: EarlyExitDrafter(exit_layer=1),
    }[name]()


DRAFTERS = ["ar", "ngram", "ngram-tree", "sps", "sps-tree", "sps-static", "early-exit"]


def ids(p):
    return torch.tensor([p])


@pytest.fixture(scope="module")
def target(tiny_model):
    return ModelAdapter(tiny_model)


@pytest.fixture(scope="module")
def ar_alone(target):
    return [generate(target, ids(p), max_new_tokens=24).token_ids for p in PROMPTS]


@pytest.mark.parametrize("name", DRAFTERS)
def test_every_row_equals_its_ar_run(tiny_model, target, ar_alone, name, one_thread):
    seqs = [Sequence(ids(p), drafter=make_drafter(tiny_model, name), k=3, max_new_tokens=24) for p in PROMPTS]
    outs = generate_many(target, seqs, max_rows=len(PROMPTS))
    assert [o.token_ids for o in outs] == ar_alone
    assert max(r.rows for o in outs for r in o.steps) == len(PROMPTS)  # they really shared steps


def test_mixed_drafters_join_and_leave(tiny_model, target, ar_alone, one_thread):
    # rows of different drafters, different max_new_tokens; 3 rows at a time, so rows join as others finish
    names = ["ngram", "sps", "ar", "early-exit", "sps-tree", "ngram-tree"]
    lengths = [24, 5, 17, 24, 9, 24]
    seqs = [
        Sequence(ids(p), drafter=make_drafter(tiny_model, n), k=4, max_new_tokens=m)
        for p, n, m in zip(PROMPTS, names, lengths, strict=True)
    ]
    outs = generate_many(target, seqs, max_rows=3)
    for out, ref, m in zip(outs, ar_alone, lengths, strict=True):
        assert out.token_ids == ref[:m] and out.finish_reason == "length"
    assert max(r.rows for o in outs for r in o.steps) == 3


def test_arrival_order_does_not_matter(tiny_model, target, ar_alone, one_thread):
    order = [4, 2, 0, 5, 1, 3]
    seqs = [Sequence(ids(PROMPTS[i]), drafter=make_drafter(tiny_model, "ngram"), k=5, max_new_tokens=24) for i in order]
    outs = generate_many(target, seqs, max_rows=4)
    assert [o.token_ids for o in outs] == [ar_alone[i] for i in order]


def test_eos_and_callback_stop_end_one_row(tiny_model, target, ar_alone, one_thread):
    eos = ar_alone[0][6]
    seen = []

    def stop_after_four(tokens):
        seen.extend(tokens)
        return "stop-sequence" if len(seen) >= 4 else None

    seqs = [
        Sequence(ids(PROMPTS[0]), drafter=make_drafter(tiny_model, "ngram"), k=3, max_new_tokens=24, eos_token_ids=[eos]),
        Sequence(ids(PROMPTS[1]), drafter=make_drafter(tiny_model, "sps"), k=3, max_new_tokens=24, on_step=stop_after_four),
        Sequence(ids(PROMPTS[3]), k=3, max_new_tokens=24),
    ]
    outs = generate_many(target, seqs, max_rows=3)
    cut = ar_alone[0].index(eos) + 1
    assert outs[0].token_ids == ar_alone[0][:cut] and outs[0].finish_reason == "stop"
    assert outs[1].finish_reason == "stop-sequence" and outs[1].token_ids == seen and 4 <= len(seen) < 24
    assert outs[1].token_ids == ar_alone[1][: len(seen)]
    assert outs[2].token_ids == ar_alone[3]


def test_cancel_between_steps(tiny_model, target, ar_alone, one_thread):
    batch = Batch(target, max_rows=4)
    a = batch.add(Sequence(ids(PROMPTS[0]), k=3, max_new_tokens=24))
    b = batch.add(Sequence(ids(PROMPTS[1]), drafter=make_drafter(tiny_model, "ngram"), k=3, max_new_tokens=24))
    batch.step()
    a.cancel()
    done = batch.step()
    assert a in done and a.finish_reason == "cancelled" and len(batch) == 1
    batch.run()
    assert b.result().token_ids == ar_alone[1]  # the other row moved into row 0 and kept its cache


def test_cache_grows_for_a_longer_row(tiny_model, target, one_thread):
    batch = Batch(target, max_rows=8)
    short = batch.add(Sequence(ids(PROMPTS[2]), k=2, max_new_tokens=4))
    batch.step()
    first = batch.cache.max_len
    long = batch.add(Sequence(ids(PROMPTS[4]), drafter=make_drafter(tiny_model, "ngram"), k=2, max_new_tokens=120))
    batch.step()
    assert batch.cache.max_len > first
    batch.run()
    assert short.result().token_ids == generate(target, ids(PROMPTS[2]), max_new_tokens=4).token_ids
    assert long.result().token_ids == generate(target, ids(PROMPTS[4]), max_new_tokens=120).token_ids


def test_batch_limits_and_errors(tiny_model, target):
    batch = Batch(target, max_rows=1)
    batch.add(Sequence(ids(PROMPTS[0]), max_new_tokens=8))
    with pytest.raises(RuntimeError, match="full"):
        batch.add(Sequence(ids(PROMPTS[1]), max_new_tokens=8))
    with pytest.raises(prefill_module.ContextTooLong, match="context"):
        Batch(target).add(Sequence(ids(PROMPTS[0]), max_new_tokens=1000))
    with pytest.raises(ValueError, match="one row"):
        Sequence(torch.tensor([[1, 2], [3, 4]]))

    from decoding.schedules.triforce import TriForceDrafter

    tri = TriForceDrafter("ngram", budget=16, chunk_size=4, gamma=2, sinks=1, window=4)
    with pytest.raises(NotBatchable, match="one sequence at a time"):
        Batch(target, max_rows=4).add(Sequence(ids(PROMPTS[4]), drafter=tri))


# ---- chunked prefill -------------------------------------------------------------------------


def test_a_long_prompt_is_filled_in_chunks_between_the_other_rows_steps(tiny_model, target, ar_alone, monkeypatch, one_thread):
    """Chunks of 3 prompt tokens, a budget of 4 per step: one chunk per step. The decoding rows commit every step
    while the 20-token prompt joins (7 chunks), each step feeds the target at most one chunk of prompt, and every
    row's output is its AR output alone."""
    monkeypatch.setattr(prefill_module, "PREFILL_CHUNK", 3)
    fed = []
    forward = target.forward

    def counting(cache, start, input_ids=None, **kw):
        if input_ids is not None and isinstance(start, int) and start + input_ids.shape[1] <= len(PROMPTS[4]) and input_ids.shape[1] > 1:
            fed.append(input_ids.shape[1])
        return forward(cache, start, input_ids=input_ids, **kw)

    monkeypatch.setattr(target, "forward", counting)
    batch = Batch(target, max_rows=4, prefill_budget=4)
    early = [batch.add(Sequence(ids(PROMPTS[i]), drafter=make_drafter(tiny_model, "ngram"), k=2, max_new_tokens=24)) for i in (0, 3)]
    while any(s.state is None for s in early):
        batch.step()
    long = batch.add(Sequence(ids(PROMPTS[4]), k=2, max_new_tokens=24))
    fed.clear()
    steps = 0
    while long.state is None:
        before = [len(s.new) for s in early]
        batch.step()
        steps += 1
        assert all(len(s.new) > b for s, b in zip(early, before, strict=True) if not s.finished)  # nobody stalls
    assert steps == 7 and fed == [3] * 6 + [2]
    batch.run()
    assert [s.result().token_ids for s in early] == [ar_alone[0], ar_alone[3]]
    assert long.result().token_ids == ar_alone[4]
    monkeypatch.undo()
    assert generate(target, ids(PROMPTS[4]), max_new_tokens=24).token_ids == ar_alone[4]  # chunked or not: the same tokens


def test_a_row_leaving_while_a_prompt_is_filled_keeps_both_exact(tiny_model, target, ar_alone, monkeypatch, one_thread):
    """Rows finish (the last decoding row and the half-filled prompt move down) while a prompt is filled in chunks."""
    monkeypatch.setattr(prefill_module, "PREFILL_CHUNK", 2)
    batch = Batch(target, max_rows=4, prefill_budget=2)
    short = [batch.add(Sequence(ids(PROMPTS[i]), k=2, max_new_tokens=m)) for i, m in ((2, 14), (0, 10), (3, 24))]
    while any(s.state is None for s in short):
        batch.step()
    long = batch.add(Sequence(ids(PROMPTS[4]), drafter=make_drafter(tiny_model, "sps"), k=2, max_new_tokens=24))
    left_mid_fill = 0
    while long.state is None:
        before = sum(s.finished for s in short)
        batch.step()
        left_mid_fill += long.fill is not None and sum(s.finished for s in short) > before
    assert left_mid_fill == 2  # both shorter rows left while the prompt was half filled
    batch.run()
    assert [s.result().token_ids for s in short] == [ar_alone[2][:14], ar_alone[0][:10], ar_alone[3]]
    assert long.result().token_ids == ar_alone[4]


def test_joining_prompts_fill_one_staging_cache_whatever_row_they_join(tiny_model, ar_alone, one_thread):
    """Every joining prompt is filled in the same one-row staging storage (on a GPU: the same graphs whatever row it
    joins at) and copied into its row; where graphs replay, prefill chunks are the widest graph (64 tokens)."""
    from decoding.loop.prefill import PREFILL_CHUNK, chunk_of

    graphed = ModelAdapter(tiny_model, graphs=True)  # the graph body on static buffers (no capture on a CPU)
    batch = Batch(graphed, max_rows=3)
    storages, seqs = {}, [Sequence(ids(PROMPTS[i % len(PROMPTS)]), k=2, max_new_tokens=6 + 3 * i) for i in range(7)]
    waiting = list(seqs)
    while waiting or len(batch):
        while waiting and not batch.full:
            batch.add(waiting.pop(0))
        batch.step()
        if batch._staging is not None:
            storages.setdefault(batch._staging.k_all.data_ptr(), batch._staging.max_len)
    sizes = list(storages.values())  # a new storage only for a longer prompt than any before, never for another row
    assert sizes == sorted(set(sizes)) and len(sizes) <= len({len(p) for p in PROMPTS}) < len(seqs)
    assert [s.result().token_ids for s in seqs] == [ar_alone[i % len(PROMPTS)][: 6 + 3 * i] for i in range(7)]
    assert chunk_of(graphed) == PREFILL_CHUNK and chunk_of(ModelAdapter(tiny_model)) == PREFILL_CHUNK
    graphed.graphs.capture = True  # what a CUDA adapter reports
    assert chunk_of(graphed) == 64


@pytest.mark.parametrize("kind", ["sps", "del"])
def test_steps_without_a_proposal_leave_no_stale_drafter_state(tiny_model, target, ar_alone, kind, one_thread):
    """The loop skips ``propose`` at k = 0 (k=auto decides so, e.g. on a loaded machine), so a drafter must not carry
    one step's or one generation's proposal state into a step it did not propose: the same drafter drafts a long
    prompt, then decodes a shorter one without drafting, then drafts again; each output is AR's."""
    from decoding.drafters.dynamic_exit import DynamicExitDrafter

    drafter = DraftModelDrafter(ModelAdapter(tiny_model, num_layers=1)) if kind == "sps" else DynamicExitDrafter([1, 2])
    for prompt, k, new in ((4, 3, 24), (0, 0, 6), (2, 0, 6), (1, 3, 24)):  # the short ones end before the long one's length
        assert generate(target, ids(PROMPTS[prompt]), drafter=drafter, k=k, max_new_tokens=new).token_ids == ar_alone[prompt][:new]


def test_a_drafter_that_fails_to_start_fails_alone(tiny_model, target, ar_alone, one_thread):
    class Broken(NgramDrafter):
        def start(self, state):
            raise RuntimeError("no drafts today")

    batch = Batch(target, max_rows=4)
    good = batch.add(Sequence(ids(PROMPTS[0]), k=2, max_new_tokens=24))
    bad = batch.add(Sequence(ids(PROMPTS[1]), drafter=Broken(), k=2, max_new_tokens=24))
    done = batch.step()
    assert done == [bad] and bad.finish_reason == "error" and isinstance(bad.error, RuntimeError) and len(bad.new) == 1
    batch.run()
    assert good.result().token_ids == ar_alone[0]


# ---- sampling, per row ----------------------------------------------------------------------

SAMPLING = SamplingParams(temperature=1.0)
N_TOKENS = 3


def test_sampled_row_does_not_depend_on_its_neighbours(tiny_model, target, one_thread):
    def seq(p, seed, name="sps"):
        return Sequence(
            ids(p),
            drafter=make_drafter(tiny_model, name),
            k=3,
            sampling=SAMPLING,
            max_new_tokens=20,
            generator=torch.Generator().manual_seed(seed),
        )

    alone = generate_many(target, [seq(PROMPTS[0], 7)], max_rows=1)[0].token_ids
    crowd = [seq(PROMPTS[1], 1, "ngram"), seq(PROMPTS[0], 7), seq(PROMPTS[4], 3, "ar"), seq(PROMPTS[3], 5, "early-exit")]
    assert generate_many(target, crowd, max_rows=4)[1].token_ids == alone


def batched_counts(model, target, draws, name="sps", k=2, rows=16, neighbours=True):
    """First N_TOKENS sampled tokens of PROMPTS[0] from ``draws`` sequences run ``rows`` at a time (each its own
    generator), interleaved with sequences of other prompts that share the steps."""
    v = model.config.vocab_size
    counts = torch.zeros([v] * N_TOKENS, dtype=torch.long)
    seqs, mine = [], []
    for i in range(draws):
        s = Sequence(
            ids(PROMPTS[0]),
            drafter=make_drafter(model, name),
            k=k,
            sampling=SAMPLING,
            max_new_tokens=N_TOKENS + 1,
            generator=torch.Generator().manual_seed(10_000 + i),
        )
        seqs.append(s)
        mine.append(s)
        if neighbours and i % 4 == 0:
            other = PROMPTS[1 + i % 5]
            seqs.append(Sequence(ids(other), drafter=make_drafter(model, "ngram"), k=3, sampling=SAMPLING, max_new_tokens=6))
    generate_many(target, seqs, max_rows=rows)
    for s in mine:
        counts[tuple(s.new[:N_TOKENS])] += 1
    return counts


# the fast tier samples the batch with ngram; the draft-model rows (sps) run in the full suite
@pytest.mark.parametrize("name", [pytest.param("sps", marks=pytest.mark.slow), "ngram"])
def test_batched_sampling_follows_the_target(tiny_model, target, name, one_thread):
    counts = batched_counts(tiny_model, target, 1500, name)
    p = chi_square_pvalue(counts, exact_joint(tiny_model, ids(PROMPTS[0]), N_TOKENS, SAMPLING))
    assert p > 1e-4, f"{name}: batched sampled tokens do not follow the target (p={p:.2e})"


def resample_from_p(drafts, q, p, u_accept, u_sample, *rest):
    """A wrong rule: a rejection draws from p, not from the residual."""
    verdict = verify_speculative(drafts, q, p, u_accept, u_sample, *rest)
    rows = torch.arange(drafts.shape[0])
    verdict.tokens[rows, verdict.num_accepted] = sample_from(p[rows, verdict.num_accepted], u_sample)
    return verdict


def test_batched_wrong_rule_is_caught(tiny_model, target, monkeypatch, one_thread):
    monkeypatch.setattr(step_module, "verify_speculative", resample_from_p)
    counts = batched_counts(tiny_model, target, 1500, "sps")
    assert chi_square_pvalue(counts, exact_joint(tiny_model, ids(PROMPTS[0]), N_TOKENS, SAMPLING)) < 1e-6


# ---- k=auto -----------------------------------------------------------------------------------


def flat_cost():  # a forward costs the same at any width: drafting is free, so k=auto drafts all it can
    return CostModel({(r, t): 1.0 for r in (1, 16) for t in (1, 9)})


def knee():  # flat up to 8 tokens a forward (memory bound), then linear in rows x tokens (compute bound), as on a CPU
    return CostModel({(r, t): 0.05 + 0.005 * max(r * t - 8, 0) for r in (1, 2, 4, 8, 16) for t in (1, 2, 3, 5, 9)})


def test_adaptive_greedy_equals_ar_and_records_k(tiny_model, target, ar_alone, one_thread):
    seqs = [Sequence(ids(p), drafter=make_drafter(tiny_model, "ngram"), k=6, adaptive=True, max_new_tokens=24) for p in PROMPTS]
    outs = generate_many(target, seqs, max_rows=6, cost=flat_cost())
    assert [o.token_ids for o in outs] == ar_alone
    ks = [r.k for o in outs for r in o.steps]
    assert all(0 <= k <= 6 for k in ks) and max(ks) == 6


def test_adaptive_turns_drafting_off_under_load(tiny_model, target, ar_alone, one_thread):
    def run(rows, cost):
        seqs = [
            Sequence(ids(PROMPTS[4]), drafter=make_drafter(tiny_model, "ngram"), k=6, adaptive=True, max_new_tokens=24) for _ in range(rows)
        ]
        outs = generate_many(target, seqs, max_rows=rows, cost=cost)
        assert all(o.token_ids == generate(target, ids(PROMPTS[4]), max_new_tokens=24).token_ids for o in outs)
        return sum(r.drafted for o in outs for r in o.steps)

    assert run(16, knee()) == 0  # high load: no speculation
    assert run(1, knee()) > 0  # one row: widening the forward costs next to nothing, drafts pay


def test_adaptive_model_drafter_and_fixed_rows_share_a_step(tiny_model, target, ar_alone, one_thread):
    seqs = [
        Sequence(ids(PROMPTS[0]), drafter=make_drafter(tiny_model, "sps"), k=4, adaptive=True, max_new_tokens=24),
        Sequence(ids(PROMPTS[1]), drafter=make_drafter(tiny_model, "ngram"), k=3, max_new_tokens=24),  # fixed k=3
        Sequence(ids(PROMPTS[3]), drafter=make_drafter(tiny_model, "sps-tree"), k=3, adaptive=True, max_new_tokens=24),
    ]
    outs = generate_many(target, seqs, max_rows=3, cost=knee())
    assert [o.token_ids for o in outs] == [ar_alone[0], ar_alone[1], ar_alone[3]]
    assert outs[1].steps[0].k == 3 and all(r.k <= 3 for r in outs[1].steps)  # the fixed row keeps its k


@pytest.mark.parametrize("drafter", ["ngram", "sps"])
def test_a_seeded_sampled_chain_draws_the_same_tokens_beside_a_tree(tiny_model, target, drafter, one_thread):
    """A sampled chain row reads its uniforms the same way whatever shares its step: alone, beside chains, or beside a
    row that drafts a tree (the step then verifies its trees as trees, its chains as chains). So a seeded request gives
    the same text on a busy server as alone."""
    sampling = SamplingParams(temperature=1.0)

    def seeded():
        return Sequence(
            ids(PROMPTS[4]), drafter=make_drafter(tiny_model, drafter), k=4, max_new_tokens=24, sampling=sampling,
            generator=torch.Generator().manual_seed(7),
        )  # fmt: skip

    alone = generate_many(target, [seeded()], max_rows=1)[0].token_ids
    for company in ("ngram-tree", "sps-tree", "ngram"):
        other = Sequence(ids(PROMPTS[1]), drafter=make_drafter(tiny_model, company), k=4, max_new_tokens=24)
        outs = generate_many(target, [seeded(), other], max_rows=2)
        assert outs[0].token_ids == alone, company
        assert any(s.drafted for s in outs[0].steps) and max(r.rows for r in outs[0].steps) == 2


class _CapturingOnce(DraftModelDrafter):
    """A draft model whose second proposal also captures a CUDA graph (a slow one: 0.3 s), as a drafter's first draft
    of a shape does on a GPU; here the capture itself is a sleep (no CUDA), accounted as ``graphs.capture`` accounts.
    (Its first proposal teaches k=auto nothing in any case: it also fed the drafter the prompt.)"""

    calls = 0

    def propose(self, state, k):
        self.calls += 1
        if self.calls == 2:
            graphs_module.capture(lambda: None, state.tokens.device, None)
        return super().propose(state, k)


class _SlowCatchUp(DraftModelDrafter):
    """A draft model whose proposals take 0.3 s more when they follow a step it did not draft in (``always``: every
    proposal), as a model drafter's lazy catch-up over what the plain steps committed (the prompt, at the first)."""

    def __init__(self, adapter, always: bool):
        super().__init__(adapter)
        self.always, self.drafted_last = always, False

    def propose(self, state, k):
        if self.always or not self.drafted_last:
            time.sleep(0.3)
        self.drafted_last = k > 0
        return super().propose(state, k)


@pytest.mark.parametrize("leave_out_captures", [True, False])
def test_a_drafts_one_off_graph_capture_is_not_learned_as_its_cost(tiny_model, target, monkeypatch, leave_out_captures, one_thread):
    """k=auto learns what a draft costs from the drafter's measured proposals. A capture happens once per shape: it
    counts in the step's time (the bench sees it) but not in what drafting costs from then on, else one slow capture
    would stop a drafter that pays. The control, with captures counted as cost, drafts far less."""
    monkeypatch.setattr(graphs_module, "_capture_graph", lambda body, device, pool: (time.sleep(0.3), None))
    if not leave_out_captures:
        monkeypatch.setattr(batch_module, "capture_seconds", lambda: 0.0)
    drafter = _CapturingOnce(ModelAdapter(tiny_model, num_layers=1))
    seq = Sequence(ids(PROMPTS[4]), drafter=drafter, k=4, adaptive=True, glance=False, max_new_tokens=40)  # the drafter alone
    out = generate_many(target, [seq], max_rows=1, cost=knee())[0]
    assert out.token_ids == generate(target, ids(PROMPTS[4]), max_new_tokens=40).token_ids
    drafting = [r for r in out.steps if r.drafted]
    assert drafting[0] is out.steps[0] and drafting[1] is out.steps[1] and drafting[1].draft_s >= 0.3  # in the step's time
    later = sum(1 for r in out.steps[2:] if r.drafted)
    if leave_out_captures:
        assert later >= 10, later
    else:
        assert later <= 4, later


@pytest.mark.parametrize("always", [False, True])
def test_a_catch_up_after_plain_steps_is_not_learned_as_what_drafting_costs(tiny_model, target, always, one_thread):
    """A model drafter catches up lazily: its first proposal after steps without drafts (the first of a request, after
    the prompt; a probe) also feeds it what they committed. That is not what a draft costs step after step, so k=auto
    does not learn it (EAGLE's head: 3-9 ms such a proposal on this CPU, 1 ms while it drafts at every step). The
    control, slow at every proposal, stops drafting."""
    drafter = _SlowCatchUp(ModelAdapter(tiny_model, num_layers=1), always)
    seq = Sequence(ids(PROMPTS[4]), drafter=drafter, k=4, adaptive=True, glance=False, max_new_tokens=40)
    out = generate_many(target, [seq], max_rows=1, cost=knee())[0]
    assert out.token_ids == generate(target, ids(PROMPTS[4]), max_new_tokens=40).token_ids
    assert out.steps[0].drafted and out.steps[0].draft_s >= 0.3
    later = sum(1 for r in out.steps[1:] if r.drafted)
    if always:
        assert later <= 4, later
    else:
        assert later >= 10, later


class _OracleTrees(NgramDrafter):
    """A model-free tree drafter that knows the target's continuation: on even steps a one-node tree with a wrong
    token, on odd steps a four-node chain of the right ones (as a suffix tree's small trees from short matches and big
    trees from long ones)."""

    def __init__(self, future: list[int], prompt_len: int, vocab: int):
        super().__init__(3, 1)
        self.future, self.prompt_len, self.vocab, self.calls = future, prompt_len, vocab, 0

    def propose(self, state, k):
        self.calls += 1
        done = state.tokens.shape[1] - self.prompt_len  # generated tokens so far (the pending one included)
        if self.calls % 2:
            toks = [(self.future[done] + 1) % self.vocab] if done < len(self.future) else []
        else:
            toks = self.future[done : done + min(k, 4)]
        if not toks:
            return Proposal.empty(1, state.tokens.device)
        return Proposal(host=toks, device=state.tokens.device, tree=Tree.from_parents(list(range(-1, len(toks)))))


def test_k_auto_judges_a_tree_by_its_size(tiny_model, target, ar_alone, one_thread):
    """One mean over all of a drafter's trees lets its losing small trees ride on its winning big ones; by size, k=auto
    drops the one-node trees (never accepted, each widening the forward) and keeps the four-node ones."""
    # any draft costs 0.4 steps more, whatever the tiny model's real steps cost (smoothing 0: nothing learnt online)
    cost = CostModel({(1, t): 1.0 + 0.4 * (t > 1) + 0.05 * t for t in (1, 2, 3, 5, 9)}, smoothing=0.0)
    future = ar_alone[4] + [0] * 8
    drafter = _OracleTrees(future, ids(PROMPTS[4]).shape[1], tiny_model.config.vocab_size)
    seq = Sequence(ids(PROMPTS[4]), drafter=drafter, k=4, adaptive=True, max_new_tokens=24)
    out = generate_many(target, [seq], max_rows=1, cost=cost)[0]
    assert out.token_ids == ar_alone[4]
    by_size = {}
    for r in out.steps:
        if r.drafted:
            by_size[r.drafted] = by_size.get(r.drafted, 0) + 1
    assert by_size.get(1, 0) <= 3 and sum(n for size, n in by_size.items() if size > 1) >= 3, by_size


class _OracleEstimates(_OracleTrees):
    """Three-node trees that know the target's continuation on even calls and are wrong on odd ones, each carrying the
    drafter's own estimate of its accepted drafts (``Proposal.expected``, as the hybrid's calibrated estimates)."""

    def propose(self, state, k):
        self.calls += 1
        done = state.tokens.shape[1] - self.prompt_len
        right = self.future[done : done + 3]
        if k < 3:  # at most k drafts (the loop lowers k near max_new_tokens)
            return Proposal.empty(1, state.tokens.device)
        toks, expected = (right, 2.9) if self.calls % 2 == 0 else ([(t + 1) % self.vocab for t in right], 0.05)
        return Proposal(host=toks, device=state.tokens.device, tree=Tree.from_parents([-1, 0, 1, 2]), expected=expected)


def test_k_auto_weighs_a_tree_by_the_drafters_own_estimate(tiny_model, target, ar_alone, one_thread):
    """Trees of one size, half of them right: the size's record (1.5 accepted a tree) would verify all of them or none.
    Where the drafter estimates each tree's accepted drafts (the hybrid, calibrated per source), k=auto verifies the
    ones it expects to pay. In-process on this CPU, 13 Spec-Bench prompts: the hybrid went from 0.96x AR (drafting on 7%
    of its steps) to 1.22x (75%)."""
    cost = CostModel({(1, t): 1.0 + 0.4 * (t > 1) + 0.05 * t for t in (1, 2, 3, 5, 9)}, smoothing=0.0)
    drafter = _OracleEstimates(ar_alone[4] + [0] * 8, ids(PROMPTS[4]).shape[1], tiny_model.config.vocab_size)
    seq = Sequence(ids(PROMPTS[4]), drafter=drafter, k=4, adaptive=True, max_new_tokens=24)
    out = generate_many(target, [seq], max_rows=1, cost=cost)[0]
    assert out.token_ids == ar_alone[4]
    drafted = [r for r in out.steps if r.drafted]
    assert len(drafted) >= 3 and all(r.accepted == r.drafted for r in drafted), [(r.drafted, r.accepted) for r in out.steps]


class _OracleKinds(NgramDrafter):
    """A model-free chain drafter that knows the target's continuation: on even steps wrong drafts of kind 1 (as
    prompt lookup's one-token matches), on odd steps right ones of kind 3 (its three-token matches)."""

    def __init__(self, future: list[int], prompt_len: int, vocab: int):
        super().__init__(3, 1)
        self.future, self.prompt_len, self.vocab, self.calls = future, prompt_len, vocab, 0

    def propose(self, state, k):
        self.calls += 1
        done = state.tokens.shape[1] - self.prompt_len
        right = self.future[done : done + k]
        if self.calls % 2:
            return Proposal(host=[(t + 1) % self.vocab for t in right], device=state.tokens.device, kind=1)
        return Proposal(host=right, device=state.tokens.device, kind=3)


def test_k_auto_keeps_a_rows_acceptance_apart_by_the_kind_of_proposal(tiny_model, target, ar_alone, one_thread):
    """Prompt lookup's one-token matches were accepted 0.45 drafts of 4 on this CPU, its three-token ones 2.76: one
    acceptance per row drafts both or neither, one per kind (``Proposal.kind``) drafts the strong ones only."""
    cost = CostModel({(1, t): 1.0 + 0.3 * (t > 1) + 0.05 * t for t in (1, 2, 3, 5, 9)}, smoothing=0.0)
    drafter = _OracleKinds(ar_alone[4] + [0] * 8, ids(PROMPTS[4]).shape[1], tiny_model.config.vocab_size)
    seq = Sequence(ids(PROMPTS[4]), drafter=drafter, k=4, adaptive=True, max_new_tokens=24)
    out = generate_many(target, [seq], max_rows=1, cost=cost)[0]
    assert out.token_ids == ar_alone[4]
    assert seq.acceptance_of[1].alpha < 0.3 < 0.7 < seq.acceptance_of[3].alpha
    drafted = [r for r in out.steps if r.drafted]
    assert sum(r.accepted for r in drafted) >= 2 * len(drafted) - 4  # nearly only the right kind was drafted
    state = DecodeState(ids([5, 6, 7, 5, 6]), None, None, GREEDY, None, 16)
    assert NgramDrafter(3, 1).propose(state, 2).kind == 2  # [5, 6] matched


class _SlowProposals(NgramDrafter):
    """A model-free drafter whose every proposal takes a millisecond (as suffix decoding's 0.3-0.5 ms on this CPU)."""

    def __init__(self):
        super().__init__(3, 1)
        self.calls = 0

    def propose(self, state, k):
        self.calls += 1
        time.sleep(0.001)
        return Proposal(host=[7] * k, device=state.tokens.device) if k > 0 else Proposal.empty(1, state.tokens.device)


def test_under_load_a_costly_model_free_drafter_stops_proposing(tiny_model, target, one_thread):
    """Sixteen rows on a compute-bound forward: the width is 1 whatever they offer, so proposals save nothing. Each
    row's gate stops them after its judge's worth and probes now and then; before 2026-11-29 only a lone row had a
    gate, and every row of a batch proposed at every step (suffix decoding at 8 rows: 0.87x batched AR here)."""
    n_tokens = 48
    drafters = [_SlowProposals() for _ in range(16)]
    seqs = [Sequence(ids(PROMPTS[4]), drafter=d, k=4, adaptive=True, max_new_tokens=n_tokens) for d in drafters]
    outs = generate_many(target, seqs, max_rows=16, cost=knee())
    want = generate(target, ids(PROMPTS[4]), max_new_tokens=n_tokens).token_ids
    assert all(o.token_ids == want for o in outs)
    assert sum(r.drafted for o in outs for r in o.steps) == 0
    judge = seqs[0].gate.judge
    assert all(judge <= d.calls <= judge + 4 for d in drafters), [d.calls for d in drafters]  # of 47 steps


class _WrongModelDrafts(NgramDrafter):
    """A model drafter (as EAGLE's head) whose drafts are never accepted, and whose first proposal after steps without
    drafts also catches up on what they committed (a millisecond)."""

    model_free = False

    def __init__(self, future: list[int], prompt_len: int, vocab: int):
        super().__init__(3, 1)
        self.future, self.prompt_len, self.vocab, self.drafted_last = future, prompt_len, vocab, False

    def propose(self, state, k):
        if k <= 0:
            self.drafted_last = False
            return Proposal.empty(1, state.tokens.device)
        if not self.drafted_last:
            time.sleep(0.001)
        self.drafted_last = True
        return self.wrong(state, k)

    def wrong(self, state, k):
        """k drafts, the first never the target's next token."""
        done = state.tokens.shape[1] - self.prompt_len
        return Proposal(host=[(self.future[done] + 1) % self.vocab] * k, device=state.tokens.device)


def test_under_load_a_rows_probe_pays_for_widening_the_whole_batch(tiny_model, target, ar_alone, one_thread):
    """A model drafter that stopped drafting probes now and then, at most a 32nd of the plain steps it waited. In a
    batch every row pays a probe's width, so the widening counted is the batch's, against the row's share of its plain
    steps: with 8 rows here no row probes in 64 tokens after its first drafts, where one-row costs (before 2026-11-29)
    let each probe twice (EAGLE at 8 rows on this CPU: 0.91x batched AR with no draft accepted)."""
    # one row: a wider forward is nearly free; eight rows: each token more costs a third of a plain step, though
    # drafts accepted at 0.8 would still pay, so the rows stay due a probe
    points = {(1, t): 0.05 + 0.002 * (t - 1) for t in (1, 2, 3, 5, 9)}
    points.update({(8, t): 0.05 + 0.016 * (t - 1) for t in (1, 2, 3, 5, 9)})
    future = ar_alone[4] + [0] * 80
    n = ids(PROMPTS[4]).shape[1]
    drafters = [_WrongModelDrafts(future, n, tiny_model.config.vocab_size) for _ in range(8)]
    seqs = [Sequence(ids(PROMPTS[4]), drafter=d, k=4, adaptive=True, glance=False, max_new_tokens=64) for d in drafters]
    outs = generate_many(target, seqs, max_rows=8, cost=CostModel(points, smoothing=0.0))
    want = generate(target, ids(PROMPTS[4]), max_new_tokens=64).token_ids
    assert all(o.token_ids == want for o in outs)
    first = [next(i for i, r in enumerate(o.steps) if not r.drafted) for o in outs]  # the first drafts, then plain steps
    probes = [sum(1 for r in o.steps[f:] if r.drafted) for o, f in zip(outs, first, strict=True)]
    assert max(first) <= 8 and sum(probes) == 0, (first, probes)


class _MarkedCatchUp(_WrongModelDrafts):
    """Its catch-up takes 20 ms and is marked as a model drafter marks it (``Drafter.caught_up``); a draft takes 1 ms."""

    def propose(self, state, k):
        if k <= 0:
            return super().propose(state, k)
        time.sleep(0.02)
        self.caught_up = mark(state.tokens.device)
        time.sleep(0.001)
        return self.wrong(state, k)


def test_a_drafter_that_drafts_now_and_then_learns_its_catch_up_and_its_drafts_apart(tiny_model, target, ar_alone, one_thread):
    """A model drafter whose drafts are never accepted drafts at a request's first step, then seldom, never on two
    steps running. Before 2026-11-29 k=auto learnt what a draft costs only from a step that followed a drafting step,
    and what catching up costs only once that was known: such a drafter learnt neither, so each request's first
    proposal caught up on its whole prompt untried (the distilled draft at 8 rows here). Where the drafter marks the
    end of its catch-up, a lone drafting step teaches both."""
    seq = Sequence(ids(PROMPTS[4]), drafter=_MarkedCatchUp(ar_alone[4] + [0] * 8, 20, tiny_model.config.vocab_size), k=2, adaptive=True,
                   max_new_tokens=24)  # fmt: skip
    out = generate_many(target, [seq], max_rows=1, cost=knee())[0]
    assert out.token_ids == ar_alone[4]
    first = out.steps[0]
    assert first.drafted and first.catch_up_s is not None and 0.02 <= first.catch_up_s < first.draft_s
    assert 0.0005 < seq.draft_cost(1) < 0.02  # the draft's own cost, the catch-up left out
    assert seq.draft_cost.catch_up(20) is not None and seq.draft_cost.catch_up(20) > 0.005  # 20 ms a catch-up of 20-40 tokens


class _CopiesLater(NgramDrafter):
    """A model-free drafter whose full proposals take a millisecond (suffix decoding's tries) and whose glance is a
    lookup: until ``copy_from`` tokens are generated its proposals are wrong (kind 1) and its glance finds nothing;
    from there both give the target's own continuation (kind 3), as a QA answer that starts quoting its passage."""

    def __init__(self, future: list[int], prompt_len: int, vocab: int, copy_from: int, glances: bool):
        super().__init__(3, 1)
        self.future, self.prompt_len, self.vocab, self.copy_from, self.glances = future, prompt_len, vocab, copy_from, glances
        self.full_at: list[int] = []  # tokens generated when each full proposal was made

    def drafts(self, state, k):
        done = state.tokens.shape[1] - self.prompt_len
        right = self.future[done : done + k]
        if done >= self.copy_from:
            return Proposal(host=right, device=state.tokens.device, kind=3)
        return Proposal(host=[(t + 1) % self.vocab for t in right], device=state.tokens.device, kind=1)

    def propose(self, state, k):
        self.full_at.append(state.tokens.shape[1] - self.prompt_len)
        time.sleep(0.001)
        return self.drafts(state, k)

    def glance(self, state, k):
        p = self.drafts(state, k)
        return p if self.glances and p.kind == 3 else Proposal.empty(1, state.tokens.device)

    def lookahead(self, state, k):
        return self.glance(state, k).host or []


def test_a_shut_gate_glances_and_copying_that_starts_later_is_drafted(tiny_model, target, one_thread):
    """Once a model-free drafter's proposals stop paying, k=auto's gate holds them back and the drafter glances
    (``Drafter.glance``: prompt lookup, for suffix decoding and the hybrid). Copying that starts later is drafted from
    its first step; with nothing to glance with the row waited for a probe (qa 323 here: suffix decoding's gate shut
    at step 16, 116 steps where every proposal made took 72). Full proposals that then offer no more than the glance
    stay held back: only probes make them."""
    cost = CostModel({(1, t): 0.004 + 0.0012 * (t > 1) + 0.0002 * t for t in (1, 2, 3, 5, 9)}, smoothing=0.0)
    want = generate(target, ids(PROMPTS[4]), max_new_tokens=64).token_ids
    n, copy_from, outs = ids(PROMPTS[4]).shape[1], 28, {}
    for glances in (True, False):
        drafter = _CopiesLater(want + [0] * 8, n, tiny_model.config.vocab_size, copy_from, glances)
        seq = Sequence(ids(PROMPTS[4]), drafter=drafter, k=4, adaptive=True, max_new_tokens=64)
        outs[glances] = (generate_many(target, [seq], max_rows=1, cost=cost)[0], drafter)
    for out, _ in outs.values():
        assert out.token_ids == want
    out, drafter = outs[True]
    shut = next(d for a, d in zip(drafter.full_at, drafter.full_at[1:], strict=False) if d > a + 1)  # the gate shut before d
    assert shut < copy_from, drafter.full_at
    assert len(drafter.full_at) < 16 + 6, (drafter.full_at, len(out.steps))  # its first 16 and a few probes
    assert len(out.steps) < len(outs[False][0].steps), (len(out.steps), len(outs[False][0].steps), drafter.full_at, outs[False][1].full_at)


class _CopiesBetter(_CopiesLater):
    """Copies from the first token: its full proposals give the target's next ``k`` tokens, its glance the next
    ``glimpse`` of them."""

    def __init__(self, future, prompt_len, vocab, glimpse):
        super().__init__(future, prompt_len, vocab, 0, True)
        self.glimpse = glimpse

    def glance(self, state, k):
        return super().glance(state, min(k, self.glimpse))


@pytest.mark.parametrize("glimpse", [4, 1])
def test_the_gate_weighs_a_full_proposal_against_the_glance(tiny_model, target, one_thread, glimpse):
    """A full proposal is worth what it saves beyond the glance the drafter would have offered instead
    (``Drafter.lookahead``): one that drafts the same four right tokens as its glance, at a millisecond more, is held
    back after the gate's first 16 and the row glances (as many steps, probes apart); one that drafts four right
    tokens where the glance has one keeps proposing."""
    cost = CostModel({(1, t): 0.004 + 0.0012 * (t > 1) + 0.0002 * t for t in (1, 2, 3, 5, 9)}, smoothing=0.0)
    want = generate(target, ids(PROMPTS[4]), max_new_tokens=160).token_ids
    n = ids(PROMPTS[4]).shape[1]
    drafter = _CopiesBetter(want + [0] * 8, n, tiny_model.config.vocab_size, glimpse)
    seq = Sequence(ids(PROMPTS[4]), drafter=drafter, k=4, adaptive=True, max_new_tokens=160)
    out = generate_many(target, [seq], max_rows=1, cost=cost)[0]
    assert out.token_ids == want
    steps = len(out.steps)
    if glimpse == 1:
        assert len(drafter.full_at) >= steps - 1, (steps, drafter.full_at)
    else:
        assert 16 <= len(drafter.full_at) <= 16 + 3 and steps <= 160 // 5 + 4, (steps, drafter.full_at)


def test_batch_phases_count_each_step_and_split_its_time(tiny_model, target, one_thread):
    """``batch_phases`` (what ``specray bench-device`` reports for its batched sweep) counts every decoding step of
    every batch once, and splits the batch's time between filling prompts and decoding steps."""
    before = batch_module.batch_phases()
    lengths = ((PROMPTS[0], 9), (PROMPTS[1], 5))
    seqs = [Sequence(ids(p), drafter=make_drafter(tiny_model, "ngram"), k=2, max_new_tokens=m) for p, m in lengths]
    begin = time.perf_counter()
    generate_many(target, seqs, max_rows=2)
    wall = time.perf_counter() - begin
    after = batch_module.batch_phases()
    # both short prompts are filled before the first step decodes: the batch steps as often as its longest row
    assert after["steps"] - before["steps"] == max(len(s.steps) for s in seqs)
    prefill, decode = after["prefill_s"] - before["prefill_s"], after["decode_s"] - before["decode_s"]
    assert prefill > 0 and decode > 0 and prefill + decode <= wall


# ---- a model drafter's row falls back on prompt lookup (glance) --------------------------------------------------


class _Declines(DraftModelDrafter):
    """A model drafter that proposes nothing whatever budget it gets (as DEL does while its exits agree too little),
    counting the proposals asked of it."""

    def __init__(self, model):
        super().__init__(ModelAdapter(model, num_layers=1))
        self.calls = 0

    def propose(self, state, k):
        self.calls += 1
        return Proposal.empty(1, state.tokens.device)


class _Knows(DraftModelDrafter):
    """A model drafter whose drafts are the target's own continuation (``future``, the new tokens of AR's output)."""

    def __init__(self, model, future: list[int], prompt_len: int):
        super().__init__(ModelAdapter(model, num_layers=1))
        self.future, self.prompt_len, self.calls = future, prompt_len, 0

    def propose(self, state, k):
        self.calls += 1
        done = state.tokens.shape[1] - self.prompt_len
        return Proposal(tokens=torch.tensor([self.future[done : done + k]], device=state.tokens.device))


def test_a_model_drafters_row_drafts_prompt_lookups_chain_where_its_own_drafts_do_not(tiny_model, target, ar_alone, one_thread):
    """Under k=auto a model drafter's row also looks its text up (prompt lookup, 0.02 ms a step) and drafts that chain
    where it is worth more than what the drafter would do: here a drafter that declines every budget. The drafter is
    not asked on those steps (it rests), the output is AR's, and the repetitive prompts take fewer steps than with
    ``glance=False``, where the row never drafts."""
    steps, looked = {}, {}
    for glance in (True, False):
        seqs = [Sequence(ids(p), drafter=_Declines(tiny_model), k=4, adaptive=True, glance=glance, max_new_tokens=24) for p in PROMPTS]
        outs = generate_many(target, seqs, max_rows=3, cost=flat_cost())
        assert [o.token_ids for o in outs] == ar_alone
        for s, o in zip(seqs, outs, strict=True):
            n_looked = sum(r.looked for r in o.steps)
            assert all(r.drafted for r in o.steps if r.looked) and not any(r.drafted for r in o.steps if not r.looked)
            assert s.drafter.calls <= len(o.steps) - n_looked, (s.drafter.calls, len(o.steps), n_looked)
        steps[glance] = [len(o.steps) for o in outs]
        looked[glance] = sum(r.looked for o in outs for r in o.steps)
    assert looked[False] == 0 and looked[True] > 10, looked
    assert sum(steps[True]) < sum(steps[False]) - 10, steps


def test_a_model_drafter_whose_drafts_pay_more_keeps_drafting_them(tiny_model, target, ar_alone, one_thread):
    """The lookup is weighed against the drafter, not preferred to it: a drafter that knows the target's next four
    tokens drafts nearly every step itself, even on a prompt whose lookups would be accepted."""
    n = ids(PROMPTS[4]).shape[1]
    drafter = _Knows(tiny_model, ar_alone[4] + [0] * 8, n)
    seq = Sequence(ids(PROMPTS[4]), drafter=drafter, k=4, adaptive=True, max_new_tokens=24)
    out = generate_many(target, [seq], max_rows=1, cost=flat_cost())[0]
    assert out.token_ids == ar_alone[4]
    assert sum(r.looked for r in out.steps) <= 1 and len(out.steps) <= 24 // 5 + 2, [(r.drafted, r.looked) for r in out.steps]


def looked_counts(model, target, draws):
    """``batched_counts`` for rows of a declining model drafter under k=auto: what they draft is prompt lookup's."""
    v = model.config.vocab_size
    counts, looked = torch.zeros([v] * N_TOKENS, dtype=torch.long), 0
    seqs = [
        Sequence(
            ids(PROMPTS[0]),
            drafter=_Declines(model),
            k=2,
            adaptive=True,
            sampling=SAMPLING,
            max_new_tokens=N_TOKENS + 1,
            generator=torch.Generator().manual_seed(20_000 + i),
        )
        for i in range(draws)
    ]
    outs = generate_many(target, seqs, max_rows=16, cost=flat_cost())
    for s, o in zip(seqs, outs, strict=True):
        counts[tuple(s.new[:N_TOKENS])] += 1
        looked += sum(r.looked and r.accepted > 0 for r in o.steps)
    return counts, looked


def test_looked_up_chains_sampled_follow_the_target_and_a_wrong_rule_is_caught(tiny_model, target, monkeypatch, one_thread):
    counts, accepted = looked_counts(tiny_model, target, 1500)
    assert accepted > 100, accepted  # the lookups were drafted and accepted: the test means something
    p = chi_square_pvalue(counts, exact_joint(tiny_model, ids(PROMPTS[0]), N_TOKENS, SAMPLING))
    assert p > 1e-4, f"looked-up chains: sampled tokens do not follow the target (p={p:.2e})"

    monkeypatch.setattr(step_module, "verify_speculative", resample_from_p)
    counts, _ = looked_counts(tiny_model, target, 1500)
    assert chi_square_pvalue(counts, exact_joint(tiny_model, ids(PROMPTS[0]), N_TOKENS, SAMPLING)) < 1e-6


def test_a_one_row_state_defers_its_device_ids_until_read(target):
    """A row whose drafter does not read ``state.tokens`` commits on the host; the ids reach the device buffer, in
    order, when something reads them; a state of several rows (or without room) commits at once."""
    from decoding.drafters.base import DecodeState

    state = DecodeState(ids([4, 5]), target, target.new_cache(1, 16), GREEDY, None, 16)
    state.reserve(8)
    assert state.defer([6]) and state.defer([7, 8]) and state.length == 5 and state.history == [4, 5, 6, 7, 8]
    assert state.rows == 1 and state._owed == 3  # nothing written yet
    assert state.tokens.tolist() == [[4, 5, 6, 7, 8]] and state._owed == 0
    state.commit(ids([9]), [9])
    assert state.tokens.tolist() == [[4, 5, 6, 7, 8, 9]] and state.history == [4, 5, 6, 7, 8, 9]
    assert not state.defer([1, 2, 3]) and state.length == 6  # no room left in the buffer of 8
    two = DecodeState(torch.tensor([[1], [2]]), target, target.new_cache(2, 16), GREEDY, None, 16)
    two.reserve(8)
    assert not two.defer([3])
