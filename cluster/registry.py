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

import abc
import dataclasses
import datetime as _dt
import json
import os
import platform
import queue
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from decoding.config import SpecConfig
from decoding.errors import ConfigError
from decoding.methods import method_of
from decoding.paths import specray_home

SCHEMA = 1
NAME_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")
MAX_NAME_LENGTH = 160
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


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
    cluster.registry.InvalidName: invalid registry name 'a//b': empty segment
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
        except (InvalidName, TypeError) as e:
            raise CorruptEntry(label, str(e)) from None

    @classmethod
    def from_json(cls, text, name: str | None = None) -> Entry:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
            raise CorruptEntry(name or "?", f"not valid JSON ({e})") from None
        return cls.from_dict(data, name=name)


def _body_without_version(entry: Entry) -> dict:
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
        doc = _body_without_version(entry)
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


# ---- Redis store --------------------------------------------------------
# KEYS: version key, entry key, names set. ARGV: body JSON without version (an object), name, channel.
# The version is spliced in as the first field so the stored JSON keeps exact floats (no cjson round trip).
_PUT_LUA = """
local v = redis.call('INCR', KEYS[1])
local doc = '{"version": ' .. v .. ', ' .. string.sub(ARGV[1], 2)
redis.call('SET', KEYS[2], doc)
redis.call('SADD', KEYS[3], ARGV[2])
redis.call('PUBLISH', ARGV[3], cjson.encode({name = ARGV[2], version = v, op = 'put'}))
return v
"""
_DELETE_LUA = """
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
local v = tonumber(redis.call('GET', KEYS[1]) or '0')
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[3], ARGV[1])
redis.call('PUBLISH', ARGV[2], cjson.encode({name = ARGV[1], version = v, op = 'delete'}))
return v
"""


def redact_url(url: str) -> str:
    """Hide a password in a Redis URL before it goes into a message.

    >>> redact_url("redis://user:secret@host:6379/0")
    'redis://user:***@host:6379/0'
    """
    p = urllib.parse.urlsplit(url)
    if p.password is None:
        return url
    netloc = f"{p.username or ''}:***@{p.hostname}" + (f":{p.port}" if p.port else "")
    return urllib.parse.urlunsplit(p._replace(netloc=netloc))


class RedisRegistry(Registry):
    """Keys ``<ns>:entry:<name>`` (JSON), ``<ns>:version:<name>`` (INCR counter), ``<ns>:names`` (set);
    updates published on ``<ns>:updates`` as ``{"name", "version", "op"}``. ``ns`` defaults to
    ``specray:registry``."""

    def __init__(self, url: str, namespace: str = "specray:registry", connect_timeout: float = 2.0, timeout: float = 5.0):
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise RegistryError("SPECRAY_REDIS_URL is set but the redis package is missing: pip install 'specray[cluster]'") from None
        self.url = url
        self.location = redact_url(url)
        self.namespace = namespace
        self.channel = f"{namespace}:updates"
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self._redis_error = redis.exceptions.RedisError
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_connect_timeout=connect_timeout,
                socket_timeout=timeout,
                retry=Retry(NoBackoff(), 1),
                decode_responses=False,  # bytes: a corrupt (non-UTF-8) value must not break listing
            )
        except ValueError as e:
            raise RegistryError(f"bad Redis URL {self.location}: {e}") from None
        self._put = self._client.register_script(_PUT_LUA)
        self._delete = self._client.register_script(_DELETE_LUA)

    def entry_key(self, name: str) -> str:
        return f"{self.namespace}:entry:{validate_name(name)}"

    def version_key(self, name: str) -> str:
        return f"{self.namespace}:version:{validate_name(name)}"

    @property
    def names_key(self) -> str:
        return f"{self.namespace}:names"

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except self._errors as e:
            raise RegistryUnavailable(f"Redis registry at {self.location} is unreachable ({what}): {e}") from None
        except self._redis_error as e:
            raise RegistryError(f"Redis registry at {self.location} failed ({what}): {e}") from None

    def ping(self) -> None:
        self._call("ping", self._client.ping)

    def put(self, name_or_entry, entry: Entry | None = None) -> int:
        entry = self._entry_arg(name_or_entry, entry)
        body = json.dumps(_body_without_version(entry), sort_keys=True, allow_nan=False)
        keys = [self.version_key(entry.name), self.entry_key(entry.name), self.names_key]
        return int(self._call(f"put {entry.name}", self._put, keys=keys, args=[body, entry.name, self.channel]))

    def get(self, name: str) -> Entry:
        text = self._call(f"get {name}", self._client.get, self.entry_key(name))
        if text is None:
            raise EntryNotFound(name, self.location)
        return Entry.from_json(text, name)

    def list(self) -> list[EntrySummary]:
        names = sorted(n.decode("utf-8", "replace") for n in self._call("list", self._client.smembers, self.names_key))
        if not names:
            return []
        out = []
        valid = []
        for n in names:
            try:
                valid.append(validate_name(n))
            except InvalidName as e:
                out.append(EntrySummary.corrupt(n, None, CorruptEntry(n, str(e))))
        texts = self._call("list", self._client.mget, [self.entry_key(n) for n in valid]) if valid else []
        versions = self._call("list", self._client.mget, [self.version_key(n) for n in valid]) if valid else []
        for n, text, v in zip(valid, texts, versions, strict=True):
            if text is None:  # removed between SMEMBERS and MGET
                continue
            try:
                out.append(EntrySummary.of(Entry.from_json(text, n)))
            except CorruptEntry as e:
                out.append(EntrySummary.corrupt(n, int(v) if v and v.isdigit() else None, e))  # v: bytes
        return sorted(out, key=lambda s: s.name)

    def delete(self, name: str) -> int:
        keys = [self.version_key(name), self.entry_key(name), self.names_key]
        v = int(self._call(f"delete {name}", self._delete, keys=keys, args=[name, self.channel]))
        if v < 0:
            raise EntryNotFound(name, self.location)
        return v

    def subscribe(self) -> Subscription:
        return _RedisSubscription(self)

    def close(self) -> None:
        self._client.close()


class _RedisSubscription(Subscription):
    def __init__(self, reg: RedisRegistry, confirm_timeout: float = 5.0):
        self._reg = reg
        self._ps = reg._client.pubsub()
        self.closed = False
        reg._call("subscribe", self._ps.subscribe, reg.channel)
        # wait for the server's confirmation: from here on no update is missed
        deadline = time.monotonic() + confirm_timeout
        while True:
            msg = reg._call("subscribe", self._ps.get_message, timeout=max(0.0, deadline - time.monotonic()))
            if msg and msg["type"] in ("subscribe", b"subscribe"):
                break
            if time.monotonic() >= deadline:
                self.close()
                raise RegistryUnavailable(f"Redis registry at {reg.location}: no subscription confirmation in {confirm_timeout}s")

    def get(self, timeout: float | None = None) -> Update | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.closed:
            left = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            msg = self._reg._call("listen", self._ps.get_message, timeout=left)
            if msg and msg["type"] in ("message", b"message"):
                try:
                    d = json.loads(msg["data"])
                    return Update(str(d["name"]), int(d["version"]) if d.get("version") is not None else None, str(d["op"]))
                except (ValueError, KeyError, TypeError):
                    continue  # someone else's message on our channel: ignore it
            if deadline is not None and time.monotonic() >= deadline:
                return None
        return None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self._ps.close()
            except Exception:
                pass


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
