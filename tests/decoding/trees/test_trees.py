"""Token trees: construction, tree attention over a cached prefix, compaction, the tree rules (greedy and
lossless sampling, pure and end to end on a tiny model), Sequoia's programme and the tree drafters."""

import random

import pytest
import torch
from tests_support import generate

from decoding.config import SpecConfig
from decoding.drafters.draft_model import DraftModelDrafter
from decoding.drafters.early_exit import EarlyExitDrafter
from decoding.drafters.ngram import NgramDrafter
from decoding.errors import ConfigError
from decoding.loop import step as loop_module
from decoding.loop.metrics import chi_square_pvalue
from decoding.loop.verify import verify_tree_greedy, verify_tree_speculative
from decoding.model.adapter import ModelAdapter
from decoding.sampling import sample_from
from decoding.trees.shapes import Dynamic, Tree, TreeError, chain, expected_accepted, sequoia_paths, tree_mask, validate_paths
from tests.decoding.loop.test_loop import CONTROL_DRAWS, N_TOKENS, PROMPT, SAMPLING, exact_joint, sample_counts

MEDUSA = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


# ---- construction ------------------------------------------------------------------------------------
def test_tree_from_paths_known_tree():
    t = Tree.from_paths(MEDUSA)
    #         0
    #      /  |  \
    #     1   2   3
    #    / \  |
    #   4   5 6
    #   |
    #   7
    assert t.parents.tolist() == [-1, 0, 0, 0, 1, 1, 2, 4]
    assert t.depth.tolist() == [0, 1, 1, 1, 2, 2, 2, 3]
    assert t.rank.tolist() == [0, 0, 1, 2, 0, 1, 0, 0]
    assert t.positions(10).tolist() == [10, 11, 11, 11, 12, 12, 12, 13]
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for node, anc in {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 3], 4: [0, 1, 4], 5: [0, 1, 5], 6: [0, 2, 6], 7: [0, 1, 4, 7]}.items():
        expected[node, anc] = True
    assert torch.equal(t.mask, expected)
    assert t.paths() == sorted(MEDUSA, key=lambda p: (len(p), p))
    assert t.retrieve_indices().tolist() == [[0, 3, -1, -1], [0, 1, 5, -1], [0, 2, 6, -1], [0, 1, 4, 7]]
    assert Tree.from_paths(list(reversed(MEDUSA))).parents.tolist() == t.parents.tolist()  # input order does not matter


def test_chain_is_the_degenerate_tree():
    c = chain(4)
    assert torch.equal(c.mask, torch.ones(5, 5, dtype=torch.bool).tril())
    assert c.depth.tolist() == [0, 1, 2, 3, 4]
    assert Tree.from_paths([[0] * i for i in range(1, 5)]).parents.tolist() == c.parents.tolist()


def test_a_shape_made_again_is_the_same_tree_and_bad_ones_still_fail():
    """A model-free drafter's proposals repeat a few shapes: the tree made for a parent list is made once (its mask,
    depths and device copies with it), and the store stays bounded."""
    from decoding.trees import shapes

    a = Tree.from_parents([-1, 0, 1, 0])
    mask = a.mask
    assert Tree.from_parents((-1, 0, 1, 0)) is a and a.mask is mask and Tree.from_parents([-1, 0, 1]) is not a
    with pytest.raises(TreeError):
        Tree.from_parents([-1, 0, 2])
    for n in range(shapes.MADE_TREES + 10):
        Tree.from_parents([-1, 0] + [0] * (n % 40) + [1] * (n // 40))
    assert len(shapes._MADE) <= shapes.MADE_TREES


def test_mask_of_batched_parents():
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]])
    masks = tree_mask(parents)
    assert torch.equal(masks[0], Tree.from_parents([-1, 0, 0, 1]).mask)
    assert torch.equal(masks[1], chain(3).mask)


@pytest.mark.parametrize(
    "paths, message",
    [
        ([[0], [0, 0, 0]], "no parent path"),
        ([[0], [2]], "previous sibling"),
        ([[-1]], ">= 0"),
        ([], "non-empty"),
        ([[0], []], "non-empty list of child ranks"),
        ([[0.5]], "integers"),
    ],
)
def test_bad_paths_are_rejected(paths, message):
    with pytest.raises(TreeError, match=message):
        validate_paths(paths)


