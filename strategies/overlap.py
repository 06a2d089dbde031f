"""How much gradient communication backward hides: timed DDP communication hooks.

DDP calls its hook for a bucket as soon as the bucket's gradients are computed and waits for
every bucket's future at the end of backward. So, per step:

- communication time: the sum over buckets of (future done - hook called);
- exposed communication: (backward returned - last bucket ready), the part of communication
  that no gradient computation overlapped;
- compute time: the step's duration minus the exposed communication.

No ``from __future__ import annotations`` here: DDP rejects hooks whose annotations are strings.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StepComm:
    comm_s: float
    exposed_comm_s: float


class CommTimer:
    """Wraps a DDP comm hook and times every bucket; ``take`` closes a step's measurement."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._comm_s = 0.0
        self._last_ready: float | None = None

    def wrap(self, hook: Callable) -> Callable:
        timer = self

        def timed_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            called = time.perf_counter()
            timer._last_ready = called

            def finished(future: torch.futures.Future) -> torch.Tensor:
                with timer._lock:
                    timer._comm_s += time.perf_counter() - called
                return future.value()

            return hook(state, bucket).then(finished)

        timed_hook.__name__ = f"timed_{getattr(hook, '__name__', 'hook')}"
        return timed_hook

    def take(self, backward_returned: float) -> StepComm:
        """The step's communication, given when its last backward returned; resets for the next step."""
        with self._lock:
            comm_s, last_ready = self._comm_s, self._last_ready
            self._comm_s, self._last_ready = 0.0, None
        exposed = max(0.0, backward_returned - last_ready) if last_ready is not None else 0.0
        return StepComm(comm_s=comm_s, exposed_comm_s=exposed)
