"""What the registry holds: an entry (a name -> config, figures, hardware, time, version), the names it accepts,
the summaries and updates it hands out, and its errors."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

from decoding.config import SpecConfig
from decoding.errors import ConfigError
from decoding.methods import method_of

SCHEMA = 1
RANKED_METRICS = ("speedup", "tokens_per_s")  # the metrics `registry list` shows and entries are ranked by
NAME_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")
MAX_NAME_LENGTH = 160


# ---- errors -------------------------------------------------------------
class RegistryError(Exception):
    """Anything the registry cannot do; the message is one line meant for users."""


class InvalidName(RegistryError, ValueError):
    def __init__(self, name, reason: str):
        self.name = name
        super().__init__(f"invalid registry name {name!r}: {reason}")


class EntryNotFound(RegistryError, LookupError):
    def __init__(self, name: str, where: str = ""):
        self.name = name
        super().__init__(f"no registry entry {name!r}" + (f" in {where}" if where else ""))


class CorruptEntry(RegistryError):
    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason
        super().__init__(f"registry entry {name!r} is corrupt: {reason}")


class RegistryUnavailable(RegistryError):
    """The store cannot be reached (Redis down, wrong port, unwritable directory)."""


# ---- names --------------------------------------------------------------
def validate_name(name) -> str:
    """Return ``name`` if it is a valid registry name, else raise :class:`InvalidName`.

    >>> validate_name("smollm2-135m/spec_bench/ngram")
    'smollm2-135m/spec_bench/ngram'
    >>> validate_name("a//b")
    Traceback (most recent call last):
    ...
    cluster.registry.entries.InvalidName: invalid registry name 'a//b': empty segment
    """
    if not isinstance(name, str) or not name:
        raise InvalidName(name, "must be a non-empty string")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidName(name, f"longer than {MAX_NAME_LENGTH} characters")
    for seg in name.split("/"):
        if not seg:
            raise InvalidName(name, "empty segment")
        if seg in (".", ".."):
            raise InvalidName(name, f"segment {seg!r} is not allowed")
        if not NAME_SEGMENT.fullmatch(seg):
            bad = sorted({c for c in seg if not NAME_SEGMENT.fullmatch(c)})
            raise InvalidName(name, f"characters {''.join(bad)!r} not allowed (use A-Z a-z 0-9 . _ - and / between segments)")
    return name


def says_lossy(name: str) -> bool:
    """Whether a name says its configuration is lossy: every other name claims losslessness (specray's methods are
    lossless unless they say otherwise), so a lossy configuration (EAD) is stored and served only under a name that
    says ``lossy``.

    >>> says_lossy("smollm2-135m/chat/ead-lossy"), says_lossy("smollm2-135m/chat/ead"), says_lossy("x/lossless-ead")
    (True, False, False)
    """
    return "lossy" in name.lower()


def check_lossy_name(name: str, config: SpecConfig) -> None:
    """Raise :class:`InvalidName` when a lossy configuration would go under a name that claims losslessness."""
    if method_of(config.method).lossy and not says_lossy(name):
        raise InvalidName(name, f"{config.method} is lossy (unverified tokens): its name must say 'lossy', e.g. {name}-lossy")


def _slug(part: str) -> str:
    """A name segment from a free-form value: a local model path gives its last component,
    a hub id ``org/name`` gives ``org-name``, other characters become ``-``."""
    part = str(part).strip()
    if part.startswith(("/", ".", "~")) or os.path.isdir(part):
        part = Path(part.rstrip("/")).name or part
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", part).strip("-")
    return "x" + s if s in ("", ".", "..") else s


def default_name(model: str, workload: str, method: str) -> str:
    """``<model>/<workload>/<method>``, each part made name-safe.

    >>> default_name("smollm2-135m", "spec_bench", "ngram")
    'smollm2-135m/spec_bench/ngram'
    >>> default_name("HuggingFaceTB/SmolLM2-360M", "long context", "early-exit")
    'HuggingFaceTB-SmolLM2-360M/long-context/early-exit'
    >>> default_name("/models/llama-3 8b/", "chat", "sps")
    'llama-3-8b/chat/sps'
    """
    return validate_name("/".join(_slug(p) for p in (model, workload, method)))


# ---- entries ------------------------------------------------------------
def utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def describe_hardware() -> dict:
    """CPU model, cores, GPUs (when torch sees CUDA), torch/Python versions, OS."""
    info = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "hostname": platform.node(),
    }
    try:
        from importlib.metadata import version

        info["torch"] = version("torch")
    except Exception:
        info["torch"] = None
    info["gpus"] = []
    try:
        import torch

        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            info["cuda"] = torch.version.cuda
    except Exception:
        pass
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class Entry:
    """One tuned configuration with what was measured, where and when.

    ``version`` is assigned by the store on :meth:`Registry.put` (the value on
    the entry passed in is ignored); entries read back carry theirs.
    """

    name: str
    config: SpecConfig
    metrics: dict = field(default_factory=dict)
    hardware: dict = field(default_factory=dict)
    created_at: str = field(default_factory=utc_now)
    version: int | None = None
    source: dict = field(default_factory=dict)

    def __post_init__(self):
        validate_name(self.name)
        if not isinstance(self.config, SpecConfig):
            raise TypeError(f"Entry.config must be a SpecConfig, got {type(self.config).__name__}")
        check_lossy_name(self.name, self.config)
        for f in ("metrics", "hardware", "source"):
            if not isinstance(getattr(self, f), dict):
                raise TypeError(f"Entry.{f} must be a dict, got {type(getattr(self, f)).__name__}")
        for key in RANKED_METRICS:  # listed and compared (the best entry of a method): numbers, or absent
            value = self.metrics.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)):
                raise RegistryError(f"cannot store {self.name!r}: metrics.{key} must be a finite number, got {value!r}")

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def lossy(self) -> bool:
        """Its method commits unverified tokens (EAD): the output is not the target's."""
        return method_of(self.config.method).lossy

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "name": self.name,
            "version": self.version,
            "config": self.config.to_dict(),
            "lossy": self.lossy,
            "metrics": self.metrics,
            "hardware": self.hardware,
            "created_at": self.created_at,
            "source": self.source,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, data, name: str | None = None) -> Entry:
        """Validate a stored document; any problem is a :class:`CorruptEntry` naming ``name``."""
        label = name if name is not None else (data.get("name") if isinstance(data, dict) else None) or "?"
        if not isinstance(data, dict):
            raise CorruptEntry(label, f"expected a JSON object, got {type(data).__name__}")
        if data.get("schema", SCHEMA) != SCHEMA:
            raise CorruptEntry(label, f"unsupported schema {data.get('schema')!r} (this specray reads {SCHEMA})")
        missing = [k for k in ("name", "config") if k not in data]
        if missing:
            raise CorruptEntry(label, f"missing field {missing[0]!r}")
        if name is not None and data["name"] != name:
            raise CorruptEntry(label, f"stored under {name!r} but names itself {data['name']!r}")
        version = data.get("version")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 1):
            raise CorruptEntry(label, f"version must be a positive integer, got {version!r}")
        created_at = data.get("created_at", "")
        if not isinstance(created_at, str):
            raise CorruptEntry(label, f"created_at must be a string, got {created_at!r}")
        try:
            config = SpecConfig.from_dict(data["config"])
        except ConfigError as e:
            raise CorruptEntry(label, f"invalid config: {e}") from None
        try:
            return cls(
                name=data["name"],
                config=config,
                metrics=data.get("metrics") or {},
                hardware=data.get("hardware") or {},
                created_at=created_at,
                version=version,
                source=data.get("source") or {},
            )
        except (RegistryError, TypeError) as e:  # a bad name, metrics that are not numbers
            raise CorruptEntry(label, str(e)) from None

    @classmethod
    def from_json(cls, text, name: str | None = None) -> Entry:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
            raise CorruptEntry(name or "?", f"not valid JSON ({e})") from None
        return cls.from_dict(data, name=name)


