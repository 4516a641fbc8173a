"""A static corpus for suffix decoding: the model's own earlier answers (its self-distillation data), searched with a
suffix array, so a request's draft can continue text the model wrote for other prompts before this process started.

SuffixDecoding's global tree holds the outputs of earlier requests; a process that just started has none. The
bundled model's self-distillation data (``data/distill/<model>``, about 2.3M answer tokens in its train split) is
such a history, written ahead of time. A trie over it would take gigabytes of nodes; a suffix array over the
concatenated answers takes two int32 arrays (about 19 MB) and answers the same two questions:

* the longest suffix of the context (up to ``max_match`` tokens) that occurs in the corpus with a continuation:
  the suffixes starting with a pattern are one contiguous range of the array, found by binary search;
* the tree of its most probable continuations: within that range the suffixes are sorted by the tokens after the
  pattern too, so every child of a tree node is a contiguous sub-range and its count is the sub-range's length.

A draft asks this at every step, so the searches are kept out of Python where they can be: each suffix's first three
tokens packed in one int64 (:attr:`CorpusIndex.heads`, 19 MB more, built in about 0.1 s at first use) give a
pattern's range by two numpy searches, and small ranges are searched and counted in Python lists. Over 274 contexts
drawn from the corpus a tree took 267 -> 105 us, the same trees (``python`` over :meth:`CorpusIndex.tree`).

>>> idx = CorpusIndex.from_texts([[1, 2, 3, 4], [1, 2, 3, 5], [7, 1, 2, 9]])
>>> idx.longest_match([8, 8, 1, 2], max_match=4)      # "1 2" occurs three times, "8 1 2" never
(2, 3)
>>> toks, parents, probs, m = idx.tree([8, 8, 1, 2], depth=2, budget=3, max_match=4, min_prob=0.1, factor=1.5)
>>> toks, parents, [round(p, 2) for p in probs], m    # 3 in two of three, then 9; under 3, 4 and 5 (one each)
([3, 9, 4], [0, 0, 1], [0.67, 0.33, 0.33], 2)
"""

from __future__ import annotations

import functools
import hashlib
import os
from bisect import bisect_left, bisect_right
from pathlib import Path

import numpy as np

from decoding.drafters.suffix import draft_size, grow
from decoding.paths import PROJECT, specray_home

END = -1  # between two texts: no match or continuation spans it
SAMPLE = 2048  # a tree node over more suffixes than this counts its children on an even sample of them
HEAD, HEAD_BITS = 3, 21  # CorpusIndex.heads: the first 3 tokens of each suffix in one int64 (token ids below 2**21 - 1)
GATHER = 4096  # CorpusIndex._bounds: ranges up to this size are searched in numpy
FEW = 64  # CorpusIndex._children and _bounds: ranges up to this size are counted and searched in Python


def suffix_array(text: np.ndarray, depth: int = 64) -> np.ndarray:
    """The start positions of ``text``'s suffixes in sorted order, by prefix doubling (numpy sorts, O(n log n)).
    Suffixes that agree on their first ``depth`` tokens keep text order: no lookup compares further."""
    n = len(text)
    rank = np.unique(text, return_inverse=True)[1].astype(np.int64)
    sa, k = np.argsort(rank, kind="stable"), 1
    while k < depth:
        second = np.full(n, -1, np.int64)
        second[: n - k] = rank[k:]
        sa = np.lexsort((second, rank))
        key_a, key_b = rank[sa], second[sa]
        new = np.empty(n, np.int64)
        new[sa] = np.concatenate([[0], np.cumsum((key_a[1:] != key_a[:-1]) | (key_b[1:] != key_b[:-1]))])
        rank, k = new, 2 * k
        if rank[sa[-1]] == n - 1:  # every suffix ranked apart
            break
    return sa.astype(np.int32)