def test_config_names_the_tree_field():
    cases = [
        (dict(tree="bush"), "tree"),
        (dict(tree="static"), "tree_paths"),
        (dict(tree="static", tree_paths="[[0], [0, 0, 0]]"), "tree_paths"),
        (dict(tree="static", tree_paths="[[0], [-1]]"), "tree_paths"),
        (dict(tree="static", tree_paths="not json"), "tree_paths"),
        (dict(tree="sequoia", tree_budget=0), "tree_budget"),
        (dict(tree="sequoia", tree_acceptance="[0.9, 0.5]"), "tree_acceptance"),
        (dict(method="pearl", tree="dyspec"), "tree"),
    ]
    for fields, name in cases:
        with pytest.raises(ConfigError) as e:
            SpecConfig(**fields)
        assert e.value.field == name, (fields, e.value)
    cfg = SpecConfig(method="sps").with_overrides(["tree=static", "tree_paths=[[0],[1],[0,0]]"])
    assert SpecConfig.from_json(cfg.to_json()) == cfg


# ---- Sequoia's dynamic programme --------------------------------------------------------------------------
def all_trees(budget, max_depth):
    """Every valid path set of 1..budget nodes and depth <= max_depth (brute force: grow by one addable path)."""
    level = {frozenset([(0,)])}
    seen = set(level)
    for _ in range(budget - 1):
        nxt = set()
        for t in level:
            for p in list(t) + [()]:
                kids = [c for c in t if len(c) == len(p) + 1 and c[:-1] == p]
                child = p + (len(kids),)
                if len(child) <= max_depth:
                    nxt.add(t | {child})
        level = nxt - seen
        seen |= level
    return [[list(p) for p in t] for t in seen]


@pytest.mark.parametrize("acceptance", [[0.7, 0.2], [0.4, 0.3, 0.2], [0.9], [0.3, 0.3, 0.3]])
def test_sequoia_is_optimal_by_brute_force(acceptance):
    budget, depth = 4, 3
    best = max(expected_accepted(acceptance, t) for t in all_trees(budget, depth))
    paths = sequoia_paths(acceptance, budget, depth)
    assert len(paths) <= budget and max(len(p) for p in paths) <= depth
    validate_paths(paths)
    assert expected_accepted(acceptance, paths) == pytest.approx(best)


def sequoia_reference(acc, budget, max_depth):
    """Sequoia's programme written loop by loop (what ``sequoia_paths`` vectorises), for the comparison below."""
    acc = list(acc)[:budget]
    K, N = len(acc), budget + 1
    c = [[1.0] * (N + 1) for _ in range(max_depth + 1)]
    choice = {}
    for d in range(1, max_depth + 1):
        g = [[0.0] * (N + 1) for _ in range(K + 1)]
        for r in range(K - 1, -1, -1):
            for n in range(1, N + 1):
                best, arg = 0.0, 0
                for m in range(1, n + 1):
                    v = acc[r] * c[d - 1][m] + g[r + 1][n - m]
                    if v > best + 1e-12:
                        best, arg = v, m
                g[r][n], choice[(d, r, n)] = best, arg
        for n in range(1, N + 1):
            c[d][n] = 1.0 + g[0][n - 1]

    def build(d, n, prefix, out):
        r, left = 0, n - 1
        while d > 0 and r < K and left > 0 and choice[(d, r, left)]:
            m = choice[(d, r, left)]
            out.append(prefix + [r])
            build(d - 1, m, prefix + [r], out)
            r, left = r + 1, left - m
        return out

    return sorted(build(max_depth, N, [], []), key=lambda p: (len(p), p))


