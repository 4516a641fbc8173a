"""TriForce on tiny models: the sparse KV views, greedy identity, exact sampling distribution, bookkeeping, knobs."""

import pytest
import torch
from conftest import tiny_llama
from tests_support import generate

from decoding.config import SpecConfig
from decoding.errors import ConfigError
from decoding.loop.metrics import chi_square_pvalue
from decoding.model.adapter import KVCache, ModelAdapter
from decoding.model.kv_views import RetrievalCache, SparseKVCache, ViewAdapter, chunk_scores_reference, streaming_cache
from decoding.sampling import GREEDY
from decoding.schedules.triforce import TriForceDrafter
from decoding.schedules.two_sided import DraftRequest, DraftSide, LocalExecutor, VerifySide, generate_two_sided
from tests.decoding.loop.test_loop import N_TOKENS, PROMPT, SAMPLING, WARPED, exact_joint, sample_counts

LONG = torch.tensor([[3, 7, 3, 7, 3, 1, 2, 5, 6, 3, 7, 9, 4, 4, 8, 3, 7, 3]])  # 18 tokens: 4 chunks of 4 + a partial chunk


pytestmark = pytest.mark.usefixtures("one_thread")


def triforce(model, bottom="layers", budget=3, chunk_size=1, gamma=2, sinks=1, window=2):
    draft = tiny_llama(layers=1, seed=1) if bottom == "model" else model
    return TriForceDrafter(
        bottom,
        budget=budget,
        chunk_size=chunk_size,
        gamma=gamma,
        sinks=sinks,
        window=window,
        bottom_adapter=ModelAdapter(draft, num_layers=1),
    )


# ---- the views ------------------------------------------------------------------------------------
def constructed_cache():
    """One layer, 2 KV heads, head size 4, 12 positions in chunks of 2. Query heads 0,1 read KV head 0 and ask for e0;
    heads 2,3 read KV head 1 and ask for e1. KV head 0 has e0 keys in chunk 3 (e1 in chunk 2), KV head 1 the reverse."""
    cache = KVCache(1, 1, 2, 4, 16, torch.float32, "cpu")
    k = cache.k[0][0]  # [H, N, D]
    k[0, 6:8, 0], k[0, 4:6, 1] = 10.0, 20.0
    k[1, 4:6, 1], k[1, 6:8, 0] = 5.0, 30.0
    k[:, 8:10, 2] = 50.0  # a strong chunk no query asks for
    cache.v[0][0] = torch.arange(16.0).view(1, 16, 1).expand(2, 16, 4)  # values = positions
    cache.length = 12
    query = torch.zeros(1, 4, 1, 4)
    query[0, :2, 0, 0], query[0, 2:, 0, 1] = 1.0, 1.0
    return cache, query


def test_retrieval_selects_the_chunks_the_query_asks_for():
    cache, query = constructed_cache()
    view = RetrievalCache(cache, budget=6, chunk_size=2, max_len=16)
    assert (view.selected, view.tail_start) == (3, 12)
    chunks = view.select([query])
    # first and latest chunk always, plus the best: chunk 3 (e0) for KV head 0, chunk 2 (e1) for KV head 1
    assert chunks[0, 0].tolist() == [[0, 3, 5], [0, 2, 5]]
    assert view.v[0][0, :, :6, 0].tolist() == [[0, 1, 6, 7, 10, 11], [0, 1, 4, 5, 10, 11]]
    scores = chunk_scores_reference(query, cache.k[0][:, :, :12], 2)
    assert scores[0, 0].argmax() == 3 and scores[0, 1].argmax() == 2


def test_retrieval_tail_holds_the_partial_chunk_and_syncs_committed_tokens():
    cache, query = constructed_cache()
    cache.length = 11  # chunks {0,1}..{8,9}, tail {10}
    view = RetrievalCache(cache, budget=5, chunk_size=2, max_len=16)
    view.select([query])
    assert (view.selected, view.tail_start, view.length) == (2, 10, 11)
    assert view.v[0][0, 0, :5, 0].tolist() == [0, 1, 8, 9, 10]  # 2 chunks (0 forced, latest 4 forced) + tail
    cache.length = 13
    view.sync()  # the full cache committed positions 11, 12
    assert view.length == 13 and view.v[0][0, 0, 4:7, 0].tolist() == [10, 11, 12]


