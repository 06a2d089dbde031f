"""SIGTERM to a driver: a stop at the next step boundary, as Ctrl-C asks, instead of the end of the process.

``ray job stop``, Kubernetes, Slurm and systemd end a process with SIGTERM, then SIGKILL after a grace period
(``ray job stop``: ``RAY_JOB_STOP_WAIT_TIME_S``, 3 s by default). Left to Ray, whose handler aborts the driver, the
run directory would keep the previous run's result.json and an MLflow run would stay RUNNING. ``raylastic train``
turns SIGTERM into a StopRequest that its poll of the Controller reads (cluster/job.py).

Example::

    request = StopRequest()
    with sigterm_asks(request):
        ...                           # after a SIGTERM, request.reason == TERMINATED
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass

INTERRUPTED = "interrupted (Ctrl-C)"
TERMINATED = "terminated (SIGTERM)"


@dataclass
class StopRequest:
    """Why the run is to stop at its next step boundary (TERMINATED, INTERRUPTED); None while nobody asked."""

    reason: str | None = None
    unwinding: BaseException | None = None
    """The exception that asked for the stop from inside the driver's loop (Ray Tune stopping a trial raises
    SystemExit in its report), raised again once the stop has kept the run's step."""

    def ask(self, reason: str, *, unwinding: BaseException | None = None) -> None:
        """Ask for the stop; the first reason given is kept."""
        if self.reason is None:
            self.reason, self.unwinding = reason, unwinding


@contextlib.contextmanager
def sigterm_asks(request: StopRequest) -> Iterator[bool]:
    """For the block, SIGTERM to this process asks ``request`` to stop and the process lives on; the handler from
    before comes back after the block. Yields whether the handler was installed: Python runs signal handlers in
    the main thread only, so from any other thread (a Tune trial, a notebook's background run) nothing is.

    Enter it after ``ray.init``, which installs Ray's own handler (a local Ray's kills the whole instance)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: request.ask(TERMINATED))
    try:
        yield True
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)  # None: not set from Python
