"""`specray serve` / `python -m jobs.serve`: the OpenAI-compatible endpoints on Ray Serve.

    specray serve --registry ~/.specray/registry --port 8000
    specray serve --config infra/serve.yaml --set max_ongoing_requests=2

Serves every registry entry under its name and the base model (plus every
entry's model) as plain AR; blocks, printing the URL and the served models;
Ctrl-C (or SIGTERM) shuts Serve and the local Ray down.

``--config`` takes a Serve config file (``infra/serve.yaml``: its
``http_options`` and the ``args`` of the application whose ``import_path`` is
``serving.app:app_builder``) or a plain mapping of ``ServeSettings`` fields;
flags override it. Ray: ``--address``, else ``RAY_ADDRESS``, else an embedded local Ray
(``cluster.runtime.connect``); ``serve.shutdown()`` on exit, and Ray's too when started here.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from jobs.common import Parser, fail, run_cli

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
    return p


def read_config(path: str) -> tuple[dict, dict]:
    """(settings mapping, http options) from a Serve config file or a plain mapping."""
    import yaml

    f = Path(path)
    if not f.is_file():
        fail(f"config file {f} does not exist")
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
    from serving.settings import ServeSettings

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
    settings = ServeSettings.from_dict(data)
    host = args.host or http.get("host") or "127.0.0.1"
    port = args.port if args.port is not None else int(http.get("port", 8000))
    if not 0 < port < 65536:
        fail(f"--port: {port} is not a TCP port")
    return settings, host, port


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

    from ray import serve

    from cluster.runtime import connect, shutdown_if_started_here
    from serving.app import build_app

    connect(args.address)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(settings), name=APP_NAME, route_prefix="/")
        url = f"http://{host}:{port}"
        print(f"specray serving at {url}/v1  (health {url}/health, metrics {url}/metrics)", flush=True)
        print(f"registry: {catalog.registry.location}", flush=True)
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
        try:
            serve.shutdown()
        finally:
            shutdown_if_started_here()
    return 0


def main(argv=None) -> int:
    return run_cli(build_parser(), main_with_args, argv)


if __name__ == "__main__":
    sys.exit(main())
