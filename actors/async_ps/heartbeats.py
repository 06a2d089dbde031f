"""Which actors have not answered a ping for too long, without blocking the one who asks.

    beats = Heartbeats(timeout_s=10)
    beats.ping({"w0": worker.ping, "s0": server.beat})   # to those answered at least interval_s ago
    heard = beats.check()  # answers since the last check, errors the actors raised, and the late (dead, or silent 10 s)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray


@dataclass
class Heard:
    answers: dict[str, Any] = field(default_factory=dict)
    """What each actor that answered since the last check returned."""
    raised: dict[str, ray.exceptions.RayTaskError] = field(default_factory=dict)
    """Actors whose ping raised an error of their own: alive, and the caller decides what the error means."""
    late: dict[str, str] = field(default_factory=dict)
    """Name -> why, for actors that died or whose ping is older than the timeout (forgotten here)."""


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

    def check(self) -> Heard:
        """What came back since the last check, and who is late."""
        now, heard = time.monotonic(), Heard()
        for name, (ref, sent) in list(self.pending.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                del self.pending[name]
                self.answered[name] = now
                try:
                    heard.answers[name] = ray.get(ref)
                except ray.exceptions.RayTaskError as error:
                    heard.raised[name] = error
                except ray.exceptions.RayError as error:
                    heard.late[name] = next((line.strip() for line in str(error).splitlines() if line.strip()),
                                            type(error).__name__)
            elif now - sent > self.timeout_s:
                del self.pending[name]
                heard.late[name] = f"no answer for {self.timeout_s:.0f}s (failure.step_timeout_s)"
        return heard

    def settle(self, names: set[str], timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the pings of ``names`` in flight, so that the next ``check`` hears them:
        a server's answer carries the failed saves it no longer holds once it answered."""
        refs = [ref for name, (ref, _) in self.pending.items() if name in names]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)

    def forget(self, name: str) -> None:
        self.pending.pop(name, None)
        self.answered.pop(name, None)
