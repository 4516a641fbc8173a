"""One decoder interface, whatever runs it.

A decoder turns text into ids and back (``encode``, ``decode``), makes a sequence of a prompt with its own drafter,
sampling and seeded generator (``sequence``), runs it (``run``: alone, in this thread; ``batches`` says whether it
may instead join the batch of the decoder's target), reports a generation's figures (``stats``) and releases what it
holds (``close``). Two runtimes implement it:

- in process, ``decoding.in_process.SpecDecoder``: the model here; its sequences join the loop's batches;
- over a target and a draft worker, ``actors.driver.ActorDecoder``: the two-sided schedule, one sequence at a time.

``cluster.decoders.open_decoder`` picks the runtime of a configuration from the method table and its placement, in
one place; generate, bench, Tune trials and Serve replicas take the decoder it gives them and do not ask which.
:class:`DecoderBase` holds what both build on the five: ``generate_ids`` and ``generate_text`` (the CLI's JSON shape).

>>> # with open_decoder(SpecConfig(method="pearl")) as dec:      # on two Ray workers
>>> #     out = dec.generate_text("Summarize: ...", chat=True)
>>> #     out["token_ids"], out["stats"]["placement"]["mode"]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from decoding.errors import ConfigError
from decoding.loop.prefill import ContextTooLong
from decoding.methods import method_of

if TYPE_CHECKING:
    import torch

    from decoding.config import SpecConfig
    from decoding.loop.output import Generation, StepCallback


class GenerationLost(RuntimeError):
    """The runtime lost a generation: a model worker died or stopped answering, or the batch it was in failed. Not
    the request's fault; the same request may succeed again."""


@runtime_checkable
class Decoder(Protocol):
    """What every caller of a decoder may use (see the module docstring)."""

    cfg: SpecConfig
    tokenizer: object  # the target's (Hugging Face) tokenizer, in this process
    max_context: int  # prompt plus new tokens fit in this many positions

    def encode(self, prompt: str | list[dict], chat: bool = False) -> torch.Tensor:
        """Token ids [1, T] on the host; a list of ``{"role", "content"}`` messages is a conversation (chat)."""

    def decode(self, ids: list[int]) -> str: ...

    def sequence(
        self,
        prompt_ids: torch.Tensor,
        max_new_tokens: int | None = None,
        seed: int | None = None,
        on_step: StepCallback | None = None,
        tag=None,
    ):
        """A sequence of this configuration: ``on_step(tokens)`` gets each step's committed tokens and may end it by
        returning a finish reason; ``cancel()``, ``finish_reason`` and ``result()`` (a ``Generation``) as the loop's."""

    def batches(self, seq) -> bool:
        """Whether ``seq`` joins the batch of this decoder's target (else :meth:`run` runs it alone)."""

    def run(self, seq) -> Generation:
        """Run ``seq`` to its end in this thread; a prompt that cannot fit is a ConfigError on ``max_new_tokens``."""

    def stats(self, gen: Generation) -> dict:
        """A generation's figures (``GenerationStats``) and where and how it ran (``placement``, ...)."""

    def fork(self, **changes) -> Decoder:
        """A decoder for one request with other sampling or draft knobs: same weights (or workers)."""

    def close(self) -> None: ...


class DecoderBase:
    """``generate_ids`` and ``generate_text`` on top of a runtime's :class:`Decoder` methods; a context manager that
    closes the decoder."""

    def generate_ids(self, prompt_ids, max_new_tokens: int | None = None, seed: int | None = None, on_step=None) -> Generation:
        return self.run(self.sequence(prompt_ids, max_new_tokens, seed, on_step))

    def generate_text(self, prompt: str | list[dict], chat: bool = False, max_new_tokens: int | None = None, seed: int | None = None):
        """The CLI's JSON shape: method, lossy (a method whose output is not the target's: EAD), text, token_ids,
        finish_reason, stats."""
        out = self.generate_ids(self.encode(prompt, chat), max_new_tokens, seed)
        return {
            "method": self.cfg.method,
            "lossy": method_of(self.cfg.method).lossy,
            "text": self.decode(out.token_ids),
            "token_ids": out.token_ids,
            "finish_reason": out.finish_reason,
            "stats": self.stats(out),
        }

    def adaptive(self, seed: int | None) -> bool:
        """Whether a generation drafts k=auto. A sampled one given its own seed keeps the fixed k: under k=auto its
        draft lengths follow the measured costs and the load, and so would its tokens (the same distribution, other
        draws); with a fixed k the same seed gives the same text wherever and beside whatever it runs."""
        if not (self.cfg.adaptive_k and method_of(self.cfg.method).serves_auto_k):
            return False
        return seed is None or self.cfg.temperature == 0

    def close(self) -> None:
        """Nothing to release (a runtime that holds workers or files says otherwise)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- text <-> ids, one rule for both runtimes --------------------------------------------------------------------
NO_TEMPLATE_HINT = "; send a plain prompt (/v1/completions, or generate without --chat)"


def encode_chat(tokenizer, messages: list[dict], field: str = "chat") -> torch.Tensor:
    """Ids [1, T] (on the host: they cross RPCs) of a conversation with the generation prompt appended; a model
    without a chat template is a ConfigError on ``field``."""
    import torch

    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(field, "this model has no chat template" + NO_TEMPLATE_HINT)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor([ids], dtype=torch.long, device="cpu")


def encode(tokenizer, prompt: str | list[dict], chat: bool = False) -> torch.Tensor:
    """Token ids [1, T] on the host of a prompt; ``chat`` applies the model's chat template. A list of
    ``{"role", "content"}`` messages (a conversation: earlier turns and their answers) is always a chat; an empty
    prompt is a ConfigError on ``prompt``."""
    import torch

    if isinstance(prompt, list):
        return encode_chat(tokenizer, prompt, field="messages")
    if not prompt or not prompt.strip():
        raise ConfigError("prompt", "is empty")
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    return torch.tensor([tokenizer(prompt)["input_ids"]], dtype=torch.long, device="cpu")


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def context_error(e: ContextTooLong) -> ConfigError:
    """A prompt plus its new tokens that cannot fit, as the user's error on ``max_new_tokens``."""
    return ConfigError("max_new_tokens", str(e))
