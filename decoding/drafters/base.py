"""The drafter interface: propose k tokens, then learn from the verdict.

The interface is deliberately narrow (after transformers' candidate generators): ``start`` once per generation,
``propose`` before each target forward, ``update`` after the verdict. A drafter that ran the target's own first
layers on the proposed tokens (self-speculation) hands back their hidden states so verification continues from that
layer instead of recomputing it.

Shapes keep the batch dimension; the loop hands each drafter one sequence (B = 1) and batches the target's
verification across sequences (``decoding.loop``). The drafters live beside this module, one module each
(``ngram``, ``draft_model``, ``early_exit``, ``eagle``, ...); what model-based ones share (drafting a chain or a
tree with a model) is ``decoding.drafters.drafting``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.builders import builds
from decoding.model.adapter import KVCache, ModelAdapter
from decoding.sampling import SamplingParams
from decoding.trees.trees import Tree


@dataclass
class DecodeState:
    """What a drafter may read. The last committed token is pending: its KV is not yet in the target cache."""

    tokens: torch.Tensor  # [B, n] prompt + generated tokens
    target: ModelAdapter
    target_cache: KVCache
    sampling: SamplingParams
    generator: torch.Generator | None
    max_len: int  # cache capacity a drafter should allocate
    accepted_path: list[int] | None = None  # trees: node indices of the last step's accepted path (root 0 first)
    # [B, c, H] the target's last-layer (pre-norm) hidden states of the c positions its last forward kept in the
    # cache, ending at position n-2 (the prompt after prefill, pending + accepted drafts after a step)
    target_hidden: torch.Tensor | None = None
    # [B, T, V] the target's logits of the last verification, one row per fed position [pending, drafts...] (tree nodes
    # in node order), rejected ones included; set by the loop before ``update`` (Token Recycling reads it)
    last_logits: torch.Tensor | None = None
    # {layer l: [B, c, H]} the target's hidden states after l layers at the positions of ``target_hidden``, for the
    # layers the drafter names in ``feature_layers`` (a feature-level drafter fuses several depths)
    target_features: dict | None = None


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, j] drafted tokens, 0 <= j <= k
    probs: torch.Tensor | None = None  # [B, j, V] warped draft distributions; None = deterministic drafts
    hidden: torch.Tensor | None = None  # [B, j+1, H] target hidden after `layer` layers for [pending, drafts]
    layer: int = 0
    tree: Tree | None = None  # the drafts are nodes 1..j of this tree (node 0 = pending); None = a chain
    # the drafts are committed without verification (EAD, lossy): the target's forward over them only catches its cache
    # up and adds its own token after them (``decoding.loop.verify.commit_unverified``)
    unverified: bool = False

    @staticmethod
    def empty(batch: int, device=None) -> Proposal:
        return Proposal(tokens=torch.zeros(batch, 0, dtype=torch.long, device=device))


class Drafter:
    """Base class: the no-op drafter proposes nothing (that is the AR baseline)."""

    name = "none"
    model_free = False  # proposing costs (next to) nothing: k=auto lets it propose first, then cuts the proposal
    batchable = True  # False: it keeps the target cache for itself and decodes one sequence at a time
    feature_layers: tuple[int, ...] = ()  # target layers whose hidden states it reads (``DecodeState.target_features``)

    def start(self, state: DecodeState) -> None:
        pass

    def propose(self, state: DecodeState, k: int) -> Proposal:
        return Proposal.empty(state.tokens.shape[0], state.tokens.device)

    def update(self, state: DecodeState, num_accepted: int) -> None:
        pass

    def max_nodes(self, k: int) -> int:
        """The most drafts one proposal may hold (the loop sizes the caches with it)."""
        return k

    def truncate(self, length: int) -> None:
        """An outer level cut the committed tokens back to their first ``length``: forget state beyond them.

        Only drafters used inside another drafter's speculative steps (TriForce's bottom level) see this.
        """


@builds("ar")
def _no_drafter(cfg, target, device, memory) -> None:
    return None
