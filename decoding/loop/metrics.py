"""Per-step records and the figures computed from them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepRecord:
    drafted: int  # tokens proposed this step (j)
    accepted: int  # drafts accepted (m); the step commits m + 1 tokens (fewer only at EOS)
    draft_s: float
    verify_s: float
    rows: int = 1  # sequences that shared this step's target forward
    k: int = -1  # the draft budget the step gave this row (k=auto: the goodput choice); -1 = not recorded
    catch_up_s: float | None = None  # of draft_s, the drafter's catch-up on committed tokens (None: not measured)
    looked: bool = False  # the drafts were prompt lookup's, a model drafter's row's fallback (decoding.loop.batch.Batch._look)


@dataclass
class GenerationStats:
    new_tokens: int
    wall_s: float
    tokens_per_s: float
    target_forwards: int  # including the prefill forward that produced the first token
    mean_accepted_tokens: float  # tokens committed per decoding target forward (tau); 1.0 for AR
    acceptance_rate: float  # accepted drafts / proposed drafts (0 when nothing was proposed)
    per_position_acceptance: list[float] = field(default_factory=list)  # P(draft i accepted | proposed), i = 1..k
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def per_position_acceptance(steps: list[StepRecord]) -> list[float]:
    """Fraction of steps whose draft at position i was accepted, among steps that proposed position i.

    >>> per_position_acceptance([StepRecord(3, 1, 0, 0), StepRecord(2, 2, 0, 0)])
    [1.0, 0.5, 0.0]
    """
    depth = max((s.drafted for s in steps), default=0)
    out = []
    for i in range(depth):
        proposed = [s for s in steps if s.drafted > i]
        out.append(sum(s.accepted > i for s in proposed) / len(proposed))
    return out


def summarize(new_tokens: int, wall_s: float, prefill_s: float, steps: list[StepRecord]) -> GenerationStats:
    drafted = sum(s.drafted for s in steps)
    accepted = sum(s.accepted for s in steps)
    return GenerationStats(
        new_tokens=new_tokens,
        wall_s=wall_s,
        tokens_per_s=new_tokens / wall_s if wall_s > 0 else 0.0,
        target_forwards=len(steps) + 1,
        mean_accepted_tokens=(accepted + len(steps)) / len(steps) if steps else 1.0,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        per_position_acceptance=per_position_acceptance(steps),
        prefill_s=prefill_s,
        draft_s=sum(s.draft_s for s in steps),
        verify_s=sum(s.verify_s for s in steps),
    )


def chi_square_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Pearson goodness of fit of observed ``counts`` against probabilities ``probs`` (same length).

    Bins whose expected count is below ``min_expected`` are pooled into one bin,
    as the chi-square approximation needs. Returns the p-value (small = the
    counts do not follow ``probs``).

    >>> round(chi_square_pvalue([50, 50], [0.5, 0.5]), 3)
    1.0
    >>> chi_square_pvalue([90, 10], [0.5, 0.5]) < 1e-9
    True
    """
    import torch

    counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
    probs = torch.as_tensor(probs, dtype=torch.float64).flatten()
    n = counts.sum()
    expected = probs / probs.sum() * n
    if bool(((expected == 0) & (counts > 0)).any()):
        return 0.0  # a draw the distribution forbids
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    df = obs.numel() - 1
    if df < 1:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux >= 4.0: ``5`` to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float | None:
    """VmHWM of this process in MiB (the peak since the last ``reset_peak_rss``), None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None
