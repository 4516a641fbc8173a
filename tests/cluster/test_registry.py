"""The registry contract, run against both stores: a real redis-server and the file store."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from redis_server import closed_port, redis_server

from cluster.registry import (
    CorruptEntry,
    Entry,
    EntryNotFound,
    FileRegistry,
    InvalidName,
    RedisRegistry,
    RegistryError,
    RegistryUnavailable,
    Update,
    default_name,
    describe_hardware,
    open_registry,
    validate_name,
)
from decoding.config import SpecConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as url:
        yield url


class Store:
    """A registry plus a way to write raw bytes where an entry lives (to corrupt it)."""

    def __init__(self, kind, make, write_raw, url):
        self.kind, self.make, self.write_raw, self.url = kind, make, write_raw, url
        self.reg = make()


@pytest.fixture(params=["file", "redis"])
def store(request, tmp_path):
    if request.param == "file":
        root = tmp_path / "registry"

        def make():
            return FileRegistry(root, poll_interval=0.05)

        def write_raw(name, text):
            path = make().entry_path(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(text.encode() if isinstance(text, str) else text)

        s = Store("file", make, write_raw, str(root))
    else:
        import redis

        url = request.getfixturevalue("redis_url")
        ns = f"test:{uuid.uuid4().hex[:8]}"  # one namespace per test: no flushing, no cross-talk

        def make():
            return RedisRegistry(url, namespace=ns)

        client = redis.Redis.from_url(url)

        def write_raw(name, text):
            client.set(make().entry_key(name), text)

        s = Store("redis", make, write_raw, url)
        s.namespace = ns
        s.client = client
    yield s
    s.reg.close()


def entry(name="smollm2-135m/spec_bench/ngram", k=6, speedup=1.2345678901234567, **kw):
    return Entry(
        name,
        SpecConfig(method="ngram", k=k, ngram_max=4, temperature=0.7, extra={"note": "x"}),
        metrics={"speedup": speedup, "tokens_per_s": 55.5, "mean_accepted_tokens": 2.25, "fidelity": {"identical": 13, "of": 13}},
        hardware={"cpu": "test cpu", "cores": 2, "gpus": []},
        source={"tune_run": "/tmp/run-1"},
        **kw,
    )


# ---- round trip, versions, list, delete -------------------------------------
def test_put_get_round_trip_is_exact(store):
    e = entry()
    assert store.reg.put(e) == 1
    got = store.reg.get(e.name)
    assert got.version == 1
    assert got == dataclasses.replace(e, version=1)
    assert got.config.extra == {"note": "x"}  # extra is compare=False in SpecConfig: check it explicitly
    assert got.metrics["speedup"] == 1.2345678901234567  # floats survive the store bit for bit
    # a fresh handle on the same store reads the same thing
    assert store.make().get(e.name) == got


def test_versions_increase_per_name_and_survive_delete(store):
    reg = store.reg
    assert [reg.put(entry(k=k)) for k in (1, 2, 3)] == [1, 2, 3]
    assert reg.put(entry(name="other/name")) == 1  # versions are per name
    got = reg.get("smollm2-135m/spec_bench/ngram")
    assert (got.version, got.config.k) == (3, 3)  # the last write wins
    assert reg.delete("smollm2-135m/spec_bench/ngram") == 3
    assert reg.put(entry(k=4)) == 4  # a reused name never repeats a version


def test_put_name_argument_overrides_entry_name(store):
    assert store.reg.put("user/given", entry()) == 1
    assert store.reg.get("user/given").name == "user/given"
    with pytest.raises(EntryNotFound):
        store.reg.get("smollm2-135m/spec_bench/ngram")


def test_list_sorted_with_summaries(store):
    reg = store.reg
    assert reg.list() == []
    reg.put(entry(name="b/model/ngram", speedup=1.5))
    reg.put(entry(name="a/model/ngram", speedup=2.0))
    reg.put(entry(name="a/model/ngram", speedup=2.5))
    rows = reg.list()
    assert [(r.name, r.version, r.status) for r in rows] == [("a/model/ngram", 2, "ok"), ("b/model/ngram", 1, "ok")]
    assert (rows[0].method, rows[0].speedup, rows[0].tokens_per_s) == ("ngram", 2.5, 55.5)
    assert rows[0].created_at and rows[0].error is None


def test_delete_and_not_found(store):
    reg = store.reg
    reg.put(entry())
    assert reg.delete("smollm2-135m/spec_bench/ngram") == 1
    with pytest.raises(EntryNotFound, match="smollm2-135m/spec_bench/ngram"):
        reg.get("smollm2-135m/spec_bench/ngram")
    with pytest.raises(EntryNotFound, match="smollm2-135m/spec_bench/ngram"):
        reg.delete("smollm2-135m/spec_bench/ngram")
    assert reg.list() == []
    with pytest.raises(EntryNotFound, match="'no/such/entry'"):
        reg.get("no/such/entry")


def test_similar_names_are_distinct_entries(store):
    reg = store.reg
    for n in ("a/b", "a_b", "a-b", "a.b", "a/b/c"):
        reg.put(entry(name=n))
    assert [r.name for r in reg.list()] == sorted(["a/b", "a_b", "a-b", "a.b", "a/b/c"])
    assert reg.delete("a/b") == 1
    assert reg.get("a/b/c").name == "a/b/c"


@pytest.mark.parametrize("bad", ["", "a//b", "/a", "a/", "a/../b", "..", "a b", "a/b?c", "ü", "x" * 200])
def test_bad_names_rejected_by_every_operation(store, bad):
    with pytest.raises(InvalidName) as info:
        store.reg.get(bad)
    assert repr(bad) in str(info.value)
    with pytest.raises(InvalidName):
        store.reg.delete(bad)
    with pytest.raises(InvalidName):
        store.reg.put(bad, entry())


def test_non_json_metrics_rejected_before_writing(store):
    with pytest.raises(RegistryError, match="a/nan"):  # the entry is refused as it is made, so never stored
        store.reg.put(Entry("a/nan", SpecConfig(), metrics={"speedup": float("nan")}))
    with pytest.raises(RegistryError, match="a/nan"):
        store.reg.put(Entry("a/nan", SpecConfig(), metrics={"other": {1, 2}}))  # a set: not JSON
    assert store.reg.list() == []


def test_ranked_metrics_must_be_numbers(store):
    """``registry list`` shows, and ranks entries by, speedup and tokens/s: a word there is refused when stored,
    and an entry written with one by hand reads as corrupt."""
    with pytest.raises(RegistryError, match="metrics.speedup must be a finite number, got 'fast'"):
        Entry("a/fast", SpecConfig(), metrics={"speedup": "fast"})
    raw = {"schema": 1, "name": "a/fast", "version": 1, "config": {}, "metrics": {"tokens_per_s": True}}
    with pytest.raises(CorruptEntry, match="metrics.tokens_per_s"):
        Entry.from_dict(raw)
    assert Entry("a/ok", SpecConfig(), metrics={"speedup": 2, "tokens_per_s": 90.5, "note": "any JSON"}).metrics["speedup"] == 2


# ---- corruption -------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ('{"name": "m/w/ngram", "config": {"method": "ngr', "not valid JSON"),
        ('["a", "list"]', "expected a JSON object"),
        (json.dumps({"name": "m/w/ngram", "version": 1, "config": {"method": "ngram", "k": 0}}), "k: draft length"),
        (json.dumps({"name": "m/w/ngram", "version": 1, "config": {"method": "medusa"}}), "unknown method"),
        (json.dumps({"name": "m/w/ngram", "version": 1, "config": {"kk": 3}}), "kk"),
        (json.dumps({"name": "other/name", "version": 1, "config": {}}), "names itself 'other/name'"),
        (json.dumps({"name": "m/w/ngram", "version": "7", "config": {}}), "version"),
        (json.dumps({"name": "m/w/ngram", "version": 1}), "missing field 'config'"),
        (json.dumps({"schema": 99, "name": "m/w/ngram", "config": {}}), "schema"),
        (b'\xff\xfe{"name": 1}', "not valid JSON"),
    ],
)
def test_corrupt_entry_reported_not_served(store, raw, why):
    reg = store.reg
    reg.put(entry(name="m/w/ngram"))
    reg.put(entry(name="m/w/sps"))
    store.write_raw("m/w/ngram", raw)
    with pytest.raises(CorruptEntry) as info:
        reg.get("m/w/ngram")
    msg = str(info.value)
    assert "'m/w/ngram'" in msg and "corrupt" in msg and why in msg, msg
    assert info.value.name == "m/w/ngram"
    rows = {r.name: r for r in reg.list()}  # listing survives the corrupt entry
    assert rows["m/w/ngram"].status == "corrupt" and why in rows["m/w/ngram"].error
    assert rows["m/w/ngram"].version == 1  # known from the version counter
    assert rows["m/w/sps"].status == "ok"
    # overwriting a corrupt entry repairs it and keeps counting
    assert reg.put(entry(name="m/w/ngram")) == 2
    assert reg.get("m/w/ngram").version == 2


# ---- atomicity --------------------------------------------------------------
def test_concurrent_puts_from_threads_get_distinct_versions(store):
    versions, errors = [], []

    def worker(i):
        reg = store.make()  # one handle per thread, like separate tuning workers
        try:
            for j in range(5):
                versions.append(reg.put(entry(k=1 + i * 5 + j)))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            reg.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert sorted(versions) == list(range(1, 21))
    final = store.reg.get("smollm2-135m/spec_bench/ngram")
    assert final.version == 20  # the stored entry is the one that got the last version


_PUTTER = """
import sys
from cluster.registry import Entry, open_registry
from decoding.config import SpecConfig
reg = open_registry(sys.argv[1], **({"namespace": sys.argv[2]} if sys.argv[2] else {}))
print(" ".join(str(reg.put(Entry("shared/name", SpecConfig(k=i + 1)))) for i in range(8)))
"""


def test_concurrent_puts_from_processes_get_distinct_versions(store):
    ns = getattr(store, "namespace", "")
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    procs = [subprocess.Popen([sys.executable, "-c", _PUTTER, store.url, ns], cwd=REPO, text=True, **pipes) for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    versions = [int(v) for out, _ in outs for v in out.split()]
    assert sorted(versions) == list(range(1, 17))
    assert store.reg.get("shared/name").version == 16


def test_file_store_leaves_no_temp_files(tmp_path):
    reg = FileRegistry(tmp_path)
    for k in range(1, 4):
        reg.put(entry(k=k))
    reg.delete("smollm2-135m/spec_bench/ngram")
    reg.put(entry(name="x/y"))
    leftovers = [p.name for p in (tmp_path / "entries").iterdir()]
    assert leftovers == ["x%2Fy.json"]


# ---- notifications ----------------------------------------------------------
def test_updates_delivered_on_put_and_delete(store):
    reg = store.reg
    reg.put(entry(name="before/subscribe"))
    with reg.subscribe() as sub:
        assert sub.get(timeout=0.3) is None  # nothing from before subscribing
        writer = store.make()  # another client writes
        writer.put(entry(name="m/w/ngram"))
        assert sub.get(timeout=5) == Update("m/w/ngram", 1, "put")
        writer.put(entry(name="m/w/ngram"))
        assert sub.get(timeout=5) == Update("m/w/ngram", 2, "put")
        writer.delete("m/w/ngram")
        assert sub.get(timeout=5) == Update("m/w/ngram", 2, "delete")
        assert sub.get(timeout=0.2) is None


def test_watch_calls_back_from_a_thread(store):
    seen, got = [], threading.Event()

    def callback(u):
        seen.append(u)
        if u.op == "delete":
            got.set()

    watcher = store.reg.watch(callback)
    try:
        store.make().put(entry(name="w/x"))
        time.sleep(0.3)  # let the file store's poller see the put before the delete
        store.make().delete("w/x")
        assert got.wait(5), seen
    finally:
        watcher.stop()
    assert seen == [Update("w/x", 1, "put"), Update("w/x", 1, "delete")]


def test_redis_keys_namespaced_and_messages_on_the_channel(redis_url):
    import redis

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    ns = f"test:{uuid.uuid4().hex[:8]}"
    reg = RedisRegistry(redis_url, namespace=ns)
    ps = client.pubsub()
    ps.subscribe(f"{ns}:updates")
    assert ps.get_message(timeout=5)["type"] == "subscribe"
    reg.put(entry(name="m/w/ngram"))
    assert json.loads(ps.get_message(timeout=5)["data"]) == {"name": "m/w/ngram", "version": 1, "op": "put"}
    assert sorted(client.keys(f"{ns}:*")) == [f"{ns}:entry:m/w/ngram", f"{ns}:names", f"{ns}:version:m/w/ngram"]
    assert json.loads(client.get(f"{ns}:entry:m/w/ngram"))["version"] == 1
    assert client.get(f"{ns}:version:m/w/ngram") == "1" and client.smembers(f"{ns}:names") == {"m/w/ngram"}
    reg.delete("m/w/ngram")
    assert json.loads(ps.get_message(timeout=5)["data"]) == {"name": "m/w/ngram", "version": 1, "op": "delete"}
    assert sorted(client.keys(f"{ns}:*")) == [f"{ns}:version:m/w/ngram"]  # the counter outlives the entry
    assert all(k.startswith("test:") for k in client.keys("*"))  # nothing outside the test namespaces
    ps.close()
    reg.close()


@pytest.mark.cluster
def test_a_watcher_follows_redis_through_a_restart():
    """Redis restarts (same port, its append-only file kept): the watcher subscribes again and later updates reach it,
    and a serving catalog that watches serves the new version without re-reading on its own. (The watcher's thread
    used to end at the first connection error, silently: nothing was pushed after a restart.)"""
    from evaluation.soak.services import RedisServer
    from serving.catalog import Catalog

    srv = RedisServer()
    srv.start()
    reg = open_registry(srv.url)
    seen = []
    watcher = reg.watch(seen.append)
    catalog = Catalog(srv.url, base_model="m", refresh_s=3600)  # re-reads only when told: updates must be pushed
    try:
        reg.put(entry(name="w/x"))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (seen and catalog.lookup("w/x")):
            time.sleep(0.05)
        assert seen == [Update("w/x", 1, "put")] and catalog.lookup("w/x").version == 1
        t_down = time.monotonic()
        srv.restart(down_s=1.0)
        version = 1
        while time.monotonic() - t_down < 15 and not any(u.version > 1 for u in seen):  # publish until one is pushed
            version = reg.put(entry(name="w/x", k=5))
            time.sleep(0.5)
        print(f"\nafter the restart: {seen[1:]} within {time.monotonic() - t_down:.1f}s of the stop")
        assert version >= 2  # the entry's counter survived the restart
        assert any(u.version > 1 for u in seen), f"no update reached the watcher after Redis restarted: {seen}"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and catalog.lookup("w/x").version < version:
            time.sleep(0.05)
        assert catalog.lookup("w/x").version == version and catalog.lookup("w/x").config.k == 5
    finally:
        try:
            catalog.close()
            watcher.stop()
        finally:
            reg.close()
            srv.close()


# ---- Redis unreachable --------------------------------------------------------
def test_redis_unreachable_raises_clear_error():
    url = f"redis://127.0.0.1:{closed_port()}/0"
    reg = RedisRegistry(url)
    t0 = time.monotonic()
    for op in (lambda: reg.put(entry()), lambda: reg.get("a/b"), reg.list, lambda: reg.delete("a/b"), reg.subscribe):
        with pytest.raises(RegistryUnavailable) as info:
            op()
        msg = str(info.value)
        assert url in msg and "unreachable" in msg and "\n" not in msg, msg
    assert time.monotonic() - t0 < 10  # short timeouts, no retry storm


@pytest.mark.cluster
def test_redis_going_down_fails_publishing_loudly():
    with redis_server() as url:
        reg = RedisRegistry(url)
        assert reg.put(entry()) == 1
        reg.close()
    with pytest.raises(RegistryUnavailable, match="unreachable"):
        reg.put(entry())


def test_password_not_shown_in_errors():
    reg = RedisRegistry(f"redis://user:hunter2@127.0.0.1:{closed_port()}/0")
    with pytest.raises(RegistryUnavailable) as info:
        reg.list()
    assert "hunter2" not in str(info.value) and "***" in str(info.value)


# ---- choosing a store ---------------------------------------------------------
def test_open_registry_picks_the_store(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECRAY_REDIS_URL", raising=False)
    monkeypatch.setenv("SPECRAY_HOME", str(tmp_path / "home"))
    reg = open_registry()
    assert isinstance(reg, FileRegistry) and reg.root == tmp_path / "home" / "registry"
    assert open_registry(str(tmp_path / "p")).root == tmp_path / "p"
    assert open_registry(tmp_path / "p").root == tmp_path / "p"
    assert open_registry(f"file://{tmp_path}/q").root == tmp_path / "q"
    monkeypatch.setenv("SPECRAY_REDIS_URL", "redis://127.0.0.1:6399/3")
    reg = open_registry()
    assert isinstance(reg, RedisRegistry) and reg.url == "redis://127.0.0.1:6399/3"
    assert isinstance(open_registry(str(tmp_path)), FileRegistry)  # an explicit argument wins over the env
    monkeypatch.setenv("SPECRAY_REDIS_URL", "")
    assert isinstance(open_registry(), FileRegistry)  # empty means unset
    with pytest.raises(RegistryError, match="unsupported registry URL 'http://x'"):
        open_registry("http://x")


def test_file_store_unusable_directory(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    reg = FileRegistry(blocker)
    with pytest.raises(RegistryUnavailable, match="afile"):
        reg.put(entry())
    assert reg.list() == []


# ---- names, entries, hardware -------------------------------------------------
def test_names_and_default_name():
    assert validate_name("smollm2-135m/spec_bench/ngram") == "smollm2-135m/spec_bench/ngram"
    assert default_name("smollm2-135m", "spec_bench", "early-exit") == "smollm2-135m/spec_bench/early-exit"
    assert default_name("HuggingFaceTB/SmolLM2-360M", "long context", "sps") == "HuggingFaceTB-SmolLM2-360M/long-context/sps"
    assert default_name("/models/llama 8b/", "chat", "ngram") == "llama-8b/chat/ngram"
    assert default_name("..", "", "ar") == "x../x/ar"
    with pytest.raises(InvalidName, match="'a/\\.\\./b'"):
        validate_name("a/../b")
    with pytest.raises(InvalidName, match="characters ' '"):
        validate_name("a b")


def test_entry_json_round_trip_and_validation():
    e = entry(version=3)
    back = Entry.from_json(e.to_json())
    assert back == e and back.to_dict() == e.to_dict()
    assert json.loads(e.to_json())["config"]["k"] == 6
    with pytest.raises(InvalidName):
        Entry("bad name", SpecConfig())
    with pytest.raises(TypeError, match="SpecConfig"):
        Entry("a/b", {"method": "ngram"})


def test_describe_hardware():
    hw = describe_hardware()
    assert hw["cores"] >= 1 and hw["cpu"] and hw["torch"] and isinstance(hw["gpus"], list)
    json.dumps(hw)  # storable


def test_file_store_flags_a_stray_file_with_an_invalid_name(tmp_path):
    reg = FileRegistry(tmp_path)
    reg.put(entry(name="good/one"))
    (tmp_path / "entries" / "bad%20name.json").write_text(entry(name="good/one").to_json())
    rows = reg.list()
    assert [(r.name, r.status) for r in rows] == [("bad%20name.json", "corrupt"), ("good/one", "ok")]
    assert "invalid registry name 'bad name'" in rows[0].error
