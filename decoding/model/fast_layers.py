"""A leaner forward for Llama-style decoder layers: the modules' own math in fewer, larger operations.

Calling transformers' decoder layers costs a few thousand small dispatches per forward; on a CPU, where a
SmolLM2 step is a few dozen milliseconds, that overhead and slow attention kernels are a large share of the step.
``LayerStack`` runs the same layers from their weights:

* RMSNorm, rotary embedding, residuals and the SiLU MLP exactly as transformers computes them: the norm is
  ``F.rms_norm`` without a weight times the weight (LlamaRMSNorm's float32 statistics and its rounding to the
  dtype before the weight, bit for bit), the rotation one ``roll`` against a sin whose first half is negated once
  per forward (:func:`signed_sin`, exact);
* in 16-bit dtypes the q/k/v projections are one matmul and gate/up another (the modules' weights become
  views of the fused matrices, so no memory is added; the products are bit-identical here, each output is
  the same dot product). float32 keeps the separate matmuls, whose results are bit-identical to the
  modules' (a fused float32 matmul may round differently and greedy float32 output must equal AR's);
* up to ``ATTEND_MAX`` queries per row over a 16-bit cache on a CPU (a decoding token, a verification chain or
  tree, ragged batch rows) attend in float32 by two matmuls and a softmax (:func:`_attend`), each KV head's
  cache read once for all its query heads and tokens. The CPU's 16-bit SDPA kernel is slow for few queries
  over a long cache; measured per layer (SmolLM2-135M shapes, one thread, this 2-core host): one query over
  4,096 slots 0.43 ms against 5.3 ms, five 0.95 against 1.6, sixteen 2.5 against 2.8 (at 1,000 slots: 0.15
  against 0.95, 0.27 against 0.40, 0.60 against 0.67); from 32 queries on the two cost the same and
  prefill chunks, causal prefills from slot 0 and float32 use SDPA, as transformers does. ``P @ V`` runs in
  float32 too and only its result is rounded to the dtype (``tests/decoding/model/test_fast_layers.py`` bounds
  the error against float64). Such a stack keeps its KV cache in float32 (:meth:`LayerStack.kv_dtype`): the
  keys and values are the 16-bit projections' values, stored exactly, so attention reads them without
  converting the whole cache twice a layer (0.7 ms of a 8 ms SmolLM2 step at 300 slots), and every result is
  the same bit for bit as over a 16-bit cache; SDPA's blocks convert them back (exactly). Where the CPU kernel
  attends (``kernels/cpu_int4.py``), the cache stays 16-bit: the kernel widens each value as it reads it.

Only layer classes whose math is exactly this (Llama, Mistral without a sliding window) and whose
projections carry no bias are run here; ``LayerStack.of`` returns None for anything else and the adapter
calls the modules.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decoding import accel

LAYER_CLASSES = ("LlamaDecoderLayer", "MistralDecoderLayer")
NORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm")
SIXTEEN_BIT = (torch.bfloat16, torch.float16)
# blocks of up to this many queries per row attend by two float32-score matmuls in 16-bit dtypes on a CPU (wider ones,
# prefill chunks, by SDPA): about where the two cost the same (see the module docstring)
ATTEND_MAX = 16

# layer -> (qkv, gate_up, the data pointers of the five projection weights that are views of them)
_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def supported(layer, config) -> bool:
    """Whether ``layer`` is a decoder layer this module computes exactly as its own forward would."""
    if type(layer).__name__ not in LAYER_CLASSES or getattr(config, "sliding_window", None):
        return False
    a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if a is None or m is None:
        return False
    if any(hasattr(a, n) for n in ("q_norm", "k_norm")) or getattr(config, "hidden_act", None) != "silu":
        return False
    if type(getattr(m, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
        return False
    linears = [getattr(a, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(x, torch.nn.Linear) and x.bias is None for x in linears):
        return False
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    return all(type(n).__name__ in NORM_CLASSES for n in norms)


def _projections(layer) -> tuple:
    a, m = layer.self_attn, layer.mlp
    return (a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj)


def fused_weights(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's [q; k; v] and [gate; up] weights as single matrices, the projections re-pointed at views of them.

    Fused again when a projection's weight no longer is its view (moved to another device, or replaced).
    """
    attn, mlp = _projections(layer)
    got = _FUSED.get(layer)
    if got is not None and got[2] == tuple(mod.weight.data_ptr() for mod in attn + mlp):
        return got[0], got[1]
    with torch.inference_mode(False), torch.no_grad():  # ordinary tensors, usable outside inference mode too
        qkv = torch.cat([mod.weight for mod in attn]).contiguous()
        gate_up = torch.cat([mod.weight for mod in mlp]).contiguous()
        for fused, mods in ((qkv, attn), (gate_up, mlp)):
            row = 0
            for mod in mods:
                rows = mod.weight.shape[0]
                mod.weight = torch.nn.Parameter(fused[row : row + rows], requires_grad=False)
                row += rows
    _FUSED[layer] = (qkv, gate_up, tuple(mod.weight.data_ptr() for mod in attn + mlp))
    return qkv, gate_up


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: ``rotate_half(x) * sin == x.roll(half, -1) * signed_sin(sin)`` exactly.

    ``rotate_half(x) = cat(-x2, x1)`` and ``roll(x) = cat(x2, x1)``; negating a factor of a product is exact in
    floating point, so moving the sign from x onto sin changes no bit, and one roll replaces two slices, a negation
    and a cat per rotation (the sign is paid once per forward instead of once per layer).

    >>> x, cos, sin = torch.randn(2, 3, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    >>> torch.equal(x * cos + torch.cat((-x[..., 4:], x[..., :4]), -1) * sin, _rotate(x, cos, signed_sin(sin)))
    True
    """
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers applies it, ``sin_signed`` from :func:`signed_sin`."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, hidden: torch.Tensor | None) -> torch.Tensor:
    """T queries per row, scores in float32: q [B, H, T, D], k/v [B, KV, S, D] -> [B, H, T, D].

    ``hidden`` is None (every query sees every slot) or bool [B|1, 1, 1, T, S], True where a query may NOT look
    (the inverted attention mask, grouped by KV head). The query heads of a KV head are one matrix
    [G * T, D] against the keys, so the cache is read once per KV head whatever T is.

    >>> q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    >>> mask = torch.ones(2, 1, 3, 5, dtype=torch.bool).tril(2)
    >>> mask[1, ..., 1] = False
    >>> ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    >>> bool(torch.allclose(_attend(q, k, v, 0.3, ~mask[:, None]), ref, atol=1e-6))
    True
    """
    b, h, t, d = q.shape
    kv = k.shape[1]
    scores = torch.matmul(q.reshape(b, kv, h // kv * t, d).float(), k.transpose(-1, -2).float()).mul_(scale)  # [B, KV, G*T, S]
    if hidden is not None:
        scores.view(b, kv, h // kv, t, -1).masked_fill_(hidden, float("-inf"))
    # the weighted sum in float32 too: a 16-bit matmul on this kind of CPU builds a kernel for each new number of
    # slots S (oneDNN's, 0.5 ms at S = 800-1300 against 0.05 ms once built), and decoding meets a new S at every
    # step; converting v costs no more than the 16-bit matmul once built
    return torch.matmul(torch.softmax(scores, -1), v.float()).to(q.dtype).view(b, h, t, d)


_DENSE: dict = {}


def linear(packed, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T`` for a 2-D ``x``, by the packed linear ``packed`` when there is one (``decoding.model.quant``).

    A narrow input in the kernel's dtype goes straight to torch's packed kernel (what ``PackedLinear.__call__``
    does after reshaping, without the reshapes: the stack keeps its activations 2-D). Which kernel runs depends only
    on shapes and dtypes, so a compiled or captured forward takes the same branch every time for a bucket.
    """
    if packed is None:
        return F.linear(x, weight)
    if packed.runs_fast(x, x.shape[0]):
        return packed.fast(x)
    if packed.repeat == 1 and x.shape[0] <= packed.max_rows and x.dtype == packed.scale_zero.dtype:
        if packed.kind == "int4":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed.packed, packed.group, packed.scale_zero)
        return torch.ops.aten._weight_int8pack_mm(x, packed.packed, packed.scale_zero)
    return packed(x)


