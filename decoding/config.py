"""The one configuration object of a speculative run.

A ``SpecConfig`` is a frozen, typed, JSON-serialisable description of a
generation: method, drafter knobs, sampling, model, dtype and placement. The
same object is a benchmark row, a Tune sample and (later) a registry entry and
a Serve model name. Invalid values fail at construction with a ``ConfigError``
that names the field.

>>> cfg = SpecConfig(method="ngram", k=6)
>>> SpecConfig.from_json(cfg.to_json()) == cfg
True
>>> cfg.with_overrides(["k=3", "ngram_max=4"]).k
3
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from dataclasses import dataclass, field

from decoding.errors import ConfigError

# the methods (METHODS: their names, re-exported here) and the constants they share live in the table
from decoding.methods import ACTOR_TRANSPORTS, METHOD_TABLE, METHODS, TRIFORCE_BOTTOMS, TWO_SIDED_SCHEDULES

DTYPES = ("float32", "bfloat16")
QUANTS = ("auto", "none", "q4", "int8")  # the weights a load runs (decoding.model.quant, which keeps the same names)
PLACEMENTS = ("local", "actors")
TREE_SHAPES = ("chain", "static", "sequoia", "dyspec")  # the tree shapes a config may name (decoding.trees.trees builds them)
DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")  # decoding.model.models.resolve_device turns it into a torch.device
DRAFT_MEMORIES = ("warm", "cold")
TREE_FITS = ("measured", "budget")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(name, message)


@dataclass(frozen=True)
class SpecConfig:
    """Everything that determines what a generation computes and how.

    Fields
    ------
    method: one of ``ar`` (baseline), ``sps`` (separate draft model),
        ``ngram`` (prompt lookup), ``early-exit`` (self-speculation) and
        ``pearl`` (draft and target in parallel on two workers).
    model: ``smollm2-135m`` (bundled) or a local Hugging Face model directory.
    draft_model: for ``sps``, a separate model with the same tokenizer. When
        unset, the draft is a shallow model made of the target's first
        ``draft_layers`` layers plus its final norm and LM head.
    k: draft length (tokens proposed per target forward); with
        ``adaptive_k`` the most a step may draft. ``k=auto`` (``--set k=auto``,
        ``{"k": "auto"}``) sets ``adaptive_k`` and keeps k's value as that cap.
    adaptive_k: choose the draft length per step and per sequence, 0 to k,
        maximising expected committed tokens per second from the sequence's
        measured acceptance and the measured cost of a target forward by batch
        rows and tokens (``decoding.loop.goodput``): long drafts at low load, none at
        high load. Chains only; trees draft whole or not at all.
    exit_layer: for ``early-exit``, the number of target layers that draft.
    confidence_threshold: stop drafting when the drafter's top-1 probability
        falls below it (Kangaroo's double early exit); 0 disables the stop.
    ngram_max / ngram_min: the longest and shortest suffix n-gram the prompt
        lookup drafter tries to match.
    temperature / top_p / top_k: sampling; temperature 0 is greedy decoding.
        The same warping is applied to draft and target distributions.
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
    device: where the model(s) of an in-process decoder live: ``auto`` (CUDA
        when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``. Inside Ray
        workers the outer layers turn ``auto`` into the GPU Ray gave the worker,
        else CPU (actors/devices.py).
    recycling / suffix / hybrid (decoding/drafters/recycling.py, suffix.py, hybrid.py):
        model-free tree drafters, ``k`` is the tree depth. ``recycle_width``:
        candidates kept per token in Token Recycling's adjacency matrix (1 =
        chains); ``tree_paths`` (with tree=static) replaces its Sequoia template.
        ``suffix_factor``: draft nodes per matched token; ``suffix_min_prob``:
        the least path probability a suffix draft keeps; ``suffix_depth``: the
        suffix tries' depth (longest substring counted); ``suffix_cache_tokens``:
        tokens of earlier outputs the global suffix cache keeps.
        ``draft_memory``: ``warm`` (the adjacency matrix and suffix cache live
        with the decoder across requests) or ``cold`` (reset every request, for
        fair per-prompt benchmarks). ``tree_fit``: ``measured`` (tree size by
        expected tokens per second under the verification cost measured on this
        host, cached under $SPECRAY_HOME/calibration) or ``budget`` (exactly
        ``tree_budget`` nodes).
    """

    method: str = "ar"
    model: str = "smollm2-135m"
    draft_model: str | None = None
    draft_layers: int = 8
    k: int = 4
    adaptive_k: bool = False
    exit_layer: int = 24
    confidence_threshold: float = 0.0
    ngram_max: int = 3
    ngram_min: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_new_tokens: int = 128
    dtype: str = "bfloat16"
    quant: str = "auto"
    compile: bool = False
    threads: int | None = None
    placement: str = "local"
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    # placement=actors (and pearl): see cluster/placement.py; None = chosen from the cluster's resources
    draft_threads: int | None = None
    target_threads: int | None = None
    num_gpus_per_model: float | None = None
    rpc_timeout_s: float = 120.0
    placement_timeout_s: float = 30.0
    actor_transport: str = "calls"
    # token trees (decoding/trees/trees.py): chain (default) | static | sequoia | dyspec
    tree: str = "chain"
    tree_paths: str = ""  # static: JSON list of rank paths, e.g. [[0],[1],[0,0]]
    tree_budget: int = 16  # sequoia / dyspec / n-gram tries: draft nodes per step
    tree_acceptance: str = ""  # sequoia: per-rank acceptance, e.g. [0.6,0.1,0.05]; empty = trees.DEFAULT_ACCEPTANCE
    # method=triforce: see decoding/schedules/triforce.py
    triforce_budget: int = 1024
    triforce_chunk_size: int = 16
    triforce_gamma: int = 4
    triforce_sinks: int = 4
    triforce_window: int = 252
    triforce_bottom: str = "ngram"
    triforce_schedule: str = "sps"  # placement=actors: sps (sequential) or pearl (middle drafts while the top verifies)
    # method=trained: a trained drafter artifact (name under $SPECRAY_HOME/drafters, or a directory); see decoding/drafters/artifacts.py
    drafter: str | None = None
    draft_vocab: int = 0
    device: str = "auto"
    # method=recycling / suffix / hybrid: see decoding/drafters/recycling.py, suffix.py, hybrid.py
    recycle_width: int = 8
    suffix_factor: float = 1.0
    suffix_min_prob: float = 0.1
    suffix_depth: int = 24
    suffix_cache_tokens: int = 16384
    draft_memory: str = "warm"
    tree_fit: str = "measured"

    def __post_init__(self) -> None:
        _check(self.method in METHODS, "method", f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        _check(bool(self.model), "model", "must name a model")
        _check(self.dtype in DTYPES, "dtype", f"unknown dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        _check(self.quant in QUANTS, "quant", f"unknown quantisation {self.quant!r}; choose from {', '.join(QUANTS)}")
        _check(self.placement in PLACEMENTS, "placement", f"unknown placement {self.placement!r}; choose from {', '.join(PLACEMENTS)}")
        _check(self.k >= 1, "k", f"draft length must be >= 1, got {self.k}")
        _check(self.draft_layers >= 1, "draft_layers", f"must be >= 1, got {self.draft_layers}")
        _check(self.exit_layer >= 1, "exit_layer", f"must be >= 1, got {self.exit_layer}")
        _check(0.0 <= self.confidence_threshold < 1.0, "confidence_threshold", f"must be in [0, 1), got {self.confidence_threshold}")
        _check(self.ngram_min >= 1, "ngram_min", f"must be >= 1, got {self.ngram_min}")
        _check(self.ngram_max >= self.ngram_min, "ngram_max", f"must be >= ngram_min ({self.ngram_min}), got {self.ngram_max}")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        _check(self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        _check(self.threads is None or self.threads >= 1, "threads", f"must be >= 1, got {self.threads}")
        _check(self.draft_threads is None or self.draft_threads >= 1, "draft_threads", f"must be >= 1, got {self.draft_threads}")
        _check(self.target_threads is None or self.target_threads >= 1, "target_threads", f"must be >= 1, got {self.target_threads}")
        _check(
            self.num_gpus_per_model is None or self.num_gpus_per_model >= 0,
            "num_gpus_per_model",
            f"must be >= 0, got {self.num_gpus_per_model}",
        )
        _check(self.rpc_timeout_s > 0, "rpc_timeout_s", f"must be > 0, got {self.rpc_timeout_s}")
        _check(self.placement_timeout_s > 0, "placement_timeout_s", f"must be > 0, got {self.placement_timeout_s}")
        _check(
            self.actor_transport in ACTOR_TRANSPORTS,
            "actor_transport",
            f"unknown transport {self.actor_transport!r}; choose from {', '.join(ACTOR_TRANSPORTS)}",
        )
        _check(
            not METHOD_TABLE[self.method].needs_drafter or bool(self.drafter),
            "drafter",
            f"method {self.method} needs drafter=NAME or a directory",
        )
        _check(
            DEVICE_RE.fullmatch(self.device) is not None,
            "device",
            f"unknown device {self.device!r}; choose from auto, cpu, cuda, cuda:N",
        )
        _check(self.draft_vocab >= 0, "draft_vocab", f"must be >= 0 (0 = the full LM head), got {self.draft_vocab}")
        self._check_tree()
        self._check_triforce()
        self._check_model_free()

    def _check_tree(self) -> None:
        """Tree fields (see the class docstring); torch is imported only when a tree is configured."""
        _check(self.tree in TREE_SHAPES, "tree", f"unknown tree {self.tree!r}; choose from {', '.join(TREE_SHAPES)}")
        _check(self.tree_budget >= 1, "tree_budget", f"must be >= 1, got {self.tree_budget}")
        _check(self.tree == "chain" or not METHOD_TABLE[self.method].chains_only, "tree", f"{self.method} drafts chains only")
        _check(self.tree != "static" or bool(self.tree_paths), "tree_paths", "tree=static needs tree_paths, e.g. [[0],[1],[0,0]]")
        if self.tree == "chain" and not self.tree_paths and not self.tree_acceptance:
            return
        from decoding.trees.trees import TreeError, parse_acceptance, parse_paths

        for name, parse in (("tree_paths", parse_paths), ("tree_acceptance", parse_acceptance)):
            if getattr(self, name):
                try:
                    parse(getattr(self, name))
                except TreeError as e:
                    raise ConfigError(name, str(e)) from None

    def _check_triforce(self) -> None:
        _check(self.triforce_chunk_size >= 1, "triforce_chunk_size", f"must be >= 1, got {self.triforce_chunk_size}")
        _check(
            self.triforce_budget >= self.triforce_chunk_size,
            "triforce_budget",
            f"must hold at least one chunk (triforce_chunk_size={self.triforce_chunk_size}), got {self.triforce_budget}",
        )
        _check(self.triforce_sinks >= 0, "triforce_sinks", f"must be >= 0, got {self.triforce_sinks}")
        _check(self.triforce_window >= 1, "triforce_window", f"must be >= 1, got {self.triforce_window}")
        _check(
            self.triforce_budget >= self.triforce_sinks + self.triforce_window,
            "triforce_budget",
            f"must be at least triforce_sinks + triforce_window ({self.triforce_sinks + self.triforce_window}): the middle level "
            f"must see at least as much context as the bottom, got {self.triforce_budget}",
        )
        _check(self.triforce_gamma >= 1, "triforce_gamma", f"must be >= 1, got {self.triforce_gamma}")
        _check(
            self.triforce_bottom in TRIFORCE_BOTTOMS,
            "triforce_bottom",
            f"unknown bottom drafter {self.triforce_bottom!r}; choose from {', '.join(TRIFORCE_BOTTOMS)}",
        )
        _check(
            self.triforce_schedule in TWO_SIDED_SCHEDULES,
            "triforce_schedule",
            f"unknown schedule {self.triforce_schedule!r}; choose from {', '.join(TWO_SIDED_SCHEDULES)}",
        )

    def _check_model_free(self) -> None:
        _check(self.recycle_width >= 1, "recycle_width", f"must be >= 1, got {self.recycle_width}")
        _check(self.suffix_factor > 0, "suffix_factor", f"must be > 0, got {self.suffix_factor}")
        _check(0.0 <= self.suffix_min_prob <= 1.0, "suffix_min_prob", f"must be in [0, 1], got {self.suffix_min_prob}")
        _check(self.suffix_depth >= 2, "suffix_depth", f"must be >= 2, got {self.suffix_depth}")
        _check(self.suffix_cache_tokens >= 0, "suffix_cache_tokens", f"must be >= 0 (0 = no global cache), got {self.suffix_cache_tokens}")
        _check(
            self.draft_memory in DRAFT_MEMORIES,
            "draft_memory",
            f"unknown draft memory {self.draft_memory!r}; choose from {', '.join(DRAFT_MEMORIES)}",
        )
        _check(self.tree_fit in TREE_FITS, "tree_fit", f"unknown tree fit {self.tree_fit!r}; choose from {', '.join(TREE_FITS)}")

    def for_method(self, label: str) -> SpecConfig:
        """The config a bench label names: a method, or ``trained:NAME`` (method trained with drafter NAME).

        >>> SpecConfig().for_method("trained:kangaroo-l10").drafter
        'kangaroo-l10'
        """
        method, _, drafter = label.partition(":")
        if drafter and method in METHOD_TABLE and METHOD_TABLE[method].needs_drafter:
            return self.replace(method="trained", drafter=drafter)
        return self.replace(method=label)

    # ---- serialisation -------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> SpecConfig:
        if not isinstance(data, dict):
            raise ConfigError("config", f"expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown field; known fields: {', '.join(sorted(known))}")
        return cls(**{k: _coerce(k, v) for k, v in _auto_k(data).items()})

    @classmethod
    def from_json(cls, text: str) -> SpecConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError("config", f"not valid JSON ({e})") from None
        return cls.from_dict(data)

    def replace(self, **changes) -> SpecConfig:
        return dataclasses.replace(self, **{k: _coerce(k, v) for k, v in _auto_k(changes).items()})

    def with_overrides(self, assignments: list[str], **changes) -> SpecConfig:
        """Apply ``key=value`` strings (the CLI's ``--set``), parsed by field type, over ``changes``, in one step
        (so fields that only make sense together, e.g. method=trained and drafter=X, can arrive from both)."""
        changes = dict(changes)
        for item in assignments:
            key, sep, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep:
                raise ConfigError(key or "set", f"expected key=value, got {item!r}")
            changes[key] = value.strip() if key == "k" and value.strip().lower() == "auto" else _parse_value(key, value.strip())
        return self.replace(**changes)


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


def _coerce(name: str, value):
    """Check a value against the field's declared type; accept ints for floats."""
    if name not in _FIELD_TYPES:
        raise ConfigError(name, "unknown field")
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
    if name not in _FIELD_TYPES:
        raise ConfigError(name, "unknown field")
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
