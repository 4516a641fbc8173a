"""The registry as files: one JSON file per entry under ``$SPECRAY_HOME/registry`` written atomically, versions
counted under an ``flock`` so two processes never hand out the same version, changes seen by polling."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import urllib.parse
from pathlib import Path

from cluster.registry.entries import (
    CorruptEntry,
    Entry,
    EntryNotFound,
    EntrySummary,
    InvalidName,
    RegistryUnavailable,
    Update,
    body_without_version,
    validate_name,
)
from cluster.registry.interface import Registry, Subscription


# ---- file store ---------------------------------------------------------
def _encode(name: str) -> str:
    return urllib.parse.quote(name, safe="")  # '/' -> %2F; the other allowed characters are kept


class FileRegistry(Registry):
    """Entries as ``root/entries/<quoted name>.json``; version counters in ``root/versions``.

    Writes: temp file + fsync + ``os.replace``, so a reader sees the old or the
    new entry, never half of one. Version increments hold an exclusive
    ``flock`` on ``root/.lock``.
    """

    def __init__(self, root, poll_interval: float = 0.1):
        self.root = Path(root).expanduser()
        self.location = str(self.root)
        self.poll_interval = poll_interval

    # paths
    def entry_path(self, name: str) -> Path:
        return self.root / "entries" / f"{_encode(validate_name(name))}.json"

    def _version_path(self, name: str) -> Path:
        return self.root / "versions" / _encode(name)

    def _ensure_dirs(self) -> None:
        try:
            (self.root / "entries").mkdir(parents=True, exist_ok=True)
            (self.root / "versions").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RegistryUnavailable(f"registry directory {self.root} is not usable: {e.strerror or e}") from None

    def _lock(self):
        import fcntl

        class _Lock:
            def __enter__(s):
                s.f = open(self.root / ".lock", "a+")
                fcntl.flock(s.f.fileno(), fcntl.LOCK_EX)
                return s

            def __exit__(s, *exc):
                fcntl.flock(s.f.fileno(), fcntl.LOCK_UN)
                s.f.close()

        return _Lock()

    @staticmethod
    def _write_atomic(path: Path, text: str) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _read_version(self, name: str) -> int:
        try:
            return int(self._version_path(name).read_text().strip() or 0)
        except FileNotFoundError:
            return 0
        except ValueError:
            return 0

    # operations
    def put(self, name_or_entry, entry: Entry | None = None) -> int:
        entry = self._entry_arg(name_or_entry, entry)
        doc = body_without_version(entry)
        self._ensure_dirs()
        path = self.entry_path(entry.name)
        try:
            with self._lock():
                version = self._read_version(entry.name)
                if version == 0 and path.exists():  # a store written without counters: continue from the entry
                    try:
                        version = Entry.from_json(path.read_text(), entry.name).version or 0
                    except CorruptEntry:
                        pass
                version += 1
                doc["version"] = version
                self._write_atomic(path, json.dumps(doc, sort_keys=True, indent=1))
                self._write_atomic(self._version_path(entry.name), f"{version}\n")
        except OSError as e:
            raise RegistryUnavailable(f"cannot write registry entry {entry.name!r} under {self.root}: {e.strerror or e}") from None
        return version

    def get(self, name: str) -> Entry:
        path = self.entry_path(name)
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            raise EntryNotFound(name, str(self.root)) from None
        except OSError as e:
            raise RegistryUnavailable(f"cannot read registry entry {name!r} at {path}: {e.strerror or e}") from None
        return Entry.from_json(text, name)

    def list(self) -> list[EntrySummary]:
        out = []
        for path in sorted((self.root / "entries").glob("*.json")):
            if path.name.startswith("."):
                continue
            name = urllib.parse.unquote(path.name[: -len(".json")])
            try:
                validate_name(name)
            except InvalidName as e:
                out.append(EntrySummary.corrupt(path.name, None, CorruptEntry(path.name, str(e))))
                continue
            try:
                out.append(EntrySummary.of(self.get(name)))
            except EntryNotFound:  # deleted while listing
                continue
            except CorruptEntry as e:
                out.append(EntrySummary.corrupt(name, self._read_version(name) or None, e))
        return sorted(out, key=lambda s: s.name)

    def delete(self, name: str) -> int:
        path = self.entry_path(name)
        if not path.parent.is_dir():
            raise EntryNotFound(name, str(self.root))
        try:
            with self._lock():
                if not path.exists():
                    raise EntryNotFound(name, str(self.root))
                version = self._read_version(name)
                path.unlink()
        except OSError as e:
            raise RegistryUnavailable(f"cannot delete registry entry {name!r} under {self.root}: {e.strerror or e}") from None
        return version

    def snapshot(self) -> dict[str, tuple]:
        """name -> (version counter, entry file stat) of the entries present now."""
        snap = {}
        for path in (self.root / "entries").glob("*.json"):
            if path.name.startswith("."):
                continue
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            name = urllib.parse.unquote(path.name[: -len(".json")])
            snap[name] = (self._read_version(name), st.st_mtime_ns, st.st_size, st.st_ino)
        return snap

    def subscribe(self) -> Subscription:
        return _PollingSubscription(self)


class _PollingSubscription(Subscription):
    """Change detection by polling the entries directory.

    Several puts between two polls coalesce into one update with the latest
    version (Redis delivers each one).
    """

    def __init__(self, reg: FileRegistry):
        self._reg = reg
        self._last = reg.snapshot()
        self._pending: queue.SimpleQueue[Update] = queue.SimpleQueue()
        self.closed = False

    def _poll(self) -> None:
        now = self._reg.snapshot()
        for name in sorted(set(self._last) | set(now)):
            before, after = self._last.get(name), now.get(name)
            if before == after:
                continue
            if after is None:
                self._pending.put(Update(name, before[0] or None, "delete"))
            else:
                self._pending.put(Update(name, after[0] or None, "put"))
        self._last = now

    def get(self, timeout: float | None = None) -> Update | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.closed:
            if self._pending.empty():
                self._poll()
            if not self._pending.empty():
                return self._pending.get_nowait()
            if deadline is not None and time.monotonic() >= deadline:
                return None
            wait = self._reg.poll_interval
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - time.monotonic()))
            time.sleep(wait)
        return None

    def close(self) -> None:
        self.closed = True