class Placement:
    """Where a forward's block of T tokens per row goes in the KV cache, and what each of its queries sees.

    Row b's tokens are written at cache slots ``slots[b]`` ([R, T]); its queries see every slot below
    ``prefix[b]`` (text committed before the block, visible to all of them) and, of the W block slots
    ``prefix[b] .. prefix[b] + W``, those ``block[b, i]`` allows (``block`` [R|1, T, W] bool; None: causal,
    W = T, query i sees block slots 0..i). Attention reads slots ``[0, end)``. ``start`` is set when every row
    writes at the same ``start .. start + T`` (a host int: the cache is then written by slice); ``rows`` ([R, 1])
    names the cache rows written when they are not 0..R-1.

    The forward of a step is a function of this structure and the token ids: eager on the host's ints, or, with
    ``end`` the cache's whole length and every field a device tensor, a static-shape graph (``decoding.model.graphs``).

    >>> p = Placement.at(3, 2, batch=1, device="cpu")           # two tokens written at slots 3, 4, causal
    >>> p.slots.tolist(), p.end, p.allowed().int()[0, 0].tolist()
    ([[3, 4]], 5, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    >>> Placement.ragged([1, 2], 1, device="cpu").allowed().int()[:, 0, 0].tolist()   # rows at their own lengths
    [[1, 1, 0], [1, 1, 1]]
    """

    __slots__ = ("slots", "prefix", "end", "block", "start", "rows")

    def __init__(self, slots, prefix, end: int, block=None, start: int | None = None, rows=None):
        self.slots, self.prefix, self.end, self.block, self.start, self.rows = slots, prefix, end, block, start, rows

    @property
    def width(self) -> int:
        """Block slots W each query may see beyond its prefix."""
        return self.slots.shape[1] if self.block is None else self.block.shape[-1]

    @classmethod
    def at(cls, start: int, t: int, batch: int, device, block: torch.Tensor | None = None) -> Placement:
        """Every row writes at ``start .. start + t``; ``block`` [R|1, T, W] with W >= T when W - T earlier block
        nodes already sit in the cache before ``start`` (a token tree fed in parts)."""
        w = t if block is None else block.shape[-1]
        slots = torch.arange(start, start + t, device=device).expand(batch, t)
        prefix = torch.full((batch,), start + t - w, dtype=torch.long, device=device)
        return cls(slots, prefix, start + t, None if block is None else block.to(device), start=start)

    @classmethod
    def ragged(cls, starts, t: int, device, block: torch.Tensor | None = None, end: int | None = None) -> Placement:
        """Row b writes at ``starts[b] .. starts[b] + t`` (a list of host ints, or a LongTensor [R]; give ``end`` with a
        tensor, or its maximum is read back, which stops the host)."""
        if isinstance(starts, torch.Tensor):
            start_t = starts.to(device)
            end = int(start_t.max()) + t if end is None else end
        else:
            end = max(starts) + t if end is None else end
            start_t = torch.as_tensor(starts, dtype=torch.long, device=device)
        slots = start_t[:, None] + torch.arange(t, device=device)
        return cls(slots, start_t, end, None if block is None else block.to(device))

    def allowed(self) -> torch.Tensor:
        """[R|1, 1, T, end] bool, True where a query may attend."""
        t, w = self.slots.shape[1], self.width
        device = self.slots.device
        rel = torch.arange(self.end, device=device)[None, :] - self.prefix[:, None]  # [R, end] slot - prefix
        if self.block is None:
            allowed = rel[:, None, :] <= torch.arange(t, device=device)[None, :, None]
        else:
            block = self.block.expand(rel.shape[0], t, w)
            picked = block.gather(2, rel.clamp(0, w - 1)[:, None, :].expand(-1, t, -1))
            allowed = (rel[:, None, :] < 0) | (picked & (rel < w)[:, None, :])
        return allowed[:, None]

    def mask(self) -> torch.Tensor | None:
        """What the layers take: None where every query sees every read slot or SDPA's causal rule is exact (one
        query at a shared start; a causal block from slot 0), else :meth:`allowed`."""
        if self.start is not None and self.block is None and (self.slots.shape[1] == 1 or self.start == 0):
            return None
        return self.allowed()


