"""The registry in Redis: namespaced keys, one Lua script per write so the entry, its version and the name index
change together, and a message on the channel ``specray:registry:updates`` for every put and delete."""

from __future__ import annotations

import json
import time
import urllib.parse

from cluster.registry.entries import (
    CorruptEntry,
    Entry,
    EntryNotFound,
    EntrySummary,
    InvalidName,
    RegistryError,
    RegistryUnavailable,
    Update,
    body_without_version,
    validate_name,
)
from cluster.registry.interface import Registry, Subscription

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")  # URLs open_registry hands to this store


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
        body = json.dumps(body_without_version(entry), sort_keys=True, allow_nan=False)
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
