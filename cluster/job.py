"""Run one job from the driver: start its Controller, follow its progress, write its results.

Example::

    from raylastic import JobConfig, train
    result = train(JobConfig(), run_dir="runs/digits")
    print(result.final_step, result.metrics["accuracy"])

Writes ``<run_dir>/result.json`` (status, final_step, metrics, history, events, config; inf and NaN
as null) however the run ends, and ``<run_dir>/model.pt``, a plain state dict
(``torch.load(path, weights_only=True)``), before result.json says "finished" (and when a run failed after
gathering its model: in its final evaluation). The status is ``finished``, ``failed``, or ``stopped``: a stop
asked from outside the run (Ctrl-C, SIGTERM, a Ray Tune scheduler), at a step boundary.
One run at a time holds a run directory (cluster/run_dir.py). However the run ends, no placement group of
it is left behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import ray
from fsspec.implementations.local import LocalFileSystem
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raylastic.actors.async_ps.controller import AsyncControllerActor
from raylastic.actors.controller.controller import ControllerActor
from raylastic.actors.controller.run_checkpoints import default_checkpoint_root
from raylastic.actors.processes.setup_hook import TRAINS_NOTHING
from raylastic.actors.status.run import RunFailed, RunResult, RunStatus
from raylastic.actors.worker_group.placement import ReservedBundles, remove_run_slots
from raylastic.cluster.connect import ray_session
from raylastic.cluster.run_dir import (
    SeenProgress,
    locked,
    read_model_file,
    require_no_checkpoints,
    require_writable,
    write_model,
    write_result,
)
from raylastic.cluster.tensorboard import TensorBoardLog
from raylastic.cluster.termination import INTERRUPTED, StopRequest, sigterm_asks
from raylastic.cluster.tracking import MlflowLog, RunEnd
from raylastic.jobconfig import JobConfig
from raylastic.jobconfig.naming import controller_name
from raylastic.workloads import check_workload

ProgressCallback = Callable[[RunStatus], None]
PROGRESS_WAIT_S = 1.0
"""Longest the driver's progress poll waits: events arrive at once, step rows at least this often."""
STOP_TIMEOUT_S = 15.0
"""Longest the driver waits for a Controller asked to stop (it ends the step in flight and shuts its workers
down) before it kills it."""
CONTROLLER_END_S = 10.0
"""Longest the driver waits for a killed Controller to be gone before it removes the run's placement groups."""


class RunStopped(RunFailed):
    """The run was stopped from outside (Ctrl-C, SIGTERM) before its last step; result.json says "stopped"."""


def train(job: JobConfig, *, run_dir: str | Path | None = None, address: str | None = None,
          on_progress: ProgressCallback | None = None, reserved: ReservedBundles | None = None,
          stop_on_sigterm: bool = False) -> RunResult:
    """Train ``job`` to its last step; raises RunFailed (and still writes result.json) if it cannot.

    Refused before any actor starts, with RunFailed and the run directory left as it was: another run
    holds the directory, the checkpoint path takes no files, or checkpoint.resume=never finds checkpoints.

    ``reserved``: place the workers in these already reserved placement-group bundles (a Ray
    Tune trial does this) instead of asking Ray for placement groups of their own.

    ``stop_on_sigterm``: while the run goes on, a SIGTERM to this process (``ray job stop``) stops it at the next
    step boundary as Ctrl-C does (RunStopped; result.json says "stopped"), and the handler from before comes back
    after it. Only from the main thread; ``raylastic train`` sets it, a notebook or a Tune trial need not.
    """
    # a bad import path, or a workload that cannot split its model, fails here, before any actor starts
    check_workload(job.workload.name, job.parallel.tp, job.parallel.pp, job.eval.every_steps)
    run_dir = Path(run_dir or Path("runs") / job.name).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_root = job.checkpoint.path or default_checkpoint_root(run_dir)
    with locked(run_dir, "run directory"):
        require_writable(checkpoint_root)
        fs, root_path = fsspec.core.url_to_fs(checkpoint_root)
        # An object store (s3://...) has no locks: keeping its runs apart is the user's part.
        local_root = isinstance(fs, LocalFileSystem)
        with locked(Path(root_path), "checkpoint directory") if local_root else contextlib.nullcontext():
            if job.checkpoint.resume == "never":
                require_no_checkpoints(checkpoint_root)
            return _run(job, run_dir, checkpoint_root, address, on_progress, reserved, stop_on_sigterm)


