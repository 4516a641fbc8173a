"""Model-free tree drafters: Token Recycling, suffix decoding and the hybrid; their data structures, the tree size
chosen from a measured cost curve, greedy equality and the sampled distribution on a tiny model."""

import itertools
import random
import time
from types import SimpleNamespace

import pytest
import torch
from tests_support import generate

from decoding.config import SpecConfig
from decoding.drafters.draft_memory import DraftMemory
from decoding.drafters.hybrid import HybridDrafter, merge_trees
from decoding.drafters.model_free import build_model_free
from decoding.drafters.ngram import NgramDrafter
from decoding.drafters.recycling import AdjacencyMatrix, RankStats, RecyclingDrafter, verified_nodes
from decoding.drafters.suffix import SuffixCache, SuffixDrafter, SuffixTrie, best_first
from decoding.errors import ConfigError
from decoding.loop import step as loop_module
from decoding.loop.metrics import chi_square_pvalue
from decoding.loop.verify import verify_tree_speculative
from decoding.model.adapter import ModelAdapter
from decoding.sampling import sample_from
from decoding.trees import hardware
from decoding.trees.shapes import Tree
from tests.decoding.loop.test_loop import N_TOKENS, PROMPT, SAMPLING, exact_joint, sample_counts

V = 12  # the tiny model's vocabulary
# this wrong rule differs from the right one only after a rejected tree node: at 300 draws recycling's control gave
# p = 0.08; it needs more draws than the loop's controls
BROKEN_RULE_DRAWS = 1500


# ---- Token Recycling's adjacency matrix ------------------------------------------------------------------------------
def test_adjacency_keeps_the_latest_top_k_of_every_observed_token():
    adj = AdjacencyMatrix(vocab=V, width=3)
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    adj.observe(torch.tensor([2, 5, 2, 9]), logits)  # token 2 twice: the later row wins
    assert adj.table[5].tolist() == logits[1].topk(3).indices.tolist()
    assert adj.table[2].tolist() == logits[2].topk(3).indices.tolist()
    assert adj.table[9].tolist() == logits[3].topk(3).indices.tolist()
    assert (adj.table[[0, 1, 3]] == -1).all()
    assert adj.table.dtype == torch.int32
    assert AdjacencyMatrix(49152, 8).table.numel() * 4 < 2 * 2**20  # under 2 MB for SmolLM2's vocabulary


def test_expansion_follows_the_template_and_drops_unknown_subtrees():
    adj = AdjacencyMatrix(vocab=V, width=2)
    adj.table[1] = torch.tensor([4, 6], dtype=torch.int32)
    adj.table[4] = torch.tensor([7, 8], dtype=torch.int32)  # 6 was never seen: its subtree is dropped
    adj.table[7] = torch.tensor([1, 2], dtype=torch.int32)
    template = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    tokens, parents, ranks = adj.expand(1, template)
    assert tokens == [4, 6, 7, 8, 1]
    assert parents == [0, 0, 1, 1, 3]
    assert ranks == [0, 1, 0, 1, 0]
    assert adj.expand(3, template) == ([], [], [])  # an unseen root drafts nothing


def test_rank_stats_count_the_accepted_rank_at_every_visited_node():
    stats = RankStats(width=2)
    # tree: root -> a (rank 0), b (rank 1); a -> c (rank 0). Accepted: root, b (rank 1); b is a leaf.
    stats.record(parents=[0, 0, 1], ranks=[0, 1, 0], path=[0, 2])
    assert (stats.visits, stats.accepted) == (1, [0, 1])
    stats.record(parents=[0, 0, 1], ranks=[0, 1, 0], path=[0, 1, 3])  # root -> a -> c: two visits, both rank 0
    assert (stats.visits, stats.accepted) == (3, [2, 1])
    acc = stats.acceptance(prior=(0.5, 0.1), weight=1.0)
    assert acc == pytest.approx([(2 + 0.5) / 4, (1 + 0.1) / 4])


