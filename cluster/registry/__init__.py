"""The registry of tuned configurations: a name -> (config, figures, hardware, time, version).

Names are ``<model>/<workload>/<method>`` (see :func:`default_name`) or any
user-given name made of ``[A-Za-z0-9._-]`` segments separated by ``/``.

Two stores behind one interface (:class:`Registry`):

- :class:`RedisRegistry` when ``SPECRAY_REDIS_URL`` is set (or a ``redis://``
  URL is passed): namespaced keys, one Lua script per write so the entry, its
  version and the name index change together, and a message on the channel
  ``specray:registry:updates`` for every put and delete.
- :class:`FileRegistry` otherwise: one JSON file per entry under
  ``$SPECRAY_HOME/registry`` written atomically, versions counted under an
  ``flock`` so two processes never hand out the same version.

Every entry read back is validated; one that does not parse, or whose config is
not a valid :class:`SpecConfig`, raises :class:`CorruptEntry` naming it and
saying why, and shows up in :meth:`Registry.list` flagged ``corrupt``.

>>> import tempfile
>>> from decoding.config import SpecConfig
>>> reg = open_registry(tempfile.mkdtemp())
>>> reg.put(Entry("smollm2-135m/chat/ngram", SpecConfig(method="ngram", k=6), metrics={"speedup": 1.7}))
1
>>> e = reg.get("smollm2-135m/chat/ngram")
>>> (e.version, e.config.k, e.metrics["speedup"])
(1, 6, 1.7)
>>> reg.put(e)
2
>>> [(s.name, s.version, s.status) for s in reg.list()]
[('smollm2-135m/chat/ngram', 2, 'ok')]
"""

from __future__ import annotations

import os
import re
import urllib.parse
from pathlib import Path

from cluster.registry.entries import (
    CorruptEntry,
    Entry,
    EntryNotFound,
    EntrySummary,
    InvalidName,
    RegistryError,
    RegistryUnavailable,
    Update,
    default_name,
    describe_hardware,
    validate_name,
)
from cluster.registry.file_store import FileRegistry
from cluster.registry.interface import Registry, Subscription
from cluster.registry.redis_store import REDIS_SCHEMES, RedisRegistry
from decoding.paths import specray_home


# ---- choosing a store ---------------------------------------------------
def default_root() -> Path:
    return specray_home() / "registry"


def open_registry(url: str | os.PathLike | None = None, **kwargs) -> Registry:
    """The registry at ``url``: ``redis://``/``rediss://``/``unix://`` -> Redis, ``file://PATH`` or a
    path -> files. Without one: ``SPECRAY_REDIS_URL`` if set, else ``$SPECRAY_HOME/registry``."""
    if url is None or url == "":
        url = os.environ.get("SPECRAY_REDIS_URL") or None
    if url is None:
        return FileRegistry(default_root(), **kwargs)
    url = os.fspath(url)
    if url.startswith(REDIS_SCHEMES):
        return RedisRegistry(url, **kwargs)
    if url.startswith("file://"):
        p = urllib.parse.urlsplit(url)
        return FileRegistry(urllib.parse.unquote(p.netloc + p.path), **kwargs)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", url):
        raise RegistryError(f"unsupported registry URL {url!r}: use redis://, rediss://, unix://, file:// or a directory")
    return FileRegistry(url, **kwargs)


__all__ = [
    "CorruptEntry",
    "Entry",
    "EntryNotFound",
    "EntrySummary",
    "FileRegistry",
    "InvalidName",
    "RedisRegistry",
    "Registry",
    "RegistryError",
    "RegistryUnavailable",
    "Subscription",
    "Update",
    "default_name",
    "describe_hardware",
    "open_registry",
    "validate_name",
]
