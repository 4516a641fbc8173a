"""Run layers [a, b) of any Llama-style Hugging Face decoder with our own cache.

The adapter drives the model's own modules (embedding, decoder layers, final
norm, LM head, rotary embedding) without forking the modelling files. The KV
cache is preallocated and addressed by position: a forward writes its keys and
values at ``start .. start+T`` and attends to ``0 .. start+T``; rolling back is
moving ``cache.length``, nothing is copied.

Works for the families whose decoder layers take ``(hidden_states,
attention_mask, position_ids, past_key_values, position_embeddings)`` and whose
attention calls ``past_key_values.update(k, v, layer_idx)``: Llama (SmolLM2),
Qwen2, Mistral and their relatives in transformers 5.

>>> # adapter = ModelAdapter(hf_model); cache = adapter.new_cache(batch=1, max_len=256)
>>> # h = adapter.forward(cache, start=0, input_ids=prompt)          # prefill
>>> # logits = adapter.logits(h[:, -1:])                             # [1, 1, V]
>>> # cache.length = 10                                               # roll back to 10 tokens
"""

from __future__ import annotations

import logging

import torch

from decoding import accel
from decoding.model.fast_layers import LayerStack, Placement, write_and_read


class KVCache:
    """Preallocated keys/values per layer, written by position.

    ``k_all``/``v_all``: [layers, batch, kv_heads, max_len + 1, head_dim]: ``max_len`` slots for positions and one
    scratch slot after them, where a step writes its padding; ``k[l]``/``v[l]`` are layer l's positions. ``length`` is
    the number of committed positions (the caller moves it to roll back). ``place`` is where the current forward
    writes (a ``fast_layers.Placement``, set by the adapter): one start for every row, or ragged rows each at its
    own length.

    A batch of sequences shares one cache: :meth:`rows` is a view of the first
    R rows (what a batched forward writes), :meth:`row` a one-row view with its
    own ``length`` (what a sequence's drafter and verdict see). Views share the
    storage; nothing is copied.
    """

    plain = True  # position-addressed slots: the fast layers write them (decoding.model.fast_layers.write_and_read)

    def __init__(self, num_layers, batch, kv_heads, head_dim, max_len, dtype, device, pool=None):
        shape = (num_layers, batch, kv_heads, max_len + 1, head_dim)
        # every layer's keys (values) in one tensor [L, batch, kv_heads, max_len + 1, head_dim]; k[l] / v[l] are views
        if pool is not None:  # recycled storage (decoding.model.graphs.CachePool: graphs keep their addresses)
            self.k_all, self.v_all = pool.take(shape, dtype, device)
        else:
            self.k_all = torch.zeros(shape, dtype=dtype, device=device)
            self.v_all = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.whole: KVCache | None | bool = None  # this is the whole storage (a view of rows 0.. names it; others False)
        self._views()
        self.length = 0
        self.place: Placement | None = None

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def scratch(self) -> int:
        """The slot after the last position: padding is written there and never read as a position."""
        return self.max_len

    def rows(self, begin: int, end: int | None = None) -> KVCache:
        """A view of rows [begin, end) (storage shared, ``length`` 0)."""
        end = begin + 1 if end is None else end
        view = KVCache.__new__(KVCache)
        view.k_all, view.v_all = self.k_all[:, begin:end], self.v_all[:, begin:end]
        view.max_len, view.length, view.place = self.max_len, 0, None
        whole = self._whole() if begin == 0 else None
        view.whole = False if whole is None else whole  # the storage of rows 0.., or none
        view._views()
        return view

    def _whole(self) -> KVCache | None:
        """The cache whose storage this cache's rows 0.. are the start of (itself when it is a whole storage); None
        for a view of other rows, or a cache of another kind."""
        whole = getattr(self, "whole", False)
        return self if whole is None else (None if whole is False else whole)

    @property
    def row_capacity(self) -> int:
        """Rows of the storage this cache's rows 0.. are the start of (its own rows for any other view)."""
        whole = self._whole()
        return self.batch if whole is None else whole.batch

    def first_rows(self, rows: int) -> KVCache | None:
        """The first ``rows`` rows of the storage this cache's rows 0.. are the start of, when it holds that many (a
        batch's CUDA graphs pad its rows up to a bucket: ``decoding.model.graphs.row_bucket``); else None."""
        whole = self._whole()
        return whole.rows(0, rows) if whole is not None and whole.batch >= rows else None

    def _views(self) -> None:
        """``k[l]`` / ``v[l]``: layer l's positions (the scratch slot left out) as views of the storage."""
        self.k = list(self.k_all[:, :, :, : self.max_len].unbind(0))
        self.v = list(self.v_all[:, :, :, : self.max_len].unbind(0))

    def row(self, index: int) -> KVCache:
        return self.rows(index, index + 1)

    def update(self, key, value, layer_idx, *args, **kwargs):  # called by HF attention (the modules' forward)
        return write_and_read(self, layer_idx, key, value, self.place)

    def compact(self, start: int, slots: list[int]) -> None:
        """Move the KV at ``slots`` (host ints, each >= start, any order: they are read before anything is written)
        to the contiguous slots start..start+m, every layer.

        After a tree verification the accepted branch sits at scattered tree slots; this makes it the
        committed prefix again (one gather + copy of the whole cache; a no-op when the branch is already in place).
        """
        m = len(slots)
        if m == 0 or list(slots) == list(range(start, start + m)):
            return
        index = torch.as_tensor(slots, dtype=torch.long, device="cpu").to(self.k_all.device, non_blocking=True)
        for buf in (self.k_all, self.v_all):
            buf[:, :, :, start : start + m] = buf.index_select(3, index)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.max_len:
            raise IndexError(f"rollback to {length} outside 0..{self.max_len}")
        self.length = length

    def export(self, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [begin, end), every layer, on the CPU: two [L, B, H, end - begin, D] tensors."""
        return self.k_all[:, :, :, begin:end].cpu(), self.v_all[:, :, :, begin:end].cpu()

    def write(self, begin: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store what :meth:`export` returned at positions begin.. (every layer); the cache then ends after them."""
        end = begin + keys.shape[3]
        if not 0 <= begin <= self.length or end > self.max_len:
            raise IndexError(f"writing positions {begin}..{end} into a cache of {self.length} (capacity {self.max_len})")
        self.k_all[:, :, :, begin:end] = keys.to(self.k_all.device)
        self.v_all[:, :, :, begin:end] = values.to(self.v_all.device)
        self.length = end


def _decoder_parts(hf_model):
    base = getattr(hf_model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, n) for n in needed) or not hasattr(hf_model, "lm_head"):
        raise TypeError(f"{type(hf_model).__name__} is not a Llama-style decoder (needs model.{{{', '.join(needed)}}} and lm_head)")
    return base