@dataclass
class LayerWeights:
    """One decoder layer as the stack computes it: its weights (fused in 16-bit dtypes), packed linears, epsilons."""

    norm_in: torch.Tensor
    norm_post: torch.Tensor
    qkv: tuple  # (q, k, v) weights, or one fused [q; k; v] matrix in a 1-tuple
    gate_up: tuple  # (gate, up), or one fused matrix
    o: torch.Tensor
    down: torch.Tensor
    packed: dict
    eps_in: float
    eps_post: float
    scale: float
    cache_index: int


def layer_weights(layer, fuse: bool, packed: dict) -> LayerWeights:
    a, m = layer.self_attn, layer.mlp
    if fuse:
        qkv, gate_up = fused_weights(layer)
        qkv, gate_up = (qkv,), (gate_up,)
    else:
        qkv, gate_up = (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), (m.gate_proj.weight, m.up_proj.weight)
    return LayerWeights(
        layer.input_layernorm.weight,
        layer.post_attention_layernorm.weight,
        qkv,
        gate_up,
        a.o_proj.weight,
        m.down_proj.weight,
        packed,
        layer.input_layernorm.variance_epsilon,
        layer.post_attention_layernorm.variance_epsilon,
        a.scaling,
        a.layer_idx,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's rounding, bit for bit: ``F.rms_norm`` without a weight (float32 statistics, the result rounded to
    the dtype), times the weight (``rms_norm`` in ``decoding.accel``: ``kernels/cpu_int4.py``'s, in one call, where
    registered)."""
    return F.rms_norm(x, (x.shape[-1],), None, eps) * weight


def add_rms_norm(h: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual sum and its norm: ``(h + d, rms_norm(h + d, weight, eps))`` (``add_rms_norm`` in ``decoding.accel``)."""
    h = h + d
    return h, rms_norm(h, weight, eps)


