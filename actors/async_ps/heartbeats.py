"""Which actors have not answered a ping for too long, without blocking the one who asks.

    beats = Heartbeats(timeout_s=10)
    beats.ping({"w0": worker.ping, "s0": server.version_now})   # to those answered at least interval_s ago
    beats.overdue()        # names whose ping has been unanswered for 10 s; a dead actor's raises: also here
"""

from __future__ import annotations

import time
from typing import Any

import ray


class Heartbeats:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.interval_s = min(1.0, timeout_s / 4)
        """Between an answer and the next ping (as the synchronous Controller polls)."""
        self.pending: dict[str, tuple[Any, float]] = {}
        self.answered: dict[str, float] = {}

    def ping(self, methods: dict[str, Any]) -> None:
        now = time.monotonic()
        for name, method in methods.items():
            if name not in self.pending and now - self.answered.get(name, 0.0) >= self.interval_s:
                self.pending[name] = (method.remote(), now)

    def overdue(self) -> dict[str, str]:
        """Name -> why, for every actor whose ping failed or is older than the timeout (forgotten here)."""
        now, late = time.monotonic(), {}
        for name, (ref, sent) in list(self.pending.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                del self.pending[name]
                self.answered[name] = now
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as error:
                    late[name] = next((line.strip() for line in str(error).splitlines() if line.strip()),
                                      type(error).__name__)
            elif now - sent > self.timeout_s:
                del self.pending[name]
                late[name] = f"no answer for {self.timeout_s:.0f}s (failure.step_timeout_s)"
        return late

    def forget(self, name: str) -> None:
        self.pending.pop(name, None)
        self.answered.pop(name, None)
