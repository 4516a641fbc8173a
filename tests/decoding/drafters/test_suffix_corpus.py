"""The suffix corpus (decoding/drafters/suffix_corpus.py): a suffix array over the model's own earlier answers answers
what a suffix trie over them would (longest match, continuation counts, best-first tree), loads from
``specray distill``'s layout without its held-out split, and is cached."""

import random
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from decoding.config import SpecConfig
from decoding.drafters import suffix_corpus
from decoding.drafters.model_free import build_model_free
from decoding.drafters.suffix import SuffixTrie, best_first
from decoding.drafters.suffix_corpus import CorpusIndex, corpus_folder, load_corpus, suffix_array
from decoding.errors import ConfigError
from decoding.paths import PROJECT


def _texts(seed, n=40, vocab=6):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def test_suffix_array_sorts_every_suffix():
    rng = np.random.default_rng(0)
    text = rng.integers(0, 4, 500).astype(np.int32)
    sa = suffix_array(text, depth=600)
    assert sorted(sa.tolist()) == list(range(500))
    assert [text[i:].tolist() for i in sa] == sorted(text[i:].tolist() for i in range(500))


@pytest.mark.parametrize("seed", range(5))
def test_match_and_tree_equal_a_suffix_trie_over_the_same_texts(seed):
    """The index's longest match, its counts and its best-first tree are the trie's (``suffix.best_first``), up to
    the order of equally probable nodes."""
    texts = _texts(seed)
    index = CorpusIndex.from_texts(texts)
    trie = SuffixTrie(depth=12)
    for t in texts:
        trie.extend(t)
        trie.end_text()
    rng = random.Random(seed + 100)
    for _ in range(40):
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 10))]
        node, m = trie.match(context, max_match=5)
        got_m, occurrences = index.longest_match(context, max_match=5)
        assert got_m == m
        if node is None:
            assert index.tree(context, depth=4, budget=8, max_match=5, min_prob=0.05, factor=3.0) == ([], [], [], 0)
            continue
        assert occurrences == node.count
        want = best_first(node, 4, min(8, 3 * m), 0.05)
        toks, parents, probs, got_m = index.tree(context, depth=4, budget=8, max_match=5, min_prob=0.05, factor=3.0)
        assert got_m == m and len(toks) == len(want[0])
        assert np.allclose(sorted(probs), sorted(want[2]))
        paths = {}
        for i, (tok, parent) in enumerate(zip(toks, parents, strict=True)):
            paths[i + 1] = paths.get(parent, ()) + (tok,)
        assert all(p == pytest.approx(_path_prob(trie, context[-m:], path)) for path, p in zip(paths.values(), probs, strict=True))


@pytest.mark.parametrize("seed", range(4))
def test_the_fast_searches_find_what_the_plain_ones_do(seed, monkeypatch):
    """The packed heads of the suffixes (numpy's binary search for a pattern's first tokens), and small ranges
    searched and counted in Python or numpy, give the same matches and trees as the plain binary searches in Python:
    every branch of each search, on the same contexts, some longer than the heads."""
    texts = _texts(seed, n=200, vocab=5 + seed)
    rng = random.Random(seed)
    contexts = [[rng.randrange(5 + seed) for _ in range(rng.randrange(1, 9))] for _ in range(60)]

    def trees(heads: bool, few: int, gather: int):
        monkeypatch.setattr(suffix_corpus, "FEW", few)
        monkeypatch.setattr(suffix_corpus, "GATHER", gather)
        index = CorpusIndex.from_texts(texts)
        if not heads:
            index.heads = None  # the plain search (as for token ids too large to pack)
        return [(index.longest_match(c, 6), index.tree(c, depth=4, budget=8, max_match=6, min_prob=0.02, factor=3.0)) for c in contexts]

    plain = trees(False, 0, 0)
    assert any(t[1][0] for t in plain) and any(m[0] > suffix_corpus.HEAD for m, _ in plain)  # trees, and matches past the heads
    for heads, few, gather in [(True, 0, 0), (True, 64, 4096), (True, 10**9, 0), (False, 64, 10**9)]:
        assert trees(heads, few, gather) == plain


def _path_prob(trie, pattern, path):
    node = trie.match(pattern, max_match=len(pattern))[0]
    p = 1.0
    for tok in path:
        kids = node.kids
        p *= kids[tok].count / sum(k.count for k in kids.values())
        node = kids[tok]
    return p


def test_a_large_range_is_counted_on_a_sample_that_keeps_the_likely_continuations(monkeypatch):
    monkeypatch.setattr(suffix_corpus, "SAMPLE", 16)
    texts = [[5, 7]] * 300 + [[5, 8]] * 100 + [[5, 9]] * 3
    toks, parents, probs, m = CorpusIndex.from_texts(texts).tree([5], depth=1, budget=3, max_match=4, min_prob=0.1, factor=3.0)
    assert m == 1 and toks == [7, 8] and parents == [0, 0]
    assert probs[0] == pytest.approx(0.75, abs=0.1) and probs[1] == pytest.approx(0.25, abs=0.1)


def test_no_match_spans_two_texts():
    index = CorpusIndex.from_texts([[1, 2], [3, 4]])
    assert index.longest_match([2, 3], max_match=2) == (1, 1)  # "3" then "4"; "2 3" is not a text's
    assert index.longest_match([9, 2], max_match=2) == (0, 0)  # "2" ends its text: no continuation


def _shards(folder, rows):
    (folder / "phase-1").mkdir(parents=True)
    table = pa.table(
        {
            "split": [r[0] for r in rows],
            "answer_ids": pa.array([r[1] for r in rows], pa.list_(pa.int32())),
        }
    )
    pq.write_table(table, folder / "phase-1" / "shard-00000.parquet")


def test_load_keeps_the_train_split_and_caches_the_index(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRAY_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(suffix_corpus, "_LOADED", {})
    _shards(tmp_path / "d", [("train", [1, 2, 3]), ("heldout", [1, 2, 9]), ("train", [1, 2, 3])])
    index = load_corpus(tmp_path / "d")
    assert index.tree([1, 2], depth=1, budget=4, max_match=2, min_prob=0.0, factor=2.0)[:3] == ([3], [0], [1.0])
    cached = list((tmp_path / "home" / "cache" / "suffix-corpus").glob("*.npz"))
    assert len(cached) == 1
    monkeypatch.setattr(suffix_corpus, "_LOADED", {})
    monkeypatch.setattr(suffix_corpus, "suffix_array", None)  # a rebuild would fail: the cache must serve
    again = load_corpus(tmp_path / "d")
    assert again.text.tolist() == index.text.tolist() and again.sa.tolist() == index.sa.tolist()


def test_auto_finds_the_bundled_models_answers_and_none_turns_it_off(tiny_model, tmp_path):
    assert corpus_folder("auto", "smollm2-135m") == PROJECT / "data" / "distill" / "smollm2-135m"
    assert corpus_folder("auto", "/some/other/model") is None and corpus_folder("none", "smollm2-135m") is None
    target = SimpleNamespace(model=tiny_model)
    base = SpecConfig(method="suffix", tree_fit="budget", drafter="none")
    assert build_model_free(base.replace(suffix_corpus="none"), target).corpus is None
    with pytest.raises(ConfigError) as e:
        build_model_free(base.replace(suffix_corpus=str(tmp_path / "missing")), target)
    assert e.value.field == "suffix_corpus" and "missing" in str(e.value)