def layer_step(w: LayerWeights, hidden: torch.Tensor, bsz: int, t: int, cos, sin, shape, attend, norms=None, fused=None) -> torch.Tensor:
    """One decoder layer on activations ``hidden`` [B*T, H] (2-D: the linears take them as they are): the layers'
    own math (the module docstring). ``attend(q, k, v) -> [B, heads, T, D]`` writes the block's keys and values
    and attends (the cache's part, which differs between the eager, compiled and captured forwards); ``shape``:
    (heads, kv_heads, head_dim); ``norms``: :func:`rms_norm` and :func:`add_rms_norm`, or implementations of
    them chosen for the forward (:func:`layer_norms`); ``fused(w, qkv) -> [B*T, heads * head_dim]``, where given
    (:func:`fused_attention`), rotates, writes and attends in one call, with the same bits."""
    norm, add_norm = norms or (rms_norm, add_rms_norm)
    heads, kv_heads, hd = shape
    nq, nkv = heads * hd, kv_heads * hd
    x = norm(hidden, w.norm_in, w.eps_in)
    if fused is not None and len(w.qkv) == 1:  # rotation, cache write and attention in one call, [B*T, nq] back
        attended = linear(w.packed.get("o"), fused(w, linear(w.packed.get("qkv"), x, w.qkv[0])), w.o)
        return _mlp(w, *add_norm(hidden, attended, w.norm_post, w.eps_post))
    if len(w.qkv) == 1:
        qk, v = linear(w.packed.get("qkv"), x, w.qkv[0]).split([nq + nkv, nkv], dim=-1)
        # q and k rotate together: the same elementwise arithmetic as one by one, in half the operations
        q, k = _rotate(qk.view(bsz, t, -1, hd).transpose(1, 2), cos, sin).split([heads, kv_heads], dim=1)
    else:  # float32: separate matmuls, bit-identical to the modules'
        q, k, v = (F.linear(x, wt) for wt in w.qkv)
        q = _rotate(q.view(bsz, t, -1, hd).transpose(1, 2), cos, sin)
        k = _rotate(k.view(bsz, t, -1, hd).transpose(1, 2), cos, sin)
    out = attend(q, k, v.view(bsz, t, -1, hd).transpose(1, 2))
    attended = linear(w.packed.get("o"), out.transpose(1, 2).reshape(bsz * t, nq).contiguous(), w.o)
    return _mlp(w, *add_norm(hidden, attended, w.norm_post, w.eps_post))


