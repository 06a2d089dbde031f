"""``raylastic sweep``: a Ray Tune + Optuna sweep over a job; exit 0 done, 1 no trial completed or
interrupted, 2 bad configuration or search space.

Example::

    raylastic sweep --base examples/sweep_base.yaml --space examples/sweep_space.yaml \\
        --num-samples 8 --metric accuracy --mode max --name digits-lr
    raylastic sweep --base examples/sweep_base.yaml --space examples/sweep_space.yaml \\
        --num-samples 8 --metric accuracy --mode max --name digits-lr --resume     # after Ctrl-C
    raylastic train --config runs/sweeps/digits-lr/best_job.yaml

Writes into ``<storage path>/<name>/``: Tune's state and one directory per trial (its job's
result.json, model.pt, checkpoints), ``trials.csv``, ``best_job.yaml`` and ``plots/*.png``.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from raylastic.cluster.job_arguments import add_job_arguments, job_from_arguments


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "sweep", help="sweep hyperparameters with Ray Tune + Optuna",
        description="Run --num-samples trials of the --base job (each a whole elastic job) with values from "
        "--space, proposed by Optuna (TPE) and stopped early by ASHA on the per-step loss.")
    add_job_arguments(parser, config_flag="--base", job="the base job", local_ray_for="the sweep")
    parser.add_argument("--space", metavar="space.yaml", help="the search space (default: optim.lr, "
                        "training.global_batch_size, strategy.bucket_cap_mb); format: examples/sweep_space.yaml")
    parser.add_argument("--num-samples", type=int, default=8, help="trials to run (default 8)")
    parser.add_argument("--metric", default="loss", help="objective: loss, or one the workload evaluates at the "
                        "end, e.g. accuracy (default loss)")
    parser.add_argument("--mode", choices=("min", "max"), default="min", help="minimize or maximize --metric")
    parser.add_argument("--name", help="the sweep's name (default: <base job name>-sweep)")
    parser.add_argument("--storage-path", default="runs/sweeps", help="where sweeps live (default runs/sweeps)")
    parser.add_argument("--resume", action="store_true", help="continue the interrupted sweep of this --name")
    parser.add_argument("--max-concurrent-trials", type=int, help="at most this many trials at once "
                        "(default: as many as the cluster fits)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    errors = Console(stderr=True, soft_wrap=True)
    out = Console(soft_wrap=True)
    from raylastic.tuning.search_space import SearchSpace

    try:
        base = job_from_arguments(args)
        space = SearchSpace.from_yaml(args.space) if args.space else None
        from raylastic.tuning.tuner import sweep  # Ray Tune, Optuna and torch: after the job's and space's checks

        out.print(f"raylastic: sweeping {args.num_samples} trials of {base.workload.name} "
                  f"({args.metric}, {args.mode})", highlight=False)
        result = sweep(base, space, num_samples=args.num_samples, metric=args.metric, mode=args.mode,
                       name=args.name, storage_path=args.storage_path, resume=args.resume, address=args.address,
                       max_concurrent_trials=args.max_concurrent_trials, verbose=1)
    except ValueError as error:
        errors.print(f"[bold red]error:[/] {error}", highlight=False)
        return 2
    out.print(result.dataframe.drop(columns="run_dir").to_string(index=False), highlight=False)
    out.print(result.summary(), highlight=False)
    result.dataframe.to_csv(result.path / "trials.csv", index=False)
    plots = result.plots(result.path / "plots")
    out.print(f"plots: {', '.join(str(p) for p in plots)}", highlight=False)
    if result.interrupted or result.completed.empty:
        return 1
    best_file = result.path / "best_job.yaml"
    best_file.write_text(_yaml(result.best_config.to_dict()))
    out.print(f"best config: {best_file}  (raylastic train --config {best_file})", highlight=False)
    return 0


def _yaml(raw: dict) -> str:
    import yaml

    return yaml.safe_dump(json.loads(json.dumps(raw)), sort_keys=False)  # tuples (faults) to lists