def test_the_logits_rows_are_matched_to_the_tokens_they_follow():
    state = SimpleNamespace(tokens=torch.tensor([[5, 6, 7, 8]]), last_logits=torch.zeros(1, 3, V))
    assert verified_nodes(state, 1, [6, 7, 2]) == [6, 7, 2]  # the proposal's root and nodes
    state.last_logits = torch.zeros(1, 1, V)  # a step that drafted nothing: only the root (pending) was verified
    assert verified_nodes(state, 0, [6, 7, 2]) == [7]  # a stale proposal is not used; the root was tokens[-2]
    assert verified_nodes(state, 0, []) == [7]


# ---- suffix tries --------------------------------------------------------------------------------------------------
def _count(text, sub):
    return sum(1 for i in range(len(text) - len(sub) + 1) if text[i : i + len(sub)] == sub)


def test_suffix_trie_counts_every_substring_up_to_its_depth():
    rnd = random.Random(0)
    text = [rnd.randrange(4) for _ in range(60)]
    trie = SuffixTrie(depth=4)
    trie.extend(text)
    for n in range(1, 5):
        for sub in itertools.product(range(4), repeat=n):
            node = trie.root
            for t in sub:
                node = node.kids.get(t) if node else None
            assert (node.count if node else 0) == _count(text, list(sub)), sub
    assert trie.root.kids[text[0]].kids  # depth 1 nodes have children
    assert all(len(trie.open) <= 4 for _ in [0])


def test_longest_match_with_a_continuation():
    trie = SuffixTrie(depth=8)
    trie.extend([9, 1, 2, 3, 5, 0, 2, 3])  # ends "2 3": seen before (followed by 5); "1 2 3" is not the suffix
    node, m = trie.match_open(max_match=6)
    assert m == 2 and list(node.kids) == [5]
    node, m = trie.match([7, 1, 2, 3], max_match=6)  # another text's context: "1 2 3" matches, continues with 5
    assert m == 3 and list(node.kids) == [5]
    assert trie.match([4, 4], max_match=6) == (None, 0)


def test_best_first_takes_the_most_frequent_paths_and_respects_min_prob():
    trie = SuffixTrie(depth=6)
    for cont in ([1, 2], [1, 2], [1, 2], [1, 3], [4, 5]):  # after 0: "1 2" x3, "1 3" x1, "4 5" x1
        trie.extend([0] + cont)
        trie.end_text()
    node = trie.root.kids[0]
    tokens, parents, probs = best_first(node, depth=2, budget=10, min_prob=0.0)
    assert tokens[:2] == [1, 2] and parents[:2] == [0, 1]
    assert probs == sorted(probs, reverse=True)
    assert probs[:2] == pytest.approx([0.8, 0.6])
    tokens, _, probs = best_first(node, depth=2, budget=10, min_prob=0.25)
    assert min(probs) >= 0.25 and 3 not in tokens
    assert len(best_first(node, depth=2, budget=2, min_prob=0.0)[0]) == 2
    assert max(len(p) for p in [best_first(node, depth=1, budget=10, min_prob=0.0)[1]]) and set(
        best_first(node, depth=1, budget=10, min_prob=0.0)[1]
    ) == {0}


def test_suffix_cache_is_bounded_and_forgets_the_oldest_outputs():
    cache = SuffixCache(depth=4, cache_tokens=100)
    for i in range(30):
        cache.add([i % 50 + 50] * 3 + [i])
    assert cache.tokens <= 100
    assert cache.trie.match([29], 3)[0] is None  # the last output ends the text: no continuation after it
    assert cache.trie.root.kids.get(0) is None  # output 0 was evicted
    assert cache.trie.root.kids.get(29) is not None


def trie_contents(trie, node=None, prefix=()):
    """{substring: count} of every node under ``node`` (the root by default), read through the node views."""
    node = trie.root if node is None else node
    out = {}
    for tok, child in node.kids.items():
        out[prefix + (tok,)] = child.count
        out |= trie_contents(trie, child, prefix + (tok,))
    return out