def test_streaming_cache_keeps_sinks_and_window():
    src = KVCache(1, 1, 1, 1, 32, torch.float32, "cpu")
    src.k[0][0, 0, :, 0] = torch.arange(32.0)
    view = streaming_cache(src, 1, length=20, sinks=2, window=4, max_len=32)
    assert view.positions() == [0, 1, 16, 17, 18, 19]

    def attended(start, t):
        view.begin(start, t)
        new = torch.arange(float(start), start + t).view(1, 1, t, 1)
        keys, _ = view.update(new, new, 0)
        return keys[0, 0, :, 0].int().tolist()

    assert attended(20, 1) == [0, 1, 16, 17, 18, 19, 20]
    assert attended(21, 3) == [0, 1, 17, 18, 19, 20, 21, 22, 23]  # three new tokens, the window slides by one
    view.rollback(21)  # 21..23 were rejected
    assert attended(21, 1) == [0, 1, 17, 18, 19, 20, 21]
    assert attended(22, 1) == [0, 1, 18, 19, 20, 21, 22]


def test_view_with_the_whole_prompt_equals_the_full_cache(tiny_model):
    """Positions, mask and slot bookkeeping of a view forward are exact: a budget covering the prompt changes nothing."""
    a = ModelAdapter(tiny_model)
    n = LONG.shape[1]
    full = a.new_cache(1, 32)
    a.forward(full, 0, input_ids=LONG)
    full.length = n
    view = RetrievalCache(full, budget=32, chunk_size=4, max_len=32)
    view.select([torch.zeros(1, 4, 1, 8)] * 3)
    assert view.selected == 4 and view.kept == 16
    nxt = torch.tensor([[5, 1, 2]])
    want = a.logits(a.forward(full, n, input_ids=nxt))
    got = ViewAdapter(a).logits(ViewAdapter(a).forward(view, n, input_ids=nxt))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    sparse = RetrievalCache(full, budget=8, chunk_size=4, max_len=32)  # 2 of 4 chunks: a different model
    sparse.select([torch.randn(1, 4, 1, 8)] * 3)
    assert not torch.allclose(ViewAdapter(a).logits(ViewAdapter(a).forward(sparse, n, input_ids=nxt)), want, atol=1e-3)


# ---- the hierarchy on a tiny model ---------------------------------------------------------------------
@pytest.mark.parametrize("bottom", ["layers", "ngram", "model"])
def test_greedy_equals_ar(tiny_model, bottom):
    target = ModelAdapter(tiny_model)
    ref = generate(target, LONG, max_new_tokens=30).token_ids
    drafter = triforce(tiny_model, bottom, budget=8, chunk_size=4, gamma=2)
    out = generate(target, LONG, drafter=drafter, k=3, max_new_tokens=30)
    assert out.token_ids == ref
    assert drafter.inner_steps and sum(s.drafted for s in drafter.inner_steps) > 0
    assert out.stats.acceptance_rate > 0  # the middle level's drafts are accepted by the full target


@pytest.mark.parametrize("max_new", [1, 2, 5, 9])
def test_max_new_tokens_exact(tiny_model, max_new):
    out = generate(ModelAdapter(tiny_model), LONG, drafter=triforce(tiny_model, budget=8, chunk_size=4), k=4, max_new_tokens=max_new)
    assert len(out.token_ids) == max_new


