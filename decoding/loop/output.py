"""What a generation has committed, its limits and how it ended: the commit rule and the stats record."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from decoding.loop.metrics import GenerationStats, StepRecord, summarize


@dataclass
class Generation:
    token_ids: list[int]  # the new tokens
    finish_reason: str  # "stop" (EOS), "length", or what the caller's on_step returned
    stats: GenerationStats
    steps: list[StepRecord] = field(default_factory=list)


StepCallback = Callable[[list[int]], "str | None"]


class Output:
    """What one generation has committed, its limits and how it ended: the commit rule and the stats record.

    Shared by the loop's :class:`Sequence` and the two-sided runtime (``decoding.schedules.two_sided``). ``commit`` takes
    a step's tokens, cuts them after the first EOS, ends the generation at ``max_new_tokens`` (a step never
    brings more than ``remaining`` tokens: drafts are capped at ``remaining - 1``) and hands the tokens to
    ``on_step``, whose returned string (if any) ends it with that finish reason.

    >>> out = Output(max_new_tokens=8, eos_token_ids=[2])
    >>> out.commit([5]); out.commit([6, 2, 7]); out.new, out.finish_reason
    ([5, 6, 2], 'stop')
    """

    def __init__(self, max_new_tokens: int, eos_token_ids: tuple[int, ...] | list[int] = (), on_step: StepCallback | None = None):
        self.max_new_tokens = max_new_tokens
        self.eos = {int(e) for e in eos_token_ids}
        self.on_step = on_step
        self.new: list[int] = []
        self.steps: list[StepRecord] = []
        self.finish_reason: str | None = None
        self.t_start = self.prefill_s = self.wall_s = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        """Tokens that may still be committed."""
        return self.max_new_tokens - len(self.new)

    def commit(self, tokens: list[int]) -> None:
        """Append a step's tokens (cut after EOS; at the limit the generation ends) and hand them to ``on_step``."""
        for i, tok in enumerate(tokens):
            if tok in self.eos:
                tokens, self.finish_reason = tokens[: i + 1], "stop"
                break
        self.new.extend(tokens)
        if self.finish_reason is None and len(self.new) >= self.max_new_tokens:
            self.finish_reason = "length"
        if self.on_step:
            reason = self.on_step(tokens)
            if reason is not None and self.finish_reason is None:
                self.finish_reason = str(reason)

    def cancel(self, reason: str = "cancelled") -> None:
        """End the generation before its next step (call between steps, from the thread that runs it)."""
        if self.finish_reason is None:
            self.finish_reason = reason

    def result(self) -> Generation:
        stats = summarize(len(self.new), self.wall_s, self.prefill_s, self.steps)
        return Generation(token_ids=list(self.new), finish_reason=self.finish_reason or "length", stats=stats, steps=self.steps)
