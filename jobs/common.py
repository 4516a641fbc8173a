"""Shared command-line plumbing: config flags, one-line errors, exit code 2."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

import kernels
from decoding.config import METHODS, SpecConfig
from decoding.errors import ConfigError


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


def finite_float(text: str) -> float:
    """argparse type of every float flag: a finite number (``nan`` and ``inf`` parse as floats, but no setting means
    them, and they slip past range checks: ``nan <= 0`` is false).

    >>> finite_float("0.5")
    0.5
    >>> finite_float("nan")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: expected a finite number, got 'nan'
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def input_file(path: str | Path, what: str) -> Path:
    """``path`` if it is a readable file, else a one-line failure saying what is wrong (missing, a directory)."""
    p = Path(path)
    if p.is_dir():
        fail(f"{what} {p} is a directory, not a file")
    if not p.is_file():
        fail(f"{what} {p} does not exist")
    if not os.access(p, os.R_OK):
        fail(f"{what} {p} is not readable")
    return p


def output_dir(path: str | Path, flag: str) -> Path:
    """Check the output directory ``path`` before any work starts: a file there, or a place where it cannot be
    created or written, fails in one line naming ``flag``. A directory that did not exist is created to prove it
    can be, then removed again (a run that fails later leaves nothing behind); the job creates it when it writes."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        fail(f"{flag}: {p} exists and is not a directory")
    missing = [d for d in (p, *p.parents) if not d.exists()]
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"{flag}: cannot create {p}: {e.strerror or e}")
    writable = os.access(p, os.W_OK | os.X_OK)
    for d in missing:  # deepest first
        try:
            d.rmdir()
        except OSError:
            break
    if not writable:
        fail(f"{flag}: {p} is not writable")
    return p


def distill_data(data: str | None, model: str) -> Path:
    """The ``specray distill`` data a training job reads: ``--data``, else the data committed for ``--model``; fails
    in one line naming the flag that chose it."""
    path = Path(data) if data else Path(__file__).resolve().parent.parent / "data" / "distill" / model
    if not (path / "manifest.json").is_file():
        if data:
            fail(f"--data: {path} is not a `specray distill` data directory (no manifest.json)")
        fail(f"--model {model}: no `specray distill` data is committed for it (no {path}); pass --data DIR")
    return path


def check_cluster_flags(args, defaults: dict) -> None:
    """Flags that only a run with ``--on-cluster`` reads, given without it: one line naming them (they were ignored
    without a word); ``defaults``: flag field -> its default.

    >>> import argparse
    >>> check_cluster_flags(argparse.Namespace(on_cluster=False, workers=None), {"workers": None})
    >>> check_cluster_flags(argparse.Namespace(on_cluster=False, workers=2), {"workers": None})
    Traceback (most recent call last):
    ...
    jobs.common.UsageError: --workers applies only with --on-cluster
    """
    if getattr(args, "on_cluster", False):
        return
    given = [f"--{name.replace('_', '-')}" for name, default in defaults.items() if getattr(args, name) != default]
    if given:
        fail(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with --on-cluster")


def check_readme(readme: str | Path, block: str) -> None:
    """Before any work: the README ``--readme`` names exists and has the ``<!-- block -->`` a finished run rewrites."""
    input_file(readme, "--readme:")
    from evaluation.markdown import check_block

    try:
        check_block(Path(readme), block)
    except ValueError as e:
        fail(f"--readme: {e}")


def output_file(path: str | Path, flag: str) -> Path:
    """Check a file a job rewrites at its end (a README's block), before any work starts: a directory there, or a
    folder that does not exist or cannot be written, fails in one line naming ``flag`` (instead of after the run)."""
    p = Path(path).expanduser()
    if p.is_dir():
        fail(f"{flag}: {p} is a directory, not a file")
    if not p.parent.is_dir():
        fail(f"{flag}: the folder {p.parent} does not exist")
    if not os.access(p if p.exists() else p.parent, os.W_OK):
        fail(f"{flag}: {p} is not writable")
    return p


_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+-]{0,127}")


def path_name(name: str, flag: str) -> str:
    """``name`` if it can be one folder name under an output directory: letters, digits and ``._=+-``, not
    starting with a dot, at most 128 characters; anything else (``..``, ``/``, ``~``, spaces) fails naming ``flag``.

    >>> path_name("tune-2026_k=4", "--name")
    'tune-2026_k=4'
    >>> path_name("../../x", "--name")
    Traceback (most recent call last):
    ...
    jobs.common.UsageError: --name: '../../x' is not a plain folder name (letters, digits, . _ = + -; no / or ..)
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        fail(f"{flag}: {name!r} is not a plain folder name (letters, digits, . _ = + -; no / or ..)")
    return name


def check_text(text: str, what: str) -> str:
    """``text`` if it is valid Unicode; command-line bytes that are not UTF-8 arrive as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        fail(f"{what} is not valid UTF-8 (byte {ord(text[e.start]) & 0xFF:#04x} at character {e.start})")
    return text


class Parser(argparse.ArgumentParser):
    """argparse whose own errors become UsageError (one line, exit 2) instead of usage text."""

    def error(self, message):
        raise UsageError(message)


def add_config_args(p: argparse.ArgumentParser, method: bool = True) -> None:
    if method:
        p.add_argument("--method", help=f"one of {', '.join(METHODS)} (default ar)")
    p.add_argument("--model", help="smollm2-135m (default) or a local Hugging Face model directory")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--temperature", type=finite_float)
    p.add_argument("--top-p", type=finite_float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--dtype", help="bfloat16 (default) or float32")
    p.add_argument(
        "--quant",
        help="the target's weights: auto (default: the GGUF's own 4-bit blocks in bfloat16 on a CPU), none, q4, int8",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="run the target's layers compiled by torch.compile (one row; minutes the first time)",
    )
    p.add_argument("--threads", type=int, help="torch threads (default: SPECRAY_THREADS, OMP_NUM_THREADS or torch's choice)")
    p.add_argument("--config", help="a SpecConfig JSON file; flags override it")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any config field, e.g. --set k=6")


_FLAG_FIELDS = ("method", "model", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "dtype", "quant", "compile", "threads")


def config_from_args(args) -> SpecConfig:
    base = {}
    if getattr(args, "config", None):
        path = input_file(args.config, "config file")
        try:
            base = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            fail(f"config file {path} is not valid JSON: {e}")
    cfg = SpecConfig.from_dict(base)
    flags = {f: getattr(args, f) for f in _FLAG_FIELDS if getattr(args, f, None) is not None}
    for item in args.set:
        check_text(item, "--set")
    return cfg.with_overrides(args.set, **flags)  # checked as it is built: the HTTP API's sampling limits too


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


def command(build_parser, body):
    """A job's ``main(argv=None)``: parse with ``build_parser()``, run ``body(args)``, errors in one line (:func:`run_cli`)."""

    def main(argv=None) -> int:
        return run_cli(build_parser(), body, argv)

    return main
