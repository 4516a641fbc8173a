"""Building the model-free tree drafters (``recycling``, ``suffix``, ``hybrid``) from a ``SpecConfig``: their builder."""

from __future__ import annotations

from typing import TYPE_CHECKING

from decoding.builders import builds
from decoding.drafters.artifacts import NO_DRAFTER, eagle_drafter
from decoding.drafters.base import Drafter
from decoding.drafters.hybrid import HybridDrafter
from decoding.drafters.ngram import NgramDrafter
from decoding.drafters.recycling import RecyclingDrafter
from decoding.drafters.suffix import SuffixDrafter
from decoding.drafters.suffix_corpus import corpus_folder, load_corpus
from decoding.errors import ConfigError
from decoding.model.adapter import ModelAdapter
from decoding.trees.hardware import chooser_for
from decoding.trees.shapes import Tree, parse_paths

if TYPE_CHECKING:
    from decoding.config import SpecConfig


def build_model_free(cfg: SpecConfig, target, memory=None) -> Drafter:
    vocab = ModelAdapter(target.model).vocab_size
    chooser = chooser_for(cfg, target)
    cold = cfg.draft_memory == "cold"
    fixed = None
    if cfg.tree == "static":  # a fixed template (the paper's) instead of Sequoia's
        fixed = Tree.from_paths(parse_paths(cfg.tree_paths))
        if int(fixed.rank.max()) >= cfg.recycle_width:
            raise ConfigError("tree_paths", f"ranks must be below recycle_width ({cfg.recycle_width})")
    recycling = RecyclingDrafter(vocab, cfg.recycle_width, cfg.tree_budget, memory=memory, cold=cold, chooser=chooser, fixed=fixed)
    if cfg.method == "recycling":
        return recycling
    suffix = SuffixDrafter(
        cfg.tree_budget,
        cfg.suffix_factor,
        cfg.suffix_min_prob,
        cfg.suffix_depth,
        cache_tokens=cfg.suffix_cache_tokens,
        memory=recycling.memory,
        cold=cold,
        chooser=chooser,
        corpus=_corpus(cfg),
    )
    if cfg.method == "suffix":
        return suffix
    head = None
    # the feature head where copying offers little, when drafter= names one: not the shipped head by default, which
    # cost more than it gained here (six first-turn Spec-Bench prompts, 2 threads: 26.4 tok/s with it, 52.2 without,
    # AR 56.1; capturing the target's features and feeding the head every step is paid even where it does not draft)
    if cfg.drafter not in (None, NO_DRAFTER):
        head = eagle_drafter(cfg.replace(tree="dyspec"), target)
        head.chooser = None  # the hybrid sizes the merged tree
    return HybridDrafter(recycling, suffix, NgramDrafter(cfg.ngram_max, cfg.ngram_min), cfg.tree_budget, chooser, head)


def _corpus(cfg: SpecConfig):
    folder = corpus_folder(cfg.suffix_corpus, cfg.model)
    if folder is None and cfg.suffix_corpus not in ("auto", "none"):
        raise ConfigError("suffix_corpus", f"no self-distillation shards (phase-*/shard-*.parquet) under {cfg.suffix_corpus}")
    return None if folder is None else load_corpus(folder)


@builds("recycling", "suffix", "hybrid")
def _model_free_drafter(cfg, target, device, memory) -> Drafter:
    return build_model_free(cfg, target, memory)