def test_a_cache_that_takes_back_old_outputs_holds_what_a_trie_of_the_kept_ones_holds():
    rnd = random.Random(3)
    cache = SuffixCache(depth=5, cache_tokens=120)
    for _ in range(60):
        cache.add([rnd.randrange(6) for _ in range(rnd.randint(1, 40))])
        fresh = SuffixTrie(depth=5)
        for out in cache.outputs:
            fresh.extend(out)
            fresh.end_text()
        assert trie_contents(cache.trie) == trie_contents(fresh)
        assert cache.trie.nodes == fresh.nodes == 1 + len(trie_contents(fresh))
        assert cache.tokens == sum(map(len, cache.outputs)) <= 120 or len(cache.outputs) == 1
    # the freed nodes are reused: the arrays hold no more nodes than the most the trie ever held at once
    assert len(cache.trie.count) - len(cache.trie.free) == cache.trie.nodes


# ---- the hybrid's merge and the hardware fit ------------------------------------------------------------------------
def test_merge_keeps_the_best_estimate_and_a_tree_in_every_prefix():
    merged = merge_trees(
        [
            ([5, 6, 7], [0, 1, 2], [0.9, 0.2, 0.1], "suffix"),
            ([5, 8, 9], [0, 1, 0], [0.5, 0.4, 0.3], "recycling"),
            ([9, 1], [0, 1], [0.6, 0.5], "ngram"),
        ]
    )
    probs = [p for _, _, p, _ in merged]
    assert probs == sorted(probs, reverse=True)
    parents = [par for _, par, _, _ in merged]
    assert all(par <= i for i, par in enumerate(parents))  # every prefix is a tree
    by_token = {(tok, par): (p, src) for tok, par, p, src in merged}
    assert by_token[(5, 0)] == (0.9, {"suffix", "recycling"})
    assert by_token[(9, 0)] == (0.6, {"recycling", "ngram"})
    assert len(merged) == 6


def test_tree_chooser_prefers_small_trees_when_nodes_are_expensive():
    acc = [0.45, 0.1, 0.05, 0.03]
    flat = hardware.TreeChooser({1: 1.0, 64: 1.02})
    steep = hardware.TreeChooser({1: 1.0, 8: 1.3, 16: 1.7, 32: 2.6, 64: 4.6})
    assert flat.choose(acc, 6).size > steep.choose(acc, 6).size
    assert steep.prefix([0.01, 0.01]) == 0  # nothing worth its cost: do not draft
    assert flat.prefix([0.5] * 80) == flat.max_budget


def test_trees_and_k_auto_read_one_measured_cost_of_the_forward(tiny_model, tmp_path, monkeypatch, one_thread):
    """The tree chooser reads the cost model k=auto reads: measured once (one row up to 64 tokens), cached per model,
    dtype and forward implementation, and the same object the loop refreshes, so a step's observed cost moves both."""
    from decoding.model import costs

    monkeypatch.setenv("SPECRAY_HOME", str(tmp_path))
    monkeypatch.setattr(costs, "_COSTS", {})
    adapter = ModelAdapter(tiny_model)
    cfg = SpecConfig(model="tiny", dtype="float32", method="suffix")
    chooser = hardware.chooser_for(cfg, SimpleNamespace(model=tiny_model))
    model = costs.forward_costs(adapter, "tiny", "float32")
    assert chooser.model is model  # one measurement, one object
    assert chooser.sizes[-1] == max(costs.TREE_WIDTHS) and chooser.max_budget == max(hardware.BUDGETS)
    assert all(model.table[(1, t)] > 0 for t in costs.CALIBRATION_WIDTHS + costs.TREE_WIDTHS)
    files = list((tmp_path / "calibration").glob(f"tiny-float32-*-{costs.CALIBRATION_FORMAT}.json"))
    assert len(files) == 1

    def check_only(target, rows=None, widths=None, **kw):  # the file is read, and checked by a plain and a wider step only
        if widths != (1, costs.CHECK_WIDTH):
            raise AssertionError("measured again instead of reading the cache")
        return costs.CostModel(model.table)  # the machine as it was measured: the file holds

    monkeypatch.setattr(costs.CostModel, "measure", check_only)
    monkeypatch.setattr(costs, "_COSTS", {})  # a new process: read from the file
    again = costs.forward_costs(adapter, "tiny", "float32")
    assert again.table == model.table
    before = chooser.cost(8) / chooser.cost(1)
    for _ in range(costs.CostModel.FRESH):  # the loop observes 8-token steps costing twice the calibrated shape
        model.observe(1, 1, model(1, 1))
        model.observe(1, 8, 2 * model(1, 8))
    assert chooser.cost(8) / chooser.cost(1) > before  # the chooser sees the correction
    with pytest.raises(ValueError, match="no verification costs"):
        hardware.TreeChooser({})


