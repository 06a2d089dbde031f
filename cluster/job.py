"""Run one job from the driver: start its Controller, follow its progress, write its results.

Example::

    from cluster import JobConfig, train
    result = train(JobConfig(), run_dir="runs/digits")
    print(result.final_step, result.metrics["accuracy"])

Writes ``<run_dir>/result.json`` (status, final_step, metrics, history, events, config; inf and NaN
as null) however the run ends, and, on success and before result.json says so, ``<run_dir>/model.pt``:
a plain state dict, ``torch.load(path, weights_only=True)``. One run at a time holds a run directory
(and a local checkpoint directory): ``<dir>/.lock``, an flock that ends with the process.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import ray
import torch
from fsspec.implementations.local import LocalFileSystem
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.async_ps.controller import AsyncControllerActor
from actors.controller import ControllerActor, RunFailed
from actors.placement import ReservedBundles
from actors.run_checkpoints import default_checkpoint_root
from actors.run_status import Event, RunResult, RunStatus
from cluster.connect import ray_session
from cluster.tensorboard import TensorBoardLog
from cluster.tracking import MlflowLog, RunEnd
from jobconfig import JobConfig
from jobconfig.naming import controller_name
from workloads import resolve_workload_class

ProgressCallback = Callable[[RunStatus], None]
PROGRESS_WAIT_S = 1.0
"""Longest the driver's progress poll waits: events arrive at once, step rows at least this often."""
LOCK_NAME = ".lock"


def train(job: JobConfig, *, run_dir: str | Path | None = None, address: str | None = None,
          on_progress: ProgressCallback | None = None, reserved: ReservedBundles | None = None) -> RunResult:
    """Train ``job`` to its last step; raises RunFailed (and still writes result.json) if it cannot.

    Refused before any actor starts, with RunFailed and the run directory left as it was: another run
    holds the directory, the checkpoint path takes no files, or checkpoint.resume=never finds checkpoints.

    ``reserved``: place the workers in these already reserved placement-group bundles (a Ray
    Tune trial does this) instead of asking Ray for placement groups of their own.
    """
    resolve_workload_class(job.workload.name)  # a bad import path fails here, before any actor starts
    run_dir = Path(run_dir or Path("runs") / job.name).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_root = job.checkpoint.path or default_checkpoint_root(run_dir)
    with _locked(run_dir, "run directory"):
        _require_writable(checkpoint_root)
        fs, root_path = fsspec.core.url_to_fs(checkpoint_root)
        # An object store (s3://...) has no locks: keeping its runs apart is the user's part.
        local_root = isinstance(fs, LocalFileSystem)
        with _locked(Path(root_path), "checkpoint directory") if local_root else contextlib.nullcontext():
            if job.checkpoint.resume == "never":
                _require_no_checkpoints(checkpoint_root)
            return _run(job, run_dir, checkpoint_root, address, on_progress, reserved)


def _run(job: JobConfig, run_dir: Path, checkpoint_root: str, address: str | None,
         on_progress: ProgressCallback | None, reserved: ReservedBundles | None) -> RunResult:
    """Every end from here on writes result.json: finished (after model.pt), failed, or killed."""
    profile_dir = str(run_dir / "profile") if job.training.profile_steps else None
    tensorboard = TensorBoardLog(run_dir)
    mlflow_log = MlflowLog(job.tracking, job, run_dir) if job.tracking.mlflow_uri else None
    seen = _SeenProgress()

    def follow(progress: RunStatus) -> None:
        tensorboard.update(progress)
        if mlflow_log is not None:
            mlflow_log.update(progress)
        if on_progress is not None:
            on_progress(progress)

    try:
        with ray_session(address, min_cpus=_cpus_needed(job)):
            controller = _start_controller(job, checkpoint_root, reserved, profile_dir)
            try:
                result = _follow(controller, controller_name(job.name), seen, follow)
            finally:
                ray.kill(controller)
        _write_model(run_dir, result.model_state)  # before result.json says "finished"
        _write_result(run_dir, job, status="finished", result=result)
    except BaseException as error:
        ended = _ended_as(error)
        with contextlib.suppress(RunFailed):  # e.g. the disk is full: the error itself still reaches the user
            _write_result(run_dir, job, status=ended, error=str(error) or type(error).__name__, progress=seen)
        if mlflow_log is not None:
            mlflow_log.finish(ended, model_path=None, result_path=run_dir / "result.json")
        raise
    finally:
        tensorboard.close()
    if mlflow_log is not None:
        mlflow_log.finish("finished", model_path=run_dir / "model.pt", result_path=run_dir / "result.json")
    return result


@dataclass
class _SeenProgress:
    """What the driver has been told of the run so far: result.json's record when the Controller, dead or
    stopped, can no longer be asked."""

    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    evaluations: list[dict[str, Any]] = field(default_factory=list)

    def add(self, progress: RunStatus) -> None:
        self.step = progress.step
        self.history += progress.history
        self.events += progress.events
        self.evaluations += progress.evaluations

    def cursor(self) -> dict[str, int]:
        """``Controller.progress``'s arguments for what comes after this."""
        return {"history_since": len(self.history), "events_since": len(self.events),
                "evaluations_since": len(self.evaluations)}


