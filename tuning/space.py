"""Search spaces over the knobs the methods expose, expressed over :class:`~decoding.config.SpecConfig`.

A space is a method choice (among the user's list) plus, per method, the knobs
that method reads. A sample is a nested dict, e.g.::

    {"method": "early-exit", "early-exit": {"k": 5, "exit_layer": 9, "confidence_threshold": 0.3}}

and :meth:`SearchSpace.to_config` maps it onto a base ``SpecConfig`` (only the
chosen method's knobs apply; the others are ignored). Invalid combinations are
resolved there, never left to crash a trial: ``ngram_min > ngram_max`` is
swapped, layer knobs are clamped below the model's depth. Whatever still fails
``SpecConfig``'s checks raises ``ConfigError``, which the trainable reports as
an invalid trial.

The same space drives two searchers: Optuna as a define-by-run function
(``space(trial)``: truly conditional, a method's knobs are only suggested when
the method is) and Tune's own random search (:meth:`SearchSpace.tune_space`).

The knobs, their default ranges and the resolvers of invalid combinations come from the table of methods
(``decoding.methods``): :data:`METHOD_KNOBS` is derived from it; a new method is searchable once it has an entry.

>>> space = SearchSpace.build(["ngram", "early-exit"], depth=4)
>>> space.knobs["early-exit"][1]
Knob(field='exit_layer', kind='int', low=1, high=3, choices=(), step=None, log=False)
>>> cfg = space.to_config({"method": "ngram", "ngram": {"k": 5, "ngram_max": 1, "ngram_min": 3}}, SpecConfig())
>>> (cfg.method, cfg.k, cfg.ngram_min, cfg.ngram_max)
('ngram', 5, 1, 3)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from decoding.config import METHODS, SpecConfig
from decoding.errors import ConfigError
from decoding.methods import DEPTH, METHOD_TABLE, KnobSpec


@dataclass(frozen=True)
class Knob(KnobSpec):
    """One searchable SpecConfig field (a table knob, ``decoding.methods.KnobSpec``): an int or float range
    (``step`` makes it discrete) or a choice, with the searchers' views."""

    @classmethod
    def of(cls, spec: KnobSpec) -> Knob:
        return cls(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)})

    def __post_init__(self):
        if self.field not in {f.name for f in dataclasses.fields(SpecConfig)}:
            raise ConfigError(self.field, "not a SpecConfig field: a knob must set one")
        if self.kind not in ("int", "float", "choice"):
            raise ConfigError(self.field, f"unknown knob kind {self.kind!r}")
        if self.kind == "choice" and not self.choices:
            raise ConfigError(self.field, "a choice knob needs choices")

    def bounded(self, depth: int) -> Knob:
        """DEPTH bounds replaced by ``depth - 1``."""
        lo = depth - 1 if self.low == DEPTH else self.low
        hi = depth - 1 if self.high == DEPTH else self.high
        return dataclasses.replace(self, low=lo, high=hi)

    def clamp(self, value):
        if self.kind == "choice":
            return value if value in self.choices else self.choices[0]
        value = int(round(value)) if self.kind == "int" else float(value)
        return min(max(value, self.low), self.high)

    def suggest(self, trial, name: str):
        """An Optuna suggestion (``trial`` is an ``optuna.Trial`` or Tune's captor)."""
        if self.kind == "int":
            return trial.suggest_int(name, int(self.low), int(self.high), log=self.log)
        if self.kind == "float":
            return trial.suggest_float(name, float(self.low), float(self.high), step=self.step, log=self.log)
        return trial.suggest_categorical(name, list(self.choices))

    def tune_domain(self):
        from ray import tune

        if self.kind == "int":
            return tune.lograndint(int(self.low), int(self.high) + 1) if self.log else tune.randint(int(self.low), int(self.high) + 1)
        if self.kind == "float":
            if self.step:
                return tune.quniform(float(self.low), float(self.high), self.step)
            return tune.loguniform(float(self.low), float(self.high)) if self.log else tune.uniform(float(self.low), float(self.high))
        return tune.choice(list(self.choices))

    def describe(self) -> str:
        if self.kind == "choice":
            return f"{self.field} in {list(self.choices)}"
        step = f" step {self.step:g}" if self.step else ""
        return f"{self.field} in [{self.low}, {self.high}]{step}"


# method -> the knobs it reads (the table's, checked here). NEEDS_LAYERS: the methods that need a model layer below the
# top one to draft from (dropped when the model has one layer), and the knob naming it.
METHOD_KNOBS: dict[str, tuple[Knob, ...]] = {name: tuple(Knob.of(k) for k in m.knobs) for name, m in METHOD_TABLE.items()}
NEEDS_LAYERS = {name: m.layer_knob for name, m in METHOD_TABLE.items() if m.layer_knob}
RESOLVERS: dict[str, Callable[[dict, int], dict]] = {name: m.resolve for name, m in METHOD_TABLE.items() if m.resolve}