def test_a_calibration_stored_under_load_is_measured_again(tiny_model, tmp_path, monkeypatch, one_thread, caplog):
    """A table measured while other work shared the machine (every plain step 3x as slow, wider ones as measured) would
    make k=auto see wider verifications as nearly free for good: the next process that reads it times a plain and a
    wider step, finds the plain one far faster than stored, warns, measures the grid again and stores it."""
    import json
    import logging

    from decoding.model import costs

    monkeypatch.setenv("SPECRAY_HOME", str(tmp_path))
    monkeypatch.setattr(costs, "_COSTS", {})
    adapter = ModelAdapter(tiny_model)
    costs.forward_costs(adapter, "tiny", "float32")
    (path,) = (tmp_path / "calibration").glob("tiny-float32-*.json")
    points = json.loads(path.read_text())["points"]
    loaded = [[r, t, s * 3 if t == 1 else s] for r, t, s in points]
    path.write_text(json.dumps({"points": loaded}))
    monkeypatch.setattr(costs, "_COSTS", {})  # a new process
    with caplog.at_level(logging.WARNING, logger="decoding.model.costs"):
        again = costs.forward_costs(adapter, "tiny", "float32")
    assert "do not hold on this machine now (a plain step now" in caplog.text
    stored = {(r, t): s for r, t, s in json.loads(path.read_text())["points"]}
    assert stored == again.table and again.table[(1, 1)] < 0.9 * 3 * points[0][2]  # measured anew and stored
    assert costs.stale(costs.CostModel({(r, t): s for r, t, s in loaded}), again) is not None


# ---- configuration ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,value",
    [
        ("recycle_width", 0),
        ("suffix_factor", 0.0),
        ("suffix_min_prob", 1.5),
        ("suffix_depth", 1),
        ("suffix_cache_tokens", -1),
        ("draft_memory", "lukewarm"),
        ("tree_fit", "guess"),
    ],
)
def test_config_names_the_bad_field(field, value):
    with pytest.raises(ConfigError) as e:
        SpecConfig(method="hybrid", **{field: value})
    assert e.value.field == field


def test_builder_makes_each_method_with_its_knobs(tiny_model):
    target = SimpleNamespace(model=tiny_model)
    memory = DraftMemory()
    base = SpecConfig(tree_fit="budget", tree_budget=6, recycle_width=3, draft_memory="cold", drafter="none")
    rec = build_model_free(base.replace(method="recycling"), target, memory)
    assert isinstance(rec, RecyclingDrafter) and rec.width == 3 and rec.cold and rec.memory is memory
    suf = build_model_free(base.replace(method="suffix", suffix_factor=2.0), target, memory)
    assert isinstance(suf, SuffixDrafter) and suf.factor == 2.0 and suf.memory is memory
    hyb = build_model_free(base.replace(method="hybrid"), target, memory)
    assert isinstance(hyb, HybridDrafter) and hyb.max_nodes(4) == 6
    static = build_model_free(base.replace(method="recycling", tree="static", tree_paths="[[0],[1],[0,0]]"), target)
    assert static.template_for(4).size == 4
    with pytest.raises(ConfigError) as e:
        build_model_free(base.replace(method="recycling", tree="static", tree_paths="[[0],[1],[2],[3]]"), target)
    assert e.value.field == "tree_paths"


