"""EAD, entropy adaptive decoding (Simonds et al. 2025, "Entropy Adaptive Decoding: Dynamic Model Switching for
Efficient Inference"): a small model generates while the rolling entropy of its predictions stays under a threshold;
above it the large model generates. There is no verification: **EAD is lossy by design**, and says so everywhere a
user sees it (``decoding.methods.Method.lossy``).

In the one loop it is a drafter and a commit rule. The drafter is SpS's (``DraftModelDrafter``: the shipped distilled
draft, ``draft_model``, or the target's first ``draft_layers`` layers) with :class:`EntropySwitch` as its stop rule:
each of the small model's predictions adds its entropy (nats) to a rolling window of the last ``ead_window``; while
the window's mean stays at or under ``ead_threshold`` the small model's token is taken, and at the first position
where it rises above, the chain ends without that token. The proposal is marked ``unverified``: the loop commits
every draft as it is (``decoding.loop.verify.commit_unverified``) and the target's one forward over
``[pending, drafts]`` is the catch-up the switch needs (the large model's cache gets the small model's tokens), its
last position giving the large model's own token. While the entropy stays high the small model proposes nothing and
the step is a plain target step. ``k`` caps the small model's run per step (each run ends with one large-model token,
so the large model writes at least one token in k + 1).

The window holds the small model's entropy at every position it predicted (the large model's positions included);
the position after a full run of k, which the large model takes, is not predicted by the small model and is not in
it. One host read per small-model token (the switch decision).

>>> rule = EntropySwitch(threshold=1.0, window=2)
>>> sure, unsure = torch.tensor([[9.0, 0, 0, 0]]), torch.zeros(1, 4)     # entropies ~0.004 and log 4 = 1.39 nats
>>> [rule.stop(x, i) for i, x in enumerate([sure, sure, unsure, unsure, sure, sure])]
[False, False, False, True, False, False]
"""

from __future__ import annotations

from collections import deque

import torch

from decoding.builders import builds
from decoding.drafters.base import DecodeState, Proposal
from decoding.drafters.draft_model import DraftModelDrafter
from decoding.drafters.drafting import StopRule


class EntropySwitch(StopRule):
    """EAD's switch as a stop rule: stop (without the token) where the rolling mean entropy of the small model's
    predictions passes ``threshold``; the window carries over from step to step (``reset`` starts a generation)."""

    keeps_last = False

    def __init__(self, threshold: float, window: int):
        self.threshold = threshold
        self.window: deque[float] = deque(maxlen=window)

    def stop(self, logits: torch.Tensor, i: int) -> bool:
        entropy = torch.special.entr(logits.float().softmax(-1)).sum(-1).max()  # nats; the least sure row decides
        self.window.append(float(entropy))  # one host read per small-model position
        return sum(self.window) / len(self.window) > self.threshold

    def reset(self) -> None:
        self.window.clear()


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
        proposal = super().propose(state, k)
        proposal.unverified = True
        return proposal


@builds("ead")
def _ead_drafter(cfg, target, device, memory) -> EadDrafter:
    from decoding.drafters.artifacts import draft_adapter  # the same small model as SpS's

    return EadDrafter(draft_adapter(cfg, target, device), cfg.ead_threshold, cfg.ead_window)
