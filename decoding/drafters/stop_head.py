"""SpecDec++'s stop rule (Huang et al. 2024, "SpecDec++: Boosting Speculative Decoding via Adaptive Candidate
Lengths"): a small acceptance-prediction head says, per drafted token, how likely the target is to accept it, and
drafting stops once the predicted probability that at least one draft of the chain is rejected passes a threshold.

With a_j the head's predicted acceptance of draft j (given the drafts before it were accepted), the chain stops
after draft i when ``1 - prod_{j <= i} a_j > stop_threshold``; draft i itself is still verified (it was drafted:
verifying it costs a slightly wider target forward, not another draft forward).

The head reads the draft distribution, not the drafter's hidden state (SpecDec++'s head sits on the draft model's
last hidden state): the distribution is what every model drafter hands ``drafting.draft_chain``, so one rule serves
eagle, SpS's draft models, early exit (Kangaroo), SWIFT and DEL alike. Its features (:func:`stop_features`): the
top-4 probabilities, the log-probabilities of the first two, the entropy and the top-1 margin. A head is trained per
drafter (its calibration is the drafter's: ``specray train-drafter --recipe stop --knob source=<drafter>``, label =
the drafter's top-1 agrees with the target's on the self-distillation data) and ships for the bundled model as
``stop-<drafter>`` (``stop-exit`` for the target's own head on intermediate layers: early exit without an adapter,
SWIFT, DEL and SpS over the target's first layers).

>>> head = StopHead(hidden=4)
>>> rule = AcceptanceStop(head, stop_threshold=0.5)
>>> logits = torch.tensor([[4.0, 0.0, 0.0, 0.0, 0.0]])
>>> a = float(torch.sigmoid(head(stop_features(logits))))      # the head's predicted acceptance of this draft
>>> [rule.stop(logits, i) for i in range(3)] == [1 - a**(i + 1) > 0.5 for i in range(3)]
True
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from decoding.drafters.drafting import StopRule
from decoding.errors import ConfigError

NUM_FEATURES = 8
EXIT_SOURCE = "exit"  # the source of a head trained on the target's own head over intermediate layers


def exit_layers(depth: int) -> list[int]:
    """The intermediate layers an ``exit`` head learns from (pooled: the drafts of early exit, SWIFT and DEL come from
    anywhere in the upper half).

    >>> exit_layers(30)
    [15, 20, 25, 28]
    """
    return sorted({max(1, min(depth - 1, x)) for x in (depth // 2, 2 * depth // 3, 5 * depth // 6, depth - 2)})


def stop_features(logits: torch.Tensor) -> torch.Tensor:
    """Features of draft distributions for the stop head: logits [N, V] (any float dtype, -inf allowed) -> [N, 8]
    float32: p1..p4 (the top-4 probabilities), log p1 / 10, log p2 / 10 (clamped at -30), the entropy / 10 and p1 - p2.

    >>> stop_features(torch.tensor([[0.0, 0.0, float("-inf")]]))[0, :4].tolist()
    [0.5, 0.5, 0.0, 0.0]
    """
    logp = logits.float().log_softmax(-1)
    top = logp.topk(min(4, logp.shape[-1]), dim=-1).values
    if top.shape[-1] < 4:
        top = torch.cat([top, top.new_full((*top.shape[:-1], 4 - top.shape[-1]), float("-inf"))], -1)
    p = top.exp()  # [N, 4]
    entropy = torch.special.entr(logp.exp()).sum(-1, keepdim=True)  # entr(0) = 0
    logs = top[..., :2].clamp(min=-30.0) / 10
    return torch.cat([p, logs, entropy / 10, p[..., :1] - p[..., 1:2]], -1)


class StopHead(nn.Module):
    """The acceptance-prediction head: features of a draft distribution -> the logit of P(the target accepts it).
    A two-layer MLP of ``hidden`` units (8 * hidden + hidden + hidden + 1 parameters: 161 for hidden=16).

    ``source`` names the drafter whose acceptance it learned (recorded in its artifact; training loads it,
    ``training.objectives.stop_rows``). Its recipe (``stop``) and the config's way to it (``with_stop_head``) live in
    ``decoding.drafters.artifacts``, which reads artifacts.
    """

    def __init__(self, hidden: int = 16, source: str = EXIT_SOURCE, target_hf=None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(NUM_FEATURES, hidden), nn.SiLU(), nn.Linear(hidden, 1))
        self.source = source
        object.__setattr__(self, "target_hf", target_hf)  # the target it was built for (not a submodule: never saved)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [N, 8] -> [N]
        return self.net(features.to(self.net[0].weight.dtype)).squeeze(-1)


class AcceptanceStop(StopRule):
    """SpecDec++'s rule over a :class:`StopHead` (see the module docstring); Kangaroo's ``confidence_threshold`` too.

    One host read per drafted token (the stop decision), as the confidence threshold has.
    """

    keeps_last = True

    def __init__(self, head: StopHead, stop_threshold: float, confidence_threshold: float = 0.0):
        if not 0.0 < stop_threshold < 1.0:
            raise ConfigError("stop_threshold", f"must be in (0, 1), got {stop_threshold}")
        self.head = copy.deepcopy(head).float().eval()  # tiny: run in float32 whatever the target's dtype
        self.threshold = stop_threshold
        self.confidence_threshold = confidence_threshold
        self._all: torch.Tensor | None = None  # [B] predicted P(every draft of the chain so far is accepted)

    @torch.inference_mode()
    def accept_probability(self, logits: torch.Tensor) -> torch.Tensor:
        """[B] the head's predicted acceptance of the drafts these logits [B, V] give."""
        return torch.sigmoid(self.head(stop_features(logits)))

    def stop(self, logits: torch.Tensor, i: int) -> bool:
        a = self.accept_probability(logits)
        self._all = a if i == 0 or self._all is None else self._all * a
        return bool((1.0 - self._all > self.threshold).all())


def chain_drafting(drafter) -> bool:
    """Whether the drafter drafts chains (a stop rule applies); trees are grown whole."""
    return getattr(drafter, "tree", None) is None


def stop_source_of(drafter) -> str:
    """The shipped stop head's source that fits a drafter (``stop-<source>``): its trained artifact, else ``exit``."""
    name = getattr(drafter, "name", "")
    if name == "eagle":
        return "eagle"
    if name == "kangaroo":
        return f"kangaroo-l{drafter.exit_layer}"
    adapter = getattr(drafter, "adapter", None)
    if name == "sps" and adapter is not None and type(adapter.hf_model).__name__ == "DraftNet":
        return "distill"  # the distilled draft (a draft from the target's first layers reads the target's own head)
    return EXIT_SOURCE
