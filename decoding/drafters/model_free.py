"""Building the model-free tree drafters (``recycling``, ``suffix``, ``hybrid``) from a ``SpecConfig``: their builder."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from decoding.builders import builds
from decoding.drafters.drafters import Drafter, NgramDrafter
from decoding.drafters.hybrid import HybridDrafter
from decoding.drafters.recycling import RecyclingDrafter
from decoding.drafters.suffix import SuffixDrafter
from decoding.errors import ConfigError
from decoding.model.adapter import ModelAdapter
from decoding.trees.hardware import TreeChooser, verify_costs
from decoding.trees.trees import Tree, parse_paths

if TYPE_CHECKING:
    from decoding.config import SpecConfig


def chooser_for(cfg: SpecConfig, target) -> TreeChooser | None:
    """``tree_fit=measured``: a chooser over this host's verification cost curve (measured once, then cached)."""
    if cfg.tree_fit != "measured":
        return None
    adapter = ModelAdapter(target.model)
    return TreeChooser(verify_costs(adapter, cfg.model, cfg.dtype, torch.get_num_threads()))


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
    )
    if cfg.method == "suffix":
        return suffix
    return HybridDrafter(recycling, suffix, NgramDrafter(cfg.ngram_max, cfg.ngram_min), cfg.tree_budget, chooser)


@builds("recycling", "suffix", "hybrid")
def _model_free_drafter(cfg, target, device, memory) -> Drafter:
    return build_model_free(cfg, target, memory)
