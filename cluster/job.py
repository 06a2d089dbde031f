"""Run one job from the driver: start its Controller, follow its progress, write its results.

Example::

    from raylastic import JobConfig, train
    result = train(JobConfig(), run_dir="runs/digits")
    print(result.final_step, result.metrics["accuracy"])

Writes ``<run_dir>/result.json`` (status, final_step, metrics, history, events, config; inf and NaN
as null) however the run ends, and ``<run_dir>/model.pt``, a plain state dict
(``torch.load(path, weights_only=True)``), before result.json says "finished" or "stopped" (and when a run
failed after gathering its model: in its final evaluation). The status is ``finished``, ``failed``, or
``stopped``: a stop asked from outside the run (Ctrl-C, SIGTERM, a Ray Tune scheduler), at a step boundary, which
keeps that step's checkpoint (result.json's ``checkpoint``: the same job resumes from it) and model.pt. A second
Ctrl-C ends the run at once; result.json then names the newest complete checkpoint.
Every call the driver makes has a bound: a Controller that leaves PROGRESS_MISSES progress calls in a row
unanswered is given up on, and the run fails saying so.
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
from raylastic.actors.status.run import RunFailed, RunResult, RunStatus, RunStopped
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
from raylastic.strategies.checkpoint_catalogue import newest_complete
from raylastic.workloads import check_workload

ProgressCallback = Callable[[RunStatus], None]
CONTROLLER_START_S = 300.0
"""Longest the driver waits for the Controller to be constructed (its imports, on a busy node) and answer."""
PROGRESS_WAIT_S = 1.0
"""Longest the driver's progress poll waits: events arrive at once, step rows at least this often."""
PROGRESS_ANSWER_S = 30.0
"""Longest the driver waits for a progress answer beyond the poll's own wait; a later one is a miss."""
PROGRESS_MISSES = 3
"""Progress calls in a row that the Controller may leave unanswered before the driver gives up on it."""
ANSWER_SLICE_S = 0.1
"""While waiting for the Controller's answer, how often the driver looks at a stop asked meanwhile (SIGTERM)."""
STOP_SLACK_S = 15.0
"""How long, beyond failure.max_step_s, the driver waits for a Controller asked to stop before it kills it."""
CONTROLLER_END_S = 10.0
"""Longest the driver waits for a killed Controller to be gone before it removes the run's placement groups."""
RESULT_FETCH_S = 60.0
"""Longest the driver waits for an ended run's result (the model's bytes) to reach it."""


