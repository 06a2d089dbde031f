"""One Ray Tune trial: a whole Raylastic job in the trial's reserved bundles, reporting every step.

The trial's placement group is ``[driver bundle] + [worker bundle] * max_workers``; the trial
function runs in bundle 0 and hands bundles 1..max_workers to its job's Controller
(``ReservedBundles``), so the job's workers, and any replacement after a failure, land in what the
trial reserved. The Controller and workers belong to the trial's actor: when ASHA stops the trial,
Tune ends that actor and they go with it.

Reports: one per committed step (``step, time_s, loss, samples_per_s, world_size, failures``) for
ASHA, then one final report with the job's held-out metrics (``accuracy`` for digits),
``final_step`` and ``completed: True``. The objective, if it is only known at the end, is ``None`` in per-step reports
(Tune wants every metric it was told about in every report).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune import PlacementGroupFactory

from raylastic.actors.status.run import RunStatus
from raylastic.actors.worker_group.placement import ReservedBundles
from raylastic.cluster.job import CONTROLLER_END_S, stop_bound_s, train
from raylastic.jobconfig import JobConfig
from raylastic.jobconfig.naming import trial_run_name
from raylastic.tuning.search_space import SearchSpace

JOBS_DIR = "jobs"
"""Each trial's job runs in <experiment>/jobs/<trial id>: result.json, model.pt, checkpoints."""
COMPLETED = "completed"
"""True only in a trial's last report: its job reached training.steps."""
FINAL_STEP = "final_step"
"""In the last report instead of "step", so that ASHA, which stops trials on "step", ignores it."""
STEP_METRICS = ("step", "time_s", "loss", "samples_per_s", "world_size")
DRIVER_BUNDLE = {"CPU": 0.01}
"""Bundle 0: the trial function (the job's driver); the Controller itself asks for no resources."""


def trial_resources(job: JobConfig) -> PlacementGroupFactory:
    """What one trial of ``job`` reserves: its driver's bundle, one bundle per worker, then (async_ps) one per
    parameter server."""
    scaling = job.scaling
    worker = {"CPU": scaling.cpus_per_worker, **({"GPU": 1} if scaling.use_gpu else {}),
              **scaling.resources_per_worker}
    servers = job.strategy.num_servers if job.strategy.name == "async_ps" else 0
    return PlacementGroupFactory([dict(DRIVER_BUNDLE)] + [dict(worker) for _ in range(scaling.max_workers)]
                                 + [{"CPU": job.strategy.server_cpus} for _ in range(servers)])


def trial_job(base: JobConfig, space: SearchSpace, config: dict[str, Any], *, sweep_name: str,
              trial_id: str) -> JobConfig:
    """The job a trial runs: ``base`` with the sampled values, named ``<sweep>-<trial id>``."""
    return dataclasses.replace(space.apply(base, config), name=trial_run_name(sweep_name, trial_id))


def run_trial(config: dict[str, Any], *, base: JobConfig, space: SearchSpace, sweep_name: str, objective: str,
              jobs_dir: str) -> None:
    """Tune's function trainable: train the trial's job in the trial's bundles, reporting every step.

    The job's run directory is ``<jobs_dir>/<trial id>``, outside the trial directories Tune stages
    and syncs, so a resumed trial finds its job's checkpoints there.
    """
    # Ray Tune gives this actor the next trial once this function has returned, waiting for that only
    # TUNE_FUNCTION_THREAD_TIMEOUT_S (2 s by default); a stopped job that took longer (ASHA stopped it, on a busy
    # machine) left the sweep waiting forever for a trial that Tune never started.
    trial_id = tune.get_context().get_trial_id()
    job = trial_job(base, space, config, sweep_name=sweep_name, trial_id=trial_id)
    wind_down_s = stop_bound_s(job) + CONTROLLER_END_S + 5  # the stop (its save and the model), the Controller's end
    os.environ["TUNE_FUNCTION_THREAD_TIMEOUT_S"] = str(int(wind_down_s))
    placement_group = ray.util.get_current_placement_group()
    reserved = ReservedBundles(placement_group, tuple(range(1, len(placement_group.bundle_specs))))
    reporter = StepReporter(placeholders={objective: None} if objective not in STEP_METRICS else {})
    result = train(job, run_dir=Path(jobs_dir) / trial_id, reserved=reserved, on_progress=reporter)
    # No "step" in the final report: ASHA (time_attr "step") leaves it alone, it is for the objective.
    # "loss" must be in every report (Tune checks ASHA's metric); NaN when no step ran (resumed at the end).
    last_row = {key: value for key, value in reporter.last.items() if key != "step"}
    tune.report({"loss": math.nan, **last_row, **result.metrics, FINAL_STEP: result.final_step,
                 "failures": reporter.failures, COMPLETED: True})


class StepReporter:
    """``on_progress`` for ``cluster.job.train``: one Tune report per new history row.

    When Tune stops the trial (ASHA, or the sweep is interrupted), ``tune.report`` raises
    SystemExit in this thread; ``train`` then stops the job at a step boundary, keeping that step's
    checkpoint and model.pt (result.json says "stopped" and names the checkpoint, which a resumed
    sweep's trial continues from), and shuts its workers down before the exception goes on.
    """

    def __init__(self, placeholders: dict[str, Any]) -> None:
        self.placeholders = placeholders
        self.failures = 0
        self.last: dict[str, Any] = {}

    def __call__(self, progress: RunStatus) -> None:
        self.failures += sum(event.type == "worker_failed" for event in progress.events)
        for row in progress.history:
            self.last = {key: row[key] for key in STEP_METRICS}
            if not math.isfinite(self.last["loss"]):
                self.last["loss"] = math.inf  # a diverged trial is the worst one to ASHA, not skipped as NaN
            tune.report({**self.placeholders, **self.last, "failures": self.failures, COMPLETED: False})
