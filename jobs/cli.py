"""The `specray` console script: one subcommand per job module."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "generate": "jobs.generate",
    "pipeline": "jobs.pipeline",
    "bench": "jobs.bench",
    "bench-serve": "jobs.bench_serve",
    "bench-device": "jobs.bench_device",
    "bench-training": "jobs.bench_training",
    "bench-http": "jobs.bench_http",
    "registry": "jobs.registry",
    "serve": "jobs.serve",
    "soak": "jobs.soak",
    "tune": "jobs.tune",
    "train-drafter": "jobs.train_drafter",
    "distill": "jobs.distill",
    "ship-drafters": "jobs.ship_drafters",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: specray {" + ",".join(COMMANDS) + "} [options]\n\nRun `specray COMMAND --help` for a command's options.")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[name]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
