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

import torch

from decoding.model.fast_layers import LayerStack


class KVCache:
    """Preallocated keys/values per layer, written by position.

    ``k[l]``/``v[l]``: [batch, kv_heads, max_len, head_dim]. ``length`` is the
    number of committed positions (the caller moves it to roll back).
    ``cursor`` is where the current forward writes; the adapter sets it: an int
    (every row writes at the same slots) or a LongTensor [batch] (ragged rows,
    each writing at its own length; see :meth:`ModelAdapter.forward`).

    A batch of sequences shares one cache: :meth:`rows` is a view of the first
    R rows (what a batched forward writes), :meth:`row` a one-row view with its
    own ``length`` (what a sequence's drafter and verdict see). Views share the
    storage; nothing is copied.
    """

    def __init__(self, num_layers, batch, kv_heads, head_dim, max_len, dtype, device):
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.length = 0
        self.cursor = 0

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def rows(self, begin: int, end: int | None = None) -> KVCache:
        """A view of rows [begin, end) (storage shared, ``length`` 0)."""
        end = begin + 1 if end is None else end
        view = KVCache.__new__(KVCache)
        view.k = [k[begin:end] for k in self.k]
        view.v = [v[begin:end] for v in self.v]
        view.max_len, view.length, view.cursor = self.max_len, 0, 0
        return view

    def row(self, index: int) -> KVCache:
        return self.rows(index, index + 1)

    def update(self, key, value, layer_idx, *args, **kwargs):  # called by HF attention
        # key/value: [batch, kv_heads, T, head_dim]
        t = key.shape[2]
        if isinstance(self.cursor, torch.Tensor):  # ragged rows: row b writes at cursor[b] .. cursor[b]+T
            end = self._ragged_end
            rows, slots = self._ragged_rows, self._ragged_slots  # [B, 1], [B, T]: row b writes at slots[b]
            # an indexed write, not scatter_: torch's CPU scatter_ into a 16-bit cache took 5 ms a call here (SmolLM2,
            # 16 rows; 300 ms of a batched step over 30 layers), the indexed write 8 us
            self.k[layer_idx][rows, :, slots] = key.transpose(1, 2)  # the indexed dims lead: [B, T, H, D]
            self.v[layer_idx][rows, :, slots] = value.transpose(1, 2)
            return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]
        end = self.cursor + t
        if end > self.max_len:
            raise IndexError(f"KV cache full: writing positions {self.cursor}..{end} of {self.max_len}")
        self.k[layer_idx][:, :, self.cursor : end] = key
        self.v[layer_idx][:, :, self.cursor : end] = value
        return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]

    def set_ragged_cursor(self, starts: torch.Tensor, t: int) -> int:
        """Prepare a ragged write of T tokens per row at ``starts`` [B]; returns the slots attention reads (max start + T)."""
        end = int(starts.max()) + t
        if end > self.max_len:
            raise IndexError(f"KV cache full: writing positions up to {end} of {self.max_len}")
        k0 = self.k[0]
        slots = starts.to(k0.device)[:, None] + torch.arange(t, device=k0.device)  # [B, T]
        self._ragged_rows = torch.arange(k0.shape[0], device=k0.device)[:, None]
        self._ragged_slots = slots
        self._ragged_end = end
        self.cursor = starts
        return end

    def compact(self, start: int, slots: torch.Tensor) -> None:
        """Move the KV at ``slots`` ([m], each >= start, any order: they are read before anything is written) to the
        contiguous slots start..start+m, every layer.

        After a tree verification the accepted branch sits at scattered tree slots; this makes it the
        committed prefix again (one gather + copy per layer; a no-op when the branch is already in place).
        """
        m = slots.shape[0]
        if m == 0 or bool((slots == torch.arange(start, start + m, device=slots.device)).all()):
            return
        for buf in (*self.k, *self.v):
            buf[:, :, start : start + m] = buf.index_select(2, slots.to(buf.device))

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.max_len:
            raise IndexError(f"rollback to {length} outside 0..{self.max_len}")
        self.length = length

    def export(self, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [begin, end), every layer, on the CPU: two [L, B, H, end - begin, D] tensors."""
        return (torch.stack([k[:, :, begin:end] for k in self.k]).cpu(), torch.stack([v[:, :, begin:end] for v in self.v]).cpu())

    def write(self, begin: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store what :meth:`export` returned at positions begin.. (every layer); the cache then ends after them."""
        end = begin + keys.shape[3]
        if not 0 <= begin <= self.length or end > self.max_len:
            raise IndexError(f"writing positions {begin}..{end} into a cache of {self.length} (capacity {self.max_len})")
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.k[layer][:, :, begin:end] = k.to(self.k[layer].device)
            self.v[layer][:, :, begin:end] = v.to(self.v[layer].device)
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

    def __init__(self, hf_model, num_layers: int | None = None, fast: bool = True):
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

    @property
    def implementation(self) -> str:
        """Which forward runs the layers ("layers": decoding.model.fast_layers, "modules": transformers', plus the packed
        weights' kind, e.g. "layers-q4-gguf"); timings measured with one do not hold for another, so the
        calibration caches are kept per implementation."""
        name = "layers" if self.stack is not None else "modules"
        return f"{name}-{self.quant.implementation}" if self.stack is not None and self.quant is not None else name

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(self.num_layers, batch, self.kv_heads, self.head_dim, max_len, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self,
        cache: KVCache,
        start: int,
        input_ids: torch.Tensor | None = None,  # [batch, T]
        hidden: torch.Tensor | None = None,  # [batch, T, hidden] entering layer `first`
        first: int = 0,
        last: int | None = None,
        positions: torch.Tensor | None = None,  # [batch, T] rotary positions; default start + arange(T)
        tree_mask: torch.Tensor | None = None,  # [T, W] (or [B, T, W]) bool over the last W <= start+T slots, True = may attend
        captured: dict | None = None,  # {layer l: None}: filled with the hidden state after l layers, [batch, T, hidden]
    ) -> torch.Tensor:
        """Run layers [first, last) on T new tokens written at cache slots start..start+T.

        ``start`` may be a LongTensor [batch]: ragged rows, row b writing at start[b]..start[b]+T and seeing
        its own slots < start[b] plus its block (causal, or ``tree_mask`` [B, T, T] over the block); the
        slots a shorter row does not own are masked out. Rows shorter than T pad their tail: the padded
        queries write KV beyond the row's committed length, which the next write overwrites.

        Returns the hidden state after layer ``last - 1``: [batch, T, hidden]. A token tree passes
        ``tree_mask`` (the ancestor-or-self mask; W > T when earlier tree nodes already sit in the cache
        before ``start``: the W columns are the slots start+T-W .. start+T) and ``positions`` (root position
        + node depth); every slot before those W is the committed prefix and visible to all.
        """
        last = self.num_layers if last is None else last
        if hidden is None:
            if first != 0:
                raise ValueError("input_ids only enter at layer 0; pass hidden for first > 0")
            hidden = self.embed(input_ids)
        bsz, t = hidden.shape[:2]
        if isinstance(start, torch.Tensor):
            start = start.to(hidden.device)
            if positions is None:
                positions = start[:, None] + torch.arange(t, device=hidden.device)
            end = cache.set_ragged_cursor(start, t)
            mask = self._ragged_mask(start, t, end, tree_mask, hidden.device)
        else:
            if positions is None:
                positions = torch.arange(start, start + t, device=hidden.device).unsqueeze(0).expand(bsz, t)
            mask = self._mask(start, t, tree_mask, hidden.device)
            cache.cursor = start
        cos_sin = self.rotary(hidden, positions)
        if self.stack is not None:
            hidden = self.stack.run(hidden, first, last, mask, cache, cos_sin, captured)
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

    @staticmethod
    def _mask(start: int, t: int, tree_mask, device):
        """None where SDPA's own rule is exact (one query, or causal from slot 0)."""
        if tree_mask is None and (t == 1 or start == 0):
            return None
        block = tree_mask.to(device) if tree_mask is not None else torch.ones(t, t, dtype=torch.bool, device=device).tril_()
        if block.dim() == 2:
            block = block[None]  # [1 or B, T, W]
        prefix = torch.ones(*block.shape[:2], start + t - block.shape[-1], dtype=torch.bool, device=device)
        return torch.cat([prefix, block], dim=-1)[:, None]  # [1 or B, 1, T, start+T]

    @staticmethod
    def _ragged_mask(start: torch.Tensor, t: int, end: int, tree_mask, device):
        """[B, 1, T, end] bool: row b's query i sees slots < start[b] and its own block by the causal or tree rule.

        >>> ModelAdapter._ragged_mask(torch.tensor([1, 2]), 2, 4, None, "cpu")[:, 0].int().tolist()
        [[[1, 1, 0, 0], [1, 1, 1, 0]], [[1, 1, 1, 0], [1, 1, 1, 1]]]
        """
        rel = torch.arange(end, device=device)[None, :] - start[:, None]  # [B, end] slot - start
        query = torch.arange(t, device=device)[None, :, None]  # [1, T, 1]
        if tree_mask is None:
            allowed = rel[:, None, :] <= query
        else:
            block = tree_mask.to(device)
            block = block.expand(start.shape[0], t, t) if block.dim() == 2 else block
            inside = (rel >= 0) & (rel < t)
            picked = block.gather(2, rel.clamp(0, t - 1)[:, None, :].expand(-1, t, -1))
            allowed = (rel[:, None, :] < 0) | (picked & inside[:, None, :])
        return allowed[:, None]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on hidden states from any layer: [batch, T, vocab] float32."""
        head = self.head if self.head is not None and self.lm_head is self.hf_model.lm_head else self.lm_head
        return head(self.norm(hidden)).float()
