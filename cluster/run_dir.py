"""A run's directory: held by one run at a time, checked before any actor starts, and what the driver writes there.

Example::

    with locked(run_dir, "run directory"):
        require_writable(checkpoint_root)
        ...                                  # the run
        write_result(run_dir, job, status="finished", result=result)

One run at a time holds a run directory (and a local checkpoint directory): ``<dir>/.lock``, an flock that ends
with the process. Each check raises RunFailed naming the directory and what to do. ``result.json`` and
``model.pt`` are written atomically: a reader finds the whole new file or the one that was there before.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import math
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import torch

from raylastic.actors.status.run import Event, RunFailed, RunResult, RunStatus
from raylastic.cluster.tracking import RunEnd, shown_config
from raylastic.jobconfig import JobConfig
from raylastic.strategies.atomic_file import write_atomically

LOCK_NAME = ".lock"


@contextlib.contextmanager
def locked(directory: Path, what: str) -> Iterator[None]:
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


def require_writable(checkpoint_root: str) -> None:
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


def require_no_checkpoints(checkpoint_root: str) -> None:
    """checkpoint.resume=never starts afresh: with another run's checkpoints in its path it would prune them,
    and a later resume could load theirs."""
    fs, path = fsspec.core.url_to_fs(checkpoint_root)
    names = sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False))
    found = [name for name in names if name.startswith(("step_", "ps_"))]
    if found:
        raise RunFailed(f"checkpoint.resume=never, but {checkpoint_root} holds checkpoints ({', '.join(found)}); "
                        "delete that directory to start afresh, or use another --run-dir or checkpoint.path")


@dataclass
class SeenProgress:
    """What the driver has been told of the run so far: result.json's record when the Controller, dead or
    stopped, can no longer be asked."""

    step: int = 0
    state: str = ""
    """The run's state in the newest progress (``running``, ..., ``stopped``)."""
    history: list[dict[str, Any]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    evaluations: list[dict[str, Any]] = field(default_factory=list)

    def add(self, progress: RunStatus) -> None:
        self.step, self.state = progress.step, progress.state
        self.history += progress.history
        self.events += progress.events
        self.evaluations += progress.evaluations

    def cursor(self) -> dict[str, int]:
        """``Controller.progress``'s arguments for what comes after this."""
        return {"history_since": len(self.history), "events_since": len(self.events),
                "evaluations_since": len(self.evaluations)}


def write_model(run_dir: Path, state: dict[str, torch.Tensor]) -> None:
    """Atomically: a reader finds the whole model.pt of this run, or the file that was there before."""
    try:
        write_atomically(run_dir / "model.pt", lambda handle: torch.save(state, handle))
    except Exception as error:
        raise RunFailed(f"could not write {run_dir / 'model.pt'}: {type(error).__name__}: {error}") from error


def read_model_file(model: dict[str, torch.Tensor] | bytes | None) -> dict[str, torch.Tensor] | None:
    """A RunResult's model as a state dict: a worker sends it as the bytes of its ``torch.save``
    (TrainWorker.full_model_file), read back as tensors and plain values only (RunFailed for anything else)."""
    if not isinstance(model, bytes):
        return model
    try:
        return torch.load(io.BytesIO(model), map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - pickle.UnpicklingError for what is not a plain state dict, or a torn file
        raise RunFailed(f"the final model is not a plain state dict: {type(error).__name__}: {error}") from None


def write_result(run_dir: Path, job: JobConfig, *, status: RunEnd, result: RunResult | None = None,
                 error: str | None = None, progress: SeenProgress | None = None) -> None:
    """result.json, atomically (RunFailed if it cannot be written). A stopped run's ``result`` is what its stop kept,
    with the ``error`` saying why it stopped."""
    payload: dict[str, Any] = {"status": status, "name": job.name, "config": shown_config(job)}
    if result is not None:
        if error is not None:
            payload["error"] = error
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
    try:
        text = json.dumps(finite(payload), indent=1, default=str, allow_nan=False)
        write_atomically(run_dir / "result.json", lambda handle: handle.write(text.encode()))
    except Exception as error:
        raise RunFailed(f"could not write {run_dir / 'result.json'}: {type(error).__name__}: {error}") from error


def finite(value: Any) -> Any:
    """``value`` with inf and NaN as None: JSON has no such numbers (Python would write bare NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value
