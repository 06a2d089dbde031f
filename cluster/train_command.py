"""``raylastic train``: run one job with live progress; exit 0 done, 1 run failed or stopped, 2 bad config.

Ctrl-C or a SIGTERM (``ray job stop``) stops the run at the next step boundary, keeping that step's checkpoint and
model.pt; result.json then says "stopped" and names the checkpoint, and the same command resumes from it. A second
Ctrl-C ends the run at once.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from raylastic.cluster.job_arguments import add_job_arguments, job_from_arguments


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train", help="run a training job", description="Run a training job to its last step and write "
        "<run dir>/result.json and model.pt. Config keys are listed in the README (section 'Configuration').")
    add_job_arguments(parser)
    parser.add_argument("--run-dir", help="where result.json, model.pt and checkpoints go (default: runs/<name>)")
    parser.add_argument("--profile", action="store_true", help="trace 5 steps with the torch profiler on rank 0 "
                        "into <run dir>/profile (open with TensorBoard); same as --set training.profile_steps=5")
    parser.set_defaults(run=run)


def load_job_or_report(args: argparse.Namespace, console: Console):
    """The validated JobConfig, or None after printing the error (no traceback)."""
    try:
        job = job_from_arguments(args, *(["training.profile_steps=5"] if args.profile else []))
        from raylastic.workloads import check_workload  # imports torch: after the config's own checks

        check_workload(job.workload.name, job.parallel.tp, job.parallel.pp, job.eval.every_steps)
        return job
    except ValueError as error:
        console.print(f"[bold red]error:[/] {error}", highlight=False)
        return None


def run(args: argparse.Namespace) -> int:
    errors = Console(stderr=True, soft_wrap=True)
    job = load_job_or_report(args, errors)
    if job is None:
        return 2
    from raylastic.actors.status.run import RunFailed, RunStopped
    from raylastic.cluster.job import train
    from raylastic.cluster.progress import ProgressDisplay

    out = Console(soft_wrap=True)
    out.print(f"raylastic: training {job.workload.name} for {job.training.steps} steps on "
              f"{job.scaling.min_workers}-{job.scaling.max_workers} workers (run {job.name})", highlight=False)
    try:
        with ProgressDisplay(job.training.steps, console=out) as display:
            result = train(job, run_dir=args.run_dir, address=args.address, on_progress=display.update,
                           stop_on_sigterm=True)
    except RunStopped as error:
        errors.print(f"[bold yellow]stopped:[/] {error}", highlight=False)
        return 1
    except KeyboardInterrupt:  # a Ctrl-C outside the run's loop, as it starts or ends
        errors.print("[bold yellow]stopped:[/] interrupted (Ctrl-C)", highlight=False)
        return 1
    except (ValueError, RunFailed) as error:
        errors.print(f"[bold red]error:[/] {error}", highlight=False)
        return 2 if isinstance(error, ValueError) else 1
    metrics = "  ".join(f"{k} {v:.4f}" for k, v in result.metrics.items())
    out.print(f"finished step {result.final_step}: {metrics}", highlight=False)
    for event in result.events:
        if event.type == "recovered":
            out.print(f"recovered at step {event.step} in {event.details['recovery_s']:.2f} s (from the failure's "
                      f"detection to the next committed step), world size {event.details['world_size']}",
                      highlight=False)
    out.print(f"results: {Path(args.run_dir or Path('runs') / job.name) / 'result.json'}", highlight=False)
    return 0