def _run(job: JobConfig, run_dir: Path, checkpoint_root: str, address: str | None,
         on_progress: ProgressCallback | None, reserved: ReservedBundles | None, stop_on_sigterm: bool) -> RunResult:
    """Every end from here on writes result.json: finished (after model.pt), failed, or stopped."""
    profile_dir = str(run_dir / "profile") if job.training.profile_steps else None
    tensorboard = TensorBoardLog(run_dir)
    mlflow_log = MlflowLog(job.tracking, job, run_dir) if job.tracking.mlflow_uri else None
    seen = SeenProgress()
    stop = StopRequest()

    def follow(progress: RunStatus) -> None:
        tensorboard.update(progress)
        if mlflow_log is not None:
            mlflow_log.update(progress)
        if on_progress is not None:
            on_progress(progress)

    def stopping(reason: str) -> None:
        # Written before the wait for the Controller: `ray job stop` sends SIGKILL 3 s after its SIGTERM.
        with contextlib.suppress(RunFailed):
            write_result(run_dir, job, status="stopped", progress=seen,
                         error=f"{reason}: stopping at the next step boundary; the last step seen was {seen.step}")

    try:
        sigterm = sigterm_asks(stop) if stop_on_sigterm else contextlib.nullcontext()
        with ray_session(address, min_cpus=_cpus_needed(job)), sigterm:  # after ray.init, which sets its own
            controller = _start_controller(job, checkpoint_root, reserved, profile_dir)
            try:
                result = _follow(controller, controller_name(job.name), seen, follow, stop, stopping)
            finally:
                _end_controller(controller, job.name)
        write_model(run_dir, result.model_state)  # before result.json says "finished"
        write_result(run_dir, job, status="finished", result=result)
    except BaseException as error:
        ended = _ended_as(error)
        if getattr(error, "model_state", None) is not None:  # gathered before the run failed (its final evaluation)
            with contextlib.suppress(RunFailed):
                write_model(run_dir, error.model_state)
        with contextlib.suppress(RunFailed):  # e.g. the disk is full: the error itself still reaches the user
            write_result(run_dir, job, status=ended, error=str(error) or type(error).__name__, progress=seen)
        if mlflow_log is not None:
            mlflow_log.finish(ended, model_path=None, result_path=run_dir / "result.json")
        raise
    finally:
        tensorboard.close()
    if mlflow_log is not None:
        mlflow_log.finish("finished", model_path=run_dir / "model.pt", result_path=run_dir / "result.json")
    return result


def _cpus_needed(job: JobConfig) -> float:
    servers = job.strategy.num_servers * job.strategy.server_cpus if job.strategy.name == "async_ps" else 0.0
    return job.scaling.max_workers * job.scaling.cpus_per_worker + servers


def _start_controller(job: JobConfig, checkpoint_root: str, reserved: ReservedBundles | None,
                      profile_dir: str | None) -> Any:
    name = controller_name(job.name)
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
    controller = AsyncControllerActor if job.strategy.name == "async_ps" else ControllerActor
    return controller.options(name=name, scheduling_strategy=beside_driver, runtime_env=TRAINS_NOTHING).remote(
        job, checkpoint_root, reserved, profile_dir)


