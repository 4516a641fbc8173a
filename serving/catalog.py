"""Which model names a server answers to: registry entries and plain model ids.

- every valid registry entry is served under its name with its ``SpecConfig``;
- the configured base model, and the ``config.model`` of every entry, are served
  as plain AR (``method="ar"``) under that model id;
- a corrupt entry is not served; it is logged once and listed in :attr:`Catalog.corrupt`
  (``/health`` shows it).

The registry is re-read when the cached copy is older than ``refresh_s``, on
demand (``/v1/models``, an unknown name) and, with ``watch``, on every update the
registry announces, so new and changed entries are served without a restart.

>>> import tempfile
>>> from cluster.registry import Entry, open_registry
>>> root = tempfile.mkdtemp()
>>> _ = open_registry(root).put(Entry("tiny/chat/ngram", SpecConfig(method="ngram", model="m")))
>>> cat = Catalog(root, base_model="smollm2-135m", dtype="float32", watch=False)
>>> [(m.name, m.kind, m.config.method) for m in cat.models()]
[('tiny/chat/ngram', 'registry', 'ngram'), ('m', 'base', 'ar'), ('smollm2-135m', 'base', 'ar')]
>>> cat.resolve("m").config.dtype
'float32'
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from cluster.registry import CorruptEntry, EntryNotFound, FileRegistry, RegistryError, open_registry
from decoding.config import SpecConfig
from decoding.methods import method_of

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class ServedModel:
    name: str
    kind: str  # "registry" | "base"
    config: SpecConfig
    version: int | None = None
    metrics: dict = field(default_factory=dict)
    created_at: str | None = None

    def describe(self) -> dict:
        """The ``/v1/models`` row."""
        return {
            "id": self.name,
            "object": "model",
            "created": _epoch(self.created_at),
            "owned_by": "specray",
            "specray": {
                "kind": self.kind,
                "method": self.config.method,
                # unverified tokens (EAD): the output is not the base model's; served only under a name saying "lossy"
                "lossy": method_of(self.config.method).lossy,
                "base_model": self.config.model,
                "version": self.version,
                "speedup": self.metrics.get("speedup"),
                "metrics": self.metrics,
                "config": self.config.to_dict(),
            },
        }


def _epoch(created_at: str | None) -> int:
    if not created_at:
        return 0
    try:
        import datetime as dt

        return int(dt.datetime.fromisoformat(created_at.replace("Z", "+00:00")).timestamp())
    except ValueError:
        return 0


class ModelNotFound(LookupError):
    def __init__(self, name: str, reason: str | None = None):
        self.name = name
        self.reason = reason
        super().__init__(reason or f"model {name!r} does not exist")


class Catalog:
    def __init__(self, registry: str | None, base_model: str, dtype: str = "bfloat16", refresh_s: float = 5.0, watch: bool = True):
        self.registry = open_registry(registry)
        if isinstance(self.registry, FileRegistry):
            self.registry.poll_interval = 1.0  # watching a directory: once a second is plenty
        self.base_model = base_model
        self.dtype = dtype
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._entries: dict[str, ServedModel] = {}
        self.corrupt: dict[str, str] = {}
        self.error: str | None = None  # the last refresh's failure (registry unreachable), if any
        self._loaded_at = 0.0
        self._watcher = None
        self.refresh()
        if watch:
            try:
                self._watcher = self.registry.watch(self._on_update, on_resync=self.refresh)
            except RegistryError as e:
                log.warning(
                    "specray: cannot watch the registry at %s (%s); re-reading it every %.0fs", self.registry.location, e, refresh_s
                )

    # ---- reading the registry --------------------------------------------
    def refresh(self) -> None:
        try:
            summaries = self.registry.list()
        except RegistryError as e:
            self.error = str(e)
            log.warning("specray: registry at %s unreadable, serving the last known entries: %s", self.registry.location, e)
            return
        entries, corrupt = {}, {}
        for s in summaries:
            if s.status != "ok":
                corrupt[s.name] = s.error or "corrupt"
                continue
            try:
                entries[s.name] = self._served(self.registry.get(s.name))
            except EntryNotFound:
                continue
            except CorruptEntry as e:
                corrupt[s.name] = e.reason
            except RegistryError as e:
                self.error = str(e)
                return
        with self._lock:
            for name, reason in corrupt.items():
                if self.corrupt.get(name) != reason:
                    log.warning("specray: registry entry %r is corrupt and not served: %s", name, reason)
            self._entries, self.corrupt = entries, corrupt
            self._loaded_at = time.monotonic()
            self.error = None

    @staticmethod
    def _served(entry) -> ServedModel:
        return ServedModel(entry.name, "registry", entry.config, entry.version, dict(entry.metrics), entry.created_at)

    def _on_update(self, update) -> None:
        """Called from the watcher thread for each put/delete."""
        if update.op == "delete":
            with self._lock:
                self._entries.pop(update.name, None)
                self.corrupt.pop(update.name, None)
            return
        try:
            served = self._served(self.registry.get(update.name))
        except EntryNotFound:
            return
        except CorruptEntry as e:
            with self._lock:
                self._entries.pop(update.name, None)
                self.corrupt[update.name] = e.reason
            log.warning("specray: registry entry %r is corrupt and not served: %s", update.name, e.reason)
            return
        except RegistryError as e:
            self.error = str(e)
            return
        with self._lock:
            self._entries[update.name] = served
            self.corrupt.pop(update.name, None)
        log.info("specray: registry entry %r version %s is served", update.name, served.version)

    def refresh_if_stale(self) -> None:
        if time.monotonic() - self._loaded_at > self.refresh_s:
            self.refresh()

    # ---- answering ----------------------------------------------------------
    def _base(self, model: str) -> ServedModel:
        return ServedModel(model, "base", SpecConfig(method="ar", model=model, dtype=self.dtype))

    def models(self) -> list[ServedModel]:
        """Registry entries (by name), then plain-AR model ids (sorted)."""
        with self._lock:
            entries = sorted(self._entries.values(), key=lambda m: m.name)
        base_ids = sorted({self.base_model} | {m.config.model for m in entries})
        return entries + [self._base(b) for b in base_ids if b not in {m.name for m in entries}]

    def lookup(self, name: str) -> ServedModel | None:
        with self._lock:
            if name in self._entries:
                return self._entries[name]
            if name in self.corrupt:
                raise ModelNotFound(name, f"registry entry {name!r} is corrupt and not served: {self.corrupt[name]}")
            models = {m.config.model for m in self._entries.values()}
        if name == self.base_model or name in models:
            return self._base(name)
        return None

    def resolve(self, name: str) -> ServedModel:
        """The served model called ``name``; re-reads the registry once before giving up."""
        found = self.lookup(name)
        if found is None:
            self.refresh()
            found = self.lookup(name)
        if found is None:
            raise ModelNotFound(name, f"the model {name!r} does not exist; GET /v1/models lists the served models")
        return found

    def close(self) -> None:
        if self._watcher is not None:
            try:
                self._watcher.stop()
            except Exception:
                pass
            self._watcher = None
        self.registry.close()