def test_hybrid_calibrates_per_match_length_and_given_the_parent():
    """A copying source's estimates are calibrated per match length, each node given its parent accepted: a node
    under a rejected parent says nothing about its own estimate."""
    hyb = drafters()["hybrid"]
    # a chain of three from a 2-token prompt-lookup match and, beside it, a one-node tree from a 1-token suffix match;
    # the target accepts the chain's first node only
    hyb._parents, hyb._ranks = [0, 1, 2, 0], [None] * 4
    hyb._raw = [{"ngram:2": 0.6}, {"ngram:2": 0.6}, {"ngram:2": 0.6}, {"suffix:1": 1.0}]
    hyb._record(SimpleNamespace(accepted_path=[0, 1]), 1)
    assert hyb.calibration == {"ngram:2": [1.0, 1.2], "suffix:1": [0.0, 1.0]}  # the third node was not judged
    assert hyb.scale("suffix:1") == 2 / 3 and hyb.scale("ngram:2") == 3 / 3.2 and hyb.scale("suffix:8") == 1.0  # (acc + 2) / (mass + 2)
    # calibrated path estimates multiply the rescaled conditionals along the path, each at most 1
    assert hyb.estimates([0, 1, 1], [0.5, 0.5, 0.25], "suffix:8") == [0.5, 0.25, 0.125]
    assert hyb.estimates([0, 1], [1.0, 0.8], "ngram:2") == [0.9375, 0.9375 * 0.75]


def test_a_hybrid_tree_that_k_auto_did_not_verify_teaches_its_calibration_nothing():
    """k=auto may drop a model-free tree unverified (its step then feeds the pending token alone): the tree's nodes
    were not rejected, so no source's record counts them. Counted as rejections, they pulled every scale down, fewer
    trees paid, more were dropped: the hybrid drafted on 7% of its steps on 13 Spec-Bench prompts."""
    hyb = drafters()["hybrid"]
    tokens = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]])
    state = SimpleNamespace(tokens=tokens, accepted_path=None, last_logits=None)
    hyb._nodes, hyb._parents, hyb._ranks, hyb._raw = [4, 5, 3], [0, 1], [None, None], [{"ngram:2": 0.6}, {"ngram:2": 0.6}]
    hyb.recycling.observe = lambda *a: None  # this test is about the hybrid's own record
    state.last_logits = torch.zeros(1, 1, V)  # the step fed the pending token only: the tree was dropped
    hyb.update(state, 0)
    assert hyb.calibration == {} and hyb._parents == []
    hyb._nodes, hyb._parents, hyb._ranks, hyb._raw = [4, 5, 3], [0, 1], [None, None], [{"ngram:2": 0.6}, {"ngram:2": 0.6}]
    state.last_logits = torch.zeros(1, 3, V)  # verified: the target rejected its first node
    hyb.update(state, 0)
    assert hyb.calibration == {"ngram:2": [0.0, 0.6]}


# ---- end to end on the tiny model ------------------------------------------------------------------------------------
def drafters(memory=None, cold=False):
    memory = memory or DraftMemory()
    rec = RecyclingDrafter(V, width=3, budget=6, memory=memory, cold=cold)
    suf = SuffixDrafter(budget=6, factor=2.0, min_prob=0.0, depth=6, memory=memory, cold=cold)
    hyb = HybridDrafter(
        RecyclingDrafter(V, width=3, budget=6, memory=memory, cold=cold),
        SuffixDrafter(budget=6, factor=2.0, min_prob=0.0, depth=6, memory=memory, cold=cold),
        NgramDrafter(2, 1),
        budget=6,
    )
    return {"recycling": rec, "suffix": suf, "hybrid": hyb}


NAMES = ["recycling", "suffix", "hybrid"]


@pytest.mark.parametrize("name", NAMES)
def test_greedy_output_equals_ar_and_trees_are_accepted(tiny_model, one_thread, name):
    target = ModelAdapter(tiny_model)
    drafter = drafters()[name]
    for prompt in (PROMPT, torch.tensor([[1, 2, 3, 4, 5, 6]]), torch.tensor([[11, 0, 11, 0]])):
        ref = generate(target, prompt, max_new_tokens=40).token_ids
        out = generate(target, prompt, drafter=drafter, k=4, max_new_tokens=40)
        assert out.token_ids == ref
    assert out.stats.mean_accepted_tokens > 1.2, out.stats.mean_accepted_tokens  # the drafts were used


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("max_new", [1, 2, 5])
def test_lengths_exact(tiny_model, one_thread, name, max_new):
    out = generate(ModelAdapter(tiny_model), PROMPT, drafter=drafters()[name], k=4, max_new_tokens=max_new)
    assert len(out.token_ids) == max_new


