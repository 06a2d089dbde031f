"""Sweeps (the Ray Tune wiring): Ray Tune runs the trials, Optuna (TPE) proposes them, ASHA stops bad ones early.

Each trial is a whole Raylastic job (its own Controller and workers, its own fault tolerance)
placed in a placement group the trial reserves (``tuning.trial``). Example::

    from raylastic import JobConfig, TrainingConfig, sweep
    result = sweep(JobConfig(training=TrainingConfig(steps=60)),
                   {"optim.lr": {"loguniform": [1e-4, 1e-1]}, "training.global_batch_size": {"choice": [32, 128]}},
                   num_samples=8, metric="accuracy", mode="max", name="digits-lr")
    result.dataframe          # one row per trial
    result.best_config        # a JobConfig, ready for cluster.train
    result.plots("plots/")    # PNGs

Two metrics, on purpose: ASHA needs a value at every step and only the training ``loss`` has
one, so ASHA always stops trials on the per-step loss (mode min). ``metric``/``mode`` is the
objective Optuna optimizes and the sweep ranks by; it may be one the job only computes at its
end (``accuracy``). A trial ASHA stopped never reaches its end: Optuna is told it was pruned,
and it ranks below every completed trial.

An interrupted sweep (Ctrl-C, a lost driver) continues with ``resume=True`` and the same
``name``: Tune restores its trials and the Optuna searcher's state; finished trials are not rerun,
unfinished ones start again and their jobs continue from their own checkpoints.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import optuna
import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.optuna import OptunaSearch

from raylastic.cluster.connect import ray_session
from raylastic.jobconfig import JobConfig
from raylastic.jobconfig.naming import RUN_NAME_CHARACTERS, is_run_name, run_prefix, trial_run_name
from raylastic.tuning.report import SweepResult
from raylastic.tuning.search_space import DEFAULT_SEARCH_SPACE, Choice, IntRange, LogUniform, SearchSpace
from raylastic.tuning.trial import COMPLETED, JOBS_DIR, run_trial, trial_resources

JOBS_END_TIMEOUT_S = 30.0
SWEEP_FILE = "raylastic_sweep.json"
"""Written into the experiment directory: the base job and search space a resumed sweep must match."""


@dataclass(frozen=True, kw_only=True)
class EarlyStopping:
    """ASHA over the per-step training loss (Li et al. 2018, https://arxiv.org/abs/1810.05934)."""

    grace_period_steps: int | None = None
    """No trial is stopped before this step; None: a quarter of training.steps."""
    reduction_factor: float = 3.0
    """At each rung only the best 1/reduction_factor of the trials seen there go on."""

    def __post_init__(self) -> None:
        if self.grace_period_steps is not None and not (
                isinstance(self.grace_period_steps, int) and self.grace_period_steps > 0):
            raise ValueError(f"early_stopping.grace_period_steps must be a positive integer or None, "
                             f"got {self.grace_period_steps!r}")
        if not self.reduction_factor > 1:
            raise ValueError(f"early_stopping.reduction_factor must be > 1, got {self.reduction_factor!r}")


ASHA_DEFAULTS = EarlyStopping()


def sweep(base_job: JobConfig, search_space: SearchSpace | Mapping[str, Any] | None = None, *,
          num_samples: int = 8, metric: str = "loss", mode: Literal["min", "max"] = "min",
          name: str | None = None, storage_path: str | Path = "runs/sweeps", resume: bool = False,
          address: str | None = None, max_concurrent_trials: int | None = None,
          early_stopping: EarlyStopping | None = ASHA_DEFAULTS, seed: int | None = 0,
          points_to_evaluate: Sequence[Mapping[str, Any]] = (), callbacks: Sequence[tune.Callback] = (),
          verbose: int = 0) -> SweepResult:
    """Run ``num_samples`` trials of ``base_job`` with values from ``search_space`` and rank them.

    ``search_space``: a SearchSpace or its dict form (default: learning rate, global batch size,
    bucket size). ``metric``/``mode``: the objective (``"accuracy", "max"`` for digits).
    ``name``: the sweep's directory under ``storage_path`` and its jobs' name prefix.
    ``resume``: continue the sweep of this name if one was interrupted (else start it).
    ``max_concurrent_trials``: at most this many at once; never more than the cluster's
    resources fit. ``early_stopping``: ASHA's settings, None to run every trial to the end.
    ``seed``: the TPE sampler's. ``points_to_evaluate``: values to try first (e.g. the base job's
    own), each a mapping of some of the space's keys; the others take the base job's values.
    ``callbacks``: Ray Tune callbacks, passed on (Tune saves them with the sweep and runs them
    again on resume). ``verbose``: Tune's console output (0 silent,
    1 a status table now and then).
    """
    space = search_space if isinstance(search_space, SearchSpace) else (
        DEFAULT_SEARCH_SPACE if search_space is None else SearchSpace.from_dict(search_space))
    space.validate(base_job)
    points = [space.complete_point(base_job, point) for point in points_to_evaluate]
    name = name or f"{base_job.name}-sweep"
    _check_arguments(name=name, num_samples=num_samples, metric=metric, mode=mode)
    experiment = Path(storage_path).resolve() / name
    resources = trial_resources(base_job)
    with ray_session(address, min_cpus=resources.required_resources.get("CPU", 0)):
        trainable = tune.with_resources(
            tune.with_parameters(run_trial, base=base_job, space=space, sweep_name=name, objective=metric,
                                 jobs_dir=str(experiment / JOBS_DIR)),
            resources)
        if tune.Tuner.can_restore(experiment):
            if not resume:
                raise ValueError(f"a sweep named {name!r} already exists at {experiment}; resume it "
                                 "(resume=True, --resume) or choose another name")
            _check_same_sweep(experiment, base_job, space, metric=metric, mode=mode)
            tuner = tune.Tuner.restore(str(experiment), trainable, resume_unfinished=True, resume_errored=False)
        else:
            concurrent = concurrent_trials(resources.required_resources, ray.cluster_resources(),
                                           max_concurrent_trials)
            tuner = _new_tuner(trainable, base_job, space, experiment, num_samples=num_samples, metric=metric,
                               mode=mode, concurrent=concurrent, early_stopping=early_stopping, seed=seed,
                               points=points, callbacks=callbacks, verbose=verbose)
            _write_sweep_file(experiment, base_job, space, metric=metric, mode=mode, num_samples=num_samples)
        grid = tuner.fit()
        _wait_for_jobs_to_end([run_prefix(trial_run_name(name, Path(result.path).name.removeprefix("trial_")))
                               for result in grid])
    return SweepResult.from_result_grid(grid, space=space, base_job=base_job, metric=metric, mode=mode,
                                        path=experiment, num_samples=_saved_num_samples(experiment, num_samples))


def concurrent_trials(trial: Mapping[str, float], cluster: Mapping[str, float], requested: int | None) -> int:
    """How many trials needing ``trial`` resources fit in ``cluster`` at once (at most ``requested``).

    >>> concurrent_trials({"CPU": 1.01}, {"CPU": 4.0, "memory": 1e9}, None)
    3
    """
    fits = min(math.floor(cluster.get(key, 0.0) / amount + 1e-9) for key, amount in trial.items() if amount > 0)
    if fits < 1:
        raise ValueError(f"one trial needs {dict(trial)} (the base job's scaling section: max_workers x "
                         f"per-worker resources, plus {{'CPU': 0.01}} for the trial's driver); "
                         f"the cluster has {dict(cluster)}")
    if requested is not None and requested < 1:
        raise ValueError(f"max_concurrent_trials must be a positive integer, got {requested!r}")
    return fits if requested is None else min(fits, requested)


def _new_tuner(trainable: Any, base_job: JobConfig, space: SearchSpace, experiment: Path, *, num_samples: int,
               metric: str, mode: str, concurrent: int, early_stopping: EarlyStopping | None, seed: int | None,
               points: list[dict[str, Any]], callbacks: Sequence[tune.Callback], verbose: int) -> tune.Tuner:
    max_steps = max([base_job.training.steps, *_values(space, "training.steps")])
    scheduler = None
    if early_stopping is not None:
        # Rungs stay below the last step (max_t = steps - 1), and a trial that passed them all runs on
        # (stop_last_trials=False): the final report, with the objective, comes after the last step's.
        max_t = max(1, max_steps - 1)
        grace = min(early_stopping.grace_period_steps or max(1, max_steps // 4), max_t)
        scheduler = ASHAScheduler(time_attr="step", metric="loss", mode="min", max_t=max_t, grace_period=grace,
                                  reduction_factor=early_stopping.reduction_factor, stop_last_trials=False)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(2, num_samples // 3)))
    searcher = FinalResultOptunaSearch(metric=metric, mode=mode, sampler=sampler, points_to_evaluate=points or None)
    return tune.Tuner(
        trainable,
        param_space=_tune_space(space),
        tune_config=tune.TuneConfig(search_alg=searcher, scheduler=scheduler, num_samples=num_samples,
                                    max_concurrent_trials=concurrent, reuse_actors=True,
                                    trial_dirname_creator=lambda trial: f"trial_{trial.trial_id}"),
        run_config=tune.RunConfig(name=experiment.name, storage_path=str(experiment.parent),
                                  callbacks=list(callbacks), verbose=verbose),
    )


class FinalResultOptunaSearch(OptunaSearch):
    """OptunaSearch that learns each trial's objective from its final report only.

    Per-step reports carry the objective as None when the job computes it only at its end; a trial
    ASHA stopped has no final report, and Optuna is told it was pruned (TPE then ranks it below the
    completed trials).
    """

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if result.get(self.metric) is not None:
            super().on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        super().on_trial_complete(trial_id, result if result and result.get(COMPLETED) else None, error)


def _wait_for_jobs_to_end(prefixes: list[str], timeout_s: float = JOBS_END_TIMEOUT_S) -> None:
    """Wait until no Controller or worker of the sweep's jobs is alive.

    Tune ends trial actors asynchronously, and their jobs' actors die after them; a sweep resumed
    at once must not meet the old jobs (same names), and nothing may keep writing after we return.
    """
    deadline = time.monotonic() + timeout_s
    while any(actor.startswith(tuple(prefixes)) for actor in ray.util.list_named_actors()):
        if time.monotonic() > deadline:
            warnings.warn(f"some of the sweep's job actors are still alive after {timeout_s} s", stacklevel=3)
            return
        time.sleep(0.1)


def _tune_space(space: SearchSpace) -> dict[str, Any]:
    converted = {}
    for key, distribution in space.parameters.items():
        if isinstance(distribution, LogUniform):
            converted[key] = tune.loguniform(distribution.low, distribution.high)
        elif isinstance(distribution, IntRange):
            converted[key] = tune.randint(distribution.low, distribution.high + 1)  # randint excludes high
        elif isinstance(distribution, Choice):
            converted[key] = tune.choice(list(distribution.values))
        else:
            converted[key] = tune.uniform(distribution.low, distribution.high)
    return converted


def _values(space: SearchSpace, key: str) -> list[Any]:
    distribution = space.parameters.get(key)
    if distribution is None:
        return []
    return list(distribution.values) if isinstance(distribution, Choice) else [distribution.high]


def _check_arguments(*, name: str, num_samples: int, metric: str, mode: str) -> None:
    if not is_run_name(name):
        raise ValueError(f"name must be {RUN_NAME_CHARACTERS} (it prefixes the trials' job names), got {name!r}")
    if not (isinstance(num_samples, int) and num_samples > 0):
        raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
    if not (isinstance(metric, str) and metric):
        raise ValueError(f"metric must be a metric's name (loss, or one the workload evaluates, e.g. accuracy), "
                         f"got {metric!r}")
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be min or max, got {mode!r}")


def _write_sweep_file(experiment: Path, base_job: JobConfig, space: SearchSpace, *, metric: str, mode: str,
                      num_samples: int) -> None:
    experiment.mkdir(parents=True, exist_ok=True)
    (experiment / SWEEP_FILE).write_text(json.dumps(
        {"base_job": base_job.to_dict(), "search_space": space.to_dict(), "metric": metric, "mode": mode,
         "num_samples": num_samples}, indent=1, default=str))


def _saved_num_samples(experiment: Path, default: int) -> int:
    saved_file = experiment / SWEEP_FILE
    return json.loads(saved_file.read_text()).get("num_samples", default) if saved_file.exists() else default


def _check_same_sweep(experiment: Path, base_job: JobConfig, space: SearchSpace, *, metric: str, mode: str) -> None:
    saved_file = experiment / SWEEP_FILE
    if not saved_file.exists():
        return
    saved = json.loads(saved_file.read_text())
    current = json.loads(json.dumps({"base_job": base_job.to_dict(), "search_space": space.to_dict(), "metric": metric,
                                     "mode": mode}, default=str))
    for key in current:
        if saved[key] != current[key]:
            raise ValueError(f"cannot resume sweep {experiment.name!r}: its {key.replace('_', ' ')} differs from "
                             f"the one it was started with (see {saved_file})")
