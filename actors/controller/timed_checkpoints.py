"""The time-based checkpoint (``checkpoint.every_minutes``): the Controller asks for one once that long has passed
since the last checkpoint ended (written or failed), and every rank takes it after the same step.

The Controller decides *when* (``checkpoint_due``, a pure function of the time since the last checkpoint); the
ranks decide *at which step*: each request carries a number, and the ranks' stop vote (actors/worker/stop_vote.py)
all-reduces the highest number asked and the highest already saved, so every rank sees the same two numbers and
saves, in the background, after the same step. A request that reaches some ranks after a vote is served at
the next one, and never twice. A generation that ends before its vote loses nothing: the request is asked
again of the next one.

What it buys: a sharded run's worker lost together with its buddy (or a second loss in the first step after a
recovery) resumes from the newest such checkpoint instead of failing.

Example (the Controller, every poll of a training generation)::

    timed = TimedCheckpoints(group, every_minutes=10.0)
    timed.observe(status, step=120)   # asks every member for a checkpoint once 10 minutes have passed
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from raylastic.actors.status.group import GroupStatus

ENDED = ("checkpointed", "checkpoint_failed")
"""The events that end a checkpoint's save, whatever asked for it: the clock starts again from each."""


def checkpoint_due(*, every_minutes: float, since_last_s: float, asked: bool) -> bool:
    """Whether to ask the ranks for a checkpoint now: ``every_minutes`` (0: never) have passed since the last
    checkpoint ended (or training began), and none is asked for already.

        checkpoint_due(every_minutes=10, since_last_s=601.0, asked=False)   # True
        checkpoint_due(every_minutes=10, since_last_s=601.0, asked=True)    # False: one is on its way
    """
    return every_minutes > 0 and not asked and since_last_s >= every_minutes * 60.0


class TimedCheckpoints:
    """Carries out ``checkpoint_due`` on the WorkerGroup, from the polls of the training generations."""

    def __init__(self, group: Any, *, every_minutes: float, clock: Callable[[], float] = time.monotonic) -> None:
        """``group``: the WorkerGroup (or a test's fake), asked with ``request_checkpoint(number)``."""
        self.group = group
        self.every_minutes = every_minutes
        self.clock = clock
        self.last_ended_at: float | None = None
        """When the last checkpoint ended (or the first generation began training)."""
        self.asked = 0
        """The number of the newest request; each request's is one higher."""
        self.asked_of: int | None = None
        """The generation the newest request that is still unanswered went to."""

    def observe(self, status: GroupStatus, step: int) -> None:
        """Every poll of a training generation: a checkpoint's end restarts the clock; ask once one is due."""
        now = self.clock()
        if self.last_ended_at is None:
            self.last_ended_at = now
        if any(event.type in ENDED for news in status.news for event in news.status.events):
            self.last_ended_at, self.asked_of = now, None
        asked = self.asked_of == status.generation  # one asked of an earlier generation may never be voted
        if checkpoint_due(every_minutes=self.every_minutes, since_last_s=now - self.last_ended_at, asked=asked):
            self.asked += 1
            self.asked_of = status.generation
            self.group.request_checkpoint(self.asked)
