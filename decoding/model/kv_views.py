"""Sparse views of a KV cache: TriForce's retrieval cache and StreamingLLM's sinks + window.

A view is a cache object with the ``KVCache`` interface HF attention calls
(``update(key, value, layer_idx)`` returns the keys/values to attend to) that
holds only some positions. Keys are stored post-rotary, so a kept key keeps its
original position and a new query enters at its true position: the relative
positions the model sees are exact, only the set of positions is sparse.

Storage is compact: ``kept`` slots hold positions picked from a source cache
(the retrieved chunks of the prompt, or the attention sinks), followed by a
*tail* addressed by position from ``tail_start`` on (the latest prompt tokens
and everything generated after them). A forward is driven through
:class:`ViewAdapter`, which turns the true start position into the compact
slot count that the adapter's mask and write cursor use, and passes the true
rotary positions explicitly. Rolling back is still moving ``length``.

Which positions the first generated token (position 11, after a prompt of 11 tokens) attends to::

    retrieval, chunk size 2, budget 7: chunks {0,1} {2,3} {4,5} {6,7} {8,9}, tail {10}
        keeps (7 - 1) // 2 = 3 chunks: the first, the latest full one and the best scored
        -> 0 1 | 4 5 | 8 9 | 10 | 11        (per layer and KV head; here {4,5} scored best)
    streaming, 1 sink, window 3 -> 0 | 8 9 10 | 11
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from decoding import accel
from decoding.model.adapter import KVCache, ModelAdapter


class SparseKVCache:
    """Keys/values of a subset of positions: ``kept`` picked slots, then a position-addressed tail.

    ``k[l]``/``v[l]``: [batch, kv_heads, kept + (max_len - tail_start), head_dim].
    Slot ``kept + p - tail_start`` holds position ``p >= tail_start``. With
    ``window`` set, a forward writing at ``start`` attends to the kept slots,
    the tail positions ``[max(tail_start, start - window), start)`` and itself
    (StreamingLLM); with ``window=None`` to the whole tail (retrieval).
    ``length`` counts true positions (everything before it is valid).
    """

    def __init__(self, like: list[torch.Tensor], kept: int, tail_start: int, max_len: int, window: int | None = None):
        """``like[l]`` ([B, H, *, D]) gives each layer's batch, heads, head size, dtype and device."""
        if not 0 <= tail_start <= max_len:
            raise ValueError(f"tail_start {tail_start} outside 0..{max_len}")
        slots = kept + max_len - tail_start
        self.k = [x.new_zeros(x.shape[0], x.shape[1], slots, x.shape[3]) for x in like]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.kept, self.tail_start, self.max_len, self.window = kept, tail_start, max_len, window
        self.length = tail_start
        self.cursor = 0  # set by the adapter to the compact start; writes use the true start from begin()
        self._start = tail_start
        self.kept_positions: tuple[int, ...] = ()  # what the kept slots hold, when it is the same for every layer and head

    def _window_start(self, start: int) -> int:
        return self.tail_start if self.window is None else max(self.tail_start, start - self.window)

    def begin(self, start: int, t: int) -> int:
        """Prepare a forward of ``t`` tokens at true position ``start``; returns how many slots precede them."""
        if start < self.tail_start or start + t > self.max_len:
            raise IndexError(f"sparse cache holds positions {self.tail_start}..{self.max_len}, asked to write {start}..{start + t}")
        self._start = start
        return self.kept + start - self._window_start(start)

    def update(self, key, value, layer_idx, *args, **kwargs):  # called by HF attention
        # key/value: [batch, kv_heads, T, head_dim] for true positions start..start+T
        begin = self.kept + self._start - self.tail_start
        end = begin + key.shape[2]
        k, v = self.k[layer_idx], self.v[layer_idx]
        k[:, :, begin:end] = key
        v[:, :, begin:end] = value
        w = self.kept + self._window_start(self._start) - self.tail_start
        if w == self.kept:  # kept slots and the attended tail are contiguous: no copy
            return k[:, :, :end], v[:, :, :end]
        return torch.cat([k[:, :, : self.kept], k[:, :, w:end]], 2), torch.cat([v[:, :, : self.kept], v[:, :, w:end]], 2)

    def rollback(self, length: int) -> None:
        if not self.tail_start <= length <= self.max_len:
            raise IndexError(f"rollback to {length} outside {self.tail_start}..{self.max_len}")
        self.length = length

    def copy_from(self, src_k: list[torch.Tensor], src_v: list[torch.Tensor], begin: int, end: int) -> None:
        """Copy positions [begin, end) (>= tail_start) from a position-addressed source (``KVCache.k``)."""
        if begin >= end:
            return
        a, b = self.kept + begin - self.tail_start, self.kept + end - self.tail_start
        for dst, src in zip(self.k + self.v, list(src_k[: len(self.k)]) + list(src_v[: len(self.v)]), strict=True):
            dst[:, :, a:b] = src[:, :, begin:end]

    def positions(self, start: int | None = None) -> list[int]:
        """The true positions a forward at ``start`` (default ``length``) attends to besides itself: ``kept_positions``
        (the sinks of a streaming cache; a retrieval cache's differ per layer and head, see ``RetrievalCache.chunks``), then the tail."""
        start = self.length if start is None else start
        return list(self.kept_positions) + list(range(self._window_start(start), start))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def streaming_cache(source: KVCache, num_layers: int, length: int, sinks: int, window: int, max_len: int) -> SparseKVCache:
    """A StreamingLLM cache (``sinks`` first positions + the latest ``window``) seeded from ``source``'s first layers.

    ``source`` holds positions [0, length) for at least ``num_layers`` layers
    (the target's cache when the drafter is the target's first layers, or the
    drafter's own prefill cache); the view's length is ``length``.

    >>> src = KVCache(1, 1, 1, 1, 16, torch.float32, "cpu")
    >>> src.k[0][0, 0, :10, 0] = torch.arange(10.0); src.length = 10
    >>> c = streaming_cache(src, 1, 10, sinks=1, window=3, max_len=16)
    >>> c.positions(), c.positions(12)
    ([0, 7, 8, 9], [0, 9, 10, 11])
    """
    s = min(sinks, length)
    tail_start = max(s, length - window)
    view = SparseKVCache(source.k[:num_layers], s, tail_start, max_len, window)
    for dst, src in zip(view.k + view.v, source.k[:num_layers] + source.v[:num_layers], strict=True):
        dst[:, :, :s] = src[:, :, :s]
    view.copy_from(source.k, source.v, tail_start, length)
    view.kept_positions = tuple(range(s))
    view.length = length
    return view


