"""What an AsyncWorker and the AsyncController hand each other: a lease of a step, and the report of its gradient."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Lease:
    ticket: int | None
    """The step (0-based) to compute; None: nothing to lease now (ask again), or the run is finished."""
    epoch: int = 0
    """The servers' epoch: it changes when they are restored, and a push of an older epoch is refused."""
    servers: tuple[Any, ...] = ()
    shards: tuple[tuple[str, ...], ...] = ()
    """The parameter names each server holds."""
    finished: bool = False
    """The run has no more steps for this worker (all applied, or it stops)."""


@dataclass(frozen=True)
class StepReport:
    ticket: int
    read_versions: list[int]
    """The version of each server's parameters the gradient was computed on."""
    loss_sum: float
    samples: int
    compute_s: float
    step_s: float
    """From the lease to the admission request: pull, compute, throttle."""
    grad_norm: float
    bytes_sent: int
    """The gradient bytes pushed to the servers."""
    bytes_received: int
    """The parameter bytes pulled from them."""
    link_delay_s: float = 0.0
    """What the emulated link (``link:``) added to the pull and the push."""
    skipped: bool = False
    """The loss or gradient was inf/NaN and training.on_nonfinite=skip: the update changes nothing."""
    sample_ids: list[int] | None = None
