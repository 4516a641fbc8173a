"""Token ids -> text deltas for streaming, with stop sequences.

The concatenated deltas always equal ``decode(all ids)`` cut before the first
stop sequence, which is what in-process generation returns. A delta holds back
(a) a trailing incomplete UTF-8 character (the tokenizer decodes it as U+FFFD)
and (b) a suffix that could still become a stop sequence.

>>> words = {1: "Hello", 2: " wor", 3: "ld", 4: ".", 5: " Bye"}
>>> a = TextAssembler(lambda ids: "".join(words[i] for i in ids), stops=["ld."])
>>> [a.feed([1]), a.feed([2]), a.feed([3]), a.feed([4])]
['Hello', ' wor', '', '']
>>> (a.stopped, a.text, a.finish())
(True, 'Hello wor', '')
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class TextAssembler:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str] | None = None):
        self.decode = decode
        self.stops = [s for s in (stops or []) if s]
        self.ids: list[int] = []
        self.text = ""  # the output text so far (cut at a stop sequence once one appeared)
        self.emitted = 0  # characters of ``text`` already handed out
        self.stopped = False  # a stop sequence appeared: generation should end

    def feed(self, new_ids: list[int]) -> str:
        """Add a step's tokens; return the text that is now safe to send."""
        if self.stopped:
            return ""
        self.ids.extend(int(i) for i in new_ids)
        text = self.decode(self.ids)
        if self.stops:
            hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
            if hits:
                self.text = text[: min(hits)]
                self.stopped = True
                return self._emit(len(self.text))
        self.text = text
        safe = len(text)
        while safe > self.emitted and text[safe - 1] == REPLACEMENT:
            safe -= 1
        safe -= self._stop_prefix_len(text[:safe])
        return self._emit(safe)

    def finish(self) -> str:
        """The rest of the text once generation is over."""
        return self._emit(len(self.text))

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop sequence."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta
