"""One table of methods: per method its knobs and their search ranges, how it runs on actors, its schedule.

Every outer layer asks this table instead of comparing method names: ``tuning.space`` derives Tune's space from
``knobs`` (and fixes invalid samples with ``resolve`` / ``fit``); ``actors``, ``cluster``, ``tuning.resources``,
``serving`` and ``jobs`` read ``actors``. The table declares and builds nothing: each method's drafter builder is
registered beside its drafter (``decoding.builders``) and ``decoding.in_process.build_drafter`` calls it. Adding a
method is one :class:`Method` entry in :data:`METHOD_TABLE` and its drafter with its builder.

>>> method_of("pearl").actors.schedule_of(None), method_of("pearl").schedule
('pearl', 'pearl')
>>> [k.field for k in method_of("ngram").knobs]
['k', 'ngram_max', 'ngram_min', 'tree', 'tree_budget']
>>> [m for m in METHODS if method_of(m).actors]
['sps', 'pearl', 'triforce']
>>> runs_on_actors("pearl", "local"), runs_on_actors("ngram", "local"), runs_on_actors("sps", "actors")
(True, False, True)

A configuration (``decoding.config.SpecConfig``) is the common fields plus options: each entry names the option
groups (:data:`OPTION_GROUPS`) its method reads, and its own defaults of them (``eagle`` drafts a 3-token chain).

>>> method_of("eagle").defaults["k"], "exit_layer" in method_of("ngram").fields, method_of("pearl").groups[-1]
(3, False, 'actors')

This module is torch-free declarations and imports only the ground module ``decoding.errors`` (``decoding.config``
imports it); the ``fit`` hooks that ask about trained artifacts are handed ``decoding.drafters.artifacts`` by their
caller (``tuning.space``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from decoding.errors import ConfigError

# A configuration (decoding.config.SpecConfig) in this table's annotations. decoding.config imports the table, so the
# table does not import it back, not even for type checkers: no import circle.
SpecConfig = Any


class ArtifactFacts(Protocol):
    """What a ``fit`` hook may ask about trained artifacts (``decoding.drafters.artifacts`` answers; the caller passes
    it in, so the table imports no drafter)."""

    def drafts_trees(self, name: str | None) -> bool: ...

    def shipped_exit_layers(self, model: str) -> list[int]: ...


# ---- constants: each defined here once, imported everywhere else ----------------------------------------------------
WORKER_ROLES = ("target", "draft")  # the two model workers of placement=actors; placement bundle 0 is the target, 1 the draft
ACTOR_TRANSPORTS = ("calls", "compiled")  # plain actor calls or Ray compiled graphs between the driver and the workers
# decoding.schedules.two_sided over a draft and a target side: sequential, or drafting while verifying
TWO_SIDED_SCHEDULES = ("sps", "pearl")
TRIFORCE_BOTTOMS = ("layers", "ngram", "model")  # what drafts for TriForce's middle level
# a method's own schedule: draft then verify (the one loop), draft while verifying (PEARL), a drafter that itself
# runs a speculative step (TriForce's middle level)
SEQUENTIAL, PARALLEL, HIERARCHICAL = "sequential", "pearl", "hierarchical"
SCHEDULES = (SEQUENTIAL, PARALLEL, HIERARCHICAL)
# what the draft worker hosts: the draft model (``draft_model`` or the target's first ``draft_layers`` layers), or the
# target again with the method's drafter over its own cache (TriForce's middle and bottom levels)
DRAFT_MODEL, TARGET_WITH_DRAFTER = "draft-model", "target-with-drafter"
DEPTH = "depth"  # a knob bound meaning "the model's depth - 1" (the deepest layer that can still draft)


# ---- options: what a configuration holds beyond the common fields, in groups; each method reads some of them --------
OPTION_GROUPS: dict[str, tuple[str, ...]] = {
    "draft": ("k", "adaptive_k", "glance"),  # draft length, or the most a step drafts under k=auto (and its fallback)
    "tree": ("tree", "tree_paths", "tree_budget", "tree_acceptance", "tree_fit"),
    "draft_model": ("draft_model", "draft_layers"),
    "confidence": ("confidence_threshold",),
    "exit": ("exit_layer",),
    "ngram": ("ngram_max", "ngram_min"),
    "drafter": ("drafter",),  # a trained artifact (a shipped one by default; none opts out)
    "vocab": ("draft_vocab",),
    "triforce": (
        "triforce_budget",
        "triforce_chunk_size",
        "triforce_gamma",
        "triforce_sinks",
        "triforce_window",
        "triforce_bottom",
        "triforce_schedule",
    ),
    "recycling": ("recycle_width",),
    "suffix": ("suffix_factor", "suffix_min_prob", "suffix_depth", "suffix_cache_tokens", "suffix_corpus"),
    "memory": ("draft_memory",),
    "stop": ("stop_threshold", "stop_head"),  # SpecDec++'s acceptance-prediction stop (decoding/drafters/stop_head.py)
    "swift": ("swift_skip", "swift_trials"),
    "ead": ("ead_threshold", "ead_window"),
    # placement=actors: every method the workers can run reads these
    "actors": (
        "placement",
        "draft_threads",
        "target_threads",
        "num_gpus_per_model",
        "rpc_timeout_s",
        "placement_timeout_s",
        "actor_transport",
    ),
}
OPTION_OF = {name: group for group, names in OPTION_GROUPS.items() for name in names}  # option field -> its group


# ---- knobs ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KnobSpec:
    """One searchable SpecConfig field and its default search range: an int or float range (``step`` makes it
    discrete; bounds are numbers or :data:`DEPTH`) or a choice. Plain data: ``tuning.space.Knob`` checks it
    (a SpecConfig field, a known kind) and adds the searchers' views."""

    field: str
    kind: str  # "int" | "float" | "choice"
    low: float | int | str | None = None  # a number, or DEPTH
    high: float | int | str | None = None
    choices: tuple = ()
    step: float | None = None
    log: bool = False


