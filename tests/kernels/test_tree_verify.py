"""The greedy tree verification kernel agrees with its torch reference on random trees (Triton's CPU interpreter).

TRITON_INTERPRET must be set before triton is imported, so the comparison runs in a fresh interpreter.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

COMPARE = textwrap.dedent(
    """
    import torch
    from decoding.trees.shapes import Tree, tree_mask
    from decoding.loop.verify import greedy_tree_accept, verify_tree_greedy
    import kernels
    from decoding import accel
    from kernels import use_kernel
    from kernels.tree_verify import greedy_tree_accept_triton

    assert kernels.install() and "greedy_tree_accept" in accel.registered()
    dispatched = lambda *a: accel.dispatch("greedy_tree_accept", greedy_tree_accept, *a)  # what verify_tree_greedy calls

    gen = torch.Generator().manual_seed(0)
    assert use_kernel(torch.zeros(1)), "the interpreter should make the kernel eligible on CPU"
    checked = deep = 0
    for case in range(60):
        t = int(torch.randint(1, 40, (1,), generator=gen))
        bsz = int(torch.randint(1, 4, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)]
        tree = Tree.from_parents(parents)
        vocab = 3  # small, so long matching paths happen
        tokens = torch.randint(0, vocab, (bsz, t), generator=gen)
        argmax = torch.randint(0, vocab, (bsz, t), generator=gen)
        if case % 3 == 0:  # per-row parents and masks ([B, T], [B, T, T])
            rows = [[-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)] for _ in range(bsz)]
            par = torch.tensor(rows)
            args = (tokens, par, tree_mask(par), torch.stack([Tree.from_parents(r).depth for r in rows]), argmax)
        else:
            args = (tokens, tree.parents, tree.mask, tree.depth, argmax)
        ref = greedy_tree_accept(*args)
        got = greedy_tree_accept_triton(*args)
        assert torch.equal(ref, got), (case, ref.tolist(), got.tolist())
        assert torch.equal(dispatched(*args), ref)
        deep += int((args[3].expand(bsz, t).gather(1, ref[:, None]) >= 2).sum())
        checked += bsz
    # the whole verdict through the kernel
    tree = Tree.from_paths([[0], [1], [1, 0]])
    logits = torch.nn.functional.one_hot(torch.tensor([[5, 0, 6, 1]]), 10).float()
    v = verify_tree_greedy(torch.tensor([[9, 4, 5, 6]]), tree.parents, tree.mask, tree.depth, logits)  # through accel
    assert v.path.tolist() == [[0, 2, 3]] and v.tokens.tolist() == [[5, 6, 1]]
    assert deep > 10, deep  # the random trees did accept paths of depth >= 2
    print("ok", checked)
    """
)


def test_kernel_matches_reference_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", SPECRAY_KERNELS="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", COMPARE], env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")
