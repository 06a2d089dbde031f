"""An emulated network link between the workers, for tests and demos: a slow link on one machine."""

from __future__ import annotations

from dataclasses import dataclass

from raylastic.jobconfig.checks import is_number, require

MAX_LATENCY_MS = 60_000.0
"""A longer latency is a typo (or seconds written as milliseconds)."""


@dataclass(frozen=True, kw_only=True)
class LinkConfig:
    """A link slower than the workers have: after each step that communicated, a worker sleeps what its bytes
    would take on it (strategies/emulated_link.py). Off by default; it changes time, never the math, so it is
    not part of a checkpoint's job hash.

    Example: ``{bandwidth_gbit_s: 1.0, latency_ms: 5}``, or ``--set link.bandwidth_gbit_s=1``.
    """

    bandwidth_gbit_s: float | None = None
    """Each worker's emulated bandwidth in Gbit/s (10^9 bits): a step's bytes sent take bytes x 8 / bandwidth
    on it; None: not limited (only the latency, if any, is added)."""
    latency_ms: float = 0.0
    """Emulated latency in milliseconds, charged once per step that sends anything; in [0, 60 000]."""

    def __post_init__(self) -> None:
        require(self.bandwidth_gbit_s is None or (is_number(self.bandwidth_gbit_s) and self.bandwidth_gbit_s > 0),
                "link.bandwidth_gbit_s", "null or a positive number of Gbit/s", self.bandwidth_gbit_s)
        require(is_number(self.latency_ms) and 0 <= self.latency_ms <= MAX_LATENCY_MS, "link.latency_ms",
                f"a number of milliseconds in [0, {MAX_LATENCY_MS:g}]", self.latency_ms)

    @property
    def emulated(self) -> bool:
        """Whether the link adds any delay at all."""
        return self.bandwidth_gbit_s is not None or self.latency_ms > 0
