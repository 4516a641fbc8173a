"""What a soak runs: the load's mix, the plan (duration, streams, faults and their timing) and the record of each
fault."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

FAULTS = ("replica_kill", "worker_kill", "node_removal", "redis_restart", "slow_reader", "queue_fill")
FAULT_WHAT = {
    "replica_kill": "SIGKILL the engine's Serve replica (ModelServer)",
    "worker_kill": "SIGKILL a model worker (target or draft, in turn) of the actor entry",
    "node_removal": "remove the node of the actor entry's replica, target or draft (in turn); a new node joins after recovery",
    "redis_restart": "stop redis-server (SIGTERM) while a `specray registry put` publishes, start it again on the same port",
    "slow_reader": "a client that stalls on a stream (4 KiB receive buffer, no reads) then reads it slowly; one that hangs up",
    "queue_fill": "a burst of plain requests past the ingress's admission limit (max_queued_requests)",
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the requests ------------------------------------------------------------------------------------------------
@dataclass
class Mix:
    """What the load sends: each model's share (actor entries capped at ``placed_max_inflight`` streams each, as their
    generations run one at a time), the streamed, chat and seeded-sampling shares, and the ``max_tokens`` values."""

    models: dict  # name -> weight
    placed: tuple = ()  # the actor entries among them
    placed_max_inflight: int = 2
    stream_share: float = 0.5
    chat_share: float = 0.5
    sampled_share: float = 0.3
    temperature: float = 0.8
    top_p: float = 0.95
    max_tokens: tuple = (16, 32, 48)


# ---- the plan ------------------------------------------------------------------------------------------------
@dataclass
class SoakPlan:
    duration_s: float = 1800.0
    min_streams: int = 8
    max_streams: int = 16
    rate: float = 1.0  # Poisson arrivals per second, on top of the floor
    request_timeout_s: float = 180.0
    schedule: list = field(default_factory=list)  # [(t_s, fault name)], in time order
    fault_gap_s: float = 10.0  # a fault waits for the previous one's recovery (bounded) plus this gap
    overlap: bool = False  # faults at their planned times, without waiting for the previous one's recovery
    recovery_wait_s: float = 120.0
    window_s: float = 60.0  # p99 windows before and after a fault
    sample_s: float = 5.0
    progress_s: float = 30.0
    node_return_s: float = 10.0  # after a node removal's recovery, a new node joins (the spare again)
    redis_down_s: float = 3.0
    burst_over: int = 16  # queue_fill: requests sent at once beyond the admission limit
    max_queued_requests: int = 24
    slow_stall_s: float = 15.0
    slow_max_tokens: int = 96
    slow_prompt_idx: int = 0  # a prompt whose completion runs to slow_max_tokens (no early end): the slow and the hung-up stream
    seed: int = 0


def even_schedule(faults: list[str], repeats: int, start_s: float, end_s: float) -> list[tuple[float, str]]:
    """Each fault ``repeats`` times, interleaved, evenly spread over [start_s, end_s).

    >>> even_schedule(["a", "b"], 2, 100, 500)
    [(100.0, 'a'), (200.0, 'b'), (300.0, 'a'), (400.0, 'b')]
    """
    n = len(faults) * repeats
    if n == 0:
        return []
    step = (end_s - start_s) / n
    return [(round(start_s + i * step, 1), faults[i % len(faults)]) for i in range(n)]


def parse_schedule(text: str, known=FAULTS) -> list[tuple[float, str]]:
    """``"60:replica_kill,150:queue_fill"`` -> [(60.0, 'replica_kill'), (150.0, 'queue_fill')]; ValueError naming the bad item.

    >>> parse_schedule("90:queue_fill, 30:replica_kill")
    [(30.0, 'replica_kill'), (90.0, 'queue_fill')]
    """
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        t, sep, name = item.partition(":")
        try:
            when = float(t)
        except ValueError:
            raise ValueError(f"{item!r} is not SECONDS:FAULT") from None
        if not sep or name not in known or when < 0:
            raise ValueError(f"{item!r} is not SECONDS:FAULT with a fault among {', '.join(known)}")
        out.append((when, name))
    return sorted(out)


@dataclass
class FaultRecord:
    name: str
    index: int
    t_planned: float
    t_inject: float | None = None
    t_end: float | None = None  # when its own action ended (the kill: at once; the restart, the burst, the slow read: later)
    target: str = ""
    detail: dict = field(default_factory=dict)
    error: str | None = None
