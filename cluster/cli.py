"""The ``raylastic`` command (also ``python -m cluster``).

Examples::

    raylastic train                                   # digits, 2 workers, local Ray
    raylastic train --config job.yaml --set training.steps=500 --set scaling.max_workers=3
    ray start --head && raylastic train --address auto
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from actors.controller import RunFailed
from cluster.job import train
from cluster.loading import load_job_config
from cluster.progress import ProgressDisplay
from workloads import resolve_workload_class


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raylastic", description="Elastic, fault-tolerant PyTorch training on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)
    train_parser = commands.add_parser(
        "train", help="run a training job", description="Run a training job to its last step and write "
        "<run dir>/result.json and model.pt. Config keys are listed in the README (section 'Configuration').")
    train_parser.add_argument("--config", metavar="job.yaml", help="YAML file with the job's sections")
    train_parser.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                              help="override one key, e.g. --set training.steps=100 (repeatable)")
    train_parser.add_argument("--address", help="Ray cluster to use ('auto' after `ray start --head`); "
                              "default: start a local instance for this run")
    train_parser.add_argument("--run-dir", help="where result.json, model.pt and checkpoints go "
                              "(default: runs/<name>)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(stderr=True, soft_wrap=True)
    try:
        job = load_job_config(args.config, args.overrides)
        resolve_workload_class(job.workload.name)
    except ValueError as error:
        console.print(f"[bold red]error:[/] {error}", highlight=False)
        return 2
    return _train(job, args, console)


def _train(job, args: argparse.Namespace, console: Console) -> int:
    out = Console(soft_wrap=True)
    out.print(f"raylastic: training {job.workload.name} for {job.training.steps} steps on "
              f"{job.scaling.min_workers}-{job.scaling.max_workers} workers (run {job.name})", highlight=False)
    try:
        with ProgressDisplay(job.training.steps, console=out) as display:
            result = train(job, run_dir=args.run_dir, address=args.address, on_progress=display.update)
    except (ValueError, RunFailed) as error:
        console.print(f"[bold red]error:[/] {error}", highlight=False)
        return 2 if isinstance(error, ValueError) else 1
    metrics = "  ".join(f"{k} {v:.4f}" for k, v in result.metrics.items())
    out.print(f"finished step {result.final_step}: {metrics}", highlight=False)
    for event in result.events:
        if event["type"] == "recovered":
            out.print(f"recovered at step {event['step']} in {event['recovery_s']:.2f} s (from the failure's "
                      f"detection to the next committed step), world size {event['world_size']}", highlight=False)
    out.print(f"results: {Path(args.run_dir or Path('runs') / job.name) / 'result.json'}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
