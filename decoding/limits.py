"""The limits of the sampling parameters a user may ask for: one rule for a configuration, the CLI and the HTTP API.

:data:`BOUNDS` holds the numeric limits: ``serving.protocol`` builds its request models' field constraints from
it, and :func:`check_sampling` checks values against it; ``decoding.config.SpecConfig`` checks its sampling
fields with :func:`check_config` when it is built (from flags, a config file, ``--set``, a registry entry or a
request's overrides). All say the same thing for the same value.

>>> check_sampling(temperature=0.7, top_p=0.9, top_k=40, seed=7)
>>> check_sampling(temperature=float("inf"))
Traceback (most recent call last):
...
decoding.errors.ConfigError: temperature: must be a finite number between 0 and 2, got inf
>>> check_sampling(seed=2**64)
Traceback (most recent call last):
...
decoding.errors.ConfigError: seed: must be an integer in [0, 2**63), got 18446744073709551616
"""

from __future__ import annotations

import math

from decoding.errors import ConfigError

TEMPERATURE_MAX = 2.0  # temperature in [0, 2] (0: greedy)
TOP_K_MAX = 1_000_000  # top_k in [0, TOP_K_MAX] (0: off); beyond any vocabulary
SEED_MAX = 2**63 - 1  # seed in [0, 2**63): what torch.Generator.manual_seed takes without wrapping
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256  # one stop sequence
MAX_THREADS = 1024  # torch threads a process may ask for (100,000 made the process run out of memory maps and crash)
MAX_TOKENS_MAX = 1_000_000  # max_tokens / max_new_tokens upper bound (the model's context caps it further)
# each numeric parameter's bounds, as pydantic's Field takes them (ge: >=, gt: >, le: <=)
BOUNDS = {
    "temperature": {"ge": 0.0, "le": TEMPERATURE_MAX},
    "top_p": {"gt": 0.0, "le": 1.0},
    "top_k": {"ge": 0, "le": TOP_K_MAX},
    "seed": {"ge": 0, "le": SEED_MAX},
    "max_tokens": {"ge": 1, "le": MAX_TOKENS_MAX},
}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _within(value, name: str) -> bool:
    b = BOUNDS[name]
    return ("ge" not in b or value >= b["ge"]) and ("gt" not in b or value > b["gt"]) and ("le" not in b or value <= b["le"])


def check_sampling(temperature=None, top_p=None, top_k=None, seed=None, stop=None, max_tokens=None, max_tokens_name="max_tokens") -> None:
    """Raise :class:`ConfigError` naming the first value outside its limits; ``None`` means "not given"."""
    if temperature is not None and not (_is_number(temperature) and math.isfinite(temperature) and _within(temperature, "temperature")):
        raise ConfigError("temperature", f"must be a finite number between 0 and {TEMPERATURE_MAX:g}, got {temperature!r}")
    if top_p is not None and not (_is_number(top_p) and math.isfinite(top_p) and _within(top_p, "top_p")):
        raise ConfigError("top_p", f"must be in (0, 1], got {top_p!r}")
    if top_k is not None and not (_is_int(top_k) and _within(top_k, "top_k")):
        raise ConfigError("top_k", f"must be an integer in [0, {TOP_K_MAX}] (0 disables it), got {top_k!r}")
    if seed is not None and not (_is_int(seed) and _within(seed, "seed")):
        raise ConfigError("seed", f"must be an integer in [0, 2**63), got {seed!r}")
    if max_tokens is not None and not (_is_int(max_tokens) and _within(max_tokens, "max_tokens")):
        raise ConfigError(max_tokens_name, f"must be an integer in [1, {MAX_TOKENS_MAX}], got {max_tokens!r}")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ConfigError("stop", "must be a string or a list of strings")
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ConfigError("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ConfigError("stop", "stop sequences must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ConfigError("stop", f"a stop sequence is at most {MAX_STOP_CHARS} characters")


def check_config(cfg) -> None:
    """The same limits on a ``SpecConfig``'s sampling fields (it checks itself so when built)."""
    check_sampling(cfg.temperature, cfg.top_p, cfg.top_k, cfg.seed, max_tokens=cfg.max_new_tokens, max_tokens_name="max_new_tokens")
