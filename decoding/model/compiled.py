"""``SpecConfig.compile``: a target's whole layer stack for one row, compiled by ``torch.compile`` per width bucket.

The eager stack (``decoding.model.fast_layers``) dispatches about 1,300 small operations per one-token step; on a
CPU that is a third of a SmolLM2 step. Compiled, the 30 layers become one graph: the norms, rotary embedding,
softmax and residuals fused into a few generated C++ kernels per layer, the packed and dense matmuls called
from it, one guard check per step. Measured on this repository's 2-core host (SmolLM2-135M, q4, one thread, a
one-token step at 300 cached tokens): 22.3 ms eager, 16.9 ms compiled, for about 2.7 minutes of compiling per
width bucket the first time (with inductor's pool of compile workers, which small hosts now skip). Hence opt-in.

Shapes: the row's width T (tokens fed) is padded to the next bucket of ``WIDTHS`` and each bucket is its own
static graph, compiled on first use; the cache length is dynamic (one graph serves every position and every
cache size). A padded token writes its KV past the row's tokens (slots the next step overwrites; the bucket
must fit the cache, else the step runs eager) and nobody attends to it. What does not fit a graph runs
eager: several rows, sparse cache views, partial layer ranges, captured hidden states, widths above 32.

The compiled graphs live in torch's caches under ``$SPECRAY_HOME/compile`` (``TORCHINDUCTOR_CACHE_DIR``, unless
set): a later process re-traces the stack (seconds) but does not recompile its kernels. Compiling needs a C++
compiler; where it fails the stack warns once and stays eager.

Numerics: the same arithmetic as the eager path with float32 attention scores (16-bit dtypes) or float32
throughout; the generated kernels may round a 16-bit intermediate differently from eager (not bit-identical to
the modules, which only the eager float32 path promises). Greedy output with the compiled path on is the
compiled target's own: AR and every speculative method run the same graphs, and float32 greedy output of a
speculative method equals AR's (``tests/decoding/model/test_compiled.py``).
"""

from __future__ import annotations

import logging
import os
import threading

import torch
import torch.nn.functional as F

from decoding.model.fast_layers import SIXTEEN_BIT, fused_weights, signed_sin
from decoding.model.quant import GROUP
from decoding.paths import specray_home

WIDTHS = (1, 2, 4, 8, 16, 32)
_CONFIG_LOCK = threading.Lock()
log = logging.getLogger("specray")


def bucket(t: int) -> int | None:
    """The compiled width a block of ``t`` tokens runs at (None: wider than every bucket).

    >>> [bucket(t) for t in (1, 2, 3, 5, 17, 33)]
    [1, 2, 4, 8, 32, None]
    """
    return next((w for w in WIDTHS if w >= t), None)


def _configure() -> None:
    """Point torch's compile caches at $SPECRAY_HOME/compile (unless the user set them)."""
    with _CONFIG_LOCK:
        if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(specray_home() / "compile")
        if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ and (os.cpu_count() or 1) <= 4:
            # a small host compiles in this process: inductor's pool of worker processes costs more than it saves
            # (a 2-layer model's width-1 graph: 91 s with the pool against 23 s without on the 2-core host, loaded)
            import torch._inductor.config as inductor_config

            inductor_config.compile_threads = 1
        # one code object serves every width bucket of every stack in the process: allow a graph per bucket and stack
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)


def _linear(x: torch.Tensor, dense: torch.Tensor, packed) -> torch.Tensor:
    """x [N, K] @ W.T: torch's packed kernel when the width takes it (decided while tracing: N is static), else dense."""
    if packed is not None and packed.repeat == 1 and x.shape[0] <= packed.max_rows and x.dtype == packed.scale_zero.dtype:
        if packed.kind == "int4":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed.packed, GROUP, packed.scale_zero)
        return torch.ops.aten._weight_int8pack_mm(x, packed.packed, packed.scale_zero)
    return F.linear(x, dense)


