"""`specray registry` / `python -m jobs.registry`: list, show, delete and publish tuned configurations.

    specray registry list [--json]
    specray registry show smollm2-135m/spec_bench/ngram [--json]
    specray registry delete smollm2-135m/spec_bench/ngram
    specray registry put my/ngram-k6 --config cfg.json --metrics '{"speedup": 1.8}' [--set k=6]

The store is ``--registry URL_OR_PATH`` when given (``redis://...``, ``file://...``
or a directory), else ``SPECRAY_REDIS_URL`` when set, else ``$SPECRAY_HOME/registry``.
Unknown or corrupt entries and an unreachable Redis print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cluster.registry import Entry, RegistryError, describe_hardware, open_registry
from decoding.config import SpecConfig
from jobs.common import Parser, command, fail, input_file

COLUMNS = ("name", "method", "version", "speedup", "tokens/s", "created_at", "status")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="specray registry", description="The registry of tuned speculative-decoding configurations.")
    sub = p.add_subparsers(dest="command", metavar="{list,show,delete,put}")
    sub.required = True

    def common(sp):
        sp.add_argument(
            "--registry",
            metavar="URL_OR_PATH",
            help="redis://..., file://... or a directory (default: SPECRAY_REDIS_URL, else $SPECRAY_HOME/registry)",
        )
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        return sp

    common(sub.add_parser("list", help="all entries, corrupt ones flagged"))
    common(sub.add_parser("show", help="one entry in full")).add_argument("name")
    common(sub.add_parser("delete", help="remove an entry")).add_argument("name")
    put = common(sub.add_parser("put", help="publish a configuration under a name"))
    put.add_argument("name")
    put.add_argument("--config", required=True, help="a SpecConfig JSON file")
    put.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    put.add_argument("--metrics", default="{}", help="a JSON object (or a file holding one): speedup, tokens_per_s, ...")
    put.add_argument("--source", default="{}", help="a JSON object (or file) saying where the figures come from")
    put.add_argument("--hardware", help="a JSON object (or file); default: this machine's description")
    return p


def _json_object(flag: str, text: str) -> dict:
    """A JSON object given inline or as a file path."""
    raw = text
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            fail(f"{flag}: not a JSON object and no file {path}")
        try:
            raw = path.read_text()
        except OSError as e:
            fail(f"{flag}: cannot read {path}: {e}")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        fail(f"{flag}: not valid JSON ({e})")
    if not isinstance(data, dict):
        fail(f"{flag}: expected a JSON object, got {type(data).__name__}")
    return data


def _fmt(v, spec: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, int | float) and not isinstance(v, bool) and spec:
        return format(v, spec)
    return str(v)


def print_table(rows: list, location: str) -> None:
    if not rows:
        print(f"no entries in {location}")
        return
    table = [COLUMNS]
    for s in rows:
        method = _fmt(s.method) + (" (LOSSY)" if s.lossy else "")  # unverified tokens (EAD): not the target's output
        table.append((s.name, method, _fmt(s.version), _fmt(s.speedup, ".2f"), _fmt(s.tokens_per_s, ".1f"), _fmt(s.created_at), s.status))
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    for s in rows:
        if s.status != "ok":
            print(f"corrupt {s.name}: {s.error}")


def _report(args, op: str, version: int, text: str) -> None:
    print(json.dumps({"name": args.name, "version": version, "op": op}) if args.json else text)


def main_with_args(args) -> int:
    if args.registry and "://" not in args.registry and args.command in ("list", "show", "delete"):
        where = Path(args.registry).expanduser()  # a directory named on the command line must be there to be read
        if not where.exists():
            fail(f"--registry: {where} does not exist")
        if not where.is_dir():
            fail(f"--registry: {where} is not a directory")
    try:
        with open_registry(args.registry) as reg:
            if args.command == "list":
                rows = reg.list()
                if args.json:
                    print(json.dumps([s.to_dict() for s in rows]))
                else:
                    print_table(rows, reg.location)
            elif args.command == "show":
                entry = reg.get(args.name)
                print(entry.to_json(indent=None if args.json else 2))
            elif args.command == "delete":
                version = reg.delete(args.name)
                _report(args, "delete", version, f"deleted {args.name} (version {version})")
            elif args.command == "put":
                path = input_file(args.config, "config file")
                try:
                    data = json.loads(path.read_text())
                except (OSError, json.JSONDecodeError) as e:
                    fail(f"config file {path} is not valid JSON: {e}")
                config = SpecConfig.from_dict(data).with_overrides(args.set)
                metrics = _json_object("--metrics", args.metrics)
                source = _json_object("--source", args.source)
                hardware = _json_object("--hardware", args.hardware) if args.hardware else describe_hardware()
                source.setdefault("config_file", str(path.resolve()))
                version = reg.put(Entry(args.name, config, metrics=metrics, hardware=hardware, source=source))
                _report(args, "put", version, f"stored {args.name} version {version} in {reg.location}")
    except RegistryError as e:
        fail(str(e))
    return 0


main = command(build_parser, main_with_args)


if __name__ == "__main__":
    sys.exit(main())