def searchable_methods() -> list[str]:
    return [m for m in METHODS if m in METHOD_KNOBS]


def parse_range(text: str) -> tuple[str, dict]:
    """``KEY=LO:HI`` (a range, ``LO:HI:STEP`` for a float step) or ``KEY=a,b,c`` (choices), the CLI's ``--range``.

    >>> parse_range("exit_layer=2:12"), parse_range("k=2,4,6")[1]
    (('exit_layer', {'low': 2, 'high': 12}), {'choices': (2, 4, 6)})
    """
    key, sep, value = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not value.strip():
        raise ConfigError(key or "range", f"expected KEY=LO:HI or KEY=a,b,c, got {text!r}")

    def num(s: str):
        s = s.strip()
        try:
            return int(s)
        except ValueError:
            try:
                return float(s)
            except ValueError:
                raise ConfigError(key, f"expected a number, got {s!r}") from None

    if ":" in value:
        parts = value.split(":")
        if len(parts) not in (2, 3):
            raise ConfigError(key, f"expected LO:HI or LO:HI:STEP, got {value!r}")
        out = {"low": num(parts[0]), "high": num(parts[1])}
        if len(parts) == 3:
            out["step"] = float(num(parts[2]))
        if out["low"] > out["high"]:
            raise ConfigError(key, f"range {value!r} has LO > HI")
        return key, out

    def num_or_name(s: str):  # choices may be names (trained drafter artifacts)
        try:
            return num(s)
        except ConfigError:
            return s.strip()

    return key, {"choices": tuple(num_or_name(v) for v in value.split(",") if v.strip())}


def _narrow(knob: Knob, spec: Mapping) -> Knob:
    if "choices" in spec:
        if knob.kind != "choice":
            bad = [v for v in spec["choices"] if isinstance(v, str | bool) or not isinstance(v, int | float)]
            if bad:
                raise ConfigError(knob.field, f"--range takes numbers for this knob, got {bad[0]!r}")
        choices = tuple(knob.clamp(v) if knob.kind != "choice" else v for v in spec["choices"])
        return dataclasses.replace(knob, kind="choice", choices=tuple(dict.fromkeys(choices)), low=None, high=None)
    lo, hi = spec.get("low", knob.low), spec.get("high", knob.high)
    if knob.kind == "int":
        lo, hi = int(lo), int(hi)
    # a user range outside the method's limits (e.g. beyond the model's depth) is cut to them
    if knob.low is not None:
        lo, hi = max(lo, knob.low), max(min(hi, knob.high), knob.low)
        lo = min(lo, hi)
    return dataclasses.replace(knob, low=lo, high=hi, step=spec.get("step", knob.step))