def test_sequoia_equals_the_loop_by_loop_programme():
    rng = random.Random(7)
    profiles = [[0.4, 0.1, 0.05, 0.03, 0.02, 0.015, 0.01, 0.01], [0.5, 0.5], [0.0, 0.0], [1.0, 0.0, 0.0]]
    profiles += [sorted((round(rng.random(), 2) for _ in range(rng.randint(1, 8))), reverse=True) for _ in range(40)]
    for i, acc in enumerate(profiles):
        budget, depth = (1, 2, 3, 5, 8, 16, 33)[i % 7], 1 + i % 6
        assert sequoia_paths(acc, budget, depth) == sequoia_reference(acc, budget, depth), (acc, budget, depth)


# ---- tree attention over a cached prefix, compaction ---------------------------------------------------------
def test_tree_forward_equals_each_path_run_as_a_sequence(tiny_model):
    a = ModelAdapter(tiny_model)
    prefix = torch.tensor([[4, 1, 5, 9, 2]])
    tree = Tree.from_paths(MEDUSA)
    nodes = torch.tensor([[6, 3, 8, 10, 7, 11, 0, 5]])  # node 0 is the pending token
    cache = a.new_cache(1, 32)
    a.forward(cache, 0, input_ids=prefix)
    start = prefix.shape[1]
    h = a.forward(cache, start, input_ids=nodes, positions=tree.positions(start)[None], tree_mask=tree.mask)
    for leaf_path in tree.retrieve_indices().tolist():
        path = [i for i in leaf_path if i >= 0]
        seq = torch.cat([prefix, nodes[:, path]], dim=1)
        ref = a.forward(a.new_cache(1, 32), 0, input_ids=seq)[:, start:]
        torch.testing.assert_close(h[:, path], ref, rtol=1e-4, atol=1e-4)


def test_tree_forward_in_levels_equals_one_forward(tiny_model):
    # what the tree drafters do: one forward per depth level, each level's mask spanning the nodes already cached
    a = ModelAdapter(tiny_model)
    prefix = torch.tensor([[4, 1, 5, 9, 2]])
    tree = Tree.from_paths(MEDUSA)
    nodes = torch.tensor([[6, 3, 8, 10, 7, 11, 0, 5]])
    start = prefix.shape[1]
    one = a.new_cache(1, 32)
    a.forward(one, 0, input_ids=prefix)
    whole = a.forward(one, start, input_ids=nodes, positions=tree.positions(start)[None], tree_mask=tree.mask)
    lv = a.new_cache(1, 32)
    a.forward(lv, 0, input_ids=prefix)
    parts = []
    for d in range(tree.max_depth + 1):
        idx = (tree.depth == d).nonzero().flatten()
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        parts.append(
            a.forward(
                lv, start + lo, input_ids=nodes[:, lo:hi], positions=tree.positions(start)[None, lo:hi], tree_mask=tree.mask[lo:hi, :hi]
            )
        )
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=1e-3, atol=1e-3)