def _mlp(w: LayerWeights, hidden: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The layer's SiLU MLP on ``x`` (the normed ``hidden``), added to ``hidden``."""
    if len(w.gate_up) == 1:
        gate, up = linear(w.packed.get("gate_up"), x, w.gate_up[0]).chunk(2, dim=-1)
    else:
        gate, up = (F.linear(x, wt) for wt in w.gate_up)
    return hidden + linear(w.packed.get("down"), F.silu(gate) * up, w.down)


def layer_norms(hidden: torch.Tensor, w: LayerWeights) -> tuple:
    """The implementations of :func:`rms_norm` and :func:`add_rms_norm` for a forward over activations like ``hidden``
    (chosen once, not at each of its 2 x layers calls: ``decoding.accel.pick``)."""
    return (
        accel.pick("rms_norm", rms_norm, hidden, w.norm_in, w.eps_in),
        accel.pick("add_rms_norm", add_rms_norm, hidden, hidden, w.norm_in, w.eps_in),
    )


def attention(q, k, v, scale: float, mask, own: bool, causal: bool, kv_heads: int) -> torch.Tensor:
    """q [B, H, T, D] against k/v [B, KV, S, D]: the float32 two-matmul attention (``own``, :func:`_attend`), or SDPA.

    ``mask``: None, or bool [B|1, 1, T, S] (True = may attend); ``causal``: a block from slot 0 (SDPA's own rule).
    """
    bsz, _, t, hd = q.shape
    if own:
        return accel.dispatch("attend_cpu", _attend_own, q, k, v, scale, mask)
    if k.dtype != q.dtype:  # a float32 cache of 16-bit values (LayerStack.kv_dtype): back to 16 bits, exactly
        k, v = k.to(q.dtype), v.to(q.dtype)
    if t == 1 and mask is not None:  # one masked query: its heads grouped by kv head, as transformers does
        grouped = q.reshape(bsz, kv_heads, -1, hd)
        return F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale).reshape(bsz, -1, 1, hd)
    if causal and k.shape[2] > t:  # a causal block from slot 0 reads only its own slots
        k, v = k[:, :, :t], v[:, :, :t]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=causal, enable_gqa=True)


def attend_own_max() -> int:
    """Queries per row up to which a 16-bit CPU stack attends by :func:`_attend_own` (wider blocks: SDPA). With the CPU
    kernel registered (``kernels/cpu_int4.py``) every block of up to ``accel.FAST_MAX_ROWS`` tokens attends query by
    query, as a decoding token does: a chain's or a token tree's tokens get the bits they get decoded alone."""
    return accel.FAST_MAX_ROWS if accel.has("attend_cpu") else ATTEND_MAX


def _attend_own(q, k, v, scale: float, mask) -> torch.Tensor:
    """:func:`_attend` with ``attention``'s mask (``attend_cpu`` in ``decoding.accel``: ``kernels/cpu_int4.py`` where
    registered, the same arithmetic with each query over its own slots only)."""
    return _attend(q, k, v, scale, None if mask is None else ~mask.unsqueeze(1))