@dataclass(frozen=True)
class SearchSpace:
    """The methods searched and, per method, the knobs searched (already bounded by the model's depth)."""

    methods: tuple[str, ...]
    depth: int
    knobs: dict  # method -> tuple[Knob, ...]
    fixed: tuple[str, ...] = ()  # fields the user fixed (--set): never searched
    notes: tuple[str, ...] = ()  # what was dropped and why

    @classmethod
    def build(
        cls,
        methods: Iterable[str],
        depth: int,
        fixed: Iterable[str] = (),
        ranges: Mapping[str, Mapping] | None = None,
        draft_model: str | None = None,
    ) -> SearchSpace:
        """The space over ``methods`` for a model ``depth`` layers deep.

        ``fixed`` fields are not searched (the base config's value is used);
        ``ranges`` narrows knobs by field name (``{"exit_layer": {"low": 2, "high": 12}}``
        or ``{"k": {"choices": (2, 4)}}``) for every method that has them.
        """
        methods = list(dict.fromkeys(methods))
        if not methods:
            raise ConfigError("methods", "no method to search")
        ranges = dict(ranges or {})
        fixed = tuple(dict.fromkeys(f.replace("-", "_") for f in fixed))
        known_fields = {k.field for m in methods for k in METHOD_KNOBS.get(m, ())}
        for key in ranges:
            if key not in known_fields:
                raise ConfigError(key, f"no method in {', '.join(methods)} has a knob {key!r}; knobs: {', '.join(sorted(known_fields))}")
            if key in fixed:
                raise ConfigError(key, "is both fixed (--set) and searched (--range)")
        knobs, notes, kept = {}, [], []
        for m in methods:
            if m not in METHOD_KNOBS:
                raise ConfigError("methods", f"method {m!r} cannot be tuned; choose from {', '.join(searchable_methods())}")
            entry = METHOD_TABLE[m]
            separate_draft = entry.draft_model_replaces_layers and bool(draft_model)
            if entry.layer_knob and not separate_draft and depth < 2:
                notes.append(f"{m} dropped: the model has {depth} layer(s), none below the top to draft from")
                continue
            mk = []
            for knob in METHOD_KNOBS[m]:
                if separate_draft and knob.field == entry.layer_knob:
                    continue  # a separate draft model: draft_layers is not read
                if knob.field in fixed:
                    continue
                knob = knob.bounded(depth)
                if knob.field in ranges:
                    knob = _narrow(knob, ranges[knob.field])
                mk.append(knob)
            knobs[m] = tuple(mk)
            kept.append(m)
        if not kept:
            raise ConfigError("methods", "; ".join(notes) or "no method left to search")
        return cls(tuple(kept), depth, knobs, fixed, tuple(notes))

    # ---- the two searchers' views -------------------------------------------------------
    def __call__(self, trial) -> None:
        """Optuna define-by-run: choose a method, then suggest only its knobs (names ``<method>/<field>``)."""
        method = trial.suggest_categorical("method", list(self.methods))
        for knob in self.knobs[method]:
            knob.suggest(trial, f"{method}/{knob.field}")

    def tune_space(self) -> dict:
        """A Tune ``param_space`` for random search: every method's knobs sampled, the chosen one's applied."""
        from ray import tune

        space: dict = {"method": tune.choice(list(self.methods))}
        for m, knobs in self.knobs.items():
            if knobs:
                space[m] = {k.field: k.tune_domain() for k in knobs}
        return space

    def default_points(self, base: SpecConfig) -> list[dict]:
        """One sample per method at its untuned values (the base config's, with the method's own defaults for what
        the user did not set), clamped into the space: the searcher tries them first."""
        points = []
        for m in self.methods:
            try:
                untuned = base.replace(method=m)
            except ConfigError:  # e.g. trained without a drafter: its knobs' values are the base's
                untuned = base
            point = {"method": m}
            for knob in self.knobs[m]:
                point[f"{m}/{knob.field}"] = knob.clamp(getattr(untuned, knob.field))
            points.append(point)
        return points

    # ---- sample -> config -------------------------------------------------------------------
    def knob_values(self, sample: Mapping) -> tuple[str, dict]:
        """(method, {field: value}) of a sample, nested (``{"ngram": {"k": 3}}``) or flat (``{"ngram/k": 3}``)."""
        method = sample.get("method")
        if method not in self.methods:
            raise ConfigError("method", f"sample method {method!r} is not in the space ({', '.join(self.methods)})")
        nested = sample.get(method) if isinstance(sample.get(method), Mapping) else {}
        values = {}
        for knob in self.knobs[method]:
            flat = f"{method}/{knob.field}"
            if knob.field in nested:
                values[knob.field] = knob.clamp(nested[knob.field])
            elif flat in sample:
                values[knob.field] = knob.clamp(sample[flat])
        resolve = RESOLVERS.get(method)
        if resolve is not None:
            values = resolve(dict(values), self.depth)
        return method, values

    def to_config(self, sample: Mapping, base: SpecConfig) -> SpecConfig:
        """The base config with the sample's method and that method's knobs; raises ConfigError if still invalid."""
        method, values = self.knob_values(sample)
        fit = METHOD_TABLE[method].fit  # e.g. one ngram bound fixed by the user, a chain-only trained artifact
        if fit is not None:
            from decoding.drafters import artifacts  # what the trained artifacts are: the hooks ask it

            values = fit(values, base, artifacts)
            # what a hook chose stays inside the searched range (a shipped exit adapter beyond this model's depth)
            bounds = {knob.field: knob for knob in self.knobs[method]}
            values = {k: bounds[k].clamp(v) if k in bounds else v for k, v in values.items()}
        return base.replace(method=method, **values)

    def check_base(self, base: SpecConfig) -> None:
        """A knob the user fixed (--set) that no trial could run with fails here, before any trial starts."""
        for m, name in NEEDS_LAYERS.items():
            separate_draft = METHOD_TABLE[m].draft_model_replaces_layers and base.draft_model
            if m in self.methods and name in self.fixed and getattr(base, name) >= self.depth and not separate_draft:
                raise ConfigError(name, f"must be below the model's {self.depth} layers, got {getattr(base, name)}")

    def describe(self) -> list[str]:
        lines = [f"methods: {', '.join(self.methods)} (model depth {self.depth})"]
        for m in self.methods:
            ks = "; ".join(k.describe() for k in self.knobs[m]) or "no knobs"
            lines.append(f"  {m}: {ks}")
        if self.fixed:
            lines.append(f"  fixed by --set: {', '.join(self.fixed)}")
        lines += [f"  note: {n}" for n in self.notes]
        return lines

    def to_dict(self) -> dict:
        return {
            "methods": list(self.methods),
            "depth": self.depth,
            "fixed": list(self.fixed),
            "notes": list(self.notes),
            "knobs": {m: [dataclasses.asdict(k) for k in ks] for m, ks in self.knobs.items()},
        }


def knob_fields() -> list[str]:
    """Every field any method's knobs set, in a stable order: the config columns of the results table."""
    return list(dict.fromkeys(k.field for ks in METHOD_KNOBS.values() for k in ks))
