"""What a worker reports: one committed step's ``StepResult`` and the ``WorkerStatus`` its mailbox
(actors/worker/mailbox.py) answers a poll with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from raylastic.actors.status.run import Event

Phase = Literal["idle", "training", "stopped", "finished", "failed"]
ErrorCause = Literal["peer_lost", "job"]
"""Why a worker failed: a collective lost its peer (recovered), or the job itself raised (fatal)."""


@dataclass(frozen=True)
class StepResult:
    step: int
    """The step's number, 1-based: after it, ``step`` optimizer steps are committed."""
    loss_sum: float
    """This rank's loss summed over its samples (the Controller sums it over the ranks)."""
    samples: int
    """The samples this rank trained on in this step."""
    duration_s: float
    finished_at: float
    """Wall-clock time (time.time()) when the step was committed."""
    sample_ids: tuple[int, ...] | None = None
    """The dataset indices all ranks trained on in this step, gathered (when samples are recorded)."""
    bytes_sent: int = 0
    """Gradient bytes this rank put on the wire (its payloads), and what float32 would have been."""
    uncompressed_bytes: int = 0
    comm_s: float | None = None
    """Time buckets spent in communication, and the part of it backward did not hide (None: not
    timed, unless strategy.comm_timing is set)."""
    exposed_comm_s: float | None = None
    skipped: bool = False
    """The optimizer did not step: the gradients were inf/NaN (training.on_nonfinite=skip, or fp16's
    loss scaler found an overflow)."""
    lr: float = 0.0
    """The learning rate of the step (the first param group's)."""
    grad_norm: float = 0.0
    """The global L2 norm of the step's gradient, before clipping."""
    compute_s: float = 0.0
    """This rank's own compute in the step, without waiting for its peers (actors/data/compute_clock.py)."""
    link_delay_s: float = 0.0
    """The emulated link's delay for the step's bytes (``link:``), part of ``duration_s``; 0 without one."""


@dataclass(frozen=True)
class WorkerStatus:
    phase: Phase
    step: int
    results: list[StepResult] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    error: str | None = None
    """The error and its full traceback (phase "failed")."""
    error_cause: ErrorCause | None = None
    evaluations: list[dict] = field(default_factory=list)
    """Periodic evaluations since the last poll (rank 0 reports them): ``{"step", "time", metrics...}``."""
    version: int = 0
    """Counts the news (phase changes, events, errors) so far; pass it back as ``poll``'s ``seen``."""
    step_running_s: float | None = None
    """How long the step in flight has been running (None: none is), for the Controller's hang watchdog."""
