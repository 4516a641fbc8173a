"""`specray serve` / `python -m jobs.serve`: the OpenAI-compatible endpoints on Ray Serve.

    specray serve --registry ~/.specray/registry --port 8000
    specray serve --config infra/serve.yaml --set max_ongoing_requests=2

Serves every registry entry under its name and the base model (plus every
entry's model) as plain AR; blocks, printing the URL and the served models;
Ctrl-C (or SIGTERM) drains in-flight requests for ``--drain-timeout-s`` and shuts
Serve and the local Ray down, in bounded time.

Before Ray starts it checks, each failing with one line and exit 2: the
registry, the base model and every ``--preload`` (their config reads and their
weights are there), and that ``--host``/``--port`` can be listened on (Ray's proxy
binds with port reuse, so a second server would otherwise share a busy port).
``--api-key`` or ``SPECRAY_API_KEY``: ``/v1/*`` requires ``Authorization: Bearer KEY``
(only the key's SHA-256 goes into the Serve config).

``--config`` takes a Serve config file (``infra/serve.yaml``: its
``http_options`` and the ``args`` of the application whose ``import_path`` is
``serving.app:app_builder``) or a plain mapping of ``ServeSettings`` fields;
flags override it. Ray: ``--address``, else ``RAY_ADDRESS``, else an embedded local Ray
(``cluster.runtime.connect``); ``serve.shutdown()`` on exit, and Ray's too when started here.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import socket
import sys
import threading
import time

from jobs.common import Parser, command, fail, finite_float, input_file

APP_NAME = "specray"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="specray serve", description="Serve the registry's configurations behind OpenAI-compatible endpoints.")
    p.add_argument(
        "--registry",
        metavar="URL_OR_PATH",
        help="redis://..., file://... or a directory (default: SPECRAY_REDIS_URL, else $SPECRAY_HOME/registry)",
    )
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--config", metavar="SERVE_YAML", help="a Serve config file (infra/serve.yaml) or a YAML/JSON mapping of serve settings")
    p.add_argument("--base-model", help="the model served as plain AR (default smollm2-135m)")
    p.add_argument("--dtype", help="dtype of the plain-AR models: bfloat16 (default) or float32")
    p.add_argument("--max-ongoing-requests", type=int, help="requests a model replica takes at once (default 64)")
    p.add_argument("--max-batch-rows", type=int, help="sequences one model's batch decodes together (default 32)")
    p.add_argument("--max-queued-requests", type=int, help="admission limit of the ingress; beyond it 429 (default 64)")
    p.add_argument("--num-replicas", type=int, help="a fixed number of model replicas (default: autoscaling 1..2)")
    p.add_argument("--preload", action="append", default=[], metavar="MODEL", help="load this model name at start (repeatable)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any serve setting, value as JSON, e.g. --set threads=2")
    p.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local Ray)")
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1/* (default: SPECRAY_API_KEY; prefer the variable, flags show up in ps)",
    )
    p.add_argument("--auth-health", action="store_true", help="also require the key on /health and /metrics")
    p.add_argument("--max-body-bytes", type=int, help="largest request body; bigger ones get 413 (default 4 MiB)")
    p.add_argument("--drain-timeout-s", type=finite_float, help="on Ctrl-C/SIGTERM, wait this long for in-flight requests (default 10)")
    return p


def read_config(path: str) -> tuple[dict, dict]:
    """(settings mapping, http options) from a Serve config file or a plain mapping."""
    import yaml

    f = input_file(path, "config file")
    try:
        data = yaml.safe_load(f.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        fail(f"config file {f} is not valid YAML: {e}")
    if not isinstance(data, dict):
        fail(f"config file {f}: expected a mapping, got {type(data).__name__}")
    if "applications" not in data:
        return data, {}
    apps = data.get("applications") or []
    ours = [a for a in apps if isinstance(a, dict) and str(a.get("import_path", "")).startswith("serving.app:")]
    if not ours:
        fail(f"config file {f}: no application with import_path serving.app:app_builder")
    args = ours[0].get("args") or {}
    if not isinstance(args, dict):
        fail(f"config file {f}: the application's args must be a mapping")
    return args, data.get("http_options") or {}


def settings_from_args(args):
    from serving.settings import ServeSettings, api_key_digest

    base, http = read_config(args.config) if args.config else ({}, {})
    data = dict(base)
    flags = {
        "registry": args.registry,
        "base_model": args.base_model,
        "dtype": args.dtype,
        "max_ongoing_requests": args.max_ongoing_requests,
        "max_batch_rows": args.max_batch_rows,
        "max_queued_requests": args.max_queued_requests,
        "num_replicas": args.num_replicas,
        "max_body_bytes": args.max_body_bytes,
        "drain_timeout_s": args.drain_timeout_s,
    }
    data.update({k: v for k, v in flags.items() if v is not None})
    if args.preload:
        data["preload"] = list(args.preload)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            fail(f"--set: expected KEY=VALUE, got {item!r}")
        try:
            data[key.strip().replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            data[key.strip().replace("-", "_")] = value
    if args.auth_health:
        data["auth_health"] = True
    key = args.api_key if args.api_key is not None else os.environ.get("SPECRAY_API_KEY")
    if key is not None:
        if not key.strip() or any(c.isspace() for c in key) or not key.isprintable():
            fail("--api-key / SPECRAY_API_KEY: the key must be printable text without spaces")
        data["api_key_sha256"] = api_key_digest(key)
    settings = ServeSettings.from_dict(data)
    host = args.host or http.get("host") or "127.0.0.1"
    try:
        port = args.port if args.port is not None else int(http.get("port", 8000))
    except (TypeError, ValueError):
        fail(f"http_options.port: not a number: {http.get('port')!r}")
    if not 0 < port < 65536:
        fail(f"--port: {port} is not a TCP port")
    return settings, host, port


def check_port_free(host: str, port: int) -> None:
    """Fail (one line) unless ``host:port`` can be listened on now: Ray's proxy binds with port reuse,
    so a second server on a busy port would start and share the port with the first."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        fail(f"--host: cannot listen on {host!r}: {getattr(e, 'strerror', None) or e}")
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free; a listener is not
        try:
            sock.bind(addr)
            sock.listen(1)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                fail(f"--port: {host}:{port} is already in use (another server listens there)")
            if e.errno == errno.EACCES:
                fail(f"--port: no permission to listen on {host}:{port}")
            fail(f"--host: cannot listen on {host}:{port}: {e.strerror or e}")


