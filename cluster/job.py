"""Run one job from the driver: start its Controller, follow its progress, write its results.

Example::

    from cluster import JobConfig, train
    result = train(JobConfig(), run_dir="runs/digits")
    print(result.final_step, result.metrics["accuracy"])

Writes ``<run_dir>/result.json`` (status, final_step, metrics, history, events, config) and,
on success, ``<run_dir>/model.pt``: a plain state dict, ``torch.load(path, weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.controller import ControllerActor, ReservedBundles, RunFailed, RunResult, default_checkpoint_root
from cluster.config import JobConfig
from cluster.connect import ray_session
from cluster.tensorboard import TensorBoardLog
from cluster.tracking import MlflowLog, RunEnd
from workloads import resolve_workload_class

ProgressCallback = Callable[[dict[str, Any]], None]
PROGRESS_WAIT_S = 1.0
"""Longest the driver's progress poll waits: events arrive at once, step rows at least this often."""


def train(job: JobConfig, *, run_dir: str | Path | None = None, address: str | None = None,
          on_progress: ProgressCallback | None = None, reserved: ReservedBundles | None = None) -> RunResult:
    """Train ``job`` to its last step; raises RunFailed (and still writes result.json) if it cannot.

    ``reserved``: place the workers in these already reserved placement-group bundles (a Ray
    Tune trial does this) instead of asking Ray for placement groups of their own.
    """
    resolve_workload_class(job.workload.name)  # a bad import path fails here, before any actor starts
    run_dir = Path(run_dir or Path("runs") / job.name).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_root = job.checkpoint.path or default_checkpoint_root(run_dir)
    profile_dir = str(run_dir / "profile") if job.training.profile_steps else None
    tensorboard = TensorBoardLog(run_dir)
    mlflow_log = MlflowLog(job.tracking, job, run_dir) if job.tracking.mlflow_uri else None

    def follow(progress: dict[str, Any]) -> None:
        tensorboard.update(progress)
        if mlflow_log is not None:
            mlflow_log.update(progress)
        if on_progress is not None:
            on_progress(progress)

    with ray_session(address, min_cpus=job.scaling.max_workers * job.scaling.cpus_per_worker):
        controller = _start_controller(job, checkpoint_root, reserved, profile_dir)
        try:
            result = _follow(controller, follow)
        except RunFailed as error:
            _write_result(run_dir, job, status="failed", error=str(error),
                          progress=ray.get(controller.progress.remote()))
            if mlflow_log is not None:
                mlflow_log.finish(_ended_as(error), model_path=None, result_path=run_dir / "result.json")
            raise
        except BaseException as error:  # e.g. a Tune trial stopped: no result.json
            if mlflow_log is not None:
                mlflow_log.finish(_ended_as(error), model_path=None, result_path=None)
            raise
        finally:
            ray.kill(controller)
            tensorboard.close()
    _write_result(run_dir, job, status="finished", result=result)
    torch.save(result.model_state, run_dir / "model.pt")
    if mlflow_log is not None:
        mlflow_log.finish("finished", model_path=run_dir / "model.pt", result_path=run_dir / "result.json")
    return result


def _start_controller(job: JobConfig, checkpoint_root: str, reserved: ReservedBundles | None,
                      profile_dir: str | None) -> Any:
    name = f"raylastic:{job.name}:controller"
    try:
        ray.get_actor(name)
    except ValueError:
        pass
    else:
        raise RunFailed(f"a run named {job.name!r} is already running on this cluster (actor {name}); "
                        "choose another name")
    # The Controller runs beside the driver (it shares the driver's fate anyway), never on a worker
    # node that may leave, and never inside a Tune trial's bundles: it takes no resources.
    beside_driver = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return ControllerActor.options(name=name, scheduling_strategy=beside_driver).remote(
        job, checkpoint_root, reserved, profile_dir)


def _follow(controller: Any, on_progress: ProgressCallback) -> RunResult:
    """Poll the Controller's progress until its run ends; Ctrl-C stops it at a step boundary."""
    done = controller.run.remote()
    cursor = {"history_since": 0, "events_since": 0, "evaluations_since": 0}
    try:
        while True:
            finished, _ = ray.wait([done], timeout=0)
            # A long poll: it answers at once on an event or the run's end, else after PROGRESS_WAIT_S.
            wait_s = 0.0 if finished else PROGRESS_WAIT_S
            progress = ray.get(controller.progress.remote(**cursor, wait_s=wait_s))
            cursor["history_since"] += len(progress["history"])
            cursor["events_since"] += len(progress["events"])
            cursor["evaluations_since"] += len(progress["evaluations"])
            on_progress(progress)
            if finished:
                return _unwrap(done)
    except KeyboardInterrupt:
        _stop(controller, done)
        raise RunFailed("interrupted (Ctrl-C); workers were shut down") from None
    except BaseException:  # e.g. Ray Tune stopping a trial from inside on_progress: stop the same way
        _stop(controller, done)
        raise


def _stop(controller: Any, done: Any) -> None:
    """End the run at the next step boundary; the Controller shuts its workers down before it returns."""
    controller.stop.remote()
    ray.wait([done], timeout=15)


def _unwrap(ref: Any) -> RunResult:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as error:
        if isinstance(error.cause, RunFailed):
            raise RunFailed(str(error.cause)) from None
        raise


def _ended_as(error: BaseException) -> RunEnd:
    """A run stopped from outside (Ctrl-C, which _follow turns into RunFailed; a Tune stop) was killed."""
    interrupted = isinstance(error.__context__, KeyboardInterrupt) or not isinstance(error, Exception)
    return "killed" if interrupted else "failed"


def _write_result(run_dir: Path, job: JobConfig, *, status: str, result: RunResult | None = None,
                  error: str | None = None, progress: dict[str, Any] | None = None) -> None:
    payload: dict[str, Any] = {"status": status, "name": job.name, "config": job.to_dict()}
    if result is not None:
        payload.update(final_step=result.final_step, metrics=result.metrics, checkpoint=result.checkpoint,
                       history=result.history, eval_history=result.eval_history, events=result.events)
        if result.memory is not None:
            payload["memory"] = [{"rank": rank, **m} for rank, m in enumerate(result.memory)]
        if result.ledger is not None:
            payload["ledger"] = result.ledger
    else:
        payload.update(error=error, final_step=progress["step"], history=progress["history"],
                       eval_history=progress["evaluations"], events=progress["events"])
    temporary = run_dir / f"result.json.{os.getpid()}.{time.time_ns()}"
    temporary.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(temporary, run_dir / "result.json")
