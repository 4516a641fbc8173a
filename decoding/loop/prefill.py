"""Prompts into the cache: the context check, prefill in fixed chunks, and the first token.

The chunks are the same whoever runs them (one sequence alone, a batch interleaving them with other rows' steps, the
two-sided runtime), so a cache's bits and the first token never depend on what else ran.
"""

from __future__ import annotations

import torch

from decoding.drafters.base import Proposal
from decoding.loop.step import verify
from decoding.model.adapter import KVCache, ModelAdapter
from decoding.sampling import SamplingParams


class ContextTooLong(ValueError):
    pass


def check_context(prompt_len: int, max_new_tokens: int, max_context: int) -> None:
    """Raise ``ContextTooLong`` when the prompt and the new tokens cannot fit the model's context."""
    if prompt_len + max_new_tokens > max_context:
        raise ContextTooLong(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of {max_context}"
        )


PREFILL_CHUNK = 256  # prompt tokens per prefill forward (see Prefill)


def chunk_of(model: ModelAdapter) -> int:
    """Prompt tokens per prefill forward on ``model``: ``PREFILL_CHUNK``, or where its forwards replay captured CUDA
    graphs the widest graph (64 tokens), so every chunk replays one graph instead of launching a whole forward's
    kernels one by one (about 1,200 for SmolLM2, 28 ms on an H200, against 2-3 ms for a graphed 64-token chunk)."""
    graphs = getattr(model, "graphs", None)
    if graphs is not None and graphs.capture:
        from decoding.model.graphs import WIDTHS

        return min(PREFILL_CHUNK, WIDTHS[-1])
    return PREFILL_CHUNK


class Prefill:
    """A prompt run into a cache in chunks of ``chunk`` tokens (``chunk_of`` the model), one forward per chunk.

    The chunks are the same whoever runs them (one sequence alone, a batch that interleaves them with other
    rows' decoding steps, the two-sided runtime): chunk c is always positions [c * chunk, (c + 1) * chunk) over
    the chunks before it, so the cache's bits and the first token never depend on what else
    ran. ``features``: the layers whose hidden states to keep (``ModelAdapter.forward``'s ``captured``).

    >>> # p = Prefill(prompt, ()); while p.remaining: p.run_chunk(target, cache)
    >>> # hidden, features = p.result()     # [1, T, H], None
    """

    def __init__(self, prompt: torch.Tensor, features=(), chunk: int | None = None):  # prompt [1, T]
        self.prompt = prompt
        self.chunk = chunk or PREFILL_CHUNK
        self.done = 0
        self.hidden: list[torch.Tensor] = []
        self.features: dict[int, list[torch.Tensor]] = {layer: [] for layer in features}

    @property
    def remaining(self) -> int:
        return self.prompt.shape[1] - self.done

    def next_chunk(self) -> int:
        """Tokens the next :meth:`run_chunk` feeds."""
        return min(self.chunk, self.remaining)

    def run_chunk(self, model: ModelAdapter, cache: KVCache) -> None:
        """Feed the next chunk; the cache then holds the prompt up to its end."""
        begin, end = self.done, self.done + self.next_chunk()
        captured = dict.fromkeys(self.features) if self.features else None
        self.hidden.append(model.forward(cache, begin, input_ids=self.prompt[:, begin:end], captured=captured))
        for layer, parts in self.features.items():
            parts.append(captured[layer])
        self.done = end
        cache.rollback(end)

    def result(self) -> tuple[torch.Tensor, dict | None]:
        """The prompt's hidden states [1, T, H] and, per feature layer, its hidden states after that layer."""
        cat = lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)  # noqa: E731
        return cat(self.hidden), ({layer: cat(parts) for layer, parts in self.features.items()} or None)


def fill(model: ModelAdapter, cache: KVCache, prompt: torch.Tensor, captured: dict | None = None) -> torch.Tensor:
    """Run the prompt [1, T] into an empty ``cache`` (in :class:`Prefill`'s chunks), which then holds exactly the prompt;
    returns the hidden states [1, T, H] (and fills ``captured``, see ``ModelAdapter.forward``)."""
    run = Prefill(prompt, tuple(captured) if captured else (), chunk_of(model))
    while run.remaining:
        run.run_chunk(model, cache)
    h, features = run.result()
    if captured is not None:
        captured.update(features or {})
    return h


def first_token(target: ModelAdapter, hidden: torch.Tensor, sampling: SamplingParams, generator) -> torch.Tensor:
    """The first new token [1, 1] after a prompt whose last hidden state is ``hidden`` [1, 1, H], by the loop's rule."""
    return verify(Proposal.empty(1, hidden.device), target.logits(hidden), sampling, generator).tokens[:, :1]


def prefill(
    target: ModelAdapter, cache: KVCache, prompt: torch.Tensor, sampling: SamplingParams, generator, captured: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill ``cache`` with the prompt [1, T] and draw the first new token with the loop's rule.

    Returns (first token [1, 1], the prompt's hidden states [1, T, H]). Afterwards the cache holds the prompt
    and the first token is pending: the loop's invariant. ``captured``: see ``ModelAdapter.forward``.
    """
    h = fill(target, cache, prompt, captured)
    return first_token(target, h[:, -1:], sampling, generator), h
