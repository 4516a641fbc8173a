"""From a ``SpecConfig`` to a ready decoder: load the model(s), build the drafter, run the loop.

>>> # dec = SpecDecoder(SpecConfig(method="ngram", k=6))
>>> # out = dec.generate_text("Summarize: ...", chat=True)
>>> # out["text"], out["stats"]["tokens_per_s"]
"""

from __future__ import annotations

import copy
import logging
import time

import torch

from decoding.builders import builder_of
from decoding.config import SpecConfig
from decoding.decoder import DecoderBase, context_error, decode, encode
from decoding.drafters import artifacts, base, dynamic_exit, ead, model_free, ngram, swift
from decoding.drafters.artifacts import with_stop_head
from decoding.drafters.base import Drafter
from decoding.errors import ConfigError
from decoding.loop.batch import Sequence, generate_many, run_alone
from decoding.loop.output import Generation
from decoding.loop.prefill import ContextTooLong
from decoding.methods import method_of
from decoding.model.adapter import ModelAdapter
from decoding.model.costs import CostModel, forward_costs
from decoding.model.loading import LoadedModel, load_model, set_threads
from decoding.sampling import SamplingParams
from decoding.schedules import triforce
from decoding.trees.shapes import tree_shape

# the modules that define the methods' drafters: importing them registers their builders (decoding.builders)
DRAFTER_MODULES = (base, ngram, model_free, artifacts, triforce, swift, dynamic_exit, ead)
log = logging.getLogger(__name__)


def draft_depth(cfg: SpecConfig) -> int:
    """The per-step draft length the loop gets: k, or a static tree's own depth."""
    shape = tree_shape(cfg)
    return shape.max_depth if cfg.tree == "static" else cfg.k


def build_drafter(cfg: SpecConfig, target: LoadedModel, device: str | torch.device | None = None, memory=None) -> Drafter | None:
    """The drafter a method uses (the builder registered beside the drafter, ``decoding.builders``); checks knobs
    that depend on the model (exit layer vs depth).

    ``device``: where a separate draft model is put (default: the target's device).
    ``memory``: the decoder's ``DraftMemory`` (state of model-free drafters that outlives a request).
    """
    device = target.device if device is None else device
    drafter = builder_of(method_of(cfg.method).name)(cfg, target, device, memory)
    return with_stop_head(drafter, cfg, target)  # SpecDec++'s stop rule on its chains when stop_threshold > 0