def check_models(settings, catalog) -> None:
    """Fail (one line) when the base model or a preloaded configuration's model does not load, instead of
    starting a server whose every request fails. Reads each model's config and looks for its weights (no weights loaded)."""
    from decoding.errors import ConfigError
    from serving.catalog import ModelNotFound

    wanted = [("--base-model", settings.base_model)]
    for name in settings.preload:
        try:
            cfg = catalog.resolve(name).config
        except ModelNotFound as e:
            fail(f"--preload {name}: {e}")
        wanted += [(f"--preload {name}", m) for m in (cfg.model, cfg.draft_model) if m]
    for flag, model in wanted:
        try:
            model_loads(model)
        except ConfigError as e:
            fail(f"{flag}: {str(e).removeprefix('model: ')}")


def model_loads(name: str) -> None:
    """Raise ConfigError unless ``name`` resolves to a model whose config reads and whose weights are there."""
    from decoding.errors import ConfigError
    from decoding.model.loading import resolve

    kind, path, _ = resolve(name)
    if kind != "dir":
        return
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # a broken config.json: any of several transformers errors
        raise ConfigError("model", f"{path}: its config.json does not load ({type(e).__name__})") from None
    if not any(next(path.glob(pattern), None) for pattern in ("*.safetensors", "*.bin", "*.gguf")):
        raise ConfigError("model", f"{path} holds no weights (*.safetensors, *.bin)")
    from safetensors import safe_open

    for weights in sorted(path.glob("*.safetensors")):  # a truncated file fails on its header, read without the tensors
        try:
            with safe_open(weights, "pt"):
                pass
        except Exception as e:  # noqa: BLE001 - safetensors' own error types
            raise ConfigError("model", f"{weights} does not load ({type(e).__name__}: {' '.join(str(e).split())[:160]})") from None