def train(job: JobConfig, *, run_dir: str | Path | None = None, address: str | None = None,
          on_progress: ProgressCallback | None = None, reserved: ReservedBundles | None = None,
          stop_on_sigterm: bool = False) -> RunResult:
    """Train ``job`` to its last step; raises RunFailed (and still writes result.json) if it cannot.

    Refused before any actor starts, with RunFailed and the run directory left as it was: another run
    holds the directory, the checkpoint path takes no files, or checkpoint.resume=never finds checkpoints.

    ``reserved``: place the workers in these already reserved placement-group bundles (a Ray
    Tune trial does this) instead of asking Ray for placement groups of their own.

    ``stop_on_sigterm``: while the run goes on, a SIGTERM to this process (``ray job stop``) stops it at the next
    step boundary as Ctrl-C does (RunStopped, whose ``result`` names the checkpoint kept; result.json says
    "stopped"), and the handler from before comes back after it. Only from the main thread; ``raylastic train``
    sets it, a notebook or a Tune trial need not.
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
    """Every end from here on writes result.json: finished or stopped (after model.pt), or failed."""
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

    ended: tuple[RunEnd, bool] | None = None
    """How the run ended and whether model.pt was written, once result.json says so."""
    try:
        sigterm = sigterm_asks(stop) if stop_on_sigterm else contextlib.nullcontext()
        with ray_session(address, min_cpus=_cpus_needed(job)), sigterm:  # after ray.init, which sets its own
            controller = _start_controller(job, checkpoint_root, reserved, profile_dir)
            try:
                result = _follow(controller, controller_name(job.name), seen, follow, stop, stopping,
                                 stop_within_s=stop_bound_s(job))
                # Written before the Controller's end and Ray's (seconds), so that a stop's fit its grace period.
                write_model(run_dir, result.model_state)  # before result.json says "finished"
                write_result(run_dir, job, status="finished", result=result)
                ended = ("finished", True)
            except BaseException as error:
                ended = _write_end(run_dir, job, checkpoint_root, seen, error)
                raise
            finally:
                _end_controller(controller, job.name)
    except BaseException as error:
        status, model_written = ended or _write_end(run_dir, job, checkpoint_root, seen, error)
        if mlflow_log is not None:
            mlflow_log.finish(status, model_path=run_dir / "model.pt" if model_written else None,
                              result_path=run_dir / "result.json")
        if stop.unwinding is not None:  # Ray Tune's stop goes on up the trial's thread, now that the stop is kept
            raise stop.unwinding from None
        raise
    finally:
        tensorboard.close()
    if mlflow_log is not None:
        mlflow_log.finish("finished", model_path=run_dir / "model.pt", result_path=run_dir / "result.json")
    if stop.unwinding is not None:  # the run finished as Ray Tune stopped it
        raise stop.unwinding
    return result


def _write_end(run_dir: Path, job: JobConfig, checkpoint_root: str, seen: SeenProgress,
               error: BaseException) -> tuple[RunEnd, bool]:
    """result.json of a run that ended with ``error``, after model.pt where the end brought the model (a stop's,
    or one gathered before the run failed: its final evaluation); how it ended, and whether model.pt was written."""
    ended = _ended_as(error)
    kept = error.result if isinstance(error, RunStopped) else None
    model_state = kept.model_state if kept is not None else getattr(error, "model_state", None)
    model_written = False
    if model_state is not None:
        with contextlib.suppress(RunFailed):
            write_model(run_dir, model_state)
            model_written = True
    if ended == "stopped" and kept is None:  # ended before the stop's save: the newest one written before
        kept = _newest_checkpoint(checkpoint_root, seen)
    with contextlib.suppress(RunFailed):  # e.g. the disk is full: the error itself still reaches the user
        write_result(run_dir, job, status=ended, result=kept, error=str(error) or type(error).__name__, progress=seen)
    return ended, model_written


def _newest_checkpoint(checkpoint_root: str, seen: SeenProgress) -> RunResult | None:
    """What result.json names for a run that ended before its stop could save: the newest complete checkpoint (and
    no model: none was gathered)."""
    try:
        found = newest_complete(checkpoint_root)[0]
    except Exception:  # noqa: BLE001 - naming it must not hide how the run ended
        return None
    if found is None:
        return None
    return RunResult(final_step=seen.step, metrics={}, history=seen.history, events=seen.events,
                     model_state={}, checkpoint=found.path, eval_history=seen.evaluations)


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


def stop_bound_s(job: JobConfig) -> float:
    """Longest the driver waits for a Controller asked to stop: it ends the step in flight, saves its checkpoint and
    gathers the model (each bounded by failure.max_step_s) and shuts its workers down. A second Ctrl-C ends it at
    once; ``ray job stop`` at RAY_JOB_STOP_WAIT_TIME_S."""
    return job.failure.max_step_s + STOP_SLACK_S


def _follow(controller: Any, name: str, seen: SeenProgress, on_progress: ProgressCallback, stop: StopRequest,
            stopping: Callable[[str], None], *, stop_within_s: float) -> RunResult:
    """Poll the Controller's progress until its run ends. A stop (``stop`` asked, Ctrl-C, or an exception from
    ``on_progress`` such as Ray Tune's, kept as ``stop.unwinding``) ends it at a step boundary, after
    ``stopping(reason)``: RunStopped with what the stop kept. A second Ctrl-C meanwhile ends it at once."""
    done = controller.run.remote()
    started, misses = False, 0
    try:
        started = _answer(controller.__ray_ready__.remote(), CONTROLLER_START_S, stop) is not None
        while started and stop.reason is None and misses < PROGRESS_MISSES:
            finished, _ = ray.wait([done], timeout=0)
            # A long poll: it answers at once on an event or the run's end, else after PROGRESS_WAIT_S.
            wait_s = 0.0 if finished else PROGRESS_WAIT_S
            progress = _answer(controller.progress.remote(**seen.cursor(), wait_s=wait_s),
                               wait_s + PROGRESS_ANSWER_S, stop)
            if progress is None:
                if stop.reason is None:
                    misses += 1
                continue
            misses = 0
            seen.add(progress)
            on_progress(progress)
            if finished:
                break
    except ray.exceptions.RayTaskError:  # raised by the Controller, which is alive (RunFailed: see _unwrap)
        _stop(controller, done, seen, within_s=STOP_SLACK_S)
        raise
    except ray.exceptions.RayActorError as error:  # the Controller is gone; its workers, its own actors, with it
        reason = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise RunFailed(f"the Controller ({name}) died at step {seen.step}: {reason}") from None
    except ray.exceptions.RayError as error:  # e.g. an answer that did not arrive: no stop to ask of it
        raise RunFailed(f"the Controller ({name}) could not be followed after step {seen.step}: "
                        f"{type(error).__name__}: {error}") from None
    except KeyboardInterrupt:
        stop.ask(INTERRUPTED)
    except BaseException as error:  # e.g. Ray Tune stopping a trial from inside on_progress: stop the same way
        stop.ask(type(error).__name__, unwinding=error)
    if not started and stop.reason is None:
        raise RunFailed(f"the Controller ({name}) did not start within {CONTROLLER_START_S:.0f} s")
    if misses >= PROGRESS_MISSES:  # the caller ends the Controller, and its workers go with it
        raise RunFailed(f"the Controller ({name}) did not answer {misses} progress calls in a row (each within "
                        f"{PROGRESS_ANSWER_S:.0f} s) after step {seen.step}; it was ended with its workers")
    if stop.reason is None:  # the run ended by itself
        return _outcome(done, seen)
    try:
        stopping(stop.reason)
        return _stopped(controller, done, seen, stop.reason, within_s=stop_within_s)
    except KeyboardInterrupt:  # a second Ctrl-C: the caller ends the Controller now
        raise RunStopped(f"{stop.reason}, then again: ended at once after step {seen.step}") from None


def _answer(call: Any, timeout_s: float, stop: StopRequest) -> Any:
    """``call``'s value, or None if it has not come within ``timeout_s`` or a stop was asked meanwhile."""
    deadline = time.monotonic() + timeout_s
    while stop.reason is None:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _ = ray.wait([call], timeout=min(ANSWER_SLICE_S, left))
        if ready:
            return ray.get(call, timeout=RESULT_FETCH_S)
    return None


