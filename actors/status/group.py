"""What the Controller observes of its workers: typed snapshots the policies decide from.

``WorkerGroup.poll`` returns a ``GroupStatus``; ``actors.controller.policies`` turns it into decisions. Nothing
here calls Ray, so a test builds these by hand.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

DONE_PHASES = frozenset({"finished", "stopped", "failed"})
"""A worker reports its last step results with these phases: it is no longer polled in this generation."""


@dataclass(frozen=True)
class LostWorker:
    """A worker the run lost: dead, hung, or unable to start."""

    name: str
    reason: str
    rank: int | None = None
    """Its rank in the last generation formed (None: it never had one)."""
    found_at: float = field(default_factory=time.time, compare=False)
    """When the loss was found (``time.time()``): a worker is described as lost the moment it is found, and the
    run may act on it later (a join's survivors can wait for the member lost to end their own calls)."""

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"


@dataclass(frozen=True)
class MemberStatus:
    """One member of the current generation, as last heard."""

    name: str
    phase: str = "training"
    node_id: str = ""
    silent_s: float = 0.0
    """Since its last answer to a poll."""
    step_running_s: float | None = None
    """How long the step in flight has been running (None: none is)."""
    error: str | None = None
    """Its error with the full traceback (phase "failed")."""
    error_cause: str | None = None
    """"peer_lost" (a collective lost its peer) or "job" (the job itself raised)."""
    dead: str | None = None
    """Why its process is gone (None: it answers)."""


@dataclass(frozen=True)
class RankNews:
    """What one member reported since the last poll: a ``WorkerStatus`` with its step results, events and
    evaluations."""

    rank: int
    status: Any


@dataclass(frozen=True)
class GroupStatus:
    """One poll of the whole group."""

    generation: int
    members: tuple[MemberStatus, ...]
    """In rank order."""
    news: tuple[RankNews, ...] = ()
    errors_for_s: float | None = None
    """Since the first member reported an error in this generation (None: none has)."""
    num_joining: int = 0
    """Workers starting up to join."""
    num_placeable: int = 0
    """Further workers whose resources are reserved and ready now."""
    num_joiners_ready: int = 0
    """Joiners constructed and ready to come in at the next step boundary."""
    draining: bool = False
    """Members were asked to leave at the next step boundary."""
    num_spares: int = 0
    """Spares started (scaling.spare_workers), constructed or not."""
    num_spares_ready: int = 0
    """Spares constructed and idle, ready to come in at once."""
    draining_nodes: dict[str, float | None] = field(default_factory=dict)
    """Nodes Ray is draining (a preemption notice) -> when each goes (``time.time()`` seconds; None: unknown)."""

    @property
    def world_size(self) -> int:
        return len(self.members)


# -- failures, as the Controller receives them: from a poll (the GenerationJudge) or from a call on the members --


@dataclass(frozen=True)
class WorkersLost:
    """Members dead or hung: recovered from (the survivors form the next generation)."""

    lost: tuple[LostWorker, ...]
    """Empty when members' collectives lost a peer that is nonetheless still there, and the others ended their
    steps (every member failed: a JobError): the group re-forms as it is."""


@dataclass(frozen=True)
class JobError:
    """Members raised an error of the job itself: a replacement would only meet it again, so the run ends."""

    errors: tuple[tuple[str, str], ...]
    """(member name, its error with the full traceback)."""
    where: str | None = None
    """Where it was raised ("in evaluate"); None: in the step after the run's newest."""

    def reason(self, step: int) -> str:
        """The run's reason to fail, ``step`` its newest committed step: the first line names the member and
        where, the rest is the error."""
        name, error = self.errors[0]
        return (f"{name} raised an error {self.where or f'at step {step + 1}'} (not retried: it is the job's, not a "
                f"lost worker)\n{error}")


Failure = WorkersLost | JobError
