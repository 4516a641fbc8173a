"""The Triton chunk-scoring kernel agrees with the torch reference (CPU, Triton's interpreter, in a subprocess).

TRITON_INTERPRET must be set before triton is imported, so the comparison runs in
a fresh interpreter; the test skips cleanly where triton is not installed.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kernels import triton_available

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import torch
    from decoding.model.kv_views import chunk_scores, chunk_scores_reference
    import kernels
    from decoding import accel
    from kernels import use_kernel
    from kernels.chunk_scores import chunk_scores_triton

    assert kernels.install() and "chunk_scores" in accel.registered()

    assert use_kernel(torch.zeros(1)), "the interpreter should route CPU tensors to the kernel"
    gen = torch.Generator().manual_seed(0)
    cases = [  # (B, Hq, Hkv, Tq, N, D, chunk, dtype)
        (1, 9, 3, 1, 96, 64, 16, torch.float32),   # SmolLM2's heads, one query
        (2, 4, 2, 3, 40, 8, 5, torch.float32),     # several queries, a chunk size that is not a power of two
        (1, 2, 2, 1, 24, 12, 8, torch.bfloat16),   # head size not a power of two, bfloat16 keys
    ]
    for bsz, hq, hkv, tq, n, d, c, dtype in cases:
        q = torch.randn(bsz, hq, tq, d, generator=gen).to(dtype)
        k = torch.randn(bsz, hkv, n + 7, d, generator=gen).to(dtype)[:, :, :n]  # a strided view, like the cache's
        ref = chunk_scores_reference(q, k, c)
        got = chunk_scores_triton(q, k, c, block_c=3)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(chunk_scores(q, k, c), ref, rtol=1e-4, atol=1e-3)  # the dispatching entry point
        wrong = chunk_scores_reference(q, k.roll(1, dims=2), c)  # the comparison can fail
        assert not torch.allclose(got, wrong, rtol=1e-4, atol=1e-3)
    print("OK", len(cases))
    """
)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_kernel_matches_reference_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", SPECRAY_KERNELS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "OK 3" in proc.stdout, proc.stdout + proc.stderr


def test_reference_is_used_without_the_interpreter():
    import torch

    from decoding.model.kv_views import chunk_scores, chunk_scores_reference

    q, k = torch.randn(1, 2, 1, 4), torch.randn(1, 1, 8, 4)
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert torch.equal(chunk_scores(q, k, 4), chunk_scores_reference(q, k, 4))
