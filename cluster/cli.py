"""The ``raylastic`` command (also ``python -m raylastic``).

Examples::

    raylastic train                                   # digits, 2 workers, local Ray
    raylastic train --config job.yaml --set training.steps=500 --set scaling.max_workers=3
    ray start --head && raylastic train --address auto

Each subcommand lives in its own module with ``register(subparsers)``, which adds its parser
and sets ``run(args) -> exit code`` as its handler; keep ``register`` light (no heavy imports).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from raylastic.cluster.import_path import use_import_path

COMMAND_MODULES = tuple(f"raylastic.{name}" for name in (
    "cluster.train_command", "cluster.export_command", "cluster.status_command", "cluster.tokenize_command",
    "cluster.plot_command", "tuning.cli"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raylastic", description="Elastic, fault-tolerant PyTorch training on Ray.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    # A user's workload ("my_module:MyWorkload") is imported from where the command runs (the `raylastic`
    # script's sys.path[0] is its own bin directory), after the standard library, as in the workers
    # (cluster/import_path.py).
    use_import_path([os.getcwd()])
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
