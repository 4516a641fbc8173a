"""Triton kernels for the hot spots of speculative decoding.

Each kernel has a torch reference in ``decoding/`` (the function the decoding
code calls on CPU) and a test that the two agree. Tests run the kernels on CPU
through Triton's interpreter (``TRITON_INTERPRET=1``). ``install()`` registers
them with ``decoding.accel`` (decoding/ never imports this package), after
which the decoding code uses them on CUDA tensors automatically; the CLI, the
model workers, Serve replicas and Tune trials call it.
"""

from __future__ import annotations

import importlib.util
import os


def triton_available() -> bool:
    """Triton is importable (it ships for Linux x86-64; elsewhere the torch references run)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton runs kernels in its CPU interpreter (set TRITON_INTERPRET=1 before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_kernel(*tensors) -> bool:
    """Whether to run the Triton kernel on these tensors: on CUDA with Triton, or on CPU under the interpreter.

    Set ``SPECRAY_KERNELS=0`` to force the torch references everywhere.
    """
    if os.environ.get("SPECRAY_KERNELS", "1") == "0" or not triton_available():
        return False
    on_cuda = all(getattr(t, "is_cuda", False) for t in tensors)
    return on_cuda or interpreting()


def _lazy(module: str, attr: str):
    """The kernel function, imported on first call (importing triton costs a second or two)."""

    def call(*args):
        import importlib

        return getattr(importlib.import_module(module), attr)(*args)

    return call


def _cpu_int4_applies() -> bool:
    from kernels.cpu_int4 import cpu_supported

    return cpu_supported()


def install() -> bool:
    """Register the kernels with ``decoding.accel`` so the decoding code uses them where they apply.

    Called once per process by the outer layers (the CLI, model workers, Serve replicas, Tune trials);
    decoding/ itself never imports kernels/. Returns whether Triton is available.
    """
    from decoding import accel

    # the CPU's 4-bit kernel (AVX512-BF16; built on first use): packed linears made from now on run it
    accel.register("int4_linear", _lazy("kernels.cpu_int4", "prepare"), applies=lambda linear: _cpu_int4_applies())
    if _cpu_int4_applies():
        from kernels.cpu_int4 import (
            add_rms_norm,
            attend,
            attend_applies,
            layer,
            layer_applies,
            norm_applies,
            rms_norm,
            rope_attend,
            rope_attend_applies,
        )

        accel.register("attend_cpu", attend, applies=attend_applies)
        accel.register("rope_attend", rope_attend, applies=rope_attend_applies)
        accel.register("layer_cpu", layer, applies=layer_applies)
        accel.register("rms_norm", rms_norm, applies=norm_applies)
        accel.register("add_rms_norm", add_rms_norm, applies=lambda h, d, weight, eps: norm_applies(h, weight, eps))
    if not triton_available():
        return False

    accel.register("chunk_scores", _lazy("kernels.chunk_scores", "chunk_scores_triton"), applies=lambda q, k, c: use_kernel(q, k))
    accel.register(
        "greedy_tree_accept",
        _lazy("kernels.tree_verify", "greedy_tree_accept_triton"),
        applies=lambda tokens, parents, mask, depth, argmax: use_kernel(tokens, argmax) and tokens.shape[1] <= 1024,
    )
    return True