_K = KnobSpec("k", "int", 1, 8)
_CONFIDENCE = KnobSpec("confidence_threshold", "float", 0.0, 0.9, step=0.05)
_DRAFT_LAYERS = KnobSpec("draft_layers", "int", 1, DEPTH)
# token trees (decoding/trees/shapes.py): the drafters that grow trees also search the shape and the node budget (static trees
# need user paths, so they are not searched; sequoia uses the config's tree_acceptance)
_TREE = (KnobSpec("tree", "choice", choices=("chain", "sequoia", "dyspec")), KnobSpec("tree_budget", "int", 4, 32))
# model-free tree drafters: k is the tree depth; tree_budget applies with tree_fit=budget (measured picks the size from
# this host's verification cost)
_FIT = (KnobSpec("tree_fit", "choice", choices=("measured", "budget")), KnobSpec("tree_budget", "int", 4, 48))
_RECYCLE = (KnobSpec("recycle_width", "int", 1, 8),)
# SpecDec++'s stop head: stop once the predicted probability that a draft of the chain is rejected passes it; 0 = off
_STOP = KnobSpec("stop_threshold", "float", 0.0, 0.9, step=0.05)
_SUFFIX = (KnobSpec("suffix_factor", "float", 0.5, 4.0, step=0.5), KnobSpec("suffix_min_prob", "float", 0.0, 0.5, step=0.05))


# ---- fixing a sample's invalid combinations (tuning.space) -----------------------------------------------------------
def _resolve_ngram(values: dict, depth: int) -> dict:
    """ngram_min > ngram_max is not an error to search around: the two bounds are swapped."""
    lo, hi = values.get("ngram_min"), values.get("ngram_max")
    if lo is not None and hi is not None and lo > hi:
        values["ngram_min"], values["ngram_max"] = hi, lo
    return values


def _fit_ngram(values: dict, base: SpecConfig, artifacts: ArtifactFacts) -> dict:
    """One bound fixed by the user (--set), the other searched: the searched one is kept on its side of it."""
    if "ngram_min" in values and "ngram_max" not in values:
        values["ngram_min"] = min(values["ngram_min"], base.ngram_max)
    if "ngram_max" in values and "ngram_min" not in values:
        values["ngram_max"] = max(values["ngram_max"], base.ngram_min)
    return values


def _resolve_trained(values: dict, depth: int) -> dict:
    """No artifact list given (--range drafter=...): keep the base config's drafter."""
    if values.get("drafter") == "":
        del values["drafter"]
    return values


def _fit_trained(values: dict, base: SpecConfig, artifacts: ArtifactFacts) -> dict:
    """Medusa, Hydra and distilled drafters search tree shapes; a chain-only artifact's trials get chains."""
    if values.get("tree", "chain") != "chain":
        if not artifacts.drafts_trees(values.get("drafter", base.drafter)):  # Kangaroo, feature head: chains only
            values["tree"] = "chain"
            values.pop("tree_budget", None)
    return values