def test_warm_memory_carries_over_and_cold_forgets(tiny_model, one_thread):
    target = ModelAdapter(tiny_model)
    memory = DraftMemory()
    warm = drafters(memory)["recycling"]
    generate(target, PROMPT, drafter=warm, k=4, max_new_tokens=20)
    seen = int((warm.adjacency.table[:, 0] >= 0).sum())
    assert seen > 0 and warm.stats.visits > 0
    # a second decoder's drafter on the same memory starts warm: it drafts at its very first step
    first = drafters(memory)["recycling"]
    out = generate(target, PROMPT, drafter=first, k=4, max_new_tokens=3)
    assert out.steps[0].drafted > 0
    cold = drafters(memory, cold=True)["recycling"]
    out = generate(target, PROMPT, drafter=cold, k=4, max_new_tokens=3)
    assert out.steps[0].drafted == 0  # forgotten at start: the first step has nothing to recycle


def test_suffix_global_cache_serves_a_later_request(tiny_model, one_thread):
    target = ModelAdapter(tiny_model)
    memory = DraftMemory()
    d = drafters(memory)["suffix"]
    first = generate(target, torch.tensor([[1, 2, 3]]), drafter=d, k=4, max_new_tokens=20)
    d.finish()
    # a new request whose prompt is the first one's output so far: the continuation is in the global cache
    prompt = torch.tensor([[1, 2, 3] + first.token_ids[:6]])
    again = generate(target, prompt, drafter=drafters(memory)["suffix"], k=4, max_new_tokens=8)
    assert again.token_ids == first.token_ids[6:14]
    assert again.steps[0].accepted >= 1
    cold = generate(target, prompt, drafter=drafters(memory, cold=True)["suffix"], k=4, max_new_tokens=8)
    assert cold.steps[0].drafted <= again.steps[0].drafted


def test_suffix_scales_its_estimates_by_what_its_verified_trees_had_accepted(tiny_model, one_thread):
    """Continuation frequencies expect more than the target accepts: the proposal's estimates (``Proposal.expected``,
    which k=auto judges a tree by) are scaled by the drafter's record of verified trees, and a proposal k=auto drops
    unverified teaches the record nothing."""
    target = ModelAdapter(tiny_model)
    d = drafters(DraftMemory())["suffix"]
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])  # a repeated text: the trie continues it
    out = generate(target, prompt, drafter=d, k=4, max_new_tokens=12)
    verified = [s for s in out.steps if s.drafted]
    accepted, expected = d.record
    assert verified and accepted == sum(s.accepted for s in verified) and expected >= len(verified) * d.min_prob
    state = SimpleNamespace(tokens=torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]]), last_logits=None)
    d.start(state)
    d.record[:] = [1.0, 9.0]  # its trees had a ninth of what they expected accepted (with the prior: 3 / 11)
    raw = d.draft(state.tokens[0, -d.max_match :].tolist(), 4)[2]  # the frequencies, unscaled
    proposal = d.propose(state, 4)
    assert raw and proposal.expected == pytest.approx(sum(min(1.0, p * 3 / 11) for p in raw[: proposal.size]))
    d.update(state, 0)  # no logits of the tree: k=auto dropped it
    assert d.record == [1.0, 9.0]