def test_compaction_leaves_the_accepted_branch_as_the_prefix(tiny_model):
    a = ModelAdapter(tiny_model)
    prefix = torch.tensor([[4, 1, 5, 9, 2]])
    tree = Tree.from_paths(MEDUSA)
    nodes = torch.tensor([[6, 3, 8, 10, 7, 11, 0, 5]])
    start = prefix.shape[1]
    cache = a.new_cache(1, 32)
    a.forward(cache, 0, input_ids=prefix)
    a.forward(cache, start, input_ids=nodes, positions=tree.positions(start)[None], tree_mask=tree.mask)
    path = [0, 1, 4, 7]  # accepted branch at scattered slots
    cache.compact(start, torch.tensor(path) + start)
    cache.rollback(start + len(path))
    after = a.forward(cache, start + len(path), input_ids=torch.tensor([[2]]))
    straight = a.new_cache(1, 32)
    seq = torch.cat([prefix, nodes[:, path], torch.tensor([[2]])], dim=1)
    ref = a.forward(straight, 0, input_ids=seq)
    for layer in range(len(cache.k)):
        torch.testing.assert_close(cache.k[layer][:, :, : start + 4], straight.k[layer][:, :, : start + 4], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cache.v[layer][:, :, : start + 4], straight.v[layer][:, :, : start + 4], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(after, ref[:, -1:], rtol=1e-4, atol=1e-4)


def test_compaction_of_a_chain_is_a_no_op(tiny_model):
    cache = ModelAdapter(tiny_model).new_cache(1, 8)
    for buf in cache.k:
        buf.normal_()
    before = [b.clone() for b in cache.k]
    cache.compact(2, torch.tensor([2, 3, 4]))
    assert all(torch.equal(x, y) for x, y in zip(before, cache.k, strict=True))
    cache.compact(2, torch.tensor([2, 5]))
    assert torch.equal(cache.k[0][:, :, 3], before[0][:, :, 5]) and torch.equal(cache.k[0][:, :, 4], before[0][:, :, 4])


# ---- greedy tree verification on hand-made cases -----------------------------------------------------------------
def _greedy(tree, tokens, argmax, vocab=12):
    logits = torch.nn.functional.one_hot(torch.tensor([argmax]), vocab).float()
    v = verify_tree_greedy(torch.tensor([tokens]), tree.parents, tree.mask, tree.depth, logits)
    m = int(v.num_accepted[0])
    return m, v.path[0, : m + 1].tolist(), v.tokens[0, : m + 1].tolist()


def test_greedy_tree_verification_cases():
    t = Tree.from_paths(MEDUSA)  # parents [-1, 0, 0, 0, 1, 1, 2, 4]
    tokens = [9, 3, 8, 10, 7, 11, 0, 5]
    # the target wants 8 at the root (node 2), then 0 (node 6, a leaf), then 4: 2 accepted + bonus
    assert _greedy(t, tokens, [8, 1, 0, 1, 1, 1, 4, 1]) == (2, [0, 2, 6], [8, 0, 4])
    # nothing matches at the root: only the target's own token
    assert _greedy(t, tokens, [1, 7, 0, 1, 5, 1, 4, 1]) == (0, [0], [1])
    # the deepest branch: 3 -> 7 -> 5, then the argmax at node 7
    assert _greedy(t, tokens, [3, 7, 0, 1, 5, 1, 4, 2]) == (3, [0, 1, 4, 7], [3, 7, 5, 2])
    # a match below a rejected node does not count (node 4's token is right but its parent's is not)
    assert _greedy(t, tokens, [8, 7, 1, 1, 5, 1, 4, 2]) == (1, [0, 2], [8, 1])


def test_greedy_tree_verification_of_a_chain_matches_the_chain_rule():
    from decoding.loop.verify import verify_greedy

    gen = torch.Generator().manual_seed(0)
    c = chain(4)
    for _ in range(50):
        drafts = torch.randint(0, 3, (2, 4), generator=gen)
        logits = torch.randn(2, 5, 3, generator=gen)
        a = verify_greedy(drafts, logits)
        nodes = torch.cat([torch.zeros(2, 1, dtype=torch.long), drafts], 1)
        b = verify_tree_greedy(nodes, c.parents, c.mask, c.depth, logits)
        assert torch.equal(a.num_accepted, b.num_accepted)
        for r in range(2):
            m = int(a.num_accepted[r])
            assert torch.equal(a.tokens[r, : m + 1], b.tokens[r, : m + 1])


# ---- the sampling rule, pure: first token distribution at a wide node -------------------------------------------
V = 6
P_ROOT = torch.tensor([0.05, 0.30, 0.25, 0.20, 0.15, 0.05], dtype=torch.float64)
Q_ROOT = torch.tensor([0.40, 0.05, 0.10, 0.15, 0.20, 0.10], dtype=torch.float64)  # a bad draft: rejections happen


def _draw_without_replacement(q, n, gen):
    out, q = [], q.clone()
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=gen))
        out.append(x)
        q[x] = 0
    return out


def no_q_update(node_tokens, children, draft_probs, target_probs, u_accept, u_sample, max_depth):
    """Wrong for drafts sampled without replacement: every sibling judged against the original q (SpecInfer's
    i.i.d. rule), as if q were not renormalised after each rejected draw."""
    from decoding.loop.verify import Verdict

    p, q = target_probs[0, 0].clone(), draft_probs[0, 1]
    for c in range(1, node_tokens.shape[1]):
        x = int(node_tokens[0, c])
        if u_accept[0, c] * q[x] <= p[x]:
            return Verdict(torch.tensor([1]), torch.tensor([[x, 0]]), torch.tensor([[0, c]]))
        p = (p - q).clamp(min=0)
        p = p / p.sum()
    return Verdict(torch.tensor([0]), sample_from(p[None], u_sample)[:, None], torch.tensor([[0]]))