class SpecDecoder(DecoderBase):
    """The in-process runtime of :class:`decoding.decoder.Decoder`: a loaded target, a drafter and sampling settings.

    ``pearl`` in one process runs its draft model with the sequential schedule
    (draft, then verify): the same tokens, without the overlap that needs two
    workers (``cluster.decoders.open_decoder`` places those); ``stats`` says so
    in ``placement``.
    """

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg
        self.threads = set_threads(cfg.threads)
        self.loaded = load_model(cfg.model, cfg.dtype, cfg.device, cfg.quant)
        self.device = self.loaded.device  # prompts, generators and caches are made here
        self.tokenizer = self.loaded.tokenizer
        self.target = ModelAdapter(self.loaded.model, compile=cfg.compile)
        from decoding.drafters.draft_memory import DraftMemory

        self.memory = DraftMemory()  # model-free drafters' state across requests (and forks)
        self.drafter = build_drafter(cfg, self.loaded, memory=self.memory)
        self.sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
        self.warm_graphs()

    def warm_graphs(self, lengths=(256, 512), widths=(1, 2, 4, 8), budget_s: float = 60.0) -> int:
        """On a GPU: capture the target's one-row graphs for the common cache lengths and widths now, at load, within
        ``budget_s`` (with progress on a terminal); the rest are captured on first use. Returns the graphs captured."""
        graphs = self.target.graphs
        if graphs is None or not graphs.capture:
            return 0
        made, begin = 0, time.perf_counter()
        for length in lengths:
            cache = self.target.new_cache(1, length)  # pooled: a generation of this length gets this storage, and its graphs
            made += graphs.warm(cache, widths, budget_s=max(0.0, budget_s - (time.perf_counter() - begin)))
            del cache
        log.info("specray: %d CUDA graphs captured at load in %.1f s", made, time.perf_counter() - begin)
        return made

    def forget_text(self) -> None:
        """Forget the text of earlier generations (``DraftMemory.forget_text``), keeping what they measured; the
        drafter is built again (suffix decoding's holds the last request, which would join its cache next)."""
        self.memory.forget_text()
        self.drafter = build_drafter(self.cfg, self.loaded, memory=self.memory)

    @property
    def max_context(self) -> int:
        return self.loaded.max_context

    def fork(self, **changes) -> SpecDecoder:
        """A decoder for one request: same weights, tokenizer and target adapter, its own drafter and sampling.

        ``changes`` are SpecConfig fields (sampling, draft knobs); the model and
        dtype cannot change. Drafters keep per-generation state (a draft cache),
        so concurrent generations each need their own fork.
        """
        cfg = self.cfg.replace(**changes)
        for name in ("model", "dtype", "quant", "compile", "device", "draft_model", "drafter"):
            if getattr(cfg, name) != getattr(self.cfg, name):
                raise ConfigError(name, "cannot change in a fork; build a new SpecDecoder")
        twin = copy.copy(self)
        twin.cfg = cfg
        twin.drafter = build_drafter(cfg, self.loaded, memory=self.memory)
        twin.sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
        return twin

    # ---- text <-> ids ----------------------------------------------------
    def encode(self, prompt: str | list[dict], chat: bool = False) -> torch.Tensor:
        """Token ids [1, T] of a prompt (:func:`decoding.decoder.encode`)."""
        return encode(self.tokenizer, prompt, chat)

    def decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids)

    # ---- generation -------------------------------------------------------
    def _sequence(self, prompt_ids, max_new_tokens, seed, on_step, tag, drafter, generator) -> Sequence:
        seq = Sequence(
            prompt_ids,
            drafter=drafter,
            k=draft_depth(self.cfg),
            adaptive=self.adaptive(seed),
            glance=self.cfg.glance,
            sampling=self.sampling,
            max_new_tokens=max_new_tokens or self.cfg.max_new_tokens,
            eos_token_ids=self.loaded.eos_token_ids,
            generator=generator.manual_seed(self.cfg.seed if seed is None else seed),
            on_step=on_step,
            tag=tag,
        )
        if seq.adaptive and self.cfg.draft_memory == "warm":
            # its acceptance and draft-cost estimates start where the latest request of this method left off (not
            # at the prior, and not assuming drafts free): a drafter that does not pay does not relearn it each time
            # (the estimators themselves are kept, live, not the sequence: its state would hold its cache's storage)
            latest = self.memory.get(("acceptance", self.cfg.method), dict)
            if "row" in latest:
                acceptance, draft_cost, tree_gain, acceptance_of = latest["row"]
                seq.acceptance = acceptance.carried()
                seq.draft_cost, seq.tree_gain = draft_cost.carried(), tree_gain.carried()
                seq.acceptance_of = {kind: a.carried() for kind, a in acceptance_of.items()}
            latest["row"] = (seq.acceptance, seq.draft_cost, seq.tree_gain, seq.acceptance_of)
        return seq

    def sequence(self, prompt_ids: torch.Tensor, max_new_tokens: int | None = None, seed: int | None = None, on_step=None, tag=None):
        """A :class:`decoding.loop.batch.Sequence` of this configuration (its own drafter, sampling and seeded generator),
        to run in a :class:`decoding.loop.batch.Batch` beside sequences of other configurations of the same target."""
        drafter = build_drafter(self.cfg, self.loaded, memory=self.memory)
        return self._sequence(prompt_ids, max_new_tokens, seed, on_step, tag, drafter, torch.Generator(device=self.device))

    def batches(self, seq: Sequence) -> bool:
        return seq.drafter.batchable

    def run(self, seq: Sequence) -> Generation:
        """``seq`` in a batch of its own, to its end (drafters that keep the target cache to themselves run so too)."""
        try:
            return run_alone(self.target, seq, self.cost_model() if seq.adaptive else None)
        except ContextTooLong as e:
            raise context_error(e) from None

    def generate_ids(
        self, prompt_ids: torch.Tensor, max_new_tokens: int | None = None, seed: int | None = None, on_step=None
    ) -> Generation:
        """One generation with the decoder's own drafter (built once; its state carries from one generation to the next)."""
        gen = torch.Generator(device=self.device)
        return self.run(self._sequence(prompt_ids.to(self.device), max_new_tokens, seed, on_step, None, self.drafter, gen))

    def cost_model(self, max_rows: int = 1) -> CostModel:
        """The measured cost of the target's forward by rows and tokens (``decoding.model.costs``), for k=auto."""
        return forward_costs(self.target, self.cfg.model, self.cfg.dtype, max_rows)

    def generate_batch(
        self, prompts: list[torch.Tensor], max_new_tokens: int | None = None, max_rows: int = 16, max_step_tokens: int | None = None
    ) -> list[Generation]:
        """Generate for every prompt ([1, T] each) in one continuous batch of up to ``max_rows`` rows."""
        seqs = [self.sequence(p, max_new_tokens) for p in prompts]
        cost = self.cost_model(max_rows) if any(s.adaptive for s in seqs) else None
        try:
            return generate_many(self.target, seqs, max_rows=max_rows, max_step_tokens=max_step_tokens, cost=cost)
        except ContextTooLong as e:
            raise context_error(e) from None

    def stats(self, gen: Generation) -> dict:
        """The generation's figures, and ``placement``: this process, its threads, the sequential schedule."""
        stats = gen.stats.to_dict()
        stats["placement"] = {"mode": "local", "threads": self.threads, "schedule": "sequential"}
        note = method_of(self.cfg.method).local_note  # pearl: the overlap needs two workers; the output is the same
        if note:
            stats["placement"]["note"] = note
        return stats