class LayerStack:
    """Runs decoder layers [first, last) of a supported model from their weights (see the module docstring)."""

    def __init__(self, layers, config, dtype: torch.dtype, device: torch.device, quant=None):
        self.layers = layers
        self.quant = quant  # decoding.model.quant.QuantWeights: packed linears of the layers (None: dense)
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.shape = (self.heads, self.kv_heads, self.head_dim)
        self.fuse = dtype in SIXTEEN_BIT
        self.dtype = dtype
        self.attend_own = dtype in SIXTEEN_BIT and torch.device(device).type == "cpu"
        self.weights = [self._weights(i) for i in range(len(layers))]

    def kv_dtype(self, compiled: bool) -> torch.dtype:
        """The dtype of the KV caches this stack attends over. Where 16-bit queries attend in float32 by torch's
        matmuls (the module docstring; a ``compiled`` forward always does), float32, so the cache is not converted
        twice a layer; where the CPU kernel attends (``attend_cpu`` registered), the model's 16-bit dtype: the kernel
        widens each value it reads, exactly, and reads half the bytes (over 800 cached tokens, 30 layers' attention
        of one token took 0.47 ms against 0.84 over a float32 cache). The keys and values written are the 16-bit
        projections' either way, so every result is the same bit for bit."""
        if self.attend_own and (compiled or not accel.has("attend_cpu")):
            return torch.float32
        return self.dtype

    def _weights(self, index: int) -> LayerWeights:
        packed = self.quant.layers[index] if self.quant is not None else _DENSE
        return layer_weights(self.layers[index], self.fuse, packed)

    @classmethod
    def of(cls, layers, config, dtype: torch.dtype, device: torch.device, quant=None) -> LayerStack | None:
        """The stack for these layers, or None when one of them is not a layer this module computes exactly."""
        if not all(supported(layer, config) for layer in layers):
            return None
        return cls(layers, config, dtype, device, quant)

    def refresh(self) -> None:
        """Read the layers' weights again (fused anew where a projection no longer is a view of its fused matrix:
        moved to another device, or replaced)."""
        self.weights = [self._weights(i) for i in range(len(self.layers))]

    def run(self, hidden, first: int, last: int, place: Placement | None, mask, cache, cos_sin, captured: dict | None = None):
        """What the modules' forward would return for ``hidden`` [B, T, hidden] through layers [first, last).

        ``place``: where the block goes (:class:`Placement`); ``mask``: ``place.mask()`` (None: one query, or a
        causal block from slot 0), or for a cache that is not plain, the adapter's mask over what its ``update``
        returns. A cache whose class says ``plain`` (the adapter's ``KVCache``) is written here, by slice where
        every row shares its start, else by index; any other cache (sparse views) through its ``update``.
        ``captured``: a dict whose keys name layers l in (first, last); each gets the hidden state after l layers.
        """
        moved = self.fuse and self.weights and not torch.compiler.is_compiling()
        if moved and fused_weights(self.layers[0])[0] is not self.weights[0].qkv[0]:
            self.refresh()
        plain = getattr(cache, "plain", False) and place is not None
        if plain and place.end > cache.max_len:
            raise IndexError(f"KV cache full: writing positions up to {place.end} of {cache.max_len}")
        if plain:

            def write(index, k, v):
                return write_and_read(cache, index, k, v, place)

        else:

            def write(index, k, v):
                return cache.update(k, v, index)

        return run_layers(self, hidden, first, last, cos_sin, mask, write, captured, (cache, place) if plain else None)


def run_layers(stack: LayerStack, hidden, first: int, last: int, cos_sin, mask, write, captured: dict | None = None, plain=None):
    """Layers [first, last) of ``stack`` on ``hidden`` [B, T, H]: the one copy of the layer math, whoever runs it
    (the eager stack, its compiled form, a captured graph). ``write(cache_index, k, v) -> (keys, values)`` stores
    the block's keys/values [B, KV, T, D] and returns the slots to attend to; ``mask`` as :meth:`LayerStack.run`."""
    bsz, t, width = hidden.shape
    cos, sin = cos_sin[0].unsqueeze(1), signed_sin(cos_sin[1]).unsqueeze(1)  # [B, 1, T, D]
    causal = mask is None and t > 1
    own = stack.attend_own and not causal and t <= attend_own_max()
    hidden = hidden.reshape(bsz * t, width)  # activations stay 2-D [B*T, hidden]
    fused, whole = fused_attention(stack, hidden, plain, cos_sin, mask) if own and plain is not None and stack.fuse else (None, None)
    norms = layer_norms(hidden, stack.weights[first]) if last > first and whole is None else None
    for index in range(first, last):
        w = stack.weights[index]

        def attend(q, k, v, w=w):
            k, v = write(w.cache_index, k, v)
            return attention(q, k, v, w.scale, mask, own, causal, stack.kv_heads)

        if whole is not None:  # the layer in one call (the same bits)
            hidden = whole(w, hidden)
        else:
            hidden = layer_step(w, hidden, bsz, t, cos, sin, stack.shape, attend, norms, fused)
        if captured is not None and index + 1 in captured:
            captured[index + 1] = hidden.view(bsz, t, width)
    return hidden.view(bsz, t, width)