def _fit_early_exit(values: dict, base: SpecConfig, artifacts: ArtifactFacts) -> dict:
    """With the drafters shipped for the model (no drafter= of the user's), a sampled exit layer snaps to the nearest
    one that has a trained Kangaroo adapter: the exit-layer search compares adapted exits. A Kangaroo adapter (shipped
    for that exit, or the user's drafter=) drafts chains only, so its trials get a chain, not a failed trial."""
    if "exit_layer" in values and base.drafter is None:
        layers = artifacts.shipped_exit_layers(base.model)
        if layers:
            values["exit_layer"] = min(layers, key=lambda layer: (abs(layer - values["exit_layer"]), layer))
    if values.get("tree", base.tree) != "chain":
        exit_layer = values.get("exit_layer", base.exit_layer)
        if base.drafter is None:
            chains = exit_layer in artifacts.shipped_exit_layers(base.model)
        else:  # drafter=none: plain early exit (trees are fine); else the artifact says
            chains = base.drafter != "none" and not artifacts.drafts_trees(base.drafter)
        if chains:
            values["tree"] = "chain"
            values.pop("tree_budget", None)
    return values


def _fit_stop(values: dict, base: SpecConfig, artifacts: ArtifactFacts) -> dict:
    """The stop head stops chains: a sample that drafts a tree runs without it (not an invalid trial)."""
    if values.get("tree", base.tree) != "chain" and values.get("stop_threshold"):
        values["stop_threshold"] = 0.0
    return values


def _and_stop(fit: Callable[[dict, SpecConfig, ArtifactFacts], dict] | None):
    """A method's fit hook followed by :func:`_fit_stop` (whose tree the method's own hook may have changed)."""

    def both(values: dict, base: SpecConfig, artifacts: ArtifactFacts) -> dict:
        return _fit_stop(fit(values, base, artifacts) if fit is not None else values, base, artifacts)

    both.__doc__ = (fit.__doc__ or "") + " Then: " + (_fit_stop.__doc__ or "")
    return both


# ---- the entries --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OnActors:
    """How a method runs with ``placement=actors``: a target worker and a draft worker (``roles``), driven by
    ``decoding.schedules.two_sided``'s ``schedule`` (or the one the config field ``schedule_field`` names) over one of
    ``transports``."""

    draft_worker: str  # DRAFT_MODEL | TARGET_WITH_DRAFTER: what the draft worker hosts
    schedule: str | None = None  # a TWO_SIDED_SCHEDULES name, fixed ...
    schedule_field: str | None = None  # ... or the SpecConfig field that holds it
    ship_kv: bool = False  # the target ships its exact KV with each verdict (the draft worker holds a copy of the target)
    level_stats: bool = False  # the draft worker reports its levels' stats (a hierarchical drafter)
    always: bool = False  # runs on actors whatever ``placement`` says (in process it takes turns: same tokens, no overlap)
    roles: tuple[str, ...] = WORKER_ROLES
    transports: tuple[str, ...] = ACTOR_TRANSPORTS

    def schedule_of(self, cfg: SpecConfig | None) -> str:
        """The two-sided schedule a config runs over the workers."""
        return self.schedule if self.schedule is not None else getattr(cfg, self.schedule_field)


@dataclass(frozen=True)
class Method:
    """One method: everything the layers outside ``decoding/`` need to know about it."""

    name: str
    summary: str
    knobs: tuple[KnobSpec, ...] = ()  # what Tune searches, in order, with default ranges
    schedule: str = SEQUENTIAL  # SEQUENTIAL | PARALLEL | HIERARCHICAL
    actors: OnActors | None = None  # None: placement=actors cannot run it
    layer_knob: str | None = None  # the field naming how many target layers draft (a one-layer model cannot run it)
    draft_model_replaces_layers: bool = False  # a separate draft_model makes layer_knob moot
    chains_only: bool = False  # draft trees are not allowed (tree must be chain)
    needs_drafter: bool = False  # needs drafter=NAME (a trained artifact); bench labels ``NAME:ARTIFACT``
    serves_auto_k: bool = True  # a served entry drafts k=auto by default (not: no drafts, or a fixed schedule)
    resolve: Callable[[dict, int], dict] | None = None  # a sample's knob values, the model depth -> valid values
    # a sample's knob values, the base config, the artifacts' facts -> valid values
    fit: Callable[[dict, SpecConfig, ArtifactFacts], dict] | None = None
    local_note: str | None = None  # said in stats["placement"]["note"] when it runs in one process
    # its output is not the target's (no verification: EAD): labelled wherever a user sees it, measured against AR, never
    # published by Tune without an explicit opt-in, and served only under a name that says "lossy"
    lossy: bool = False
    options: tuple[str, ...] = ()  # the OPTION_GROUPS it reads ("actors" too when it runs on actors)
    defaults: Mapping[str, object] = field(default_factory=dict)  # its own defaults of options (others: SpecConfig's)

    @property
    def groups(self) -> tuple[str, ...]:
        return self.options + (("actors",) if self.actors is not None else ())

    @property
    def fields(self) -> tuple[str, ...]:
        """The option fields this method reads."""
        return tuple(name for group in self.groups for name in OPTION_GROUPS[group])