@pytest.mark.parametrize("mode", ["without-replacement", "deterministic", "wrong"])
def test_recursive_rejection_sampling_first_token(mode):
    gen = torch.Generator().manual_seed(1)
    n, draws = 3, 3000  # the wrong rule: p ~ 4e-10 at 3000 draws (7e-6 at 2000), the right ones p > 0.1
    tree = Tree.from_parents([-1, 0, 0, 0])
    children = torch.tensor([[[1, 2, 3], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1]]])  # children_table(tree.parent_list), padded
    target = torch.stack([P_ROOT] + [torch.full((V,), 1 / V, dtype=torch.float64)] * n)[None]
    counts = torch.zeros(V)
    rule = no_q_update if mode == "wrong" else verify_tree_speculative
    for _ in range(draws):
        if mode == "deterministic":
            kids, probs = [0, 4, 3], None  # any fixed candidates (here the draft's top 3)
        else:
            kids = _draw_without_replacement(Q_ROOT, n, gen)
            probs = Q_ROOT.expand(1, n + 1, V)
        v = rule(
            torch.tensor([[0] + kids]),
            children,
            probs,
            target,
            torch.rand(1, n + 1, generator=gen, dtype=torch.float64),
            torch.rand(1, generator=gen, dtype=torch.float64),
            tree.max_depth,
        )
        counts[int(v.tokens[0, 0])] += 1
    p = chi_square_pvalue(counts, P_ROOT)
    if mode == "wrong":
        assert p < 1e-6, "the wrong rule went unnoticed: the test cannot tell"
    else:
        assert p > 1e-4, f"{mode}: first token does not follow p (p={p:.2e}, counts {counts.tolist()})"


# ---- end to end on the tiny model: greedy equality and the sampled joint distribution --------------------------------
STATIC = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


def tree_drafters(model):
    return {
        "sps-static": DraftModelDrafter(ModelAdapter(model, num_layers=1), tree=STATIC),
        "sps-dyspec": DraftModelDrafter(ModelAdapter(model, num_layers=1), tree=Dynamic(6)),
        "early-exit-static": EarlyExitDrafter(exit_layer=1, tree=STATIC),
        "early-exit-dyspec": EarlyExitDrafter(exit_layer=1, tree=Dynamic(6)),
        # level-wise (EAGLE-2) trees rerank their nodes: early exit's hidden states must follow the new order
        "sps-levels": DraftModelDrafter(ModelAdapter(model, num_layers=1), tree=Dynamic(6, width=3)),
        "early-exit-levels": EarlyExitDrafter(exit_layer=1, tree=Dynamic(6, width=3)),
        "ngram-trie": NgramDrafter(ngram_max=2, ngram_min=1, tree_budget=6),
    }


NAMES = ["sps-static", "sps-dyspec", "early-exit-static", "early-exit-dyspec", "sps-levels", "early-exit-levels", "ngram-trie"]


@pytest.mark.parametrize("name", NAMES)
def test_greedy_trees_equal_ar_on_tiny_model(tiny_model, name):
    target = ModelAdapter(tiny_model)
    ref = generate(target, PROMPT, max_new_tokens=30).token_ids
    out = generate(target, PROMPT, drafter=tree_drafters(tiny_model)[name], k=3, max_new_tokens=30)
    assert out.token_ids == ref
    assert out.stats.mean_accepted_tokens > 1.0  # the trees were used and accepted something


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("max_new", [1, 2, 5])
def test_tree_lengths_exact(tiny_model, name, max_new):
    out = generate(ModelAdapter(tiny_model), PROMPT, drafter=tree_drafters(tiny_model)[name], k=4, max_new_tokens=max_new)
    assert len(out.token_ids) == max_new


