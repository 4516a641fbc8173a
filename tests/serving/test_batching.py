"""The replica's batch engine without Ray: requests from many threads share one batch, a request that cannot
start fails alone, a failing step fails the in-flight requests (never hangs) and the engine starts over."""

import threading

import pytest
import torch
from tests_support import generate

from decoding.drafters.ngram import NgramDrafter
from decoding.loop.batch import Sequence
from decoding.loop.prefill import ContextTooLong
from decoding.model.adapter import ModelAdapter
from serving.batching import EngineFailed, EngineLoop

PROMPTS = [[3, 7, 3, 7, 3], [1, 2, 3, 4, 5, 6], [9, 9, 4, 9, 9, 4], [5], [2, 11, 6, 2, 11, 6, 2], [0, 4, 8]]


@pytest.fixture(scope="module")
def target(tiny_model):
    return ModelAdapter(tiny_model)


def submit_all(engine, seqs, timeout=60):
    """Submit from one thread per sequence; wait for every done callback; return {index: error}."""
    errors, finished = {}, threading.Barrier(len(seqs) + 1, timeout=timeout)

    def done(seq, error):
        errors[seq.tag] = error
        threading.Thread(target=finished.wait, daemon=True).start()

    threads = [threading.Thread(target=engine.submit, args=(s, done)) for s in seqs]
    for t in threads:
        t.start()
    finished.wait()
    return errors


def test_threads_share_one_batch_and_get_their_own_tokens(target, one_thread):
    refs = [generate(target, torch.tensor([p]), max_new_tokens=20).token_ids for p in PROMPTS * 4]
    engine = EngineLoop(target, "tiny", max_rows=8)
    try:
        seqs = [
            Sequence(torch.tensor([p]), drafter=NgramDrafter(2, 1) if i % 2 else None, k=3, max_new_tokens=20, tag=i)
            for i, p in enumerate(PROMPTS * 4)
        ]
        errors = submit_all(engine, seqs)
        assert all(e is None for e in errors.values()) and len(errors) == len(seqs)
        assert [s.result().token_ids for s in seqs] == refs
        assert max(r.rows for s in seqs for r in s.steps) == 8  # 24 requests, 8 rows at a time
        assert engine.steps < sum(len(r) for r in refs) // 4  # far fewer steps than tokens: they were batched
    finally:
        engine.close()


def test_a_request_that_cannot_start_fails_alone(target, one_thread):
    engine = EngineLoop(target, "tiny", max_rows=4)
    try:
        good = [Sequence(torch.tensor([p]), k=2, max_new_tokens=12, tag=i) for i, p in enumerate(PROMPTS[:3])]
        bad = Sequence(torch.tensor([PROMPTS[0]]), max_new_tokens=10_000, tag="bad")  # beyond the context
        broken = Sequence(torch.tensor([PROMPTS[1]]), drafter=BrokenStart(2, 1), max_new_tokens=12, tag="broken")  # fails once filled
        errors = submit_all(engine, [*good, bad, broken])
        assert isinstance(errors["bad"], ContextTooLong)
        assert isinstance(errors["broken"], RuntimeError) and broken.finish_reason == "error"
        assert all(errors[i] is None for i in range(3))
        assert [s.result().token_ids for s in good] == [
            generate(target, torch.tensor([p]), max_new_tokens=12).token_ids for p in PROMPTS[:3]
        ]
    finally:
        engine.close()


class BrokenStart(NgramDrafter):
    def start(self, state):
        raise RuntimeError("cannot start")


class FailingDrafter(NgramDrafter):
    """A drafter that breaks on its third proposal: a fault inside a step, as a bug or an OOM would be."""

    def __init__(self):
        super().__init__(2, 1)
        self.calls = 0

    def propose(self, state, k):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("injected fault")
        return super().propose(state, k)


def test_a_failing_step_fails_the_batch_and_the_engine_starts_over(target, one_thread):
    engine = EngineLoop(target, "tiny", max_rows=4)
    try:
        seqs = [Sequence(torch.tensor([p]), k=2, max_new_tokens=200, tag=i) for i, p in enumerate(PROMPTS[:3])]
        seqs.append(Sequence(torch.tensor([PROMPTS[4]]), drafter=FailingDrafter(), k=2, max_new_tokens=200, tag=3))
        errors = submit_all(engine, seqs)
        assert all(isinstance(e, EngineFailed) for e in errors.values()), errors
        assert engine.restarts == 1 and "injected fault" in engine.last_error and engine.alive
        after = Sequence(torch.tensor([PROMPTS[1]]), k=2, max_new_tokens=12, tag="after")
        assert submit_all(engine, [after]) == {"after": None}
        assert after.result().token_ids == generate(target, torch.tensor([PROMPTS[1]]), max_new_tokens=12).token_ids
    finally:
        engine.close()


def test_close_fails_what_is_waiting(target):
    engine = EngineLoop(target, "tiny", max_rows=1)
    engine.close()
    with pytest.raises(EngineFailed, match="shut down"):
        engine.submit(Sequence(torch.tensor([PROMPTS[0]])), lambda s, e: None)
