"""What an actor entry's replica (serving.placed_worker.PlacedWorker) does when a model worker is lost, without Ray: the
decoder's workers are a script of states. A restarting worker is waited for (the generation that lost it before its
first token runs again); one dead for good, a compiled graph, or a restart longer than RESTART_WAIT_S makes the
replica exit (Serve replaces it). The real thing, on a Ray cluster over HTTP: tests/cluster/test_serve_placed.py."""

from __future__ import annotations

import asyncio

import pytest

from actors.driver import WorkerDied
from serving import placed_worker as placement
from serving.placed_worker import PlacedWorker


class FakeDecoder:
    def __init__(self, states: list[dict], transport: str = "calls", fail_runs: int = 0):
        self.states, self.transport, self.fail_runs = list(states), transport, fail_runs
        self.executor = type("Executor", (), {"transport": transport})()
        self.placement = {r: {"pid": 1} for r in ("replica", "target", "draft")}
        self.refreshed = self.runs = 0

    def worker_states(self, timeout_s: float = 2.0) -> dict:
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def refresh_placement(self) -> None:
        self.refreshed += 1

    def run(self, seq) -> None:
        self.runs += 1
        if self.runs <= self.fail_runs:
            seq.delivered += seq.per_run
            raise WorkerDied("the target worker died during generation after 0 generated tokens")


class Seq:
    def __init__(self, per_run: int = 0):
        self.delivered, self.per_run, self.tag = 0, per_run, "req"


def replica(dec: FakeDecoder, monkeypatch) -> PlacedWorker:
    w = object.__new__(PlacedWorker)  # no Serve, no placement group: only the loss handling is under test
    w.name, w.dec, w._exiting, w._restart_seen, w.exits = "e/pearl", dec, False, None, []
    monkeypatch.setattr(w, "_exit", lambda err: w.exits.append(str(err)))
    monkeypatch.setattr(placement.time, "sleep", lambda s: None)
    return w


ALIVE = {"target": "alive", "draft": "alive"}
RESTARTING = {"target": "restarting", "draft": "alive"}


def test_a_generation_lost_before_its_first_token_runs_again_once_the_worker_is_back(monkeypatch):
    dec = FakeDecoder([RESTARTING, RESTARTING, {"target": "busy", "draft": "alive"}, ALIVE], fail_runs=1)
    w = replica(dec, monkeypatch)
    w._run(dec, Seq())
    assert dec.runs == 2 and dec.refreshed == 1 and w.exits == [] and w._restart_seen is None


def test_a_generation_that_delivered_tokens_fails_and_the_next_waits_for_the_restart(monkeypatch):
    dec = FakeDecoder([RESTARTING, RESTARTING, ALIVE], fail_runs=1)
    w = replica(dec, monkeypatch)
    with pytest.raises(WorkerDied):
        w._run(dec, Seq(per_run=3))  # its tokens are out: it ends as a 503, not run twice
    assert w._lost(WorkerDied("the target worker died")) and w._restart_seen is not None and w.exits == []
    w._run(dec, Seq())
    assert dec.runs == 2 and dec.refreshed == 1 and w._restart_seen is None


@pytest.mark.parametrize("states,transport", [({"target": "dead", "draft": "alive"}, "calls"), (RESTARTING, "compiled")])
def test_a_worker_dead_for_good_or_a_compiled_graph_makes_the_replica_exit(monkeypatch, states, transport):
    dec = FakeDecoder([states], transport=transport)
    w = replica(dec, monkeypatch)
    assert not w._lost(WorkerDied("the target worker died"))
    assert len(w.exits) == 1
    with pytest.raises(WorkerDied):
        w._check_workers()


def test_a_restart_longer_than_the_wait_makes_the_replica_exit(monkeypatch):
    dec = FakeDecoder([RESTARTING])
    w = replica(dec, monkeypatch)
    monkeypatch.setattr(placement, "RESTART_WAIT_S", 0.0)
    assert w._lost(WorkerDied("the draft worker died"))
    with pytest.raises(WorkerDied, match="not back within"):
        w._await_workers()
    assert len(w.exits) == 1


def test_the_health_check_passes_while_workers_compute_or_restart(monkeypatch):
    dec = FakeDecoder([{"target": "busy", "draft": "alive"}, RESTARTING])
    w = replica(dec, monkeypatch)
    asyncio.run(w.check_health())
    assert w._restart_seen is None
    asyncio.run(w.check_health())  # restarting: noted, still healthy (Serve would otherwise replace the replica mid-restart)
    assert w._restart_seen is not None and w.exits == []