def test_stops_right_after_eos(tiny_model):
    target = ModelAdapter(tiny_model)
    ref = generate(target, LONG, max_new_tokens=30).token_ids
    eos = ref[6]
    out = generate(target, LONG, drafter=triforce(tiny_model, budget=8, chunk_size=4), k=4, max_new_tokens=30, eos_token_ids=[eos])
    assert out.token_ids == ref[: ref.index(eos) + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("sampling, draws", [(SAMPLING, 300), (WARPED, 300)], ids=["plain", "top-k-top-p"])
def test_sampled_distribution_matches_target(tiny_model, sampling, draws):
    # budget 3 of the 5 prompt tokens, chunks of 1: the middle level is a different distribution from the target
    counts = sample_counts(tiny_model, triforce(tiny_model), sampling, k=3, draws=draws)
    p = chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, sampling))
    assert p > 1e-4, f"triforce: sampled tokens do not follow the target (p={p:.2e})"


def test_misaligned_proposal_probs_are_caught(tiny_model, monkeypatch):
    """Reporting the middle's distributions one position off (a bookkeeping slip) biases the output: the test above can fail.

    (Dropping them altogether would not: treating sampled drafts as deterministic is lossless too, only less efficient.)
    """
    drafter = triforce(tiny_model)
    propose = drafter.propose

    def misaligned(state, k):
        prop = propose(state, k)
        prop.probs = prop.probs.roll(1, dims=1)
        return prop

    monkeypatch.setattr(drafter, "propose", misaligned)
    counts = sample_counts(tiny_model, drafter, SAMPLING, k=4, draws=400)  # caught at p < 1e-15 from 150 draws
    assert chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, SAMPLING)) < 1e-6


def test_middle_level_is_sparse_and_rejected_sometimes(tiny_model):
    target = ModelAdapter(tiny_model)
    gen = torch.Generator().manual_seed(0)
    drafted = accepted = 0
    for _ in range(30):
        d = triforce(tiny_model)
        out = generate(target, PROMPT, drafter=d, k=3, sampling=SAMPLING, max_new_tokens=8, generator=gen)
        drafted += sum(s.drafted for s in out.steps)
        accepted += sum(s.accepted for s in out.steps)
        assert isinstance(d.retrieval, SparseKVCache) and d.retrieval.kept == 3
    assert 0.1 < accepted / drafted < 0.95


# ---- the levels on two sides (the middle and bottom on a draft side, the full target on a target side) --------
def two_sided(model, sampling=GREEDY, **knobs):
    """A target side and a draft side hosting TriForce's lower levels over its own copy of the target."""
    draft = DraftSide(triforce(model, **knobs), sampling, target=ModelAdapter(model))
    return LocalExecutor(VerifySide(ModelAdapter(model), sampling), draft)


@pytest.mark.parametrize("schedule", ["sps", "pearl"])
@pytest.mark.parametrize("bottom", ["layers", "ngram", "model"])
def test_two_sided_greedy_equals_ar(tiny_model, schedule, bottom):
    ref = generate(ModelAdapter(tiny_model), LONG, max_new_tokens=30).token_ids
    ex = two_sided(tiny_model, bottom=bottom, budget=8, chunk_size=4, gamma=2)
    out = generate_two_sided(ex, LONG, schedule=schedule, k=3, max_new_tokens=30, ship_kv=True)
    assert out.token_ids == ref
    stats = ex.draft.level_stats()
    assert stats["middle_drafted"] > 0 and stats["kv_bytes"]["middle"] > 0


def test_shipped_kv_makes_the_draft_side_draft_as_in_one_process(tiny_model):
    # sequential schedule + the verdicts' exact KV: the middle level sees what it sees in process, step for step
    local = triforce(tiny_model, budget=8, chunk_size=4, gamma=2)
    generate(ModelAdapter(tiny_model), LONG, drafter=local, k=3, max_new_tokens=30)
    ex = two_sided(tiny_model, budget=8, chunk_size=4, gamma=2)
    generate_two_sided(ex, LONG, schedule="sps", k=3, max_new_tokens=30, ship_kv=True)
    remote = ex.draft.drafter
    assert [(s.drafted, s.accepted) for s in remote.inner_steps] == [(s.drafted, s.accepted) for s in local.inner_steps]
    full = ex.draft.state.target_cache
    top = ex.target.cache
    # the draft side's copy of the full cache followed the verifier's, up to the last verdict (no request after it)
    assert LONG.shape[1] < full.length < top.length
    torch.testing.assert_close(full.k[1][:, :, : full.length], top.k[1][:, :, : full.length], rtol=0, atol=0)


@pytest.mark.parametrize("schedule", ["sps", "pearl"])
def test_without_shipped_kv_the_middle_keeps_its_own_kv_and_stays_lossless(tiny_model, schedule):
    ref = generate(ModelAdapter(tiny_model), LONG, max_new_tokens=24).token_ids
    ex = two_sided(tiny_model, budget=8, chunk_size=4, gamma=2)
    out = generate_two_sided(ex, LONG, schedule=schedule, k=3, max_new_tokens=24)
    assert out.token_ids == ref
    assert ex.draft.state.target_cache.length == LONG.shape[1]  # the draft side's full cache never moved past the prompt


def test_draft_side_catches_up_on_tokens_it_never_drafted_after(tiny_model):
    # a request that only syncs (k=0) leaves its appended token unfed; the next one must feed it (and its own) first.
    # With the whole prompt retrieved the middle level is the target itself: its drafts are the target's greedy tokens.
    side = DraftSide(triforce(tiny_model, budget=20, chunk_size=4, window=8), target=ModelAdapter(tiny_model))
    prompt = LONG[0].tolist()
    side.prefill(prompt, 48)
    side.draft(DraftRequest(keep=len(prompt), append=[5], k=0))
    drafts = side.draft(DraftRequest(keep=len(prompt) + 1, append=[9, 2, 11, 4], k=6)).tokens
    ref = generate(ModelAdapter(tiny_model), torch.tensor([prompt + [5, 9, 2, 11, 4]]), max_new_tokens=6).token_ids
    assert drafts == ref


@pytest.mark.parametrize("schedule, draws", [("sps", 300), ("pearl", 300)])
def test_two_sided_sampled_distribution_matches_target(tiny_model, schedule, draws):
    ex = two_sided(tiny_model, SAMPLING)
    counts = torch.zeros([tiny_model.config.vocab_size] * N_TOKENS, dtype=torch.long)
    for i in range(draws):
        out = generate_two_sided(ex, PROMPT, schedule=schedule, k=3, sampling=SAMPLING, max_new_tokens=N_TOKENS + 1, seed=i, ship_kv=True)
        counts[tuple(out.token_ids[:N_TOKENS])] += 1
    p = chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, SAMPLING))
    assert p > 1e-4, f"triforce over two sides ({schedule}): sampled tokens do not follow the target (p={p:.2e})"


# ---- knobs -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "knobs, field",
    [
        (dict(triforce_chunk_size=0), "triforce_chunk_size"),
        (dict(triforce_budget=200, triforce_sinks=4, triforce_window=252), "triforce_budget"),
        (dict(triforce_budget=8, triforce_chunk_size=16, triforce_window=2), "triforce_budget"),
        (dict(triforce_gamma=0), "triforce_gamma"),
        (dict(triforce_window=0), "triforce_window"),
        (dict(triforce_sinks=-1), "triforce_sinks"),
        (dict(triforce_bottom="tree"), "triforce_bottom"),
    ],
)
def test_bad_knobs_name_the_field(knobs, field):
    with pytest.raises(ConfigError) as e:
        SpecConfig(method="triforce", **knobs)
    assert e.value.field == field and "\n" not in str(e.value)


def test_model_bottom_needs_a_draft_model(tiny_model_dir):
    from decoding.in_process import build_drafter
    from decoding.model.loading import load_model

    loaded = load_model(str(tiny_model_dir), "float32")  # 2 layers
    with pytest.raises(ConfigError, match="draft_model"):
        build_drafter(SpecConfig(method="triforce", model=str(tiny_model_dir), triforce_bottom="model"), loaded)
    with pytest.raises(ConfigError, match="draft_layers"):
        build_drafter(SpecConfig(method="triforce", triforce_bottom="layers", draft_layers=2), loaded)