def check_placed_entries(settings, catalog) -> None:
    """Before Serve starts: every entry that runs on two workers fits the cluster (one line naming the entry, what it
    wants and what the cluster has, and exit 2, instead of a deployment that never gets its placement group)."""
    from cluster.runtime import shutdown_if_started_here
    from decoding.errors import ConfigError
    from serving.placed_worker import placed_entries

    if not settings.place_actor_entries:
        return
    try:
        placed_entries(catalog, settings.placed_replica_num_cpus)
    except ConfigError as e:
        catalog.close()
        shutdown_if_started_here()
        fail(str(e))


def _shutdown_serve(timeout_s: float) -> bool:
    """``serve.shutdown()`` bounded by ``timeout_s``; False when it did not finish in time."""
    from ray import serve

    done = threading.Event()

    def run():
        try:
            serve.shutdown()
        finally:
            done.set()

    threading.Thread(target=run, name="serve-shutdown", daemon=True).start()
    return done.wait(timeout_s)


def main_with_args(args) -> int:
    settings, host, port = settings_from_args(args)
    from cluster.registry import RegistryError
    from serving.catalog import Catalog

    try:  # fail fast on a bad registry, and tell the user what will be served
        catalog = Catalog(settings.registry, settings.base_model, settings.dtype, watch=False)
    except RegistryError as e:
        fail(str(e))
    if catalog.error:
        fail(catalog.error)
    try:
        check_models(settings, catalog)
        check_port_free(host, port)
    except BaseException:
        catalog.close()
        raise

    from ray import serve

    from cluster.runtime import connect, shutdown_if_started_here
    from serving.app import build_app

    connect(args.address)
    check_placed_entries(settings, catalog)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(build_app(settings), name=APP_NAME, route_prefix="/")
        except RuntimeError as e:  # a replica's constructor failed (e.g. a preload that does not load)
            first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            fail(f"the application did not start: {first[:300]} (the Serve logs have the details)")
        url = f"http://{host}:{port}"
        print(f"specray serving at {url}/v1  (health {url}/health, metrics {url}/metrics)", flush=True)
        root = getattr(catalog.registry, "root", None)  # a directory registry that no one has written to yet
        missing = "  (no such directory yet: what is published there is served as it lands)" if root and not root.exists() else ""
        print(f"registry: {catalog.registry.location}{missing}", flush=True)
        for m in catalog.models():
            extra = f" v{m.version}" if m.version else ""
            speed = f" speedup {m.metrics['speedup']:.2f}" if isinstance(m.metrics.get("speedup"), int | float) else ""
            print(f"  {m.name}  [{m.config.method}{extra}{speed}]", flush=True)
        for name, why in sorted(catalog.corrupt.items()):
            print(f"  {name}  [corrupt, not served: {why}]", flush=True)
        print("Ctrl-C to stop", flush=True)
        while not stop.wait(0.5):
            pass
        print("shutting down", file=sys.stderr, flush=True)
    finally:
        catalog.close()
        t0 = time.monotonic()
        try:
            # replicas drain for drain_timeout_s (graceful_shutdown_timeout_s); a few seconds more for Serve's own actors
            if not _shutdown_serve(settings.drain_timeout_s + 5.0):
                print(f"Serve did not shut down within {settings.drain_timeout_s + 5.0:.0f}s; stopping anyway", file=sys.stderr, flush=True)
        finally:
            shutdown_if_started_here()
        print(f"stopped in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
    return 0


main = command(build_parser, main_with_args)


if __name__ == "__main__":
    sys.exit(main())
