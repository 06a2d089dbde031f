"""What a reader of a run sees: its ``RunStatus`` (``Controller.progress()``), its typed ``Event``s, and the
``RunResult`` of a finished run.

An event says what happened to the run at a step; result.json, MLflow and TensorBoard keep it as
``event.to_dict()``::

    Event("worker_failed", step=12, time_s=3.2, details={"worker": "raylastic:digits:worker2", "reason": "..."})
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

EventType = Literal[
    "worker_failed",          # died, hung, or raised (``traceback``); ``reason``; ``found_s`` (when it was found)
    "worker_joined",          # a joiner came in at a step boundary; ``started_ahead``: built in a process started
                              # ahead, ``warm_process``: one that had imported the training modules by then
    "worker_start_failed",    # a new worker could not be constructed; ``worker``, ``node_id``, ``error``
    "worker_left",            # a drained worker left at a step boundary
    "spares_taken",           # idle spares come in at the next boundary; ``workers``, ``reason``
    "node_draining",          # Ray drains a node of the run (a preemption notice); ``deadline_s``, ``workers``
    "node_drain_cancelled",   # the drain was called off before the boundary: its workers stay
    "drained",                # a draining node's workers left at a step boundary; ``steps_lost`` (0)
    "generation_formed",      # ``generation``, ``world_size``, ``state_source``, ``steps_lost``, ``duration_s``,
                              # ``rendezvous_calls`` (the members' calls to the run's keys as they joined)
    "recovered",              # the first step committed after a failure; ``recovery_s``, ``world_size``
    "waiting_for_resources",  # below min_workers after a failure; ``workers``, ``needed``
    "resumed",                # the run started from a checkpoint; ``path``, ``saved_world_size``, ``saved_strategy``
    "checkpointed",           # ``path``, ``duration_s`` or ``reason``
    "checkpoint_failed",      # a periodic save failed and the run carried on; ``path``, ``error``
    "checkpoint_rejected",    # a checkpoint failed verification (its sizes on the head, its checksums on the ranks
                              # that load it) and was skipped; ``path``, ``reason``
    "compiled",               # torch.compile's first step of a generation; ``first_step_s``
    "shares_changed",         # the batch split follows the ranks' speeds from the next step; ``shares``, ``rates``
    "straggler",              # a rank slower than straggler_factor, persistently; ``rank``, ``node_id``,
                              # ``speed_vs_median``
    "worker_draining",        # a worker leaves at the next step boundary; ``workers``, ``reason``
    "server_failed",          # async_ps: a parameter server died or stopped answering; ``server``, ``reason``
    "stopped",                # the user asked the run to stop: its step's ``checkpoint`` and the model were kept
    "finished",               # the final metrics
]


@dataclass(frozen=True)
class Event:
    type: EventType
    step: int
    time_s: float = 0.0
    """Seconds since the run began, stamped by the RunLog when it takes the event in."""
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "step": self.step, "time_s": self.time_s, **self.details}

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Event:
        """An event as result.json holds it."""
        details = {k: v for k, v in record.items() if k not in ("type", "step", "time_s")}
        return cls(record["type"], record["step"], record.get("time_s", 0.0), details)


@dataclass(frozen=True)
class RunStatus:
    """``Controller.progress()``: the run's state and what happened since the reader's last positions."""

    state: str
    """The Controller's state: placing, forming, running, resizing, recovering, waiting_for_workers,
    finishing, stopping, finished, failed or stopped."""
    generation: int
    world_size: int
    step: int
    members: list[str]
    failures: int
    history: list[dict[str, Any]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    layout: str | None = None
    """The current generation's model-parallel layout (``pp2 x dp2``); None without model parallelism."""


@dataclass(frozen=True)
class RunResult:
    final_step: int
    metrics: dict[str, float]
    history: list[dict[str, Any]]
    events: list[Event]
    model_state: dict[str, Any] | bytes
    """The full model's state dict; on its way from a worker to the driver, the bytes of its ``torch.save``."""
    checkpoint: str | None
    memory: list[dict[str, int]] | None = None
    """Per rank: bytes of parameters, gradients and optimizer state held at the end of the run."""
    ledger: dict[int, list[dict[str, Any]]] | None = None
    """training.record_samples: every application of every step (``RunLog.ledger`` has its shape)."""
    eval_history: list[dict[str, Any]] | None = None
    """The periodic evaluations (eval.every_steps): ``{"step", "time_s", metrics...}`` each."""


class RunFailed(RuntimeError):
    """The run ended with an error; the message says what failed and where the last checkpoint is."""

    def __init__(self, message: str, model_state: dict[str, Any] | bytes | None = None) -> None:
        super().__init__(message)
        self.model_state = model_state
        """The full model, where the run gathered it before it failed (its final evaluation failed)."""


class RunStopped(RunFailed):
    """The run was stopped before its last step (Ctrl-C, SIGTERM, a Ray Tune scheduler, the Controller's ``stop``);
    result.json says "stopped"."""

    def __init__(self, message: str, result: RunResult | None = None) -> None:
        super().__init__(message)
        self.result = result
        """What the stop kept: the checkpoint of the step it stopped at and the full model (``model_state``), as a
        finished run's; None where nothing was trained to keep, or the stop could not wait for it."""
