"""TriForce (Sun et al. 2024): hierarchical speculation for long contexts.

Three levels, each drafting for the one above::

    bottom  a cheap drafter: the target's first layers or a separate small model, both with a
            StreamingLLM cache (sinks + recent window), or n-gram prompt lookup
    middle  the target model over a retrieval cache (top prompt chunks by query relevance + tail)
    top     the target model over its full cache: the loop's own verification

The middle level is a drafter (:class:`TriForceDrafter`) whose ``propose`` runs
the loop's step body, :func:`decoding.loop.step.speculative_step`, on its own
``DecodeState`` (target = the target over the retrieval view, drafter = the
bottom level) until it has committed ``gamma`` tokens (the top level's ``k``).
Each inner step commits tokens distributed exactly as the middle model would
sample them (the inner lossless rule), so the middle's warped distribution at
each committed position is the proposal's ``probs``; the top-level rule then
makes the output follow the full target. Greedy: the middle commits its own
argmax tokens and the top keeps the prefix the full target agrees with.

Bookkeeping between the levels (n = committed tokens when ``propose`` starts; the full cache holds n - 1):

* ``propose``: the retrieval view copies the full cache's exact KV of the tokens
  committed since its last sync and rolls back to n - 1, so only the middle's own
  speculative tokens carry its approximate KV.
* the inner steps move the view and the bottom's cache as in any loop.
* ``update``: the top accepted m of the middle's tokens, so the committed tokens
  agree with the middle's first n + m; the bottom forgets anything beyond them.

Selection policy: the retrieval view selects its chunks once per generation,
right after prefill, with the queries of the first generated token at every
layer (one extra forward of the full target on that token, run layer by layer
to read the queries, :func:`decoding.model.kv_views.layer_queries`). The prompt does not change
during decoding and generated tokens are always in the view's tail, so a
prompt-only selection stays valid; re-selecting would cost that extra target forward again.
"""

from __future__ import annotations

import torch

from decoding.builders import builds
from decoding.drafters.artifacts import draft_adapter, shipped_artifact
from decoding.drafters.base import DecodeState, Drafter, Proposal
from decoding.drafters.draft_model import DraftModelDrafter, first_layers_adapter
from decoding.drafters.ngram import NgramDrafter
from decoding.errors import ConfigError
from decoding.loop.metrics import StepRecord
from decoding.loop.step import speculative_step  # this drafter runs the loop's step (it lives above the loop)
from decoding.model.adapter import ModelAdapter
from decoding.model.kv_views import RetrievalCache, ViewAdapter, layer_queries, streaming_cache
from decoding.sampling import warp

BOTTOMS = ("layers", "ngram", "model")


