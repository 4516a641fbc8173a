"""Triton kernels for the hot spots of speculative decoding.

Each kernel has a torch reference in ``decoding/`` (the function the decoding
code calls on CPU) and a test that the two agree. Tests run the kernels on CPU
through Triton's interpreter (``TRITON_INTERPRET=1``); on CUDA tensors the
decoding code calls the kernel automatically through ``dispatch``.
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
