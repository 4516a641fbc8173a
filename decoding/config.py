"""The one configuration object of a speculative run.

A ``SpecConfig`` is a frozen, typed, JSON-serialisable description of a
generation: the common fields (method, model, sampling, dtype, device) and the
options its method reads (draft length, tree, drafter knobs, placement). The
method's table entry (``decoding.methods``) names the option groups it reads and
its own defaults; an option left unset takes the method's default (``eagle``
drafts a dynamic tree of 32 nodes, depth 6), and a config changed to another
method (``replace``, ``for_method``) takes that method's defaults for what was
never set. The JSON is flat: the common fields, the method's options and any
option given explicitly; flat keys of any option are accepted as input. The
same object is a benchmark row, a Tune sample, a registry entry and a Serve
model name. Invalid values fail at construction with a ``ConfigError`` that
names the field.

>>> cfg = SpecConfig(method="ngram", k=6)
>>> SpecConfig.from_json(cfg.to_json()) == cfg
True
>>> cfg.with_overrides(["k=3", "ngram_max=4"]).k
3
>>> "exit_layer" in cfg.to_dict(), SpecConfig(method="eagle").k, cfg.replace(method="eagle").k
(False, 3, 6)

The options
-----------
Each method reads some groups of them (``decoding.methods.OPTION_GROUPS``):

draft_model: for ``sps``, a separate model with the same tokenizer. When
    unset, the draft is a shallow model made of the target's first
    ``draft_layers`` layers plus its final norm and LM head.
k: the most a step drafts (tokens proposed per target forward); with
    ``adaptive_k=false`` exactly k (for experiments). ``k=auto``
    (``--set k=auto``) is the default and keeps k's value as the cap.
adaptive_k: (default true) choose the draft length per step and per
    sequence, 0 to k, maximising expected committed tokens per second from
    the sequence's measured acceptance, the measured cost of a target
    forward by batch rows and tokens on this device, and what its drafter's
    proposals cost (``decoding.loop.goodput``): drafting stops where it does
    not pay and is probed again now and then, so no method runs slower than
    AR by much; long drafts at low load, none at high load. Trees draft
    whole or not at all. Methods with a schedule of their own (pearl,
    triforce) keep their k. Sampled output then depends on measured times
    (which draft lengths drew which random numbers): the same distribution,
    not the same tokens from run to run; ``adaptive_k=false`` reproduces them.
glance: (default true) under k=auto, a row also weighs prompt lookup's
    chain (the continuation of its text's latest earlier 1-3-gram, 0.02 ms
    a step) and drafts it where it is worth more than the method's own
    drafts: a model drafter then rests that step; suffix decoding and the
    hybrid draft it where their own proposals stop paying. ``glance=false``
    leaves the method's drafter alone (for experiments on the drafter).
exit_layer: for ``early-exit``, the number of target layers that draft.
confidence_threshold: stop drafting when the drafter's top-1 probability
    falls below it (Kangaroo's double early exit); 0 disables the stop.
ngram_max / ngram_min: the longest and shortest suffix n-gram the prompt
    lookup drafter tries to match.
placement: ``local`` (one process) or ``actors`` (draft and target in
    separate Ray actors; ``pearl`` always uses actors; ``triforce`` puts
    its middle and bottom levels in the draft actor, see triforce_schedule).
draft_threads / target_threads: torch threads (and Ray CPUs) of the draft
    and target workers; unset = half the node's CPUs each on one node.
num_gpus_per_model: GPUs per worker; unset = 1 with two or more GPUs in the
    cluster, 0.5 with one, 0 without.
rpc_timeout_s: the longest wait for a worker's answer before the
    generation fails (a dead worker fails at once).
placement_timeout_s: the longest wait for the placement group's resources.
actor_transport: ``calls`` (plain actor calls) or ``compiled`` (Ray
    compiled graphs) between the driver and the workers.
tree: the shape drafts take (``sps``, ``early-exit``, ``ngram``, and ``trained``
    drafters with Medusa, Hydra or distilled-draft recipes): ``chain``
    (k drafts in a row), ``static`` (the rank paths in ``tree_paths``),
    ``sequoia`` (the tree of ``tree_budget`` nodes and depth <= k maximising
    the expected accepted length under ``tree_acceptance``, a per-rank
    acceptance vector; unset = a generic falling profile,
    ``jobs.bench_trees --calibrate`` measures yours) or
    ``levels`` (EAGLE-2's dynamic tree: grown level by level, the 8 most
    probable children of each level fed in one draft forward, then the
    ``tree_budget`` best nodes kept) or
    ``dyspec`` (grown per step best-first by draft probability, up to
    ``tree_budget`` nodes, depth <= k). ``ngram`` merges several earlier
    matches into a trie of as many nodes as the shape has.
triforce_*: for ``triforce`` (decoding/schedules/triforce.py), whose top level drafts
    ``k`` tokens per full-target forward with the target over a retrieval
    cache of ``triforce_budget`` prompt tokens in chunks of
    ``triforce_chunk_size``; that middle level is drafted for by
    ``triforce_bottom``: ``layers`` (the target's first ``draft_layers``
    layers), ``model`` (``draft_model``) or ``ngram`` (``ngram_max`` /
    ``ngram_min``), which proposes ``triforce_gamma`` tokens per middle
    forward; the model bottoms keep a StreamingLLM cache of
    ``triforce_sinks`` first positions plus the latest ``triforce_window``.
    With ``placement=actors`` the middle and bottom levels run in a draft
    worker (holding its own copy of the target and of its cache, kept exact
    by the KV each verdict ships) and the full target in a target worker;
    ``triforce_schedule`` is ``sps`` (the top verifies, then the middle
    drafts: TriForce's own order) or ``pearl`` (the middle drafts the next
    tokens while the top verifies the last ones).
    The default bottom is ``ngram``: on SmolLM2-135M the first 8 layers
    (plus norm and head, which alone cost a fifth of a full forward) had
    their drafts accepted by the middle level 2% of the time, n-gram 12-40%.
drafter: for ``trained``, a trained drafter artifact (its name under
    ``$SPECRAY_HOME/drafters`` or a directory): a Kangaroo adapter, Medusa
    or Hydra heads, a feature-level head or a distilled draft model
    (``specray train-drafter``). Its recipe knobs (exit layer, heads) come
    from the artifact; ``k`` and ``confidence_threshold`` apply.
draft_vocab: for ``trained``, draft over only this many of the most
    frequent tokens of the drafter's training data (VocabTrim: a smaller
    LM head for drafting); 0 = the full head.
stop_threshold / stop_head: SpecDec++'s stop on a model drafter's chains
    (``sps``, ``eagle``, ``early-exit``, ``trained``, ``swift``, ``del``;
    decoding/drafters/stop_head.py): a chain stops once the predicted
    probability that one of its drafts is rejected passes ``stop_threshold``
    (0 = off); ``stop_head`` names the head's artifact (default: the one
    shipped for the drafter). Chains only.
swift_skip / swift_trials: for ``swift`` (decoding/drafters/swift.py), the
    share of the skippable layers (all but the first and last) a draft
    skips, and the trials of the search for which ones.
ead_threshold / ead_window: for ``ead`` (lossy; decoding/drafters/ead.py),
    the small model writes while the mean entropy (nats) of the last
    ``ead_window`` positions' predictions (each from the model that wrote
    it) stays at or under ``ead_threshold``, the target otherwise; ``k``
    caps one run of the small model.
recycling / suffix / hybrid (decoding/drafters/recycling.py, suffix.py, hybrid.py):
    model-free tree drafters, ``k`` is the tree depth. ``recycle_width``:
    candidates kept per token in Token Recycling's adjacency matrix (1 =
    chains); ``tree_paths`` (with tree=static) replaces its Sequoia template.
    ``suffix_factor``: draft nodes per matched token; ``suffix_min_prob``:
    the least path probability a suffix draft keeps; ``suffix_depth``: the
    suffix tries' depth (longest substring counted); ``suffix_cache_tokens``:
    tokens of earlier outputs the global suffix cache keeps;
    ``suffix_corpus``: the model's own answers written ahead of time
    (``specray distill``'s folder) searched as a third source
    (decoding/drafters/suffix_corpus.py): ``auto`` (this checkout's
    ``data/distill/<model>`` when there is one), ``none``, or a folder.
    ``draft_memory``: ``warm`` (the adjacency matrix and suffix cache live
    with the decoder across requests) or ``cold`` (reset every request, for
    fair per-prompt benchmarks). ``tree_fit``: ``measured`` (tree size by
    expected tokens per second under the verification cost measured on this
    host, cached under $SPECRAY_HOME/calibration) or ``budget`` (exactly
    ``tree_budget`` nodes).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import typing
from dataclasses import dataclass, field

from decoding.errors import ConfigError
from decoding.limits import MAX_THREADS, check_config

# the methods (METHODS: their names, re-exported here), their option groups and the constants they share live in the table
from decoding.methods import ACTOR_TRANSPORTS, METHOD_TABLE, METHODS, OPTION_OF, TRIFORCE_BOTTOMS, TWO_SIDED_SCHEDULES
from decoding.treespec import TreeError, parse_acceptance, parse_paths

DTYPES = ("float32", "bfloat16")
QUANTS = ("auto", "none", "q4", "int8")  # the weights a load runs (decoding.model.quant, which keeps the same names)
PLACEMENTS = ("local", "actors")
TREE_SHAPES = ("chain", "static", "sequoia", "dyspec", "levels")  # the tree shapes a config may name (decoding.trees.shapes builds them)
DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")  # decoding.model.loading.resolve_device turns it into a torch.device
DRAFT_MEMORIES = ("warm", "cold")
TREE_FITS = ("measured", "budget")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(name, message)


COMMON = (
    *("method", "model", "temperature", "top_p", "top_k", "seed", "max_new_tokens"),
    *("dtype", "quant", "compile", "threads", "device", "extra"),  # the target as run, and where
)


@dataclass(frozen=True, init=False)
class SpecConfig:
    """Everything that determines what a generation computes and how: the common fields below, and the options its
    method reads (documented in this module's docstring).

    Common fields
    -------------
    method: a name in ``decoding.methods.METHODS``, the table of methods (``ar`` is the baseline; docs/methods.md
        describes every method and the options it reads).
    model: ``smollm2-135m`` (bundled) or a local Hugging Face model directory.
    temperature / top_p / top_k: sampling; temperature 0 is greedy decoding.
        The same warping is applied to draft and target distributions. Their
        limits, and seed's and max_new_tokens', are the HTTP API's (``decoding.limits``).
    seed: seed of the ``torch.Generator`` that drives every random draw.
    quant: the target's weights (decoding/model/quant.py): ``auto`` (default: the
        GGUF's own 4-bit blocks when the model is a Q4_1 GGUF run in bfloat16 on
        a CPU, else dense), ``none`` (dense in ``dtype``), ``q4`` (the GGUF's
        Q4_1/Q8_0 blocks in torch's packed int4 kernel; other models are
        quantised to Q4_1-style groups) or ``int8`` (per-channel int8 weight-only).
        Lossless means against the target as run: AR with the same ``quant``.
    compile: run the target's layer stack compiled by ``torch.compile`` for one row
        (decoding/model/compiled.py: width buckets 1-32, each compiled on first
        use, minutes the first time on a machine, cached under
        ``$SPECRAY_HOME/compile``); batches of several rows, partial layer ranges
        and wider blocks run eager; eager too, with one warning, where compiling
        fails. Off by default: a 22.3 -> 16.9 ms one-token q4 step on the 2-core
        host, against minutes of compiling per width.
    device: where the model(s) of an in-process decoder live: ``auto`` (CUDA
        when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``. Inside Ray
        workers the outer layers turn ``auto`` into the GPU Ray gave the worker,
        else CPU (actors/devices.py).
    """

    # ---- common: every configuration has them -------------------------------------------------------------------------
    method: str = "ar"
    model: str = "smollm2-135m"
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_new_tokens: int = 128
    dtype: str = "bfloat16"
    quant: str = "auto"
    compile: bool = False
    threads: int | None = None
    device: str = "auto"
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    # ---- options: each method reads some groups of them (decoding.methods.OPTION_GROUPS); one not given takes the
    # method's own default (Method.defaults), else the default written here
    k: int = 4
    adaptive_k: bool = True
    glance: bool = True
    # trees (decoding/trees/shapes.py): chain | static (tree_paths: JSON rank paths, e.g. [[0],[1],[0,0]]) | sequoia
    # (tree_acceptance: per-rank acceptance, e.g. [0.6,0.1,0.05]) | dyspec | levels; tree_budget: draft nodes per step
    tree: str = "chain"
    tree_paths: str = ""
    tree_budget: int = 16
    tree_acceptance: str = ""
    tree_fit: str = "measured"
    draft_model: str | None = None
    draft_layers: int = 8
    confidence_threshold: float = 0.0
    exit_layer: int = 24
    ngram_max: int = 3
    ngram_min: int = 1
    # a trained drafter artifact (name under $SPECRAY_HOME/drafters, or a directory); see decoding/drafters/artifacts.py
    drafter: str | None = None
    draft_vocab: int = 0
    # method=triforce: see decoding/schedules/triforce.py; triforce_schedule (placement=actors): sps or pearl
    triforce_budget: int = 1024
    triforce_chunk_size: int = 16
    triforce_gamma: int = 4
    triforce_sinks: int = 4
    triforce_window: int = 252
    triforce_bottom: str = "ngram"
    triforce_schedule: str = "sps"
    # the model-free drafters: decoding/drafters/recycling.py, suffix.py, hybrid.py
    recycle_width: int = 8
    suffix_factor: float = 1.0
    suffix_min_prob: float = 0.1
    suffix_depth: int = 24
    suffix_cache_tokens: int = 16384
    suffix_corpus: str = "auto"
    draft_memory: str = "warm"
    # the stop head (decoding/drafters/stop_head.py): stop a chain once the predicted probability that one of its drafts
    # is rejected passes stop_threshold (0 = off); stop_head: an artifact (default: the one shipped for the drafter)
    stop_threshold: float = 0.0
    stop_head: str | None = None
    # method=swift (decoding/drafters/swift.py): the share of the skippable layers a draft skips, trials of the search
    swift_skip: float = 0.2  # SWIFT's paper skips 45% of a 13B model's layers; a 135M model has less to spare
    swift_trials: int = 16
    # method=ead (decoding/drafters/ead.py, lossy): the small model writes while the mean entropy (nats) of the last
    # ead_window positions' predictions (each from the model that wrote it) stays at or under ead_threshold
    ead_threshold: float = 1.5
    ead_window: int = 4
    # placement=actors (and pearl): see cluster/placement.py; None = chosen from the cluster's resources
    placement: str = "local"
    draft_threads: int | None = None
    target_threads: int | None = None
    num_gpus_per_model: float | None = None
    rpc_timeout_s: float = 120.0
    placement_timeout_s: float = 30.0
    actor_transport: str = "calls"
    # the options given explicitly (the others took a default; a new method gives them its own: replace)
    _given: frozenset = field(default=frozenset(), repr=False, compare=False, hash=False)

    def __init__(self, **values):
        """Keyword fields only; an option not given takes its method's default, else the class's."""
        method = values.get("method", "ar")
        own = METHOD_TABLE[method].defaults if method in METHOD_TABLE else {}
        given = frozenset(name for name in values if name in OPTION_DEFAULTS)
        for f in _FIELDS:
            if f.name in values:
                value = values.pop(f.name)
            elif f.name in own:
                value = own[f.name]
            else:
                value = f.default_factory() if f.default is dataclasses.MISSING else f.default
            object.__setattr__(self, f.name, value)
        if values:
            raise TypeError(f"SpecConfig got unknown fields: {', '.join(sorted(values))}")
        object.__setattr__(self, "_given", given)
        self.__post_init__()

    def __post_init__(self) -> None:
        _check(self.method in METHODS, "method", f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        entry = METHOD_TABLE[self.method]
        _check_common(self)
        # the groups the method reads, and any group an option was given in: a value given must be valid
        for group in dict.fromkeys([*entry.groups, *sorted(OPTION_OF[name] for name in self._given)]):
            _GROUP_CHECKS[group](self)
        _check(self.tree == "chain" or not entry.chains_only, "tree", f"{self.method} drafts chains only")
        _check(not entry.needs_drafter or bool(self.drafter), "drafter", f"method {self.method} needs drafter=NAME or a directory")

    @property
    def given(self) -> dict:
        """The options set explicitly (not taken from a default), by name."""
        return {name: getattr(self, name) for name in OPTION_DEFAULTS if name in self._given}

    def for_method(self, label: str) -> SpecConfig:
        """The config a bench label names: a method, or ``METHOD:NAME`` (the method with drafter NAME: a trained
        artifact for ``trained``, ``eagle``, ``early-exit`` and ``hybrid``, ``none`` for no shipped drafter);
        ``placement=actors`` stays with the methods that run on workers (the others run in process).

        >>> SpecConfig().for_method("trained:kangaroo-l10").drafter
        'kangaroo-l10'
        >>> SpecConfig().for_method("hybrid:none").drafter, SpecConfig().for_method("eagle").method
        ('none', 'eagle')
        >>> base = SpecConfig(placement="actors")
        >>> base.for_method("sps").placement, base.for_method("ngram").placement
        ('actors', 'local')
        """
        method, _, drafter = label.partition(":")
        cfg = self.replace(method=method, drafter=drafter) if drafter and method in METHOD_TABLE else self.replace(method=label)
        return cfg if cfg.placement == "local" or METHOD_TABLE[cfg.method].actors is not None else cfg.replace(placement="local")

    # ---- serialisation -------------------------------------------------
    def to_dict(self) -> dict:
        """The common fields, the options the method reads and any option given explicitly (flat, JSON-ready)."""
        keep = set(COMMON) | set(METHOD_TABLE[self.method].fields) | set(self.given)
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name in keep}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> SpecConfig:
        if not isinstance(data, dict):
            raise ConfigError("config", f"expected a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(COMMON) - set(OPTION_DEFAULTS))
        if unknown:
            _unknown_field(unknown[0])
        return cls(**{k: _coerce(k, v) for k, v in _auto_k(data).items()})

    @classmethod
    def from_json(cls, text: str) -> SpecConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError("config", f"not valid JSON ({e})") from None
        return cls.from_dict(data)

    def replace(self, **changes) -> SpecConfig:
        """A copy with ``changes``; options that took a default take the (new) method's defaults again."""
        changes = {k: _coerce(k, v) for k, v in _auto_k(changes).items()}
        kept = {name: getattr(self, name) for name in COMMON} | self.given
        return SpecConfig(**(kept | changes))

    def with_overrides(self, assignments: list[str], **changes) -> SpecConfig:
        """Apply ``key=value`` strings (the CLI's ``--set``), parsed by field type, over ``changes``, in one step
        (so fields that only make sense together, e.g. method=trained and drafter=X, can arrive from both)."""
        changes = dict(changes)
        for item in assignments:
            key, sep, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or not key:
                raise ConfigError(key or "set", f"expected key=value, got {item!r}")
            changes[key] = value.strip() if key == "k" and value.strip().lower() == "auto" else _parse_value(key, value.strip())
        return self.replace(**changes)


def _check_common(c: SpecConfig) -> None:
    """The common fields (every configuration has them)."""
    _check(bool(c.model), "model", "must name a model")
    _check(c.dtype in DTYPES, "dtype", f"unknown dtype {c.dtype!r}; choose from {', '.join(DTYPES)}")
    _check(c.quant in QUANTS, "quant", f"unknown quantisation {c.quant!r}; choose from {', '.join(QUANTS)}")
    check_config(c)  # temperature, top_p, top_k, seed, max_new_tokens: the limits the HTTP API has too
    _check(c.threads is None or 1 <= c.threads <= MAX_THREADS, "threads", f"must be in [1, {MAX_THREADS}], got {c.threads}")
    _check(
        DEVICE_RE.fullmatch(c.device) is not None,
        "device",
        f"unknown device {c.device!r}; choose from auto, cpu, cuda, cuda:N",
    )


# ---- each option group's checks (a method's groups, and any group an option was given in) -------------------------
def _check_draft(c: SpecConfig) -> None:
    _check(c.k >= 1, "k", f"draft length must be >= 1, got {c.k}")


def _check_tree(c: SpecConfig) -> None:
    _check(c.tree in TREE_SHAPES, "tree", f"unknown tree {c.tree!r}; choose from {', '.join(TREE_SHAPES)}")
    _check(c.tree_budget >= 1, "tree_budget", f"must be >= 1, got {c.tree_budget}")
    _check(c.tree != "static" or bool(c.tree_paths), "tree_paths", "tree=static needs tree_paths, e.g. [[0],[1],[0,0]]")
    _check(c.tree_fit in TREE_FITS, "tree_fit", f"unknown tree fit {c.tree_fit!r}; choose from {', '.join(TREE_FITS)}")
    for name, parse in (("tree_paths", parse_paths), ("tree_acceptance", parse_acceptance)):
        if getattr(c, name):
            try:
                parse(getattr(c, name))
            except TreeError as e:
                raise ConfigError(name, str(e)) from None


def _check_draft_model(c: SpecConfig) -> None:
    _check(c.draft_layers >= 1, "draft_layers", f"must be >= 1, got {c.draft_layers}")


def _check_confidence(c: SpecConfig) -> None:
    _check(0.0 <= c.confidence_threshold < 1.0, "confidence_threshold", f"must be in [0, 1), got {c.confidence_threshold}")


def _check_exit(c: SpecConfig) -> None:
    _check(c.exit_layer >= 1, "exit_layer", f"must be >= 1, got {c.exit_layer}")


def _check_ngram(c: SpecConfig) -> None:
    _check(c.ngram_min >= 1, "ngram_min", f"must be >= 1, got {c.ngram_min}")
    _check(c.ngram_max >= c.ngram_min, "ngram_max", f"must be >= ngram_min ({c.ngram_min}), got {c.ngram_max}")


def _check_vocab(c: SpecConfig) -> None:
    _check(c.draft_vocab >= 0, "draft_vocab", f"must be >= 0 (0 = the full LM head), got {c.draft_vocab}")


def _check_triforce(c: SpecConfig) -> None:
    _check(c.triforce_chunk_size >= 1, "triforce_chunk_size", f"must be >= 1, got {c.triforce_chunk_size}")
    _check(
        c.triforce_budget >= c.triforce_chunk_size,
        "triforce_budget",
        f"must hold at least one chunk (triforce_chunk_size={c.triforce_chunk_size}), got {c.triforce_budget}",
    )
    _check(c.triforce_sinks >= 0, "triforce_sinks", f"must be >= 0, got {c.triforce_sinks}")
    _check(c.triforce_window >= 1, "triforce_window", f"must be >= 1, got {c.triforce_window}")
    _check(
        c.triforce_budget >= c.triforce_sinks + c.triforce_window,
        "triforce_budget",
        f"must be at least triforce_sinks + triforce_window ({c.triforce_sinks + c.triforce_window}): the middle level "
        f"must see at least as much context as the bottom, got {c.triforce_budget}",
    )
    _check(c.triforce_gamma >= 1, "triforce_gamma", f"must be >= 1, got {c.triforce_gamma}")
    _check(
        c.triforce_bottom in TRIFORCE_BOTTOMS,
        "triforce_bottom",
        f"unknown bottom drafter {c.triforce_bottom!r}; choose from {', '.join(TRIFORCE_BOTTOMS)}",
    )
    _check(
        c.triforce_schedule in TWO_SIDED_SCHEDULES,
        "triforce_schedule",
        f"unknown schedule {c.triforce_schedule!r}; choose from {', '.join(TWO_SIDED_SCHEDULES)}",
    )


def _check_recycling(c: SpecConfig) -> None:
    _check(c.recycle_width >= 1, "recycle_width", f"must be >= 1, got {c.recycle_width}")


def _check_suffix(c: SpecConfig) -> None:
    _check(c.suffix_factor > 0, "suffix_factor", f"must be > 0, got {c.suffix_factor}")
    _check(0.0 <= c.suffix_min_prob <= 1.0, "suffix_min_prob", f"must be in [0, 1], got {c.suffix_min_prob}")
    _check(c.suffix_depth >= 2, "suffix_depth", f"must be >= 2, got {c.suffix_depth}")
    _check(c.suffix_cache_tokens >= 0, "suffix_cache_tokens", f"must be >= 0 (0 = no global cache), got {c.suffix_cache_tokens}")


def _check_memory(c: SpecConfig) -> None:
    memories = ", ".join(DRAFT_MEMORIES)
    _check(c.draft_memory in DRAFT_MEMORIES, "draft_memory", f"unknown draft memory {c.draft_memory!r}; choose from {memories}")


def _check_stop(c: SpecConfig) -> None:
    _check(0.0 <= c.stop_threshold < 1.0, "stop_threshold", f"must be in [0, 1) (0 = no stop head), got {c.stop_threshold}")
    _check(c.stop_threshold == 0 or c.tree == "chain", "stop_threshold", f"the stop head stops chains; tree={c.tree} drafts a tree")


def _check_swift(c: SpecConfig) -> None:
    _check(0.0 < c.swift_skip < 1.0, "swift_skip", f"must be in (0, 1), got {c.swift_skip}")
    _check(c.swift_trials >= 0, "swift_trials", f"must be >= 0 (0 = no search), got {c.swift_trials}")


def _check_ead(c: SpecConfig) -> None:
    _check(c.ead_threshold >= 0, "ead_threshold", f"must be >= 0 (nats), got {c.ead_threshold}")
    _check(c.ead_window >= 1, "ead_window", f"must be >= 1, got {c.ead_window}")
    _check(not (c.method == "ead" and c.adaptive_k), "k", "ead switches models by entropy: k=auto does not apply")


def _check_actors(c: SpecConfig) -> None:
    _check(c.placement in PLACEMENTS, "placement", f"unknown placement {c.placement!r}; choose from {', '.join(PLACEMENTS)}")
    for name in ("draft_threads", "target_threads"):
        value = getattr(c, name)
        _check(value is None or 1 <= value <= MAX_THREADS, name, f"must be in [1, {MAX_THREADS}], got {value}")
    gpus = c.num_gpus_per_model
    _check(gpus is None or gpus >= 0, "num_gpus_per_model", f"must be >= 0, got {gpus}")
    _check(c.rpc_timeout_s > 0, "rpc_timeout_s", f"must be > 0, got {c.rpc_timeout_s}")
    _check(c.placement_timeout_s > 0, "placement_timeout_s", f"must be > 0, got {c.placement_timeout_s}")
    _check(
        c.actor_transport in ACTOR_TRANSPORTS,
        "actor_transport",
        f"unknown transport {c.actor_transport!r}; choose from {', '.join(ACTOR_TRANSPORTS)}",
    )


def _nothing(c: SpecConfig) -> None:
    """An option group with nothing to check on its own (a drafter name is checked when it loads)."""


_GROUP_CHECKS = {
    "draft": _check_draft,
    "tree": _check_tree,
    "draft_model": _check_draft_model,
    "confidence": _check_confidence,
    "exit": _check_exit,
    "ngram": _check_ngram,
    "drafter": _nothing,
    "vocab": _check_vocab,
    "triforce": _check_triforce,
    "recycling": _check_recycling,
    "suffix": _check_suffix,
    "memory": _check_memory,
    "stop": _check_stop,
    "swift": _check_swift,
    "ead": _check_ead,
    "actors": _check_actors,
}


_FIELDS = [f for f in dataclasses.fields(SpecConfig) if not f.name.startswith("_")]
OPTION_DEFAULTS = {f.name: f.default for f in _FIELDS if f.name not in COMMON}  # every option and its own default
_FIELD_TYPES = typing.get_type_hints(SpecConfig)


def _auto_k(changes: dict) -> dict:
    """``k="auto"`` means adaptive_k=True with k left as it is (the cap).

    >>> _auto_k({"k": "auto"})
    {'adaptive_k': True}
    """
    if isinstance(changes.get("k"), str) and changes["k"].lower() == "auto":
        changes = {key: v for key, v in changes.items() if key != "k"}
        changes["adaptive_k"] = True
    return changes


def _unknown_field(name: str) -> typing.NoReturn:
    """A field no configuration has: one line that lists the ones there are (a config file, ``--set``, a request)."""
    raise ConfigError(name, f"unknown field; known fields: {', '.join(sorted(set(COMMON) | set(OPTION_DEFAULTS)))}")


def _coerce(name: str, value):
    """Check a value against the field's declared type; accept ints for floats."""
    if name not in _FIELD_TYPES or name.startswith("_"):
        _unknown_field(name)
    hint = _FIELD_TYPES[name]
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if value is None:
        if optional:
            return None
        raise ConfigError(name, "must not be null")
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base in (int, float) and isinstance(value, bool):
        raise ConfigError(name, f"expected {base.__name__}, got a boolean")
    if not isinstance(value, typing.get_origin(base) or base):
        raise ConfigError(name, f"expected {getattr(base, '__name__', base)}, got {type(value).__name__} {value!r}")
    return value


def _parse_value(name: str, text: str):
    if name not in _FIELD_TYPES or name.startswith("_"):
        _unknown_field(name)
    hint = _FIELD_TYPES[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args else hint
    if text.lower() in ("none", "null") and type(None) in typing.get_args(hint):
        return None
    if base is bool:
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ConfigError(name, f"expected true or false, got {text!r}")
        return text.lower() in ("true", "1", "yes")
    try:
        if base is int:
            return int(text)
        if base is float:
            return float(text)
        if base is dict:
            return json.loads(text)
    except ValueError:
        raise ConfigError(name, f"expected {base.__name__}, got {text!r}") from None
    return text
