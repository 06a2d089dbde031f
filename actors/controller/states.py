"""The states of a run. The Controller moves from one to the next (``Controller.advance``)::

    placing -> forming -> running -> finishing -> finished
                 ^  ^        |  \\
                 |  |        |   +-> resizing (drained workers leave, joiners come in) -> forming
                 |  |        v
                 |  +---- recovering (failed workers dropped, failure counted) <- a failure in any state
                 +------- waiting_for_workers (below scaling.min_workers)

    any state -> failed (a job error, too many failures, too few workers)
    running (at a step boundary) / resizing -> stopping -> stopped (the user asked: the step is kept)
    forming / waiting_for_workers, or nothing trained yet -> stopped (the user asked: nothing to keep)
    running -> running: one poll of the training generation per transition

Each state carries what the next one needs, so the run's situation is in one value, not in flags.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from raylastic.actors.status.group import LostWorker
from raylastic.actors.status.run import RunFailed, RunStopped
from raylastic.strategies.checkpoint_catalogue import Checkpoint


@dataclass(frozen=True)
class Placing:
    """Reserving slots, starting the first workers, finding the checkpoint to resume from."""

    name: ClassVar[str] = "placing"


@dataclass(frozen=True)
class Forming:
    """Every member joins generation g+1; the state is handed over or restored."""

    name: ClassVar[str] = "forming"

    restore: Checkpoint | None = None
    """The checkpoint this generation loads (a resume, a sharded resize or recovery)."""
    recovering_since: float | None = None
    """When the failure this generation recovers from happened (its "recovered" event's start)."""


@dataclass(frozen=True)
class Running:
    """The generation trains: its first transition starts it, and each one takes one poll of the group, which
    the poll's observers take in and the GenerationJudge judges."""

    name: ClassVar[str] = "running"

    recovering_since: float | None = None
    started: bool = False
    """Whether the generation's training was started (before it is, a stop request ends the run at once)."""
    boundary_requested: bool = False
    """Whether every member was asked to stop at the next step boundary (a membership change, a stop)."""


@dataclass(frozen=True)
class Resizing:
    """At a step boundary: sharded state is saved, drained workers leave, ready joiners come in."""

    name: ClassVar[str] = "resizing"


@dataclass(frozen=True)
class Recovering:
    """Failed workers are dropped and the failure counted; the next generation forms from what is left."""

    name: ClassVar[str] = "recovering"

    lost: tuple[LostWorker, ...]
    recovering_since: float
    restore: Checkpoint | None = None
    """The checkpoint the failed state was to load: still to be loaded by a replicated run."""


@dataclass(frozen=True)
class WaitingForWorkers:
    """Below scaling.min_workers after a failure or a drain: replacements start as their slots become ready."""

    name: ClassVar[str] = "waiting_for_workers"

    needed: int
    deadline: float
    """``time.monotonic()`` by which they must be in (scaling.placement_timeout_s after the failure)."""
    recovering_since: float | None = None
    """When the failure that left the run short happened (None: a drain did)."""
    restore: Checkpoint | None = None


@dataclass(frozen=True)
class Finishing:
    """The final checkpoint, the full model and the final evaluation, in that order."""

    name: ClassVar[str] = "finishing"


@dataclass(frozen=True)
class Stopping:
    """A stop the user asked for, at a step boundary: the step's checkpoint and the full model, as Finishing writes
    them, and no evaluation (a stop has to fit the grace period the user gives it, e.g. ``ray job stop``'s)."""

    name: ClassVar[str] = "stopping"


@dataclass(frozen=True)
class Finished:
    name: ClassVar[str] = "finished"
    result: Any = field(repr=False)
    """The RunResult."""


@dataclass(frozen=True)
class Failed:
    name: ClassVar[str] = "failed"
    reason: str
    model_state: Any = field(default=None, repr=False)
    """The full model, where it was gathered before the run failed (a failed final evaluation)."""


@dataclass(frozen=True)
class Stopped:
    """The user asked the run to stop."""

    name: ClassVar[str] = "stopped"
    result: Any = field(default=None, repr=False)
    """The RunResult of what the stop kept (its checkpoint and model); None when nothing was trained to keep or no
    generation was formed to save it from."""


RunState = (Placing | Forming | Running | Resizing | Recovering | WaitingForWorkers | Finishing | Stopping | Finished
            | Failed | Stopped)
TERMINAL = (Finished, Failed, Stopped)
STOPPABLE = (Forming, Running, Resizing, WaitingForWorkers)
"""States a stop request may end before they act (``after_a_stop``)."""


def ending(state: Finished | Failed | Stopped, *, step: int, note: Callable[[], str]) -> Any:
    """What a run that ended in ``state`` gives its driver: the RunResult, or RunFailed saying why it failed, or
    RunStopped saying where it stopped (its checkpoint, else ``note()``: where the last checkpoint is)."""
    if isinstance(state, Finished):
        return state.result
    if isinstance(state, Stopped):
        kept = state.result
        where = f"; checkpoint: {kept.checkpoint} (the same job resumes from it)" if kept is not None else note()
        raise RunStopped(f"run stopped by the user at step {step}{where}", result=kept)
    raise RunFailed(state.reason, model_state=state.model_state)


def after_a_stop(state: RunState, *, step: int) -> RunState | None:
    """Where a stop request takes ``state`` before it acts; None: ``state`` acts first (a recovery drops the failed
    workers, a finish writes its checkpoint, a generation that trains stops at its next step boundary, and one that
    forms holds the survivors' steps once it has formed).

    A formed generation that does not train (not started yet, or ended at a boundary for a resize) keeps its step:
    Stopping. Nothing is kept at step 0 (nothing trained) or below min_workers (no generation to save from)."""
    acts_first = not isinstance(state, STOPPABLE) or isinstance(state, Running) and state.started
    if acts_first:
        return None
    if step == 0 or isinstance(state, WaitingForWorkers):
        return Stopped()
    return None if isinstance(state, Forming) else Stopping()
