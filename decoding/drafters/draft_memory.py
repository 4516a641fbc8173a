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
>>> m.get("seen", list, text=True).append(5); m.forget_text(); m.get("seen", list), "counts" in m
([], True)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable


class DraftMemory:
    def __init__(self):
        self._stores: dict = {}
        self._text: set = set()  # the keys of stores made from earlier requests' text
        self._lock = threading.Lock()

    def get(self, key: Hashable, factory: Callable[[], object], text: bool = False):
        """The store under ``key``, made by ``factory()`` the first time. ``text``: the store is made from the text of
        earlier requests (the suffix cache, Token Recycling's adjacency), which :meth:`forget_text` drops."""
        store = self._stores.get(key)
        if store is None:
            with self._lock:
                store = self._stores.setdefault(key, factory())
                if text:
                    self._text.add(key)
        return store

    def clear(self) -> None:
        with self._lock:
            self._stores.clear()
            self._text.clear()

    def forget_text(self) -> None:
        """Drop the stores made from earlier requests' text; keep what they measured (acceptance, costs, SWIFT's layer
        search). A benchmark that runs a prompt again must not let a drafter copy its own earlier answer."""
        with self._lock:
            for key in self._text:
                self._stores.pop(key, None)
            self._text.clear()

    def __contains__(self, key) -> bool:
        return key in self._stores
