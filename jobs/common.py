"""Shared command-line plumbing: config flags, one-line errors, exit code 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import kernels
from decoding.config import METHODS, ConfigError, SpecConfig


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


def fail(message: str):
    raise UsageError(message)


def parse_ints(text: str, flag: str, minimum: int, unit: str = "") -> list[int]:
    """A comma list of integers, each >= ``minimum``; anything else fails naming ``flag``.

    >>> parse_ints("2, 4,6", "--chain-k", 1)
    [2, 4, 6]
    """
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"{flag}: expected a comma list of integers, got {text!r}")
    if not values or min(values) < minimum:
        fail(f"{flag}: values must be >= {minimum}{unit}, got {text!r}")
    return values


class Parser(argparse.ArgumentParser):
    """argparse whose own errors become UsageError (one line, exit 2) instead of usage text."""

    def error(self, message):
        raise UsageError(message)


def add_config_args(p: argparse.ArgumentParser, method: bool = True) -> None:
    if method:
        p.add_argument("--method", help=f"one of {', '.join(METHODS)} (default ar)")
    p.add_argument("--model", help="smollm2-135m (default) or a local Hugging Face model directory")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--dtype", help="bfloat16 (default) or float32")
    p.add_argument("--threads", type=int, help="torch threads (default: SPECRAY_THREADS, OMP_NUM_THREADS or torch's choice)")
    p.add_argument("--config", help="a SpecConfig JSON file; flags override it")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any config field, e.g. --set k=6")


_FLAG_FIELDS = ("method", "model", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "dtype", "threads")


def config_from_args(args) -> SpecConfig:
    base = {}
    if getattr(args, "config", None):
        path = Path(args.config)
        if not path.is_file():
            fail(f"config file {path} does not exist")
        try:
            base = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            fail(f"config file {path} is not valid JSON: {e}")
    cfg = SpecConfig.from_dict(base)
    flags = {f: getattr(args, f) for f in _FLAG_FIELDS if getattr(args, f, None) is not None}
    return cfg.with_overrides(args.set, **flags)


def run_cli(parser: argparse.ArgumentParser, body, argv=None) -> int:
    """Parse, run, and turn user errors into one line on stderr with exit code 2."""
    try:
        args = parser.parse_args(argv)
        kernels.install()  # Triton kernels for the decoding code where they apply (CUDA)
        return body(args)
    except (UsageError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