def _stopped(controller: Any, done: Any, seen: SeenProgress, reason: str, *, within_s: float) -> RunResult:
    """Stop the run for ``reason``: RunStopped saying where it stopped and what it kept (its result, if it finished
    meanwhile)."""
    if not _stop(controller, done, seen, within_s=within_s):
        raise RunStopped(f"{reason}: the Controller did not stop within {within_s:.0f} s of the stop asked "
                         f"after step {seen.step} and was ended; its workers went with it")
    return _outcome(done, seen, reason)


def _outcome(done: Any, seen: SeenProgress, reason: str | None = None) -> RunResult:
    """The ended run's result; RunStopped if the Controller ended it stopped (asked here for ``reason``, or by
    anyone else), RunFailed if it failed."""
    try:
        return _unwrap(done)
    except RunStopped as stopped:
        if reason is None:
            raise
        raise RunStopped(f"{reason}: {stopped}", result=stopped.result) from None


def _stop(controller: Any, done: Any, seen: SeenProgress, *, within_s: float) -> bool:
    """End the run at the next step boundary; the Controller saves that step, gathers the model and shuts its
    workers down before it returns. What it logged meanwhile is added to ``seen``, if it still answers. Whether
    it ended within ``within_s``."""
    controller.stop.remote()
    ended, _ = ray.wait([done], timeout=within_s)
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
    """The Controller's RunResult, its model read back from the bytes a worker sent; a stop's the same way."""
    try:
        result = ray.get(ref, timeout=RESULT_FETCH_S)
    except ray.exceptions.RayTaskError as error:
        if isinstance(error.cause, RunStopped):
            kept = error.cause.result
            raise RunStopped(str(error.cause), result=None if kept is None else _read_back(kept)) from None
        if isinstance(error.cause, RunFailed):
            raise RunFailed(str(error.cause), model_state=read_model_file(error.cause.model_state)) from None
        raise
    return _read_back(result)


def _read_back(result: RunResult) -> RunResult:
    return dataclasses.replace(result, model_state=read_model_file(result.model_state))


def _ended_as(error: BaseException) -> RunEnd:
    """A run stopped from outside (Ctrl-C or SIGTERM, which _follow turns into RunStopped; a Tune stop, which is
    no Exception) was stopped; any other error failed it."""
    return "stopped" if isinstance(error, RunStopped) or not isinstance(error, Exception) else "failed"