@contextlib.contextmanager
def _locked(directory: Path, what: str) -> Iterator[None]:
    """Hold ``<directory>/.lock`` for the block; RunFailed at once, naming the holder, if another run does."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise RunFailed(f"{what} {directory} is not writable: {type(error).__name__}: {error}") from None
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the descriptor closes or we die
        except BlockingIOError:
            holder = os.pread(descriptor, 200, 0).decode(errors="replace").strip() or "unknown"
            raise RunFailed(f"{what} {directory} is in use by another run (pid {holder}); wait for it to end, "
                            "or use another --run-dir or checkpoint.path") from None
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(descriptor)


def _require_writable(checkpoint_root: str) -> None:
    """The checkpoint path must take a file before any actor starts, not at the first save."""
    fs, path = fsspec.core.url_to_fs(checkpoint_root)
    probe = f"{path.rstrip('/')}/.write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        fs.makedirs(path, exist_ok=True)
        with fs.open(probe, "wb") as handle:
            handle.write(b"raylastic")
        fs.rm(probe)
    except Exception as error:  # noqa: BLE001 - fsspec's backends raise their own kinds
        raise RunFailed(f"checkpoint path {checkpoint_root} is not writable: {type(error).__name__}: {error}") from None


def _require_no_checkpoints(checkpoint_root: str) -> None:
    """checkpoint.resume=never starts afresh: with another run's checkpoints in its path it would prune them,
    and a later resume could load theirs."""
    fs, path = fsspec.core.url_to_fs(checkpoint_root)
    names = sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False))
    found = [name for name in names if name.startswith(("step_", "ps_"))]
    if found:
        raise RunFailed(f"checkpoint.resume=never, but {checkpoint_root} holds checkpoints ({', '.join(found)}); "
                        "delete that directory to start afresh, or use another --run-dir or checkpoint.path")


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
    return controller.options(name=name, scheduling_strategy=beside_driver).remote(
        job, checkpoint_root, reserved, profile_dir)


def _follow(controller: Any, name: str, seen: _SeenProgress, on_progress: ProgressCallback) -> RunResult:
    """Poll the Controller's progress until its run ends; Ctrl-C stops it at a step boundary."""
    done = controller.run.remote()
    try:
        while True:
            finished, _ = ray.wait([done], timeout=0)
            # A long poll: it answers at once on an event or the run's end, else after PROGRESS_WAIT_S.
            wait_s = 0.0 if finished else PROGRESS_WAIT_S
            progress = ray.get(controller.progress.remote(**seen.cursor(), wait_s=wait_s))
            seen.add(progress)
            on_progress(progress)
            if finished:
                return _unwrap(done)
    except ray.exceptions.RayTaskError:  # raised by the Controller, which is alive (RunFailed: see _unwrap)
        _stop(controller, done, seen)
        raise
    except ray.exceptions.RayActorError as error:  # the Controller is gone; its workers, its own actors, with it
        reason = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise RunFailed(f"the Controller ({name}) died at step {seen.step}: {reason}") from None
    except KeyboardInterrupt:
        _stop(controller, done, seen)
        raise RunFailed("interrupted (Ctrl-C); workers were shut down") from None
    except BaseException:  # e.g. Ray Tune stopping a trial from inside on_progress: stop the same way
        _stop(controller, done, seen)
        raise


def _stop(controller: Any, done: Any, seen: _SeenProgress) -> None:
    """End the run at the next step boundary; the Controller shuts its workers down before it returns.
    What it logged meanwhile is added to ``seen``, if it still answers."""
    controller.stop.remote()
    ray.wait([done], timeout=15)
    with contextlib.suppress(ray.exceptions.RayError):
        seen.add(ray.get(controller.progress.remote(**seen.cursor()), timeout=5))


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


def _write_model(run_dir: Path, state: dict[str, torch.Tensor]) -> None:
    """Atomically: a reader finds the whole model.pt of this run, or the file that was there before."""
    temporary = run_dir / f"model.pt.{os.getpid()}.tmp"
    try:
        torch.save(state, temporary)
        os.replace(temporary, run_dir / "model.pt")
    except Exception as error:
        temporary.unlink(missing_ok=True)
        raise RunFailed(f"could not write {run_dir / 'model.pt'}: {type(error).__name__}: {error}") from error


def _write_result(run_dir: Path, job: JobConfig, *, status: RunEnd, result: RunResult | None = None,
                  error: str | None = None, progress: _SeenProgress | None = None) -> None:
    """result.json, atomically (RunFailed if it cannot be written)."""
    payload: dict[str, Any] = {"status": status, "name": job.name, "config": job.to_dict()}
    if result is not None:
        payload.update(final_step=result.final_step, metrics=result.metrics, checkpoint=result.checkpoint,
                       history=result.history, eval_history=result.eval_history,
                       events=[event.to_dict() for event in result.events])
        if result.memory is not None:
            payload["memory"] = [{"rank": rank, **m} for rank, m in enumerate(result.memory)]
        if result.ledger is not None:
            payload["ledger"] = result.ledger
    else:
        payload.update(error=error, final_step=progress.step, history=progress.history,
                       eval_history=progress.evaluations, events=[event.to_dict() for event in progress.events])
    temporary = run_dir / f"result.json.{os.getpid()}.{time.time_ns()}"
    try:
        temporary.write_text(json.dumps(_finite(payload), indent=1, default=str, allow_nan=False))
        os.replace(temporary, run_dir / "result.json")
    except Exception as error:
        temporary.unlink(missing_ok=True)
        raise RunFailed(f"could not write {run_dir / 'result.json'}: {type(error).__name__}: {error}") from error


def _finite(value: Any) -> Any:
    """``value`` with inf and NaN as None: JSON has no such numbers (Python would write bare NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value