def _forward_row(hidden, cos, sin, k_all, v_all, slots, hidden_slots, layers, shape):
    """Layers of one row: hidden [T, H], cos/sin [T, D] (sin signed, ``fast_layers.signed_sin``), k_all/v_all
    [L, 1, KV, M, D], slots [T] (E - T .. E: where the T tokens are written, by index so that no slice starts
    at a dynamic position), hidden_slots bool [T, E] (True: the query may not look there): the tokens attend to
    slots < E. ``layers``: per layer (weights, packed linears, epsilons, scale);
    ``shape``: (heads, kv_heads, head_dim, fused). Only E and M vary between calls (dynamic)."""
    heads, kv_heads, hd, fused = shape
    t, width = hidden.shape
    end = hidden_slots.shape[1]
    nq, nkv, group = heads * hd, kv_heads * hd, heads // kv_heads
    for index, (w, packed, eps_in, eps_post, scale) in enumerate(layers):
        x = F.rms_norm(hidden, (width,), None, eps_in) * w["norm_in"]
        if fused:
            qk, v = _linear(x, w["qkv"], packed.get("qkv")).split([nq + nkv, nkv], dim=-1)
        else:
            qk, v = torch.cat([F.linear(x, w["q"]), F.linear(x, w["k"])], dim=-1), F.linear(x, w["v"])
        qk = qk.view(t, heads + kv_heads, hd).transpose(0, 1)  # [H + KV, T, D]
        qk = qk * cos + qk.roll(hd // 2, -1) * sin
        q, k = qk.split([heads, kv_heads], dim=0)
        k_all[index, 0].index_copy_(1, slots, k)
        v_all[index, 0].index_copy_(1, slots, v.view(t, kv_heads, hd).transpose(0, 1))
        keys, values = k_all[index, 0, :, :end], v_all[index, 0, :, :end]  # [KV, S, D]
        scores = torch.matmul(q.reshape(kv_heads, group * t, hd).float(), keys.transpose(-1, -2).float()) * scale
        scores = scores.view(kv_heads, group, t, -1).masked_fill(hidden_slots, float("-inf")).view(kv_heads, group * t, -1)
        out = torch.matmul(torch.softmax(scores, -1).to(values.dtype), values)  # [KV, G*T, D]
        out = out.view(heads, t, hd).transpose(0, 1).reshape(t, nq)
        hidden = hidden + _linear(out, w["o"], packed.get("o"))
        x = F.rms_norm(hidden, (width,), None, eps_post) * w["norm_post"]
        if fused:
            gate, up = _linear(x, w["gate_up"], packed.get("gate_up")).chunk(2, dim=-1)
        else:
            gate, up = F.linear(x, w["gate"]), F.linear(x, w["up"])
        hidden = hidden + _linear(F.silu(gate) * up, w["down"], packed.get("down"))
    return hidden


class CompiledStack:
    """The whole stack of a ``LayerStack`` for one row, compiled per width bucket (see the module docstring).

    :meth:`run` returns None where the graph does not apply (the caller runs eager). The weights are read once,
    at construction: a model whose weights change afterwards needs a new adapter.
    """

    def __init__(self, stack, dtype: torch.dtype, device: torch.device):
        self.stack = stack
        self.disabled = torch.device(device).type != "cpu"  # built for the CPU's packed kernels and fused loops
        if self.disabled:
            log.warning("specray: compile=True runs the compiled stack on CPUs only; %s runs eager", device)
        self.shape = (stack.heads, stack.kv_heads, stack.head_dim, stack.fuse)
        self.layers = [self._layer(i, layer) for i, layer in enumerate(stack.layers)]
        self._fn = None
        self.compiled_widths: set[int] = set()

    def _layer(self, index: int, layer):
        a, m = layer.self_attn, layer.mlp
        w = {"norm_in": layer.input_layernorm.weight, "norm_post": layer.post_attention_layernorm.weight}
        w["o"], w["down"] = a.o_proj.weight, m.down_proj.weight
        if self.stack.fuse:
            w["qkv"], w["gate_up"] = fused_weights(layer)
        else:
            w.update(q=a.q_proj.weight, k=a.k_proj.weight, v=a.v_proj.weight, gate=m.gate_proj.weight, up=m.up_proj.weight)
        packed = self.stack.quant.layers[index] if self.stack.quant is not None else {}
        eps = (layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon)
        return w, packed, eps[0], eps[1], a.scaling

    def run(self, hidden: torch.Tensor, mask, cache, cos_sin) -> torch.Tensor | None:
        """The stack's output for ``hidden`` [1, T, H] written at ``cache.cursor`` (what ``LayerStack.run`` returns over
        every layer), or None when no compiled graph applies."""
        bsz, t, width = hidden.shape
        wide = bucket(t)
        if self.disabled or bsz != 1 or wide is None or not getattr(cache, "plain", False) or not isinstance(cache.cursor, int):
            return None
        begin, k_all = cache.cursor, getattr(cache, "k_all", None)
        if k_all is None or begin + wide > cache.max_len:
            return None
        end = begin + wide
        pad = wide - t
        h = hidden[0]
        cos, sin = cos_sin[0][0], signed_sin(cos_sin[1])[0]  # [T, D]
        if pad:
            h = torch.cat([h, h.new_zeros(pad, width)])
            cos, sin = torch.cat([cos, cos[-1:].expand(pad, -1)]), torch.cat([sin, sin[-1:].expand(pad, -1)])
        if wide == 1:
            hidden_slots = torch.zeros(1, end, dtype=torch.bool, device=hidden.device)  # one query sees every slot
        else:
            allowed = torch.zeros(wide, end, dtype=torch.bool, device=hidden.device)
            if mask is None:  # a causal block
                allowed[:t, : begin + t] = torch.ones(t, begin + t, dtype=torch.bool, device=hidden.device).tril(begin)
            else:  # [1, 1, T, begin + T]
                allowed[:t, : begin + t] = mask[0, 0]
            allowed[t:, 0] = True  # padding looks at slot 0 only; no real query looks at the padding
            hidden_slots = ~allowed
        torch._dynamo.mark_dynamic(hidden_slots, 1)
        torch._dynamo.mark_dynamic(k_all, 3)
        torch._dynamo.mark_dynamic(cache.v_all, 3)
        try:
            slots = torch.arange(begin, end, device=hidden.device)
            out = self._call(h, cos, sin, k_all, cache.v_all, slots, hidden_slots)
        except Exception as e:  # noqa: BLE001 - no compiler, an unsupported op: eager from now on
            log.warning("specray: compiling the layer stack failed (%s: %s); running eager", type(e).__name__, e)
            self.disabled = True
            return None
        self.compiled_widths.add(wide)
        return out[:t][None]

    def _call(self, h, cos, sin, k_all, v_all, slots, hidden_slots):
        if self._fn is None:
            _configure()
            self._fn = torch.compile(_forward_row, fullgraph=True)
        return self._fn(h, cos, sin, k_all, v_all, slots, hidden_slots, self.layers, self.shape)


def compilable(dtype: torch.dtype) -> bool:
    """Dtypes the compiled stack runs (16-bit for speed, float32 for exactness checks)."""
    return dtype in SIXTEEN_BIT or dtype == torch.float32
