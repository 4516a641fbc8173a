"""State of model-free drafters that outlives one request (Token Recycling's adjacency matrix, the suffix cache).

A ``DraftMemory`` belongs to a decoder (``engine.SpecDecoder``) and is handed to every drafter it builds, its
forks' included, so what one request taught is there for the next. Drafters look their stores up by key and
create them on first use.

>>> m = DraftMemory()
>>> m.get("counts", dict)["a"] = 1
>>> m.get("counts", dict)
{'a': 1}
>>> m.clear(); m.get("counts", dict)
{}
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable


class DraftMemory:
    def __init__(self):
        self._stores: dict = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, factory: Callable[[], object]):
        """The store under ``key``, made by ``factory()`` the first time."""
        store = self._stores.get(key)
        if store is None:
            with self._lock:
                store = self._stores.setdefault(key, factory())
        return store

    def clear(self) -> None:
        with self._lock:
            self._stores.clear()

    def __contains__(self, key) -> bool:
        return key in self._stores
