"""DEL (Zarch et al. 2025, "DEL: Context-Aware Dynamic Exit Layer for Efficient Self-Speculative Decoding"): early-exit
self-speculation whose exit layer and draft length are chosen per step from what each candidate exit would have
achieved on the text so far.

Tracking. After every step the hidden states of the committed positions (pending and the accepted drafts) exist at
every candidate exit layer at no extra forward: below the step's exit the drafter's own forward kept them (the early
exit drafter's ``shallow`` hook), at the exit they are the drafts' hidden states, above it the target's verification
captured them (``feature_layers``). Each candidate's prediction there is the target's norm and head on them; it is
scored against the committed tokens (whether a draft from that exit would have been accepted, given the ones before).
To keep this cheap the head is applied to a shortlist only, the target's own top :data:`SHORTLIST` tokens at each
position (the target's token is among them; a candidate whose full-vocabulary argmax lies outside the shortlist is
counted as agreeing when the target's token tops the shortlist: an upper bound, exact whenever the candidate's
argmax is in the target's top 64). Agreement counts decay by :data:`DECAY` per step (context-aware), from a
pessimistic prior (no acceptance until seen).

Choosing. Per step the exit E and the draft length j in 0..k maximise the expected committed tokens per unit of cost
(tokens per layer, DEL's heuristic, with the LM head counted in layers' worth of weights):
``(1 + a_E + ... + a_E^j) / ((j + 1) E + j h + (L - E) + h)`` against AR's ``1 / (L + h)``; j = 0 is a plain
step (the drafter draws nothing), so DEL falls back to AR wherever no exit pays. One host read per step (the
agreement estimates), and the confidence stop's one per drafted token.

Tracking costs about 0.5 ms a step on this CPU's SmolLM2 (5% of a step), paid whether or not DEL drafts; where no exit
pays it is pure loss. So a drafting step tracks always, and plain steps track ever more rarely while no exit pays: the
first plain step, then after 4, 8, 16 and at most :data:`MAX_TRACK_EVERY` plain steps (its verification then captures
the candidate exits; the others capture nothing), back to one in :data:`TRACK_EVERY` once DEL drafts. At one in 4 it
cost 2.8% of AR's speed over 8 Spec-Bench prompts where DEL never drafted (the other drafters cost 0.5-1.1%).

>>> choose_exit([0.2, 0.99], [20, 26], depth=30, head=8.0, k=4)    # a deep exit that nearly always agrees pays
(26, 4)
>>> choose_exit([0.2, 0.85], [20, 26], depth=30, head=8.0, k=4)    # below that a plain step is cheaper per token
(26, 0)
"""

from __future__ import annotations

import torch

from decoding.builders import builds
from decoding.drafters.base import DecodeState, Proposal
from decoding.drafters.draft_model import model_depth
from decoding.drafters.early_exit import EarlyExitDrafter
from decoding.drafters.swift import layer_costs
from decoding.errors import ConfigError

SHORTLIST = 64  # the target's top tokens a candidate exit's head is applied to
DECAY = 0.95  # per tracked step, of the agreement counts
TRACK_EVERY = 4  # plain steps track one in this many after a drafting step (drafting steps track always)
MAX_TRACK_EVERY = 32  # ... and, while no exit pays, one in twice as many after each tracked one, up to this many