_NO_ROWS = torch.empty(0, dtype=torch.long)
_EVERY_SLOT = torch.empty(0, dtype=torch.bool)


def fused_attention(stack: LayerStack, hidden: torch.Tensor, plain, cos_sin, mask):
    """``(fused, whole)`` for a forward's layers, its arguments prepared once for all of them; ``(None, None)`` where no
    implementation applies (the layers then rotate, write and attend op by op).

    ``fused(w, qkv) -> [B*T, heads * head_dim]`` (:func:`layer_step`'s): a layer's rotation, cache write (at the
    placement of ``plain = (cache, place)``) and attention in one call (``rope_attend`` in ``decoding.accel``:
    ``kernels/cpu_int4.py``'s, where registered and it applies). ``whole(w, hidden)``, where ``layer_cpu`` applies
    too: the whole of :func:`layer_step` in one call; else None."""
    cache, place = plain
    k_all, v_all = _cache_tensors(cache)
    impl = accel.pick("rope_attend", None, hidden, k_all[0])
    if impl is None:
        return None, None
    cos, sin = cos_sin[0].contiguous(), signed_sin(cos_sin[1]).contiguous()  # [B|1, T, D]
    rows = _NO_ROWS if place.rows is None else place.rows.reshape(-1).contiguous()
    slots = place.slots.contiguous()
    allowed = _EVERY_SLOT if mask is None else mask.squeeze(1).contiguous()
    heads, kv_heads, _ = stack.shape
    end = place.end

    def fused(w: LayerWeights, qkv: torch.Tensor) -> torch.Tensor:
        return impl(qkv, cos, sin, k_all[w.cache_index], v_all[w.cache_index], rows, slots, end, allowed, w.scale, heads, kv_heads)

    layer = accel.pick("layer_cpu", None, stack, hidden)
    if layer is None:
        return fused, None

    def whole(w: LayerWeights, hidden: torch.Tensor) -> torch.Tensor:
        return layer(w, hidden, cos, sin, k_all[w.cache_index], v_all[w.cache_index], rows, slots, end, allowed, heads, kv_heads)

    return fused, whole


def _cache_tensors(cache):
    """A plain cache's keys and values, indexed by layer (the adapter's KVCache: [layers, B, KV, S, D] each)."""
    return (cache.k_all, cache.v_all) if hasattr(cache, "k_all") else (cache.k, cache.v)


def write_and_read(cache, index: int, k: torch.Tensor, v: torch.Tensor, place: Placement):
    """Write the block's keys/values [B, KV, T, D] of layer ``index`` where ``place`` says; return the slots read."""
    k_layers, v_layers = _cache_tensors(cache)
    k_all, v_all = k_layers[index], v_layers[index]
    k, v = k.to(k_all.dtype), v.to(v_all.dtype)  # a float32 cache of 16-bit values (LayerStack.kv_dtype); else no-ops
    if place.start is not None:
        k_all[:, :, place.start : place.start + k.shape[2]] = k
        v_all[:, :, place.start : place.start + k.shape[2]] = v
    else:
        # an indexed write, not scatter_: torch's CPU scatter_ into a 16-bit cache took 5 ms a call here (SmolLM2,
        # 16 rows; 300 ms of a batched step over 30 layers), the indexed write 8 us
        rows = place.rows if place.rows is not None else _row_index(k.shape[0], k.device)
        k_all[rows, :, place.slots] = k.transpose(1, 2)  # the indexed dims lead: [B, T, KV, D]
        v_all[rows, :, place.slots] = v.transpose(1, 2)
    return k_all[:, :, : place.end], v_all[:, :, : place.end]


_ROWS: dict = {}


def _row_index(rows: int, device) -> torch.Tensor:
    """[R, 1] = 0..R-1, made once per size and device (a step allocates nothing it can keep)."""
    key = (rows, str(device))
    if key not in _ROWS:
        index = torch.arange(rows, device=device)[:, None]
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            return index  # made by a graph's replay: not a tensor to keep (decoding.model.graphs passes its rows)
        _ROWS[key] = index
    return _ROWS[key]
