"""The interface every registry store implements (:class:`Registry`), its subscriptions to changes, and the
:class:`Watcher` that follows them in a thread."""

from __future__ import annotations

import abc
import dataclasses
import threading
from collections.abc import Callable, Iterator

from cluster.registry.entries import Entry, EntrySummary, RegistryError, RegistryUnavailable, Update, validate_name


# ---- the interface ------------------------------------------------------
class Subscription(abc.ABC):
    """Updates after the moment of subscribing. ``get(timeout)`` returns one or None; iterate to block."""

    @abc.abstractmethod
    def get(self, timeout: float | None = None) -> Update | None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __iter__(self) -> Iterator[Update]:
        while not self.closed:
            u = self.get(timeout=1.0)
            if u is not None:
                yield u

    closed = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Watcher:
    """A daemon thread feeding a subscription to a callback until :meth:`stop`.

    With ``resubscribe`` (a function returning a new subscription), a subscription the store drops (Redis restarted
    or unreachable for a while) is made again, retrying with a backoff up to ``max_backoff_s``, and ``on_resync`` is
    called once it is back: updates published while it was away were not seen, so the consumer re-reads the store.
    Without it the thread ends at the first error (surfaced by :meth:`stop`)."""

    def __init__(
        self,
        sub: Subscription,
        callback: Callable[[Update], None],
        resubscribe: Callable[[], Subscription] | None = None,
        on_resync: Callable[[], None] | None = None,
        max_backoff_s: float = 5.0,
    ):
        self._sub, self._callback = sub, callback
        self._resubscribe, self._on_resync, self._max_backoff_s = resubscribe, on_resync, max_backoff_s
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.resubscribed = 0  # how many times the subscription was made again
        self.last_error: str | None = None  # why it was lost the last time
        self._thread = threading.Thread(target=self._run, name="registry-watch", daemon=True)
        self._thread.start()

    def _run(self):
        try:
            while not self._stop.is_set():
                try:
                    u = self._sub.get(timeout=0.2)
                except RegistryUnavailable as e:
                    if self._resubscribe is None:
                        raise
                    self.last_error = str(e)
                    self._sub.close()
                    if not self._subscribe_again():
                        return
                    continue
                if u is not None:
                    self._callback(u)
        except BaseException as e:  # surfaced on stop()
            self.error = e
        finally:
            self._sub.close()

    def _subscribe_again(self) -> bool:
        """Subscribe again until it works (True) or the watcher is stopped (False); then resync the consumer."""
        delay = 0.1
        while not self._stop.wait(delay):
            try:
                self._sub = self._resubscribe()
            except RegistryUnavailable as e:
                self.last_error = str(e)
                delay = min(2 * delay, self._max_backoff_s)
                continue
            self.resubscribed += 1
            if self._on_resync is not None:
                try:
                    self._on_resync()
                except RegistryError as e:  # the consumer's own re-read failed; the next update or refresh retries it
                    self.last_error = str(e)
            return True
        return False

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self.error is not None:
            raise self.error


class Registry(abc.ABC):
    """Name -> :class:`Entry`, with a version per name and update notifications."""

    location: str

    @abc.abstractmethod
    def put(self, name_or_entry, entry: Entry | None = None) -> int:
        """Store an entry (``put(entry)`` or ``put(name, entry)``); returns its new version."""

    @abc.abstractmethod
    def get(self, name: str) -> Entry: ...

    @abc.abstractmethod
    def list(self) -> list[EntrySummary]:
        """All entries sorted by name; corrupt ones are flagged, never raised."""

    @abc.abstractmethod
    def delete(self, name: str) -> int:
        """Remove an entry; returns the version it had. Versions keep counting if the name is reused."""

    @abc.abstractmethod
    def subscribe(self) -> Subscription: ...

    def watch(self, callback: Callable[[Update], None], on_resync: Callable[[], None] | None = None) -> Watcher:
        """Call ``callback(update)`` from a background thread; ``.stop()`` the returned watcher. A lost subscription
        is made again (and ``on_resync()`` called: updates may have been missed meanwhile)."""
        return Watcher(self.subscribe(), callback, resubscribe=self.subscribe, on_resync=on_resync)

    def names(self) -> list[str]:
        return [s.name for s in self.list()]

    def close(self) -> None:  # noqa: B027 - stores without connections have nothing to release
        """Release connections (nothing for the file store)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"{type(self).__name__}({self.location!r})"

    @staticmethod
    def _entry_arg(name_or_entry, entry: Entry | None) -> Entry:
        if entry is None:
            if not isinstance(name_or_entry, Entry):
                raise TypeError("put(entry) or put(name, entry)")
            return name_or_entry
        name = validate_name(name_or_entry)
        return entry if entry.name == name else dataclasses.replace(entry, name=name)