def candidate_exits(depth: int) -> list[int]:
    """Every other layer from the middle up, and the one below the top.

    >>> candidate_exits(30)
    [15, 17, 19, 21, 23, 25, 27, 28]
    """
    return sorted(set(range(max(1, depth // 2), depth - 1, 2)) | {depth - 2}) if depth > 2 else [1]


def choose_exit(alphas: list[float], exits: list[int], depth: int, head: float, k: int) -> tuple[int, int]:
    """(exit layer, draft length) maximising expected tokens per cost (module docstring); ``head`` in layers' worth of
    weights. Draft length 0 (a plain target step) wins ties."""
    ar = depth + head
    best, choice = 1.0 / ar, (exits[-1], 0)
    for alpha, exit_layer in zip(alphas, exits, strict=True):
        tokens = 1.0
        for j in range(1, k + 1):
            tokens += alpha**j
            cost = (j + 1) * exit_layer + j * head + (depth - exit_layer) + head
            if tokens / cost > best:
                best, choice = tokens / cost, (exit_layer, j)
    return choice


class DynamicExitDrafter(EarlyExitDrafter):
    """The early-exit drafter with its exit layer and draft length chosen per step (see the module docstring)."""

    name = "del"

    def __init__(self, exits: list[int], confidence_threshold: float = 0.0):
        super().__init__(exits[-1], confidence_threshold)
        self.exits = list(exits)
        self.head_layers = None  # the LM head's weights in layers' worth (from the target's config, at start)
        self.feature_layers = ()
        self.hits = self.seen = None  # [C] decayed agreement counts per candidate (on the target's device)
        self.kept: dict[int, list[torch.Tensor]] = {}  # this step's hidden states below the exit, per candidate
        self.draft_hidden: list[torch.Tensor] = []  # this step's exit-layer hidden states [B, 1, H] per fed token
        self.drafting = False
        self.plain_steps = 0  # plain steps so far
        self.wait, self.interval = 0, TRACK_EVERY  # plain steps before the next tracked one; the spacing after it
        self.choices: list[tuple[int, int]] = []  # (exit, draft length) per step, for stats and tests

    def start(self, state: DecodeState) -> None:
        c = len(self.exits)
        self.hits = torch.zeros(c, device=state.tokens.device)
        self.seen = torch.zeros(c, device=state.tokens.device)
        self.choices, self.plain_steps, self.wait, self.interval = [], 0, 0, TRACK_EVERY
        layer, head = layer_costs(state.target)
        self.head_layers = head / layer
        self._plain_step()

    def _plain_step(self) -> None:
        """Until the next proposal, a step is plain: a tracked one's verification captures every candidate exit, an
        untracked one's nothing (the loop skips ``propose`` at k = 0, so nothing of a drafting step may carry over)."""
        self.drafting, self.kept, self.draft_hidden = False, {}, []
        self.feature_layers = tuple(self.exits) if self.wait == 0 else ()

    def alphas(self) -> list[float]:
        """Each candidate's estimated acceptance (one host read)."""
        return (self.hits / (self.seen + 1.0)).tolist()

    def shallow(self, t, cache, slot, ids):
        below = [e for e in self.exits if e < self.exit_layer]
        captured = dict.fromkeys(below) if below else None
        h = t.forward(cache, slot, input_ids=ids, last=self.exit_layer, captured=captured)
        for e in below:
            self.kept.setdefault(e, []).append(captured[e])
        self.draft_hidden.append(h)
        return h

    def propose(self, state: DecodeState, k: int) -> Proposal:
        exit_layer, j = choose_exit(self.alphas(), self.exits, state.target.num_layers, self.head_layers, k)
        self.choices.append((exit_layer, j))
        self.kept, self.draft_hidden = {}, []
        self.drafting = j > 0
        if not self.drafting:  # a plain step: _plain_step said whether its verification captures the candidates
            return Proposal.empty(state.tokens.shape[0], state.tokens.device)
        self.exit_layer = exit_layer
        self.feature_layers = tuple(e for e in self.exits if e > exit_layer)
        return super().propose(state, j)

    @torch.inference_mode()
    def update(self, state: DecodeState, num_accepted: int) -> None:
        m, t = num_accepted, state.target
        if not self.drafting:
            self.plain_steps += 1
            if not self.feature_layers:  # an untracked plain step
                self.wait -= 1
                self._plain_step()
                return
            self.wait, self.interval = self.interval - 1, min(2 * self.interval, MAX_TRACK_EVERY)
        else:
            self.wait, self.interval = TRACK_EVERY - 1, TRACK_EVERY
        hidden = []  # [C] of [m+1, H]: each candidate's hidden states at pending and the accepted drafts
        for e in self.exits:
            if self.drafting and e < self.exit_layer:
                h = torch.cat(self.kept[e], 1)
            elif self.drafting and e == self.exit_layer:
                h = torch.cat(self.draft_hidden, 1)
            else:
                h = state.target_features[e]
            hidden.append(h[0, : m + 1])
        labels = state.tokens[0, -(m + 1) :]  # [m+1] what each position committed next
        shortlist = state.last_logits[0, : m + 1].topk(min(SHORTLIST, t.vocab_size), dim=-1).indices  # [m+1, S]
        rows = t.lm_head.weight[shortlist].float()  # [m+1, S, H]
        normed = t.norm(torch.stack(hidden)).float()  # [C, m+1, H]
        scores = torch.einsum("cph,psh->cps", normed, rows)  # [C, m+1, S]
        agree = shortlist.gather(-1, scores.argmax(-1).T).T == labels  # [C, m+1]
        self.hits.mul_(DECAY).add_(agree.float().sum(-1))
        self.seen.mul_(DECAY).add_(m + 1)
        self._plain_step()


def build_del(cfg, target) -> DynamicExitDrafter:
    depth = model_depth(target)
    if depth < 2:
        raise ConfigError("method", f"del exits below the top layer: the model needs at least 2 layers, it has {depth}")
    return DynamicExitDrafter(candidate_exits(depth), cfg.confidence_threshold)


@builds("del")
def _del_drafter(cfg, target, device, memory):
    return build_del(cfg, target)
