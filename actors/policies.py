"""Pure policies the Controller asks; they decide from observed state and never call Ray.

Example::

    policy = ScalingPolicy(min_workers=2, max_workers=4)
    policy.decide(ScalingState(num_workers=2, num_placeable=1))   # -> Resize(num_workers=3)
    FailurePolicy(max_failures=1).decide(failures_so_far=2)       # -> Raise(...)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Noop:
    """Keep the current workers."""


@dataclass(frozen=True)
class Resize:
    num_workers: int


@dataclass(frozen=True)
class ScalingState:
    num_workers: int
    """Workers in the current generation."""
    num_placeable: int
    """Further workers whose resources are reserved and ready now."""


@dataclass(frozen=True, kw_only=True)
class ScalingPolicy:
    """Ask for as many workers as allowed, as soon as resources for them are ready."""

    min_workers: int
    max_workers: int

    def decide(self, state: ScalingState) -> Noop | Resize:
        target = min(self.max_workers, state.num_workers + state.num_placeable)
        if target != state.num_workers and target >= self.min_workers:
            return Resize(target)
        return Noop()


@dataclass(frozen=True)
class Recover:
    backoff_s: float
    """Wait this long before forming the next generation."""


@dataclass(frozen=True)
class Raise:
    reason: str


@dataclass(frozen=True, kw_only=True)
class FailurePolicy:
    """Survive up to ``max_failures`` failures per run (workers lost together count once), backing off
    exponentially if asked."""

    max_failures: int
    backoff_s: float = 0.0
    max_backoff_s: float = 30.0

    def decide(self, failures_so_far: int) -> Recover | Raise:
        """``failures_so_far`` counts the failure being decided on."""
        if failures_so_far > self.max_failures:
            return Raise(f"{failures_so_far} failures, more than failure.max_failures="
                         f"{self.max_failures}")
        doublings = min(failures_so_far - 1, 32)
        delay = min(self.max_backoff_s, self.backoff_s * 2**doublings) if self.backoff_s else 0.0
        return Recover(backoff_s=delay)