def _follow(controller: Any, name: str, seen: SeenProgress, on_progress: ProgressCallback, stop: StopRequest,
            stopping: Callable[[str], None]) -> RunResult:
    """Poll the Controller's progress until its run ends. A stop (``stop`` asked, Ctrl-C, or an exception from
    ``on_progress`` such as Ray Tune's) ends it at a step boundary, after ``stopping(reason)``."""
    done = controller.run.remote()
    try:
        while stop.reason is None:
            finished, _ = ray.wait([done], timeout=0)
            # A long poll: it answers at once on an event or the run's end, else after PROGRESS_WAIT_S.
            wait_s = 0.0 if finished else PROGRESS_WAIT_S
            progress = ray.get(controller.progress.remote(**seen.cursor(), wait_s=wait_s))
            seen.add(progress)
            on_progress(progress)
            if finished:
                break
    except ray.exceptions.RayTaskError:  # raised by the Controller, which is alive (RunFailed: see _unwrap)
        _stop(controller, done, seen)
        raise
    except ray.exceptions.RayActorError as error:  # the Controller is gone; its workers, its own actors, with it
        reason = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise RunFailed(f"the Controller ({name}) died at step {seen.step}: {reason}") from None
    except KeyboardInterrupt:
        stop.ask(INTERRUPTED)
    except BaseException as error:  # e.g. Ray Tune stopping a trial from inside on_progress: stop the same way
        stopping(type(error).__name__)
        _stop(controller, done, seen)
        raise
    if stop.reason is None:  # the run ended by itself
        return _outcome(done, seen)
    stopping(stop.reason)
    return _stopped(controller, done, seen, stop.reason)


def _stopped(controller: Any, done: Any, seen: SeenProgress, reason: str) -> RunResult:
    """Stop the run for ``reason``: RunStopped saying where it stopped (its result, if it finished meanwhile)."""
    if not _stop(controller, done, seen):
        raise RunStopped(f"{reason}: the Controller did not stop within {STOP_TIMEOUT_S:.0f} s of the stop asked "
                         f"after step {seen.step} and was ended; its workers went with it")
    return _outcome(done, seen, reason)


def _outcome(done: Any, seen: SeenProgress, reason: str | None = None) -> RunResult:
    """The ended run's result; RunStopped if the Controller ended it stopped (asked here for ``reason``, or by
    anyone else), RunFailed if it failed."""
    try:
        return _unwrap(done)
    except RunFailed as error:
        if seen.state != "stopped":
            raise
        raise RunStopped(f"{reason}: {error}" if reason else str(error)) from None


def _stop(controller: Any, done: Any, seen: SeenProgress) -> bool:
    """End the run at the next step boundary; the Controller shuts its workers down before it returns. What
    it logged meanwhile is added to ``seen``, if it still answers. Whether it ended within STOP_TIMEOUT_S."""
    controller.stop.remote()
    ended, _ = ray.wait([done], timeout=STOP_TIMEOUT_S)
    with contextlib.suppress(ray.exceptions.RayError):
        seen.add(ray.get(controller.progress.remote(**seen.cursor()), timeout=5))
    return bool(ended)


def _end_controller(controller: Any, run_name: str) -> None:
    """Kill the Controller if it still lives, wait (bounded) until it is gone, then remove any placement group
    of the run left behind: a Controller killed or stopped from outside could not release them."""
    ray.kill(controller)
    deadline = time.monotonic() + CONTROLLER_END_S
    while time.monotonic() < deadline:  # a call may still be answered until the kill lands
        try:
            ray.get(controller.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            break
        time.sleep(0.05)
    try:
        remove_run_slots(run_name)
    except Exception as error:  # noqa: BLE001 - cleaning up must not hide how the run ended
        warnings.warn(f"could not remove the placement groups of run {run_name}: {type(error).__name__}: {error}",
                      RuntimeWarning, stacklevel=2)


def _unwrap(ref: Any) -> RunResult:
    """The Controller's RunResult, its model read back from the bytes a worker sent."""
    try:
        result = ray.get(ref)
    except ray.exceptions.RayTaskError as error:
        if isinstance(error.cause, RunFailed):
            raise RunFailed(str(error.cause), model_state=read_model_file(error.cause.model_state)) from None
        raise
    return dataclasses.replace(result, model_state=read_model_file(result.model_state))


def _ended_as(error: BaseException) -> RunEnd:
    """A run stopped from outside (Ctrl-C or SIGTERM, which _follow turns into RunStopped; a Tune stop, which is
    no Exception) was stopped; any other error failed it."""
    return "stopped" if isinstance(error, RunStopped) or not isinstance(error, Exception) else "failed"