def test_the_hybrid_weighs_its_trees_by_what_its_verified_ones_had_accepted(tiny_model, one_thread):
    """k=auto verifies the hybrid's trees whose estimates came out high, so verified trees expected more than the
    target took, however well each source is calibrated node by node: the tree's summed estimate
    (``Proposal.expected``) is scaled by the record of its verified trees; an unverified tree teaches it nothing."""
    target = ModelAdapter(tiny_model)
    d = drafters(DraftMemory())["hybrid"]
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
    out = generate(target, prompt, drafter=d, k=4, max_new_tokens=12)
    verified = [s for s in out.steps if s.drafted]
    assert verified and d.record[0] == sum(s.accepted for s in verified) and d.record[1] > 0
    state = SimpleNamespace(tokens=prompt, history=prompt[0].tolist(), last_logits=None, accepted_path=None, rows=1, device=prompt.device)
    d.start(state)
    d.record[:] = [0.0, 0.0]
    first = d.propose(state, 3)  # the merged tree after [..., 6, 7], its estimates calibrated: the record is empty
    unscaled = first.expected
    d.update(state, 0)
    d.record[:] = [1.0, 9.0]  # its trees had a ninth of what they expected accepted (with the prior: 3 / 11)
    proposal = d.propose(state, 3)
    assert proposal.tokens.tolist() == first.tokens.tolist() and proposal.expected == pytest.approx(unscaled * 3 / 11)
    d.update(state, 0)  # no logits of the tree: k=auto dropped it
    assert d.record == [1.0, 9.0]
    state.last_logits = torch.zeros(1, 1 + proposal.size, V)  # verified: two of its drafts accepted
    d.propose(state, 3)
    d.update(state, 2)
    assert d.record == pytest.approx([3.0, 9.0 + unscaled])


def test_the_hybrids_recycling_stops_where_its_nodes_do_not_pay_and_probes(tiny_model, one_thread, monkeypatch):
    """The hybrid's recycling proposes only while the nodes it alone proposed, accepted, pay for its seconds and the
    verification they added (``ProposeGate``): made to cost 20 ms a proposal (more than four accepted tokens save at
    4 ms a step), it stops after its first 16 proposals, proposes again only as probes, and the output stays the
    target's."""
    target = ModelAdapter(tiny_model)
    d = drafters()["hybrid"]
    d.chooser = hardware.TreeChooser({1: 0.004, 2: 0.0045, 4: 0.0055, 8: 0.0075, 16: 0.011})
    calls, full = [], []
    slow = d.recycling.draft

    def costly(root, k):
        calls.append(len(full))
        t = time.perf_counter()
        while time.perf_counter() - t < 0.02:
            pass
        return slow(root, k)

    monkeypatch.setattr(d.recycling, "draft", costly)
    candidates = d.candidates
    monkeypatch.setattr(d, "candidates", lambda state, k: full.append(1) or candidates(state, k))
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6]])
    out = generate(target, prompt, drafter=d, k=4, max_new_tokens=200)
    assert out.token_ids == generate(target, prompt, max_new_tokens=200).token_ids
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert len(full) > 40 and gaps[:15] == [1] * 15, (len(full), calls)  # judged over its first 16 proposals
    assert not d.gates["recycling"].on and len(calls) - 16 >= 2, calls  # then probes, after 8, 16, 32 idle steps
    assert gaps[15:] == sorted(gaps[15:]) and min(gaps[15:]) > 8, gaps
    assert len(calls) < len(full) / 2


def test_the_hybrid_credits_recycling_with_the_accepted_nodes_it_alone_proposed():
    """What recycling saved at a step: each accepted node that no other source proposed is worth a plain step, less
    the verification its own nodes added; a node another source proposed too saves it nothing, and a step where its
    gate held it back is an idle one."""
    d = drafters()["hybrid"]
    d.chooser = hardware.TreeChooser({1: 0.004, 9: 0.008})  # 0.5 ms a node
    seen = []
    d.gates["recycling"].observe = lambda proposed, saved, spent, plain: seen.append((proposed, saved, spent))
    # root -> a (suffix and recycling) -> b (recycling alone), root -> c (recycling alone)
    for path, accepted, credit in (([0, 1, 2], 2, 0.004), ([0, 3], 1, 0.004), ([0, 1], 1, 0.0)):
        d._parents, d._sources = [0, 1, 0], [{"suffix:2", "recycling"}, {"recycling"}, {"recycling"}]
        d._spent = {"recycling": 0.002}
        d.judge(SimpleNamespace(accepted_path=path), accepted)
        assert seen.pop() == (True, pytest.approx(credit - 0.001), 0.002), path  # b and c: two nodes of width
    d.judge(SimpleNamespace(accepted_path=None), None)  # no tree verified
    assert seen.pop() == (True, 0.0, 0.002)
    d._spent = {}
    d.judge(SimpleNamespace(accepted_path=None), None)  # recycling held back
    assert seen.pop() == (False, 0.0, 0.0)