class ModelAdapter:
    """A thin, stateless driver over a HF causal LM; state lives in ``KVCache``.

    ``num_layers`` may be smaller than the model's depth: an adapter over the
    first L layers (with the model's own final norm and head) is a shallow
    draft model that shares the target's weights but not its cache.
    """

    def __init__(self, hf_model, num_layers: int | None = None, fast: bool = True, compile: bool = False, graphs: bool | None = None):
        base = _decoder_parts(hf_model)
        self.hf_model = hf_model
        self.config = hf_model.config
        self.embed = base.embed_tokens
        self.layers = base.layers
        self.norm = base.norm
        self.rotary = base.rotary_emb
        self.lm_head = hf_model.lm_head
        depth = len(self.layers)
        self.num_layers = depth if num_layers is None else num_layers
        if not 1 <= self.num_layers <= depth:
            raise ValueError(f"num_layers must be in 1..{depth}, got {self.num_layers}")
        self.kv_heads = getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads
        self.head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads
        self.vocab_size = self.lm_head.out_features
        param = next(hf_model.parameters())
        self.dtype, self.device = param.dtype, param.device
        # packed weight-only linears the loader attached (decoding.model.quant, models.load_model(quant=...)); None: dense
        self.quant = getattr(hf_model, "specray_quant", None)
        # the layers' own math in fewer operations (decoding.model.fast_layers); None: call the modules
        self.stack = LayerStack.of(self.layers, self.config, self.dtype, self.device, self.quant) if fast else None
        self.head = self.quant.head if self.quant is not None and self.stack is not None else None
        # compile=True: the whole stack compiled for one row per width bucket (decoding.model.compiled); eager elsewhere
        self.compiled = None
        if compile and self.stack is not None and self.num_layers == depth:
            from decoding.model.compiled import CompiledStack

            self.compiled = CompiledStack(self.stack, self.dtype, self.device)
        elif compile:
            logging.getLogger("specray").warning("specray: compile=True needs the fast layers over the whole model; running eager")
        # the KV caches' dtype: the stack's (float32 where 16-bit queries attend by torch's matmuls on a CPU, fast_layers'
        # docstring), else the model's
        self.cache_dtype = self.stack.kv_dtype(compiled=self.compiled is not None) if self.stack is not None else self.dtype
        # graphs (default: on a CUDA device): forwards replayed from CUDA graphs per shape (decoding.model.graphs), over
        # caches from a pool (a cache's storage is baked into its graphs)
        self.graphs = None
        self.pool = None
        if graphs or (graphs is None and self.device.type == "cuda" and self.compiled is None):
            from decoding.model.graphs import CachePool, GraphRunner

            self.graphs = GraphRunner(self)
            self.pool = CachePool() if self.device.type == "cuda" else None

    @classmethod
    def shared(cls, module) -> ModelAdapter:
        """The one adapter of a drafter's module (kept on the module): every drafter over that module (a batch's rows,
        a server's requests) shares its captured graphs and its pool of cache storage, so a new request replays
        the graphs an earlier one captured instead of capturing its own."""
        adapter = getattr(module, "_specray_adapter", None)
        if adapter is None:
            adapter = cls(module)
            object.__setattr__(module, "_specray_adapter", adapter)  # not a submodule: never saved or trained
        return adapter

    def loop_graphs(self):
        """The :class:`~decoding.model.graphs.LoopGraphs` of draft loops over this adapter's caches (made once)."""
        if getattr(self, "_loops", None) is None:
            from decoding.model.graphs import LoopGraphs

            self._loops = LoopGraphs(self.device)
        return self._loops

    @property
    def implementation(self) -> str:
        """Which forward runs the layers ("layers": decoding.model.fast_layers, "compiled": its compiled form for one row
        (decoding.model.compiled), "modules": transformers', plus the packed
        weights' kind, e.g. "layers-q4-gguf"); timings measured with one do not hold for another, so the
        calibration caches are kept per implementation."""
        name = ("compiled" if self.compiled is not None else "layers") if self.stack is not None else "modules"
        if self.cache_dtype != self.dtype:
            name += "-f32kv"
        elif self.stack is not None and self.stack.attend_own and accel.has("rope_attend"):
            name += "-fused"  # the CPU kernels' norms and fused attention (decoding.model.fast_layers.fused_attention)
        if self.graphs is not None:
            name += "-graphs"
        return f"{name}-{self.quant.implementation}" if self.stack is not None and self.quant is not None else name

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        if self.pool is not None:  # lengths rounded up: caches of one length share storage, and so graphs
            from decoding.model.graphs import round_len

            max_len = round_len(max_len)
        return KVCache(self.num_layers, batch, self.kv_heads, self.head_dim, max_len, self.cache_dtype, self.device, self.pool)

    @torch.inference_mode()
    def forward(
        self,
        cache: KVCache,
        start,
        input_ids: torch.Tensor | None = None,  # [batch, T]
        hidden: torch.Tensor | None = None,  # [batch, T, hidden] entering layer `first`
        first: int = 0,
        last: int | None = None,
        positions: torch.Tensor | None = None,  # [batch, T] rotary positions; default the written slots
        tree_mask: torch.Tensor | None = None,  # [T, W] (or [B, T, W]) bool over the last W <= start+T slots, True = may attend
        captured: dict | None = None,  # {layer l: None}: filled with the hidden state after l layers, [batch, T, hidden]
        place: Placement | None = None,
    ) -> torch.Tensor:
        """Run layers [first, last) on T new tokens written at cache slots start..start+T.

        ``start`` may be a list of host ints (one per row): ragged rows, row b writing at start[b]..start[b]+T
        and seeing its own slots < start[b] plus its block (causal, or ``tree_mask`` [B, T, T] over the block);
        the slots a shorter row does not own are masked out. Rows shorter than T pad their tail: the padded
        queries write KV beyond the row's committed length, which the next write overwrites. ``place`` (a
        :class:`~decoding.model.fast_layers.Placement`) says all of that directly, built once by the caller (the
        loop's step, with device tensors and host ints side by side); ``start`` and ``tree_mask`` are then ignored.

        Returns the hidden state after layer ``last - 1``: [batch, T, hidden]. A token tree passes
        ``tree_mask`` (the ancestor-or-self mask; W > T when earlier tree nodes already sit in the cache before
        ``start``: the W columns are the slots start+T-W .. start+T) and ``positions`` (root position
        + node depth); every slot before those W is the committed prefix and visible to all.
        """
        last = self.num_layers if last is None else last
        if hidden is None and first != 0:
            raise ValueError("input_ids only enter at layer 0; pass hidden for first > 0")
        x = input_ids if hidden is None else hidden
        bsz, t = x.shape[:2]
        device = x.device
        if place is None:
            block = tree_mask if tree_mask is None or tree_mask.dim() == 3 else tree_mask[None]
            if isinstance(start, int):
                place = Placement.at(start, t, bsz, device, block)
                if self.graphs is not None and getattr(cache, "plain", False):  # indexed writes: the static form graphs replay
                    place.start = None
            else:
                place = Placement.ragged(start, t, device, block)
        if positions is None:
            positions = place.slots
        if self.graphs is not None and place.start is None:  # the static form: a captured graph of this shape
            out = self.graphs.run(cache, hidden if input_ids is None else input_ids, positions, place, first, last, captured)
            if out is not None:
                return out
        return self.eager_forward(cache, input_ids if hidden is None else None, hidden, first, last, positions, place, captured)

    def eager_forward(self, cache, input_ids, hidden, first: int, last: int, positions, place: Placement, captured: dict | None):
        """``forward`` run op by op (also the body a CUDA graph captures): ``input_ids`` or ``hidden`` entering layer
        ``first``, placed by ``place``."""
        if hidden is None:
            hidden = self.embed(input_ids)
        mask = place.mask()
        cache.place = place
        cos_sin = self.rotary(hidden, positions)
        out = None
        if self.compiled is not None and first == 0 and last == self.num_layers and not captured:
            out = self.compiled.run(hidden, place, cache, cos_sin)
        if out is not None:
            hidden = out
        elif self.stack is not None:
            hidden = self.stack.run(hidden, first, last, place, mask, cache, cos_sin, captured)
        else:
            for index in range(first, last):
                hidden = self.layers[index](
                    hidden,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=cache,
                    position_embeddings=cos_sin,
                )
                if isinstance(hidden, tuple):  # older transformers return (hidden, ...)
                    hidden = hidden[0]
                if captured is not None and index + 1 in captured:
                    captured[index + 1] = hidden
        if captured is not None and last in captured:
            captured[last] = hidden
        return hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on hidden states from any layer: [batch, T, vocab] float32."""
        head = self.head if self.head is not None and self.lm_head is self.hf_model.lm_head else self.lm_head
        return head(self.norm(hidden)).float()
