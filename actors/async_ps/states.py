"""The states of an asynchronous run, in the synchronous Controller's shape (actors/controller/states.py): the
AsyncController moves from one to the next (``AsyncController.advance``)::

    placing -> waiting_for_workers -> running -> finishing -> finished
                                        ^  |        |
                                        |  v        v
                               restoring_servers <--+   (a server lost in any state; every server back to the
                                                         newest whole cut)

    any state -> failed (an error of the job or of a server, too many failures)
    waiting_for_workers, running -> stopped (the user asked, before any update was applied)
    running -> stopping -> stopped (the user asked: the steps leased before it are pushed, then kept)
    running -> running: one supervising pass (workers that ended, heartbeats, hung steps, evaluation)

Placing, Finishing and the terminal states are the synchronous run's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from raylastic.actors.controller.states import Failed, Finished, Finishing, Placing, Stopped


@dataclass(frozen=True)
class StartingWorkers:
    """The workers start; no step is leased until scaling.min_workers of them have asked for one (one alone would
    take every step until the others are up, seconds on a busy machine), or the run fails at the deadline."""

    name: ClassVar[str] = "waiting_for_workers"

    deadline: float
    """``time.monotonic()`` by which they must have asked (scaling.placement_timeout_s after they were started)."""


@dataclass(frozen=True)
class Training:
    """Workers lease, compute and push steps; each transition is one supervising pass."""

    name: ClassVar[str] = "running"


@dataclass(frozen=True)
class RestoringServers:
    """The lost servers are replaced (each one counted as a failure), and every server goes back to the newest whole
    checkpoint (or the start) in a new epoch."""

    name: ClassVar[str] = "recovering"

    lost: tuple[tuple[int, str], ...]
    """(server index, why it was lost)."""


@dataclass(frozen=True)
class Stopping:
    """A stop the user asked for: no step is leased from now on; once the steps leased before it are pushed and
    every server holds the same version, that version is written and the model gathered, as a finish does, without
    its evaluation. Past the deadline nothing is kept (the newest checkpoint stands)."""

    name: ClassVar[str] = "stopping"

    deadline: float
    """``time.monotonic()`` by which the leased steps must have been pushed (failure.max_step_s after the stop)."""


AsyncRunState = (Placing | StartingWorkers | Training | RestoringServers | Finishing | Stopping | Finished | Failed
                 | Stopped)
