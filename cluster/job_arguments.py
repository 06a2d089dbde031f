"""The arguments every command that runs jobs takes (``raylastic train``, ``raylastic sweep``), declared once.

Example::

    add_job_arguments(parser)
    job = job_from_arguments(parser.parse_args(["--set", "training.steps=50"]))
"""

from __future__ import annotations

import argparse

from raylastic.jobconfig import JobConfig, load_job_config


def add_job_arguments(parser: argparse.ArgumentParser, *, config_flag: str = "--config", job: str = "the job",
                      local_ray_for: str = "this run") -> None:
    """Add the job's YAML file (``config_flag``), ``--set`` overrides and ``--address``.

    ``job`` names the job in the help ("the base job" of a sweep); ``local_ray_for`` says what the
    local Ray instance started without ``--address`` is for.
    """
    parser.add_argument(config_flag, dest="config", metavar="job.yaml",
                        help=f"YAML file with {job}'s sections (default: the built-in defaults)")
    parser.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                        help=f"override one key of {job}, e.g. --set training.steps=100 (repeatable)")
    parser.add_argument("--address", help="Ray cluster to use ('auto' after `ray start --head`); "
                        f"default: start a local instance for {local_ray_for}")


def job_from_arguments(args: argparse.Namespace, *more_overrides: str) -> JobConfig:
    """The validated JobConfig of ``args`` (ValueError naming the field), ``more_overrides`` applied last."""
    return load_job_config(args.config, [*args.overrides, *more_overrides])