class CorpusIndex:
    """``text`` (int32 token ids, texts separated by ``END``, padded with ``END``) and its suffix array."""

    def __init__(self, text: np.ndarray, sa: np.ndarray, pad: int = 64):
        self.text, self.sa, self.pad = text, sa, pad

    @classmethod
    def from_texts(cls, texts, pad: int = 64) -> CorpusIndex:
        parts = []
        for t in texts:
            parts += [np.asarray(t, np.int32), np.array([END], np.int32)]
        body = np.concatenate(parts) if parts else np.array([END], np.int32)
        sa = suffix_array(body)
        return cls(np.concatenate([body, np.full(pad, END, np.int32)]), sa, pad)

    @property
    def tokens(self) -> int:
        return len(self.sa)

    @functools.cached_property
    def heads(self) -> np.ndarray | None:
        """The first ``HEAD`` tokens of each suffix in suffix-array order, packed into one int64 each (a token t as t + 1
        in ``HEAD_BITS`` bits, ``END`` as 0): sorted, since the suffixes are. A pattern's range among them is two
        binary searches in numpy instead of about forty comparisons in Python. None where a token id does not fit."""
        if len(self.text) and int(self.text.max()) + 1 >= 1 << HEAD_BITS:
            return None
        shifted = self.text.astype(np.int64) + 1
        packed = np.zeros(len(self.sa), np.int64)
        for j in range(HEAD):
            packed = (packed << HEAD_BITS) | shifted[self.sa.astype(np.int64) + j]
        return packed

    def _range(self, pattern: list[int]) -> tuple[int, int]:
        """The suffix-array range of the suffixes that start with ``pattern``: its first ``HEAD`` tokens by
        :attr:`heads`, the rest by binary search within that range."""
        text, sa, m = self.text, self.sa, len(pattern)
        lo, hi, at = 0, len(sa), 0
        if self.heads is not None:
            head = pattern[:HEAD]
            low = high = 0
            for j in range(HEAD):
                t = head[j] + 1 if j < len(head) else None
                low = (low << HEAD_BITS) | (t if t is not None else 0)
                high = (high << HEAD_BITS) | (t if t is not None else (1 << HEAD_BITS) - 1)
            lo, hi = int(self.heads.searchsorted(low, "left")), int(self.heads.searchsorted(high, "right"))
            at = len(head)
        if at >= m or lo >= hi:
            return lo, hi
        rest = pattern[at:]

        def key(i):
            return text[sa[i] + at : sa[i] + m].tolist()

        lo = bisect_left(range(lo, hi), rest, key=key) + lo
        return lo, bisect_right(range(lo, hi), rest, key=key) + lo

    def _continued(self, lo: int, hi: int, m: int) -> bool:
        """Whether a suffix in the range has a token (not ``END``) after its first ``m``."""
        step = max(1, (hi - lo) // SAMPLE)
        return bool((self.text[self.sa[lo:hi:step] + m] != END).any())

    def longest_match(self, context: list[int], max_match: int) -> tuple[int, int]:
        """(m, occurrences): the longest suffix of ``context`` (at most ``max_match`` tokens) that occurs with a
        continuation, and how often; (0, 0) when not even its last token does."""
        m, lo, hi = self._longest(context, max_match)
        return m, hi - lo

    def _longest(self, context: list[int], max_match: int) -> tuple[int, int, int]:
        """(m, lo, hi): the longest match and its range. A binary search over m: a suffix that occurs has every
        shorter one occur too."""
        best, lo_m, hi_m = (0, 0, 0), 1, min(max_match, len(context), self.pad - 1)
        while lo_m <= hi_m:
            m = (lo_m + hi_m) // 2
            lo, hi = self._range(context[-m:])
            if lo < hi and self._continued(lo, hi, m):
                best, lo_m = (m, lo, hi), m + 1
            else:
                hi_m = m - 1
        return best

    def _children(self, lo: int, hi: int, at: int) -> list[tuple[int, int]]:
        """(token, count) of the continuations at offset ``at`` of the suffixes in [lo, hi) (sorted there by it),
        counted on an even sample of the range when it is large."""
        if hi - lo <= FEW:  # a few suffixes: counted in Python (numpy's per-call costs outweigh the work)
            out: list[tuple[int, int]] = []
            for tok in self.text[self.sa[lo:hi] + at].tolist():
                if tok == END:
                    continue
                if out and out[-1][0] == tok:
                    out[-1] = (tok, out[-1][1] + 1)
                else:
                    out.append((tok, 1))
            return out
        keys = self.text[self.sa[lo : hi : max(1, (hi - lo) // SAMPLE)] + at]
        keys = keys[keys != END]
        if not len(keys):
            return []
        cuts = np.concatenate([[0], np.flatnonzero(keys[1:] != keys[:-1]) + 1, [len(keys)]])
        return list(zip(keys[cuts[:-1]].tolist(), np.diff(cuts).tolist(), strict=True))

    def _bounds(self, lo: int, hi: int, at: int, tok: int) -> tuple[int, int]:
        """The sub-range of [lo, hi) whose token at offset ``at`` is ``tok`` (sorted there by it)."""
        text, sa = self.text, self.sa
        if hi - lo <= FEW:  # a few suffixes: their tokens as a list, two searches in Python
            keys = text[sa[lo:hi] + at].tolist()
            return lo + bisect_left(keys, tok), lo + bisect_right(keys, tok)
        if hi - lo <= GATHER:  # a small range: its tokens gathered, two searches in numpy
            keys = text[sa[lo:hi] + at]
            return lo + int(keys.searchsorted(tok, "left")), lo + int(keys.searchsorted(tok, "right"))

        def key(i):
            return int(text[sa[i] + at])

        a = bisect_left(range(lo, hi), tok, key=key) + lo
        return a, bisect_right(range(a, hi), tok, key=key) + a

    def tree(self, context: list[int], depth: int, budget: int, max_match: int, min_prob: float, factor: float = 1.0):
        """(tokens, parents, path probabilities, match length) of the ``suffix.draft_size(m, factor, budget)`` most probable
        continuations (depth <= ``depth``) of the context's longest match, best first (``suffix.grow``); parents
        index [root, nodes...] (0 = the pending token). A node is (its parent's range, the offset of its token, its
        token): its own range is found when it is expanded."""
        m, lo, hi = self._longest(context, max_match)
        if m == 0:
            return [], [], [], 0

        def kids(node):
            lo, hi, at, tok = node
            if tok is not None:
                lo, hi = self._bounds(lo, hi, at, tok)
                at += 1
            return [(t, c, (lo, hi, at, t)) for t, c in self._children(lo, hi, at)]

        return *grow(kids, (lo, hi, m, None), depth, draft_size(m, factor, budget), min_prob), m


def fingerprint(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


_LOADED: dict[str, CorpusIndex] = {}  # by fingerprint: the decoders of one process share an index


def corpus_folder(source: str, model: str) -> Path | None:
    """The self-distillation folder ``source`` names: ``none`` -> None; ``auto`` -> this checkout's
    ``data/distill/<model>`` when there is one (the bundled model's is), else None; else the folder given."""
    if source == "none":
        return None
    folder = PROJECT / "data" / "distill" / model if source == "auto" else Path(source).expanduser()
    return folder if any(folder.glob("phase-*/shard-*.parquet")) else None


def load_corpus(folder: Path) -> CorpusIndex:
    """The index over the train-split answers of ``folder``'s shards (``specray distill``'s layout), built once and
    kept under ``$SPECRAY_HOME/cache/suffix-corpus`` (building it takes a few seconds; loading it, milliseconds)."""
    files = sorted(folder.glob("phase-*/shard-*.parquet"))
    key = fingerprint(files)
    if key in _LOADED:
        return _LOADED[key]
    cached = specray_home() / "cache" / "suffix-corpus" / f"{key}.npz"
    try:
        with np.load(cached) as z:
            index = CorpusIndex(z["text"], z["sa"])
    except (OSError, KeyError, ValueError):
        index = CorpusIndex.from_texts(_answers(files))
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(tmp, text=index.text, sa=index.sa)
        os.replace(tmp, cached)
    return _LOADED.setdefault(key, index)


def _answers(files: list[Path]):
    import pyarrow.parquet as pq

    for f in files:
        rows = pq.read_table(f, columns=["split", "answer_ids"]).to_pydict()
        for split, ids in zip(rows["split"], rows["answer_ids"], strict=True):
            if split != "heldout" and ids:  # held-out answers stay out: they measure the drafters
                yield ids
