"""A worker's status mailbox: what its ``poll`` answers, written by the actor's calls, the step-loop
thread and the async saver's callbacks.

News (a phase change, an event, an evaluation) bumps the version and wakes a waiting ``poll`` at
once; step results are not news, they go with the next answer. So the Controller hears of news
at once and costs a training worker one call a second::

    status = StatusMailbox()
    status.set_phase("training")
    status.poll(wait_s=1.0, seen=0)  # at once: WorkerStatus(phase="training", step=0, ..., version=1)
    status.poll(wait_s=1.0, seen=1)  # after 1 s, with the step results of the meantime
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from raylastic.actors.status.run import Event
from raylastic.actors.status.worker import ErrorCause, Phase, StepResult, WorkerStatus


class StatusMailbox:
    """One worker's phase, committed step and the news and step results a ``poll`` has not taken yet."""

    def __init__(self) -> None:
        self._lock = threading.Condition(threading.Lock())
        self._version = 0
        self._phase: Phase = "idle"
        self._error: str | None = None
        self._error_cause: ErrorCause | None = None
        self._results: list[StepResult] = []
        self._events: list[Event] = []
        self._evaluations: list[dict] = []
        self._step_started: float | None = None
        self.step = 0
        """Committed optimizer steps this worker holds: the step loop advances it (``commit``); joining a group,
        receiving state and restoring a checkpoint set it."""

    @property
    def phase(self) -> Phase:
        return self._phase

    def poll(self, wait_s: float = 0.0, seen: int = -1) -> WorkerStatus:
        """Phase, committed step and the step results since the last poll; waits up to ``wait_s``
        for news after version ``seen``."""
        with self._lock:
            self._lock.wait_for(lambda: self._version != seen, timeout=wait_s)
            results, self._results = self._results, []
            events, self._events = self._events, []
            evaluations, self._evaluations = self._evaluations, []
            running = None if self._step_started is None else time.monotonic() - self._step_started
            return WorkerStatus(self._phase, self.step, results, events, self._error, self._error_cause, evaluations,
                                self._version, running)

    def set_phase(self, phase: Phase, error: str | None = None, cause: ErrorCause | None = None) -> None:
        """Only "failed" carries an error; every other phase clears it."""
        with self._lock:
            self._phase, self._error, self._error_cause = phase, error, cause
            self._announce()

    @contextlib.contextmanager
    def step_in_flight(self) -> Iterator[None]:
        """Around one step, or the work at its boundary (a save): ``poll`` reports how long it has been running
        (``step_running_s``), which the hang watchdog (failure.max_step_s) bounds."""
        self._step_started = time.monotonic()
        try:
            yield
        finally:
            self._step_started = None

    def commit(self, result: StepResult, event: Event | None = None) -> None:
        """Step ``result.step`` is committed: its result goes with the next poll, and ``event`` (if any) with it."""
        with self._lock:
            self.step = result.step
            self._results.append(result)
            if event is not None:
                self._events.append(event)
                self._announce()

    def post_event(self, event: Event) -> None:
        """The Controller logs it as a run event."""
        with self._lock:
            self._events.append(event)
            self._announce()

    def post_evaluation(self, evaluation: dict) -> None:
        """``{"step", "time", metrics...}``: a row of the run's eval history."""
        with self._lock:
            self._evaluations.append(evaluation)
            self._announce()

    def answer_now(self) -> None:
        """Wake a waiting ``poll``: the Controller ends the generation and wants the step results it holds, which
        are not news (a worker blocked in a collective with a lost peer would otherwise have none to tell)."""
        with self._lock:
            self._announce()

    def drop_results(self) -> None:
        """Forget step results no poll took (those of a generation that has ended)."""
        with self._lock:
            self._results = []

    def _announce(self) -> None:
        """News for a waiting ``poll`` (call with the lock held)."""
        self._version += 1
        self._lock.notify_all()
