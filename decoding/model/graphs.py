"""CUDA graphs of a model's forwards: each shape captured once over static buffers, then replayed.

On a GPU a small model's decoding step is launch-bound: SmolLM2-135M's eager step dispatches about 1,200 kernels at
about 23 us each on an H200 (a one-token step 50 ms inside generation), while the same step replayed as one CUDA
graph costs about 3 ms. :class:`GraphRunner` replays ``ModelAdapter.forward`` from captured graphs, one per

    (cache storage, row bucket of ``ROW_BUCKETS``, width bucket of ``WIDTHS``, layer range, ids or hidden states in,
     captured layers, tree block)

so the target's verification of every width up to 64 tokens, a batch of rows, and each drafter's forwards (an eagle
head's one-layer steps, a distilled draft's steps, early exit's shallow layers, which all go through their own
adapter's ``forward``) replay instead of launching kernel by kernel. The graph body is the forward's static form:

* the block's tokens are written by index at ``slots`` (padding to the bucket at the cache's scratch slot, see
  ``KVCache``), never by a slice that starts at a host int;
* a batch's rows pad up to a row bucket where the cache's storage holds that many rows (the batch cache's rows
  0..R-1 are the start of a storage of more): a continuous batch's row count changes as sequences join and leave,
  and a graph per exact count captured anew at almost every change (on the H200, 16 rows decoded slower than 4, and
  128 rows 1.2x 4). The padded rows write the scratch slot of rows no sequence holds and their outputs are dropped;
* attention reads every slot of the cache under the mask ``Placement.allowed`` builds from the committed
  ``prefix`` and the tree ``block``: no shape depends on a length;
* inputs, positions, slots, prefix and block are static buffers the runner copies into before each replay; outputs
  are copied out (a graph's output buffer is overwritten by its next replay).

A cache's storage is baked into its graphs, so on CUDA the adapter hands out caches from a pool (``CachePool``):
storage of the same shape is reused once its cache is gone, and a new generation's cache is one whose graphs exist.
Capture runs at load for the common shapes (``GraphRunner.warm``, bounded in time, with progress) and otherwise on
first use; a shape whose capture fails runs eager, with one warning naming it. Float32 greedy output through the
graphs equals the eager forward's (``tests/gpu/test_graphs.py``).

Without CUDA (``capture=False``) the runner runs the same body on the same static buffers without capturing: the
CPU tests check the static form and the buffer plumbing against the eager forward.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from decoding.model.fast_layers import Placement

log = logging.getLogger("specray")

WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # tokens per row a graph is captured for (a block pads to the next)
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # batch rows a graph is captured for (then by 64)
MAX_GRAPHS = 256  # graphs kept per adapter (least recently used dropped beyond it)


def bucket(t: int) -> int | None:
    """The captured width a block of ``t`` tokens runs at (None: wider than every bucket).

    >>> [bucket(t) for t in (1, 3, 5, 33, 64, 65)]
    [1, 4, 8, 64, 64, None]
    """
    return next((w for w in WIDTHS if w >= t), None)


def row_bucket(rows: int, capacity: int) -> int:
    """The rows a batch's graph runs at: the next of ``ROW_BUCKETS`` (past them, the next multiple of 64), within the
    ``capacity`` of the cache's storage.

    >>> [row_bucket(r, 128) for r in (1, 3, 5, 17, 33, 100, 128)], row_bucket(100, 100), row_bucket(300, 512)
    ([1, 4, 8, 24, 48, 128, 128], 100, 320)
    """
    padded = next((b for b in ROW_BUCKETS if b >= rows), -(-rows // 64) * 64)
    return max(rows, min(padded, capacity))


def round_len(n: int) -> int:
    """Cache lengths on a GPU round up (to a power of two from 256): caches of one length share storage and graphs.

    >>> [round_len(n) for n in (10, 300, 2048, 2049)]
    [256, 512, 2048, 4096]
    """
    size = 256
    while size < n:
        size *= 2
    return size


class CachePool:
    """Storage for KV caches, recycled by shape: a cache whose tensors are all gone (views included) gives its storage
    back, and the next cache of that shape gets it, at the same address. Storage is never freed while the process
    lives (a captured graph may still point at it)."""

    def __init__(self):
        self.free: dict[tuple, list] = {}
        self.made = 0

    def take(self, shape: tuple, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (tuple(shape), dtype, str(device))
        spare = self.free.get(key)
        if spare:
            k_storage, v_storage = spare.pop()
            k_all = torch.empty(0, dtype=dtype, device=device).set_(k_storage, 0, shape)
            v_all = torch.empty(0, dtype=dtype, device=device).set_(v_storage, 0, shape)
        else:
            k_all = torch.zeros(shape, dtype=dtype, device=device)
            v_all = torch.zeros(shape, dtype=dtype, device=device)
            self.made += 1
        # both tensors gone (their views keep them alive): the storage is free again
        storages, alive = (k_all.untyped_storage(), v_all.untyped_storage()), [2]

        def gone() -> None:
            alive[0] -= 1
            if alive[0] == 0:
                self.free.setdefault(key, []).append(storages)

        weakref.finalize(k_all, gone)
        weakref.finalize(v_all, gone)
        return k_all, v_all


@dataclass
class _Graph:
    inputs: dict
    output: torch.Tensor
    features: dict = field(default_factory=dict)
    graph: object = None  # torch.cuda.CUDAGraph; None: run the body on the buffers (no CUDA)
    body: object = None


class GraphRunner:
    """Replays an adapter's forwards from captured CUDA graphs (see the module docstring); ``run`` returns None where
    no graph applies (the caller runs eager)."""

    def __init__(self, adapter, capture: bool = True, max_graphs: int = MAX_GRAPHS):
        self.adapter = adapter
        self.capture = capture and torch.cuda.is_available() and adapter.device.type == "cuda"
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.failed: set[tuple] = set()
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.captures = self.replays = 0
        self.capture_s = 0.0

    # ---- what applies --------------------------------------------------------------------------------------------
    @staticmethod
    def applies(cache, t: int, place: Placement) -> bool:
        """Plain caches (not sparse views), blocks of up to 64 tokens, trees fed whole (a block as wide as the tokens)."""
        if not getattr(cache, "plain", False) or not hasattr(cache, "k_all") or bucket(t) is None:
            return False
        return place.block is None or place.block.shape[-1] == t

    def key(self, cache, rows: int, t: int, first: int, last: int, ids: bool, captured, block: bool) -> tuple:
        return (cache.k_all.data_ptr(), tuple(cache.k_all.shape), rows, bucket(t), first, last, ids, tuple(sorted(captured or ())), block)

    # ---- replay ----------------------------------------------------------------------------------------------------
    def run(self, cache, x: torch.Tensor, positions: torch.Tensor, place: Placement, first: int, last: int, captured: dict | None):
        """The forward's hidden states [R, t, H] (and ``captured`` filled), from the graph of this shape; None when no
        graph applies or its capture failed."""
        rows, t = x.shape[:2]
        if not self.applies(cache, t, place):
            return None
        padded = row_bucket(rows, cache.row_capacity)
        if padded > rows:
            cache = cache.first_rows(padded)
        key = self.key(cache, padded, t, first, last, x.dtype == torch.long, captured, place.block is not None)
        if key in self.failed:
            return None
        g = self.graphs.get(key)
        if g is None:
            g = self._make(key, cache, x, positions, place, first, last, captured, padded)
            if g is None:
                return None
        else:
            self.graphs.move_to_end(key)
        self._fill(g, cache, x, positions, place, t)
        if g.graph is not None:
            g.graph.replay()
        else:
            g.body()
        self.replays += 1
        if captured is not None:
            for layer in captured:
                captured[layer] = g.features[layer][:rows, :t].clone()
        return g.output[:rows, :t].clone()

    def _fill(self, g: _Graph, cache, x, positions, place: Placement, t: int) -> None:
        """Copy one call's inputs into the graph's static buffers; the padding past ``t`` (and the rows past the
        call's) writes the scratch slot and is seen by no real query."""
        inp = g.inputs
        r = x.shape[0]
        inp["x"][:r, :t].copy_(x)
        inp["positions"][:r, :t].copy_(positions)
        inp["slots"][:r, :t].copy_(place.slots)
        width = inp["slots"].shape[1]
        if t < width:
            inp["slots"][:r, t:].fill_(cache.scratch)
            inp["positions"][:r, t:].copy_(positions[:, -1:].expand(-1, width - t))
        inp["prefix"][:r].copy_(place.prefix)
        if r < inp["slots"].shape[0]:  # rows padded to the bucket: rows no sequence holds, their scratch slot only
            inp["slots"][r:].fill_(cache.scratch)
            inp["prefix"][r:].zero_()
        if "block" in inp:
            inp["block"].copy_(inp["eye"])  # padding queries see themselves; no real query sees the padding
            inp["block"][:r, :t, :t].copy_(place.block)

    # ---- capture ---------------------------------------------------------------------------------------------------
    def _make(self, key, cache, x, positions, place: Placement, first: int, last: int, captured, rows: int) -> _Graph | None:
        """Capture the graph of ``key`` for ``rows`` rows (the call's, or its row bucket)."""
        if len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        t = x.shape[1]
        width = bucket(t)
        device = x.device
        inputs = {
            "x": x.new_zeros(rows, width, *x.shape[2:]),
            "positions": positions.new_zeros(rows, width),
            "slots": place.slots.new_full((rows, width), cache.scratch),
            "prefix": place.prefix.new_zeros(rows),
            "rows": torch.arange(rows, device=device)[:, None],
        }
        if place.block is not None:
            inputs["eye"] = torch.eye(width, dtype=torch.bool, device=device).expand(rows, width, width).contiguous()
            inputs["block"] = inputs["eye"].clone()
        layers = tuple(sorted(captured or ()))
        g = _Graph(inputs, output=None)
        self._fill(g, cache, x, positions, place, t)
        adapter = self.adapter

        def body():
            static = Placement(inputs["slots"], inputs["prefix"], cache.max_len, inputs.get("block"), rows=inputs["rows"])
            feats = dict.fromkeys(layers) if layers else None
            ids, hidden = (inputs["x"], None) if inputs["x"].dtype == torch.long else (None, inputs["x"])
            out = adapter.eager_forward(cache, ids, hidden, first, last, inputs["positions"], static, feats)
            return out, feats or {}

        begin = time.perf_counter()
        try:
            if self.capture:
                g.graph, (g.output, g.features) = self._capture(body, device)
            else:
                out, feats = body()
                g.output, g.features = out, feats
                g.body = lambda: _copy_into(g, body())
        except Exception as e:  # noqa: BLE001 - an op that cannot be captured: this shape runs eager from now on
            log.warning(
                "specray: capturing a CUDA graph failed for rows=%d width=%d layers %d-%d (%s: %s); that shape runs eager",
                rows,
                width,
                first,
                last,
                type(e).__name__,
                e,
            )
            self.failed.add(key)
            return None
        self.capture_s += time.perf_counter() - begin
        self.captures += 1
        self.graphs[key] = g
        return g

    def _capture(self, body, device):
        return capture(body, device, self.pool)

    def warm(self, cache, widths=(1, 2, 4, 8), budget_s: float = 60.0, progress: bool = True) -> int:
        """Capture the target's one-row graphs for ``widths`` over ``cache`` (a pooled cache of the shape generation
        will use), within ``budget_s`` seconds; the rest are captured on first use. Returns the graphs captured."""
        from tqdm.auto import tqdm

        begin = time.perf_counter()
        bar = tqdm(widths, desc="capturing CUDA graphs", disable=not progress, leave=False)
        with torch.inference_mode():
            made = self._warm(cache, bar, begin, budget_s)
        bar.close()
        return made

    def _warm(self, cache, bar, begin: float, budget_s: float) -> int:
        made, device = 0, self.adapter.device
        for w in bar:
            if time.perf_counter() - begin > budget_s:
                log.info("specray: graph capture stopped after %.0f s; wider blocks are captured on first use", budget_s)
                break
            ids = torch.zeros(1, w, dtype=torch.long, device=device)
            place = Placement.at(0, w, 1, device)
            place = Placement(place.slots, place.prefix, place.end)  # indexed: the static form
            if self.run(cache, ids, place.slots, place, 0, self.adapter.num_layers, None) is not None:
                made += 1
        return made


_CAPTURE_S = [0.0]  # seconds this process has spent capturing graphs, every runner together


def capture_seconds() -> float:
    """Seconds this process has spent capturing CUDA graphs so far (every :func:`capture`, failed ones included): the
    decoding loop takes a proposal's captures out of what its drafter learns a draft costs, since they happen once
    per shape, not per step (``decoding.loop.batch``)."""
    return _CAPTURE_S[0]


def capture(body, device, pool):
    """``body()`` captured as one CUDA graph (after two warm-up runs on a side stream: lazy initialisations, the
    allocator's first blocks): (graph, the outputs its replays overwrite)."""
    begin = time.perf_counter()
    try:
        return _capture_graph(body, device, pool)
    finally:
        _CAPTURE_S[0] += time.perf_counter() - begin


def _capture_graph(body, device, pool):
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            body()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = body()
    return graph, out


class LoopGraphs:
    """Whole multi-step functions of device tensors, captured as one CUDA graph per key and replayed: a drafter's
    draft loop (every draft forward, the heads, the arg-maxes, a tree's growth and reranking), where
    :class:`GraphRunner` replays one forward at a time and the host launches the rest op by op.

    ``run(key, fn, *inputs)`` calls ``fn(*static)`` on static copies of ``inputs`` (device tensors): the first call of
    a key captures it (the key names everything the graph bakes in: shapes, the cache's storage, the loop's
    constants), later calls copy their inputs into the static buffers and replay. It returns a copy of ``fn``'s
    outputs (a tensor or a tuple of tensors), or None where the capture failed (one warning naming the key; the caller
    runs its eager loop). Without CUDA (``capture=False``) ``fn`` runs on the static buffers each call: the CPU tests
    check the loop's static form against the eager loop.
    """

    def __init__(self, device, capture: bool | None = None, max_graphs: int = MAX_GRAPHS):
        device = torch.device(device)
        can = torch.cuda.is_available() and device.type == "cuda"
        self.device, self.capture = device, can if capture is None else capture and can
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, tuple] = OrderedDict()  # key -> (static inputs, graph or None, outputs)
        self.failed: set[tuple] = set()
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.captures = self.replays = 0
        self.capture_s = 0.0

    def run(self, key: tuple, fn, *inputs: torch.Tensor):
        if key in self.failed:
            return None
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._make(key, fn, inputs)
            if entry is None:
                return None
        else:
            self.graphs.move_to_end(key)
            for buf, x in zip(entry[0], inputs, strict=True):
                buf.copy_(x)
        static, graph, out = entry
        if graph is not None:
            graph.replay()
        else:
            out = fn(*static)
        self.replays += 1
        return tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()

    def _make(self, key: tuple, fn, inputs):
        if len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        static = tuple(x.clone() for x in inputs)
        graph, out = None, None
        if self.capture:
            begin = time.perf_counter()
            try:
                graph, out = capture(lambda: fn(*static), self.device, self.pool)
            except Exception as e:  # noqa: BLE001 - a loop that cannot be captured runs eager from now on
                log.warning("specray: capturing the draft loop %s as a CUDA graph failed (%s: %s); it runs eager", key, type(e).__name__, e)
                self.failed.add(key)
                return None
            self.capture_s += time.perf_counter() - begin
        self.captures += 1
        self.graphs[key] = (static, graph, out)
        return self.graphs[key]


def _copy_into(g: _Graph, result) -> None:
    out, feats = result
    g.output.copy_(out)
    for layer, value in feats.items():
        g.features[layer].copy_(value)