class TriForceDrafter(Drafter):
    """The middle level: the target over a retrieval cache, drafted for by a bottom level, drafting for the target.

    ``bottom``: ``layers`` / ``model`` (``bottom_adapter`` is the target's first layers
    or a separate model; it drafts ``gamma`` tokens per middle forward with a
    StreamingLLM cache of ``sinks`` + ``window``) or ``ngram``. ``budget`` prompt
    tokens are retrieved in chunks of ``chunk_size``.
    """

    reads_tokens = True  # it reads ``state.tokens`` at its steps

    batchable = False  # its middle level keeps a retrieval view of the target cache

    name = "triforce"

    def __init__(
        self,
        bottom: str,
        *,
        budget: int,
        chunk_size: int,
        gamma: int,
        sinks: int = 4,
        window: int = 252,
        bottom_adapter: ModelAdapter | None = None,
        ngram: tuple[int, int] = (3, 1),
        confidence_threshold: float = 0.0,
    ):
        if bottom not in BOTTOMS:
            raise ValueError(f"bottom must be one of {', '.join(BOTTOMS)}, got {bottom!r}")
        if bottom != "ngram" and bottom_adapter is None:
            raise ValueError(f"bottom={bottom!r} needs a bottom_adapter")
        self.bottom_kind, self.bottom_adapter = bottom, bottom_adapter
        self.budget, self.chunk_size, self.gamma = budget, chunk_size, gamma
        self.sinks, self.window, self.ngram, self.threshold = sinks, window, ngram, confidence_threshold
        self.retrieval: RetrievalCache | None = None
        self.bottom: Drafter | None = None
        self.inner: DecodeState | None = None
        self.inner_steps: list[StepRecord] = []  # the middle level's steps (bottom drafts judged by the middle)

    def start(self, state: DecodeState) -> None:
        full, n = state.target_cache, state.tokens.shape[1]
        self.retrieval = RetrievalCache(full, self.budget, self.chunk_size, state.max_len)
        self.retrieval.select(layer_queries(state.target, full, n - 1, state.tokens[:, -1:]))
        self.inner = DecodeState(state.tokens, ViewAdapter(state.target), self.retrieval, state.sampling, state.generator, state.max_len)
        self.bottom = self._build_bottom(state)
        self.bottom.start(self.inner)
        self.inner_steps = []

    def _build_bottom(self, state: DecodeState) -> Drafter:
        if self.bottom_kind == "ngram":
            return NgramDrafter(*self.ngram)
        a, prompt = self.bottom_adapter, state.tokens[:, :-1]  # the pending token is fed by the first propose
        if self.bottom_kind == "layers":  # the target's first layers: their prompt KV is already in the target's cache
            source = state.target_cache
        else:  # a separate model: prefill it once, keep sinks + window
            source = a.new_cache(prompt.shape[0], prompt.shape[1])
            a.forward(source, 0, input_ids=prompt)
        view = streaming_cache(source, a.num_layers, prompt.shape[1], self.sinks, self.window, state.max_len)
        return DraftModelDrafter(ViewAdapter(a, lambda batch, max_len: view), self.threshold)

    def propose(self, state: DecodeState, k: int) -> Proposal:
        self.retrieval.sync()
        inner, view, n = self.inner, self.retrieval, state.tokens.shape[1]
        if view.length < n - 1:  # tokens the full cache has not reached yet and the middle has not seen (a draft side)
            inner.target.forward(view, view.length, input_ids=state.tokens[:, view.length : n - 1])
            view.rollback(n - 1)
        inner.tokens = state.tokens
        tokens, probs = [], []
        while len(tokens) < k:
            # the last inner step may commit at most what is left: m + 1 <= k - produced
            step = speculative_step(inner, self.bottom, min(self.gamma, k - len(tokens) - 1))
            self.inner_steps.append(step.record)
            tokens += step.committed
            if not state.sampling.greedy:
                probs.append(warp(step.logits[:, : step.num_accepted + 1], state.sampling))  # [B, m+1, V]
        drafts = torch.tensor([tokens], dtype=state.tokens.dtype, device=state.tokens.device)
        return Proposal(tokens=drafts, probs=torch.cat(probs, 1) if probs else None)

    def update(self, state: DecodeState, num_accepted: int) -> None:
        # the top kept n + m of the middle's tokens and replaced the next one
        self.truncate(state.tokens.shape[1] - 1)

    def truncate(self, length: int) -> None:
        """The committed tokens were cut back to their first ``length``: both levels forget what lies beyond."""
        self.bottom.truncate(length)
        self.retrieval.truncate(length)

    def cache_bytes(self) -> dict:
        """KV bytes held by the middle (retrieval view) and bottom (streaming view) levels."""
        bottom = getattr(getattr(self.bottom, "cache", None), "nbytes", None)
        return {"middle": self.retrieval.nbytes() if self.retrieval else 0, "bottom": bottom() if bottom else 0}

    def level_stats(self) -> dict:
        """The latest generation's middle level: KV bytes of the two lower levels and the bottom's drafts it judged."""
        steps = self.inner_steps
        return {
            "kv_bytes": self.cache_bytes(),
            "middle_steps": len(steps),
            "middle_drafted": sum(s.drafted for s in steps),
            "middle_accepted": sum(s.accepted for s in steps),
        }


@builds("triforce")
def _triforce_drafter(cfg, target, device, memory) -> Drafter:
    bottom = None
    if cfg.triforce_bottom == "model":
        if cfg.draft_model in (None, "layers") and shipped_artifact(cfg.model, "distill") is None:
            raise ConfigError(
                "draft_model", "triforce_bottom=model needs a draft_model (a local model directory or a distilled-draft artifact)"
            )
        bottom = draft_adapter(cfg, target, device)
    elif cfg.triforce_bottom == "layers":
        bottom = first_layers_adapter(cfg, target)
    return TriForceDrafter(
        cfg.triforce_bottom,
        budget=cfg.triforce_budget,
        chunk_size=cfg.triforce_chunk_size,
        gamma=cfg.triforce_gamma,
        sinks=cfg.triforce_sinks,
        window=cfg.triforce_window,
        bottom_adapter=bottom,
        ngram=(cfg.ngram_max, cfg.ngram_min),
        confidence_threshold=cfg.confidence_threshold,
    )