@pytest.mark.parametrize("name", ["sps-static", "early-exit-dyspec", "early-exit-levels", "ngram-trie"])
def test_sampled_distribution_with_trees_matches_target(tiny_model, name):
    counts = sample_counts(tiny_model, tree_drafters(tiny_model)[name], SAMPLING)
    p = chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, SAMPLING))
    assert p > 1e-4, f"{name}: sampled tokens do not follow the target (p={p:.2e})"


def test_trees_accept_more_than_chains_when_sampling(tiny_model):
    # the distribution test means something only if the tree's extra candidates get accepted
    target = ModelAdapter(tiny_model)
    gen = torch.Generator().manual_seed(0)
    tau = {}
    for name, tree in (("chain", None), ("tree", STATIC)):
        outs = [
            generate(
                target,
                PROMPT,
                drafter=DraftModelDrafter(ModelAdapter(tiny_model, num_layers=1), tree=tree),
                k=3,
                sampling=SAMPLING,
                max_new_tokens=10,
                generator=gen,
            )
            for _ in range(15)
        ]
        tau[name] = sum(o.stats.mean_accepted_tokens for o in outs) / len(outs)
    assert tau["tree"] > tau["chain"], tau


def test_wrong_tree_rule_is_caught_end_to_end(tiny_model, monkeypatch):
    def draw_from_p(node_tokens, children, draft_probs, target_probs, u_accept, u_sample, *rest):
        """Wrong: the final draw comes from p at the last accepted node, not from the residual after rejections."""
        v = verify_tree_speculative(node_tokens, children, draft_probs, target_probs, u_accept, u_sample, *rest)
        m = int(v.num_accepted[0])
        v.tokens[0, m] = sample_from(target_probs[0, int(v.path[0, m])][None], u_sample)[0]
        return v

    monkeypatch.setattr(loop_module, "verify_tree_speculative", draw_from_p)
    counts = sample_counts(tiny_model, tree_drafters(tiny_model)["sps-static"], SAMPLING, draws=CONTROL_DRAWS)
    assert chi_square_pvalue(counts, exact_joint(tiny_model, PROMPT, N_TOKENS, SAMPLING)) < 1e-6


def test_tune_space_searches_tree_shape_and_budget():
    from tuning.space import SearchSpace

    space = SearchSpace.build(["sps", "early-exit", "ngram"], depth=30)
    for method in space.methods:
        fields = {k.field: k for k in space.knobs[method]}
        assert fields["tree"].choices == ("chain", "sequoia", "dyspec") and (fields["tree_budget"].low, fields["tree_budget"].high) == (
            4,
            32,
        )
    cfg = space.to_config({"method": "sps", "sps": {"k": 3, "tree": "sequoia", "tree_budget": 12}}, SpecConfig())
    assert (cfg.tree, cfg.tree_budget, cfg.k) == ("sequoia", 12, 3)


def test_level_wise_trees_feed_one_forward_per_level_and_rerank(tiny_model):
    """Dynamic(width=w): depth-1 draft forwards of at most w nodes each, the kept nodes ranked by path probability
    (non-increasing; every parent before its children), at most ``budget`` of them."""
    from decoding.drafters.base import DecodeState
    from decoding.drafters.drafting import draft_tree
    from decoding.sampling import GREEDY

    target = ModelAdapter(tiny_model)
    widths = []

    def step(toks, lo, hi, tree):
        widths.append(hi - lo)
        return torch.randn(1, hi - lo, 12, generator=torch.Generator().manual_seed(lo))

    state = DecodeState(PROMPT, target, target.new_cache(1, 64), GREEDY, None, 64)
    root = torch.randn(1, 12, generator=torch.Generator().manual_seed(99))
    path, order = [], []
    tokens, probs, tree, fed = draft_tree(step, root, Dynamic(7, width=3), 4, state, feed_last=False, path_probs=path, order=order)
    assert widths == [3, 3, 3] and fed == 0 and probs is None
    assert tokens.shape[1] == 7 and tree.size == 8 and len(order) == 8 and order[0] == 0
    assert path[1:] == sorted(path[1:], reverse=True)
    assert all(p < i for i, p in enumerate(tree.parents.tolist()) if i)