# ---- retrieval -----------------------------------------------------------------------------------
def chunk_scores_reference(query: torch.Tensor, keys: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """TriForce's chunk relevance: mean key of each chunk . query, summed over a KV head's query heads and tokens.

    query: [B, Hq, Tq, D] post-rotary queries of the latest token(s); keys: [B, Hkv, N, D]
    post-rotary, N a multiple of ``chunk_size``; Hq a multiple of Hkv (grouped-query
    attention: query heads g*Hq/Hkv .. (g+1)*Hq/Hkv - 1 read KV head g). Returns [B, Hkv, N / chunk_size] float32.

    >>> q = torch.tensor([[[[1.0, 0.0]]]])                       # one head, one token
    >>> k = torch.tensor([[[[1.0, 0], [3, 0], [0, 5], [0, 5]]]])  # chunks of 2: mean keys (2, 0) and (0, 5)
    >>> chunk_scores_reference(q, k, 2).tolist()
    [[[2.0, 0.0]]]
    """
    bsz, hq, tq, dim = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    q_sum = query.float().reshape(bsz, hkv, (hq // hkv) * tq, dim).sum(2)  # [B, Hkv, D]
    means = keys.float().reshape(bsz, hkv, n // chunk_size, chunk_size, dim).mean(3)  # [B, Hkv, C, D]
    return (means @ q_sum.unsqueeze(-1)).squeeze(-1)  # [B, Hkv, C]


def chunk_scores(query: torch.Tensor, keys: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``chunk_scores_reference``, or the Triton kernel (kernels/chunk_scores.py) where ``kernels.install()`` registered it."""
    return accel.dispatch("chunk_scores", chunk_scores_reference, query, keys, chunk_size)


def select_chunks(scores: torch.Tensor, count: int, forced: tuple[int, ...] = ()) -> torch.Tensor:
    """Indices of the ``count`` best chunks per KV head, ``forced`` chunks always among them, in increasing order.

    scores: [B, H, C] -> [B, H, count] int64.

    >>> select_chunks(torch.tensor([[[5.0, 1, 9, 3, 0]]]), 2, forced=(4,)).tolist()
    [[[2, 4]]]
    """
    scores = scores.clone()
    for c in forced:
        scores[..., c] = float("inf")
    return scores.topk(count, dim=-1).indices.sort(-1).values


def layer_queries(adapter: ModelAdapter, cache, start: int, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Post-rotary attention queries of ``input_ids`` at every layer, from a forward run one layer at a time.

    Query of layer l = rotary(q_proj(input_layernorm(hidden entering l))), as the
    Llama attention computes it. The forward writes these tokens' KV at
    ``start..`` in ``cache`` like any forward (``length`` does not move).
    Returns one [B, Hq, T, D] tensor per layer.
    """
    bsz, t = input_ids.shape
    positions = torch.arange(start, start + t, device=input_ids.device).unsqueeze(0).expand(bsz, t)
    out = []
    with torch.inference_mode():
        hidden = adapter.embed(input_ids)
        cos, sin = (x.unsqueeze(1) for x in adapter.rotary(hidden, positions))  # [B, 1, T, D]
        for i, layer in enumerate(adapter.layers[: adapter.num_layers]):
            q = layer.self_attn.q_proj(layer.input_layernorm(hidden)).view(bsz, t, -1, adapter.head_dim).transpose(1, 2)
            half = q.shape[-1] // 2
            rotated = torch.cat([-q[..., half:], q[..., :half]], dim=-1)
            out.append(q * cos + rotated * sin)
            hidden = adapter.forward(cache, start, hidden=hidden, first=i, last=i + 1, positions=positions)
    return out


class RetrievalCache(SparseKVCache):
    """TriForce's retrieval cache over a target's full cache: top prompt chunks by query relevance + the tail.

    The prompt (the full cache's first ``length`` positions) is cut into chunks of
    ``chunk_size``; the incomplete last chunk and everything after the prompt form
    the tail, kept in full. Per layer and KV head, ``select`` keeps the
    ``budget // chunk_size`` full chunks (less the tail's share) whose mean key
    scores highest against the given queries (:func:`chunk_scores`), always with
    the first chunk (attention sinks) and the latest full chunk. ``sync`` copies
    the target's exact KV of newly committed tokens into the tail, so only the
    middle level's own speculative tokens carry its approximate KV.
    """

    def __init__(self, full: KVCache, budget: int, chunk_size: int, max_len: int):
        n = full.length
        self.full, self.chunk_size = full, chunk_size
        self.num_chunks = n // chunk_size
        tail_start = self.num_chunks * chunk_size
        self.selected = min(self.num_chunks, max(0, (budget - (n - tail_start)) // chunk_size))
        kept = self.selected * chunk_size
        super().__init__(full.k, kept, tail_start, max_len)
        self.copy_from(full.k, full.v, tail_start, n)
        self.length = self.synced = n
        self.chunks: torch.Tensor | None = None  # [L, B, H, selected] chunk indices

    def select(self, queries: list[torch.Tensor]) -> torch.Tensor:
        """Gather the best chunks of every layer for ``queries`` (one [B, Hq, T, D] per layer); returns the chunk ids."""
        c, count = self.chunk_size, self.selected
        last = self.num_chunks - 1
        forced = (0, last) if count >= 2 else (last,) if count == 1 else ()
        chosen = []
        for layer, q in enumerate(queries):
            keys = self.full.k[layer][:, :, : self.tail_start]  # [B, H, N, D]
            ids = select_chunks(chunk_scores(q, keys, c), count, forced)  # [B, H, count]
            tok = (ids.unsqueeze(-1) * c + torch.arange(c, device=ids.device)).flatten(-2)  # [B, H, count * c]
            index = tok.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
            self.k[layer][:, :, : self.kept] = keys.gather(2, index)
            self.v[layer][:, :, : self.kept] = self.full.v[layer][:, :, : self.tail_start].gather(2, index)
            chosen.append(ids)
        self.chunks = torch.stack(chosen)
        return self.chunks

    def sync(self) -> None:
        """Copy the full cache's exact KV of the positions it gained since the last sync (over the middle's own KV of them).

        Positions past the full cache that the view already holds stay: they are the middle's KV of tokens the
        full cache has not reached yet (a draft side running ahead of its verifier); the caller cuts off the
        stale ones with :meth:`truncate` first.
        """
        n = self.full.length
        self.copy_from(self.full.k, self.full.v, self.synced, n)
        self.synced = n
        self.rollback(max(self.length, n))

    def truncate(self, length: int) -> None:
        """Forget positions from ``length`` on (the tokens there changed); the next sync recopies what it must."""
        self.rollback(min(self.length, length))
        self.synced = min(self.synced, length)


class ViewAdapter:
    """A ``ModelAdapter`` whose forwards go through a sparse view: true positions in, compact slots inside.

    ``make_cache(batch, max_len)`` builds the view a drafter asks for with ``new_cache``.
    Everything else (logits, layers, config) is the wrapped adapter's.
    """

    def __init__(self, base: ModelAdapter, make_cache: Callable[[int, int], SparseKVCache] | None = None):
        self.base, self.make_cache = base, make_cache

    def __getattr__(self, name):
        return getattr(self.base, name)

    def new_cache(self, batch: int, max_len: int) -> SparseKVCache:
        if self.make_cache is None:
            raise TypeError("this ViewAdapter was built without a cache factory")
        return self.make_cache(batch, max_len)

    def forward(
        self,
        cache: SparseKVCache,
        start: int,
        input_ids=None,
        hidden=None,
        first=0,
        last=None,
        positions=None,
        tree_mask=None,
        captured=None,
    ):
        x = input_ids if hidden is None else hidden
        bsz, t = x.shape[:2]
        if positions is None:
            positions = torch.arange(start, start + t, device=x.device).unsqueeze(0).expand(bsz, t)
        slots = cache.begin(start, t)
        return self.base.forward(cache, slots, input_ids, hidden, first, last, positions, tree_mask, captured)
