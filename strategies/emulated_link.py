"""A slow network link emulated in the step loop: the delay a step's bytes would take on it (``link:``).

After a step's communication (DDP's gradient traffic, or DiLoCo's outer step) the step loop sleeps
``delay_s(bytes_sent, messages)``: the latency once per message plus bytes x 8 / bandwidth. It lets one
machine show where a slow link hurts and what communicating less wins (benchmarks/slow_links.py),
without changing the math: the same parameters, later.

What is emulated, and what is not:

- the bytes are the payload this rank hands to its collectives (strategies/compression/accounting.py),
  which is what each rank's link carries in a ring all-reduce at 2 ranks; at N ranks a ring all-reduce
  carries 2(N-1)/N times that, and an all-gather (top-k, 1-bit, int8) N-1 times: not modelled;
- one message per step that sent anything (DDP's buckets count as one): a lower bound on latency;
- the delay is added after the step, not overlapped with backward: an upper bound on DDP's exposed
  communication (DiLoCo's outer step is not overlapped in any case);
- it comes on top of the real transport (local gloo, gigabytes per second), and each rank sleeps for
  its own bytes: a rank's peers do not wait for its sleep, but they send as much and sleep as long;
- state hand-overs, checkpoints, evaluation and the step's control traffic are not delayed.

Example::

    link = EmulatedLink(bandwidth_gbit_s=1.0, latency_ms=5.0)
    link.delay_s(bytes_sent=17_000_000, messages=1)     # 0.005 + 0.136 s
"""

from __future__ import annotations

from dataclasses import dataclass

from raylastic.jobconfig.link import LinkConfig


@dataclass(frozen=True, kw_only=True)
class EmulatedLink:
    bandwidth_gbit_s: float | None = None
    """Gbit/s (10^9 bits); None: not limited."""
    latency_ms: float = 0.0
    """Per message."""

    @classmethod
    def of(cls, config: LinkConfig) -> EmulatedLink | None:
        """The link ``config`` emulates; None when it emulates none (the default)."""
        if not config.emulated:
            return None
        return cls(bandwidth_gbit_s=config.bandwidth_gbit_s, latency_ms=config.latency_ms)

    def delay_s(self, bytes_sent: int, messages: int) -> float:
        """Seconds ``messages`` messages carrying ``bytes_sent`` bytes in all take on this link."""
        transfer_s = 0.0 if self.bandwidth_gbit_s is None else bytes_sent * 8 / (self.bandwidth_gbit_s * 1e9)
        return messages * self.latency_ms / 1000 + transfer_s