_ON_TWO_WORKERS = OnActors(DRAFT_MODEL, schedule="sps")
METHOD_TABLE: dict[str, Method] = {
    m.name: m
    for m in (
        Method("ar", "plain autoregressive decoding: the baseline of every speedup", serves_auto_k=False),
        Method(
            "sps",
            "a smaller model of the same tokenizer (draft_model, else the target's first draft_layers layers) drafts",
            (_K, _DRAFT_LAYERS, _CONFIDENCE, *_TREE, _STOP),
            actors=_ON_TWO_WORKERS,
            layer_knob="draft_layers",
            draft_model_replaces_layers=True,
            fit=_and_stop(None),
            options=("draft", "draft_model", "confidence", "tree", "stop"),
        ),
        Method(
            "ngram",
            "prompt lookup: drafts copied from earlier matches of the latest n-gram",
            (_K, KnobSpec("ngram_max", "int", 1, 5), KnobSpec("ngram_min", "int", 1, 3), *_TREE),
            resolve=_resolve_ngram,
            fit=_fit_ngram,
            options=("draft", "ngram", "tree"),
        ),
        Method(
            "early-exit",
            "self-speculation: the target's first exit_layer layers draft",
            (_K, KnobSpec("exit_layer", "int", 1, DEPTH), _CONFIDENCE, *_TREE, _STOP),
            layer_knob="exit_layer",
            fit=_and_stop(_fit_early_exit),
            options=("draft", "exit", "confidence", "tree", "drafter", "stop"),
            # the bundled model's shipped Kangaroo adapter after layer 6, two tokens a step (one Spec-Bench prompt, 2
            # threads, 64 tokens: exit 6 k=2 40.6 tok/s, k=3 37.5, k=4 28.5; exit 12 k=2 32.5; exit 24 without an
            # adapter, the old default, 22.7; AR 60.5)
            defaults={"exit_layer": 6, "k": 2},
        ),
        Method(
            "pearl",
            "SpS with drafting and verifying at the same time on two workers (pre- and post-verify)",
            (_K, _DRAFT_LAYERS, _CONFIDENCE),
            schedule=PARALLEL,
            actors=OnActors(DRAFT_MODEL, schedule="pearl", always=True),
            layer_knob="draft_layers",
            draft_model_replaces_layers=True,
            chains_only=True,
            local_note="pearl ran in one process: drafting and verifying took turns (the sps schedule)",
            options=("draft", "draft_model", "confidence"),
        ),
        Method(
            "triforce",
            "the target over a retrieval-selected sparse KV cache drafts for the full target, a bottom drafter for it",
            # bounds keep triforce_budget >= sinks (default 4) + window
            (
                _K,
                KnobSpec("triforce_gamma", "int", 1, 8),
                KnobSpec("triforce_bottom", "choice", choices=("ngram", "layers")),
                _DRAFT_LAYERS,
                KnobSpec("triforce_budget", "int", 256, 4096, log=True),
                KnobSpec("triforce_chunk_size", "int", 4, 64, log=True),
                KnobSpec("triforce_window", "int", 16, 252, log=True),
            ),
            schedule=HIERARCHICAL,
            actors=OnActors(TARGET_WITH_DRAFTER, schedule_field="triforce_schedule", ship_kv=True, level_stats=True),
            serves_auto_k=False,
            options=("draft", "triforce", "draft_model", "ngram", "confidence"),
        ),
        Method(
            "trained",
            "a trained drafter artifact (Kangaroo adapter, Medusa or Hydra heads, feature head, distilled draft)",
            # drafter: --range drafter=a,b,c searches artifacts, --set drafter=X fixes one; draft_vocab: VocabTrim
            (
                _K,
                _CONFIDENCE,
                KnobSpec("drafter", "choice", choices=("",)),
                KnobSpec("draft_vocab", "choice", choices=(0, 4096, 8192, 16384)),
                *_TREE,
                _STOP,
            ),
            needs_drafter=True,
            resolve=_resolve_trained,
            fit=_and_stop(_fit_trained),
            options=("draft", "confidence", "drafter", "vocab", "tree", "stop"),
        ),
        Method(
            "eagle",
            "a feature-level head (the target's low, middle and last hidden states, one layer, a trimmed vocabulary) drafts "
            "chains or dynamic trees sized by the measured verification cost; the head shipped for the model unless drafter=",
            # k: the tree's depth; tree_budget: nodes drafted before the cost curve picks the verified prefix
            (
                KnobSpec("k", "int", 2, 10),
                KnobSpec("tree", "choice", choices=("levels", "dyspec", "chain")),
                KnobSpec("tree_budget", "int", 8, 64),
                *_FIT[:1],
                _STOP,
            ),
            fit=_and_stop(None),
            options=("draft", "confidence", "drafter", "tree", "stop"),
            # a 3-token chain: on this project's 2-core CPU every draft forward of the head costs about a tenth of the
            # target's step, so chains beat trees (six first-turn Spec-Bench prompts, 2 threads: chain k=3 0.69x AR,
            # levels of 4 or 8 nodes 0.53x / 0.51x, dyspec of 32 0.24x); --set tree=levels for a GPU's cheap width
            defaults={"k": 3, "tree": "chain"},
        ),
        Method(
            "recycling",
            "Token Recycling: a tree from the target's own past top-k candidates (an adjacency matrix)",
            (_K, *_RECYCLE, *_FIT),
            options=("draft", "recycling", "tree", "memory"),
        ),
        Method(
            "suffix",
            "suffix decoding: a tree from suffix tries over this and earlier requests",
            (_K, *_SUFFIX, *_FIT),
            options=("draft", "recycling", "suffix", "tree", "memory"),
        ),
        Method(
            "hybrid",
            "recycling, suffix and prompt-lookup drafts merged into one tree",
            (_K, *_RECYCLE, *_SUFFIX, *_FIT),
            options=("draft", "recycling", "suffix", "ngram", "tree", "memory", "drafter", "confidence"),
        ),
        Method(
            "swift",
            "SWIFT: the target drafts for itself with a swift_skip share of its intermediate layers skipped, the skipped set "
            "searched during generation (swift_trials trials of a local random search), with a confidence stop",
            (
                KnobSpec("k", "int", 1, 10),
                KnobSpec("swift_skip", "float", 0.1, 0.6, step=0.05),
                _CONFIDENCE,
                _STOP,
            ),
            options=("draft", "swift", "confidence", "memory", "stop"),
            defaults={"k": 4, "confidence_threshold": 0.6},
        ),
        Method(
            "del",
            "DEL: early exit whose exit layer and draft length are chosen per step from each candidate exit's tracked "
            "acceptance (tokens per layer); a plain target step where no exit pays",
            (KnobSpec("k", "int", 1, 8), _CONFIDENCE, _STOP),
            options=("draft", "confidence", "stop"),
            defaults={"k": 4},
        ),
        Method(
            "ead",
            "EAD (LOSSY): a small model (the distilled draft, draft_model or the target's first draft_layers layers) "
            "generates while the rolling entropy of the writers' predictions stays under ead_threshold, the target above it; no "
            "verification",
            (
                KnobSpec("ead_threshold", "float", 0.25, 4.0, step=0.25),
                KnobSpec("ead_window", "int", 1, 16),
                KnobSpec("k", "int", 4, 32),
            ),
            lossy=True,
            serves_auto_k=False,
            options=("draft", "draft_model", "ead"),
            defaults={"k": 16, "adaptive_k": False},
        ),
    )
}
METHODS = tuple(METHOD_TABLE)


def method_of(name: str) -> Method:
    """The table entry of a method; an unknown name fails with a ``ConfigError`` on ``method``."""
    try:
        return METHOD_TABLE[name]
    except (KeyError, TypeError):
        raise ConfigError("method", f"unknown method {name!r}; choose from {', '.join(METHODS)}") from None


def actor_methods() -> tuple[str, ...]:
    """The methods ``placement=actors`` runs."""
    return tuple(name for name, m in METHOD_TABLE.items() if m.actors is not None)


def on_actors(cfg: SpecConfig) -> OnActors:
    """How ``cfg`` runs over a target and a draft worker; a method the workers cannot run fails on ``placement``."""
    plan = method_of(cfg.method).actors
    if plan is None:
        *rest, last = actor_methods()
        raise ConfigError("placement", f"placement=actors runs {', '.join(rest)} and {last}, not {cfg.method!r}")
    return plan


def runs_on_actors(method: str | None, placement: str | None) -> bool:
    """Whether a config of ``method`` with ``placement`` hosts its models in actors (pearl always does)."""
    entry = METHOD_TABLE.get(method) if isinstance(method, str) else None
    return placement == "actors" or (entry is not None and entry.actors is not None and entry.actors.always)
