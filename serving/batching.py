"""One decoding batch per model in a replica: a thread steps it, request handlers feed it.

:class:`EngineLoop` owns a ``decoding.loop.batch.Batch`` over one target model (one
model and dtype). Handlers :meth:`~EngineLoop.submit` a ``Sequence`` and a
``done`` callback; the loop thread admits waiting sequences between steps
(up to ``max_rows`` in the batch at once, the rest wait in order), runs a
step (chunks of the joining prompts within ``prefill_budget`` tokens, then
one decoding step of every row: a long prompt never stalls the others for
its whole prefill), and calls ``done(seq, error)`` when a sequence finishes
(EOS, length, a stop sequence or a cancellation reported by its
``on_step``), fails alone (its prompt does not fit, its drafter fails to
start) or is failed with the batch. An exception inside a step fails every in-flight
sequence with :class:`EngineFailed` (the handlers answer 503) and the loop
starts over with an empty batch: no request hangs and the replica is not left
wedged.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from decoding.decoder import GenerationLost
from decoding.loop.batch import Batch, Sequence
from decoding.loop.prefill import PREFILL_CHUNK

log = logging.getLogger("ray.serve")

DoneCallback = Callable[[Sequence, Exception | None], None]


class EngineFailed(GenerationLost):
    """The batch a sequence was in failed; the sequence was ended (the request may be retried)."""


class EngineLoop:
    def __init__(
        self,
        target,
        name: str,
        *,
        max_rows: int = 32,
        max_step_tokens: int | None = None,
        cost=None,
        prefill_budget: int | None = PREFILL_CHUNK,
    ):
        self.target, self.name = target, name
        self.max_rows, self.max_step_tokens, self.cost = max_rows, max_step_tokens, cost
        self.prefill_budget = prefill_budget
        self.batch = self._new_batch()
        self._waiting: collections.deque[tuple[Sequence, DoneCallback]] = collections.deque()
        self._done: dict[int, DoneCallback] = {}
        self._cond = threading.Condition()
        self._closed = False
        self.restarts = 0
        self.steps = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"specray-engine-{name}", daemon=True)
        self._thread.start()

    def _new_batch(self) -> Batch:
        return Batch(
            self.target, max_rows=self.max_rows, max_step_tokens=self.max_step_tokens, cost=self.cost, prefill_budget=self.prefill_budget
        )

    # ---- what handlers call ---------------------------------------------------------
    def submit(self, seq: Sequence, done: DoneCallback) -> None:
        with self._cond:
            if self._closed:
                raise EngineFailed(f"the {self.name} engine is shut down")
            self._waiting.append((seq, done))
            self._cond.notify()

    def set_cost(self, cost) -> None:
        """Install the forward-cost model k=auto needs (measured in the background after start; until then rows
        draft their configured k)."""
        self.cost = cost
        self.batch.cost = cost

    def stats(self) -> dict:
        with self._cond:
            waiting = len(self._waiting)
        return {
            "rows": len(self.batch.rows),
            "joining": len(self.batch.joining),
            "waiting": waiting,
            "steps": self.steps,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "cost_model": self.cost is not None,
        }

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # ---- the loop thread ------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._waiting and not len(self.batch):
                    self._cond.wait()
                if self._closed:
                    pending = list(self._waiting) + [(s, self._done.pop(id(s))) for s in self.batch.rows + self.batch.joining]
                    self._waiting.clear()
                    break
                admit = []
                while self._waiting and len(self.batch) + len(admit) < self.max_rows:
                    admit.append(self._waiting.popleft())
            try:
                for seq, done in admit:
                    self._admit(seq, done)
                if len(self.batch):
                    finished = self.batch.step()
                    self.steps += 1
                    for seq in finished:
                        self._finish(seq, seq.error)  # error: its drafter failed to start (it failed alone)
            except Exception as e:  # a bug or a resource error inside a step: fail the batch, start over
                log.exception("specray: the %s engine failed a step; failing its %d sequences and restarting", self.name, len(self.batch))
                self.last_error = f"{type(e).__name__}: {e}"
                self.restarts += 1
                failed = self.batch.rows + self.batch.joining
                self.batch = self._new_batch()
                for seq in failed:
                    seq.cancel("error")
                    self._finish(seq, EngineFailed(f"the batch failed ({type(e).__name__}); the request was ended"))
        for seq, done in pending:
            done(seq, EngineFailed(f"the {self.name} engine shut down"))

    def _admit(self, seq: Sequence, done: DoneCallback) -> None:
        """Queue one sequence in the batch (the steps prefill it); a sequence that cannot join fails alone."""
        try:
            self.batch.add(seq)
        except Exception as e:  # its prompt does not fit, its drafter runs alone, ...
            if not isinstance(e, ValueError):
                log.exception("specray: a sequence failed to join the %s engine", self.name)
            done(seq, e)
            return
        self._done[id(seq)] = done

    def _finish(self, seq: Sequence, error: Exception | None) -> None:
        done = self._done.pop(id(seq), None)
        if done is not None:
            done(seq, error)
