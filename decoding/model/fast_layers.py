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
  prefill chunks, causal prefills from slot 0 and float32 use SDPA, as transformers does. The probabilities
  are rounded to the dtype before ``P @ V`` (SDPA keeps them in float32): against float64 that is at most a
  third more error at the attention output, near the dtype's own rounding, and no more error in the model's
  hidden states on average (``tests/decoding/model/test_fast_layers.py``).

Only layer classes whose math is exactly this (Llama, Mistral without a sliding window) and whose
projections carry no bias are run here; ``LayerStack.of`` returns None for anything else and the adapter
calls the modules.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

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
    return torch.matmul(torch.softmax(scores, -1).to(v.dtype), v).view(b, h, t, d)


_DENSE: dict = {}


def _linear(packed: dict, key: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for a 2-D ``x``, by the layer's packed linear ``key`` when it has one (``decoding.model.quant``).

    A narrow input in the kernel's dtype goes straight to torch's packed kernel (what ``PackedLinear.__call__``
    does after reshaping, without the reshapes: the stack keeps its activations 2-D).
    """
    linear = packed.get(key)
    if linear is None:
        return F.linear(x, weight)
    if linear.repeat == 1 and x.shape[0] <= linear.max_rows and x.dtype == linear.scale_zero.dtype:
        if linear.kind == "int4":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, linear.packed, linear.group, linear.scale_zero)
        return torch.ops.aten._weight_int8pack_mm(x, linear.packed, linear.scale_zero)
    return linear(x)


class LayerStack:
    """Runs decoder layers [first, last) of a supported model from their weights (see the module docstring)."""

    def __init__(self, layers, config, dtype: torch.dtype, device: torch.device, quant=None):
        self.layers = layers
        self.quant = quant  # decoding.model.quant.QuantWeights: packed linears of the layers (None: dense)
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.fuse = dtype in SIXTEEN_BIT
        self.attend_own = dtype in SIXTEEN_BIT and torch.device(device).type == "cpu"
        if self.fuse:
            for layer in layers:
                fused_weights(layer)
        # per layer: (cache index, attention scale, the two norms' epsilons), read once
        self.meta = [
            (a.layer_idx, a.scaling, layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon)
            for layer, a in ((layer, layer.self_attn) for layer in layers)
        ]

    @classmethod
    def of(cls, layers, config, dtype: torch.dtype, device: torch.device, quant=None) -> LayerStack | None:
        """The stack for these layers, or None when one of them is not a layer this module computes exactly."""
        if not all(supported(layer, config) for layer in layers):
            return None
        return cls(layers, config, dtype, device, quant)

    def run(self, hidden, first: int, last: int, mask, cache, cos_sin, captured: dict | None = None) -> torch.Tensor:
        """What the modules' forward would return for ``hidden`` [B, T, hidden] through layers [first, last).

        ``mask``: None (one query, or a causal block from slot 0) or bool [B|1, 1, T, S], True = may attend.
        ``captured``: a dict whose keys name layers l in (first, last); each gets the hidden state after l layers.
        A cache whose class says ``plain`` (the adapter's ``KVCache``) with one write position for every row is
        written here by slice; any other cache (ragged rows, sparse views) through its ``update``.
        """
        bsz, t, width = hidden.shape
        n = bsz * t
        hd, nq, nkv = self.head_dim, self.heads * self.head_dim, self.kv_heads * self.head_dim
        cos, sin = cos_sin[0].unsqueeze(1), signed_sin(cos_sin[1]).unsqueeze(1)  # [B, 1, T, D]
        causal = mask is None and t > 1
        own = self.attend_own and t <= ATTEND_MAX and not causal
        hidden_slots = None if mask is None or not own else ~mask.unsqueeze(1)  # [B|1, 1, 1, T, S]
        plain = getattr(cache, "plain", False) and isinstance(cache.cursor, int)
        if plain:
            begin, end = cache.cursor, cache.cursor + t
            if end > cache.max_len:
                raise IndexError(f"KV cache full: writing positions {begin}..{end} of {cache.max_len}")
        hidden = hidden.reshape(n, width)  # activations stay 2-D [B*T, hidden]: the linears take them as they are
        for index in range(first, last):
            layer = self.layers[index]
            cache_index, scale, eps_in, eps_post = self.meta[index]
            packed = self.quant.layers[index] if self.quant is not None else _DENSE
            x = F.rms_norm(hidden, (width,), None, eps_in) * layer.input_layernorm.weight  # LlamaRMSNorm's rounding, bit for bit
            if self.fuse:
                qkv, gate_up = fused_weights(layer)
                qk, v = _linear(packed, "qkv", x, qkv).split([nq + nkv, nkv], dim=-1)
                # q and k rotate together: the same elementwise arithmetic as one by one, in half the operations
                q, k = _rotate(qk.view(bsz, t, -1, hd).transpose(1, 2), cos, sin).split([self.heads, self.kv_heads], dim=1)
            else:
                a = layer.self_attn
                q, k, v = F.linear(x, a.q_proj.weight), F.linear(x, a.k_proj.weight), F.linear(x, a.v_proj.weight)
                q = _rotate(q.view(bsz, t, -1, hd).transpose(1, 2), cos, sin)
                k = _rotate(k.view(bsz, t, -1, hd).transpose(1, 2), cos, sin)
            v = v.view(bsz, t, -1, hd).transpose(1, 2)
            if plain:
                k_all, v_all = cache.k[cache_index], cache.v[cache_index]
                k_all[:, :, begin:end] = k
                v_all[:, :, begin:end] = v
                k, v = k_all[:, :, :end], v_all[:, :, :end]
            else:
                k, v = cache.update(k, v, cache_index)
            if own:
                out = _attend(q, k, v, scale, hidden_slots)
            elif t == 1 and mask is not None:  # one masked query: its heads grouped by kv head, as transformers does
                grouped = q.reshape(bsz, self.kv_heads, -1, hd)
                out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale).reshape(bsz, -1, 1, hd)
            else:
                if causal and k.shape[2] > t:  # a causal block from slot 0 reads only its own slots
                    k, v = k[:, :, :t], v[:, :, :t]
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=causal, enable_gqa=True)
            o_weight = None if "o" in packed else layer.self_attn.o_proj.weight
            hidden = hidden + _linear(packed, "o", out.transpose(1, 2).reshape(n, nq).contiguous(), o_weight)
            x = F.rms_norm(hidden, (width,), None, eps_post) * layer.post_attention_layernorm.weight
            if self.fuse:
                gate, up = _linear(packed, "gate_up", x, gate_up).chunk(2, dim=-1)
            else:
                m = layer.mlp
                gate, up = F.linear(x, m.gate_proj.weight), F.linear(x, m.up_proj.weight)
            down_weight = None if "down" in packed else layer.mlp.down_proj.weight
            hidden = hidden + _linear(packed, "down", F.silu(gate) * up, down_weight)
            if captured is not None and index + 1 in captured:
                captured[index + 1] = hidden.view(bsz, t, width)
        return hidden.view(bsz, t, width)
