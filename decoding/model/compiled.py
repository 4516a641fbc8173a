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

from decoding.model.fast_layers import run_layers
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


def _layers(stack, hidden, cos, sin, k_all, v_all, slots, allowed):
    """The whole stack for one row: hidden [1, W, H], cos/sin [1, W, D] (HF rotary's), k_all/v_all [L, 1, KV, M, D],
    slots [1, W] (where the W tokens are written: by index, so no slice starts at a dynamic position), allowed
    bool [1, 1, W, E] (the queries attend to slots < E, the one dynamic size). The layer math is ``fast_layers.run_layers``'s:
    only how the cache is written differs from the eager stack."""
    rows, end = slots.new_zeros(1, 1), allowed.shape[3]

    def write(index, k, v):
        k_all[index][rows, :, slots] = k.transpose(1, 2).to(k_all.dtype)
        v_all[index][rows, :, slots] = v.transpose(1, 2).to(v_all.dtype)
        return k_all[index, :, :, :end], v_all[index, :, :, :end]

    return run_layers(stack, hidden, 0, len(stack.weights), (cos, sin), allowed, write)


class CompiledStack:
    """The whole stack of a ``LayerStack`` for one row, compiled per width bucket (see the module docstring).

    :meth:`run` returns None where the graph does not apply (the caller runs eager). The weights are read once,
    at construction: a model whose weights change afterwards needs a new adapter.
    """

    def __init__(self, stack, dtype: torch.dtype, device: torch.device):
        self.stack = stack
        self.disabled = torch.device(device).type != "cpu"  # built for the CPU's packed kernels and fused loops
        if self.disabled:
            log.warning("specray: compile=True runs the compiled stack on CPUs only; %s runs eager (CUDA: graphs=True)", device)
        self._fn = None
        self.compiled_widths: set[int] = set()

    def run(self, hidden: torch.Tensor, place, cache, cos_sin) -> torch.Tensor | None:
        """The stack's output for ``hidden`` [1, T, H] written where ``place`` says (what ``LayerStack.run`` returns
        over every layer), or None when no compiled graph applies."""
        bsz, t, width = hidden.shape
        wide = bucket(t)
        if self.disabled or bsz != 1 or wide is None or not getattr(cache, "plain", False) or place.start is None:
            return None
        k_all = getattr(cache, "k_all", None)
        if k_all is None or place.start + t > cache.max_len:
            return None
        pad = wide - t
        cos, sin = cos_sin
        slots = place.slots
        allowed = place.allowed()  # [1, 1, T, end]
        end = place.end
        if pad:
            hidden = torch.cat([hidden, hidden.new_zeros(1, pad, width)], 1)
            cos, sin = torch.cat([cos, cos[:, -1:].expand(1, pad, -1)], 1), torch.cat([sin, sin[:, -1:].expand(1, pad, -1)], 1)
            slots = torch.cat([slots, slots.new_full((1, pad), cache.scratch)], 1)  # padding writes the scratch slot
            padded = torch.zeros(1, 1, pad, end, dtype=torch.bool, device=hidden.device)
            padded[..., 0] = True  # padding looks at slot 0 only; no real query looks at the padding
            allowed = torch.cat([allowed, padded], 2)
        torch._dynamo.mark_dynamic(allowed, 3)
        torch._dynamo.mark_dynamic(k_all, 3)
        torch._dynamo.mark_dynamic(cache.v_all, 3)
        try:
            out = self._call(hidden, cos, sin, k_all, cache.v_all, slots, allowed)
        except Exception as e:  # noqa: BLE001 - no compiler, an unsupported op: eager from now on
            log.warning("specray: compiling the layer stack failed (%s: %s); running eager", type(e).__name__, e)
            self.disabled = True
            return None
        self.compiled_widths.add(wide)
        return out[:, :t]

    def _call(self, hidden, cos, sin, k_all, v_all, slots, allowed):
        if self._fn is None:
            _configure()
            self._fn = torch.compile(_layers, fullgraph=True)
        return self._fn(self.stack, hidden, cos, sin, k_all, v_all, slots, allowed)
