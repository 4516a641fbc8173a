"""EAD, entropy adaptive decoding (Simonds et al. 2025, "Entropy Adaptive Decoding: Dynamic Model Switching for
Efficient Inference"): a small model generates while the rolling entropy of its predictions stays under a threshold;
above it the large model generates. There is no verification: **EAD is lossy by design**, and says so everywhere a
user sees it (``decoding.methods.Method.lossy``).

In the one loop it is a drafter and a commit rule. The drafter is SpS's (``DraftModelDrafter``: the shipped distilled
draft, ``draft_model``, or the target's first ``draft_layers`` layers) with :class:`EntropySwitch` as its stop rule.
The switch keeps a rolling window of the last ``ead_window`` positions' entropies (nats), each the entropy of the
prediction of the model that wrote the position. The small model writes the next position when the window's mean,
with its own prediction's entropy added, stays at or under ``ead_threshold``; else that position is the large
model's, and the large model's entropy there enters the window instead. The proposal is marked ``unverified``: the
loop commits every draft as it is (``decoding.loop.verify.commit_unverified``) and the target's one forward over
``[pending, drafts]`` is the catch-up the switch needs (the large model's cache gets the small model's tokens), its
last position giving the large model's own token. ``k`` caps the small model's run per step (each run ends with one
large-model token, so the large model writes at least one token in k + 1).

While the window's mean is above the threshold the large model writes and **the small model does not run**: its
entropy at those positions is not needed, and its cache catches up on them in one forward when it next runs. That is
the paper's cost model (the small model's tokens replace the large model's; the small model costs nothing while the
large one writes), and what keeps EAD from paying for a small model it does not use. The large model's entropies
come from the logits its step computed anyway, read only for the positions in the window when the small model is
next asked. A check that fails backs off: where the window is still above the threshold, or the small model is asked
and unsure at once (refused before writing a token), the small model sits out the next 1, 2, 4, ... large-model
positions (at most :data:`MAX_BACKOFF`, back to 1 once it writes), so a small model that is rarely sure, or a large
one that is rarely sure, costs little (each ask costs the small model's catch-up forward, each check an entropy over
the vocabulary). One host read per small-model token (the switch decision) and per large-model entropy read.

>>> rule = EntropySwitch(threshold=1.0, window=2)
>>> sure, unsure = torch.tensor([[9.0, 0, 0, 0]]), torch.zeros(1, 4)     # entropies ~0.004 and log 4 = 1.39 nats
>>> [rule.stop(x, i) for i, x in enumerate([sure, sure, unsure, unsure])]   # the first unsure one is taken: mean 0.70
[False, False, False, True]
>>> rule.large_wrote(unsure[0]), rule.small_may_write()                    # the large model unsure too: it goes on
(None, False)
>>> rule.large_wrote(sure[0]), rule.small_may_write()                      # mean 0.70 again: the small model's turn
(None, True)
>>> rule.large_wrote(unsure[0]), rule.large_wrote(unsure[0]), rule.small_may_write(), rule.wait   # failed again: 2 to sit out
(None, None, False, 2)
>>> rule.large_wrote(sure[0]), rule.small_may_write()                      # mean 0.70, but 1 position still to sit out
(None, False)
>>> rule.large_wrote(sure[0]), rule.small_may_write()
(None, True)
"""

from __future__ import annotations

from collections import deque

import torch

from decoding.builders import builds
from decoding.drafters.base import DecodeState, Proposal
from decoding.drafters.draft_model import DraftModelDrafter
from decoding.drafters.drafting import StopRule

MAX_BACKOFF = 32  # the most large-model positions the small model sits out after failed checks


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy (nats) of the least sure row's prediction: logits [B, V] -> a scalar tensor."""
    return torch.special.entr(logits.float().softmax(-1)).sum(-1).max()


class EntropySwitch(StopRule):
    """EAD's switch as a stop rule: stop (without the token) where the window's mean with the small model's entropy
    would pass ``threshold``; the large model's entropies enter it through :meth:`large_wrote`. The window carries
    over from step to step (``reset`` starts a generation)."""

    keeps_last = False

    def __init__(self, threshold: float, window: int):
        self.threshold = threshold
        self.window: deque[float | torch.Tensor] = deque(maxlen=window)  # a large-model entry: its logits until read
        self.backoff = 1  # large-model positions to wait after the next failed check
        self.wait = 0  # large-model positions left before the small model is asked again

    def _over(self, e: float | None = None) -> bool:
        """Whether the window's mean (with ``e`` added, the oldest entry dropped if full) is above the threshold; the
        large model's entries are read here, so a position that leaves the window unasked is never read."""
        for i, v in enumerate(self.window):
            if isinstance(v, torch.Tensor):
                self.window[i] = float(entropy(v))  # one host read
        kept = list(self.window)[1:] if e is not None and len(self.window) == self.window.maxlen else list(self.window)
        values = kept + ([] if e is None else [e])
        return bool(values) and sum(values) / len(values) > self.threshold

    def stop(self, logits: torch.Tensor, i: int) -> bool:
        e = float(entropy(logits))  # one host read per small-model position
        if self._over(e):
            if i == 0:  # asked and refused before writing anything: ask less often
                self._back_off()
            return True  # the position is the large model's; its entropy enters the window (large_wrote)
        self.window.append(e)
        self.backoff = 1
        return False

    def small_may_write(self) -> bool:
        """Whether the small model is asked for the next position: the window's mean is at or under the threshold
        and no back-off is running."""
        if self.wait > 0:
            return False
        if self._over():
            self._back_off()
            return False
        return True

    def _back_off(self) -> None:
        """A failed check: the small model sits out the next ``backoff`` large-model positions, doubling to MAX_BACKOFF."""
        self.wait, self.backoff = self.backoff, min(2 * self.backoff, MAX_BACKOFF)

    def large_wrote(self, logits: torch.Tensor) -> None:
        """The large model wrote a position from these logits [V] or [B, V] (read when the window is next needed)."""
        self.window.append(logits.reshape(-1, logits.shape[-1]).clone())  # a copy: a graph's output buffer is reused
        self.wait = max(0, self.wait - 1)

    def reset(self) -> None:
        self.window.clear()
        self.backoff, self.wait = 1, 0


class EadDrafter(DraftModelDrafter):
    """SpS's draft model switched by :class:`EntropySwitch`; its drafts are committed unverified (lossy)."""

    name = "ead"
    lossy = True

    def __init__(self, adapter, threshold: float, window: int):
        super().__init__(adapter, EntropySwitch(threshold, window))

    def start(self, state: DecodeState) -> None:
        super().start(state)
        self.threshold.reset()

    def propose(self, state: DecodeState, k: int) -> Proposal:
        if not self.threshold.small_may_write():  # the large model writes on; the small model's cache catches up later
            return Proposal.empty(state.tokens.shape[0], state.tokens.device)
        proposal = super().propose(state, k)
        proposal.unverified = True
        return proposal

    def update(self, state: DecodeState, num_accepted: int) -> None:
        super().update(state, num_accepted)
        if state.last_logits is not None:  # the step's last position is the large model's token
            self.threshold.large_wrote(state.last_logits[0, num_accepted])


@builds("ead")
def _ead_drafter(cfg, target, device, memory) -> EadDrafter:
    from decoding.drafters.artifacts import draft_adapter  # the same small model as SpS's

    return EadDrafter(draft_adapter(cfg, target, device), cfg.ead_threshold, cfg.ead_window)