@pytest.mark.parametrize("name", NAMES)
def test_sampled_distribution_matches_target(tiny_model, one_thread, name):
    drafter = drafters()[name]
    counts = sample_counts(tiny_model, drafter, SAMPLING, k=3)
    p = chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, SAMPLING))
    assert p > 1e-4, f"{name}: sampled tokens do not follow the target (p={p:.2e})"


@pytest.mark.parametrize("name", ["suffix", "hybrid"])
def test_a_glance_is_prompt_lookup_and_lossless(tiny_model, one_thread, name):
    """What suffix decoding and the hybrid propose while k=auto's gate holds their full proposals back
    (``Drafter.glance``): prompt lookup's chain. Drafted at every step here, it keeps the output the target's (greedy
    and sampled), its drafts are accepted, and it teaches neither drafter's record nor the hybrid's calibration (a
    chain is not the trees they judge); the hybrid's recycling table is not fed after it."""
    target = ModelAdapter(tiny_model)
    drafter = drafters()[name]
    drafter.propose = drafter.glance  # every step glances
    for prompt in (PROMPT, torch.tensor([[1, 2, 3, 4, 5, 6]]), torch.tensor([[11, 0, 11, 0]])):
        out = generate(target, prompt, drafter=drafter, k=4, max_new_tokens=40)
        assert out.token_ids == generate(target, prompt, max_new_tokens=40).token_ids
    assert out.stats.mean_accepted_tokens > 1.2, out.stats.mean_accepted_tokens
    assert drafter.record == [0.0, 0.0]
    if name == "hybrid":
        assert not drafter.calibration and (drafter.recycling.adjacency.table < 0).all(), drafter.calibration
    state = SimpleNamespace(tokens=torch.tensor([[5, 6, 7, 5, 6]]), history=[5, 6, 7, 5, 6], rows=1, device=torch.device("cpu"))
    drafter.start(state)
    proposal = drafter.glance(state, 3)
    assert proposal.tokens.tolist() == [[7, 5, 6]]  # after [5, 6]: what followed its earlier occurrence
    counts = sample_counts(tiny_model, drafter, SAMPLING, k=3)
    p = chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, SAMPLING))
    assert p > 1e-4, f"{name}'s glance: sampled tokens do not follow the target (p={p:.2e})"


def test_sampling_trees_are_really_accepted(tiny_model, one_thread):
    # the distribution test means something only if drafted nodes get accepted under sampling
    target = ModelAdapter(tiny_model)
    gen = torch.Generator().manual_seed(0)
    for name, drafter in drafters().items():
        outs = [generate(target, PROMPT, drafter=drafter, k=3, sampling=SAMPLING, max_new_tokens=12, generator=gen) for _ in range(30)]
        tau = sum(o.stats.mean_accepted_tokens for o in outs) / len(outs)
        assert tau > 1.1, (name, tau)


# the fast tier keeps the control on the hybrid (it drafts with all three sources); the other two run in the full suite
@pytest.mark.parametrize("name", [n if n == "hybrid" else pytest.param(n, marks=pytest.mark.slow) for n in NAMES])
def test_a_broken_tree_rule_is_caught(tiny_model, one_thread, monkeypatch, name):
    def draw_from_p(node_tokens, children, draft_probs, target_probs, u_accept, u_sample, *rest):
        """Wrong: the final draw comes from p at the last accepted node, not from the residual after rejections."""
        v = verify_tree_speculative(node_tokens, children, draft_probs, target_probs, u_accept, u_sample, *rest)
        m = int(v.num_accepted[0])
        v.tokens[0, m] = sample_from(target_probs[0, int(v.path[0, m])][None], u_sample)[0]
        return v

    monkeypatch.setattr(loop_module, "verify_tree_speculative", draw_from_p)
    counts = sample_counts(tiny_model, drafters()[name], SAMPLING, k=3, draws=BROKEN_RULE_DRAWS)
    assert chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, SAMPLING)) < 1e-6