def body_without_version(entry: Entry) -> dict:
    doc = entry.to_dict()
    del doc["version"]
    try:
        json.dumps(doc, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise RegistryError(f"cannot store {entry.name!r}: metrics/hardware/source must be plain JSON ({e})") from None
    return doc


@dataclass(frozen=True)
class EntrySummary:
    """One row of :meth:`Registry.list`; ``status`` is ``ok`` or ``corrupt`` (then ``error`` says why)."""

    name: str
    version: int | None
    status: str
    error: str | None = None
    method: str | None = None
    speedup: float | None = None
    tokens_per_s: float | None = None
    created_at: str | None = None
    lossy: bool = False  # the method commits unverified tokens (EAD)

    @classmethod
    def of(cls, entry: Entry) -> EntrySummary:
        m = entry.metrics
        return cls(
            name=entry.name,
            version=entry.version,
            status="ok",
            method=entry.method,
            lossy=entry.lossy,
            speedup=m.get("speedup"),
            tokens_per_s=m.get("tokens_per_s"),
            created_at=entry.created_at,
        )

    @classmethod
    def corrupt(cls, name: str, version: int | None, err: CorruptEntry) -> EntrySummary:
        return cls(name=name, version=version, status="corrupt", error=err.reason)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Update:
    """A change notification: ``op`` is ``put`` or ``delete``; ``version`` the entry's version then."""

    name: str
    version: int | None
    op: str
