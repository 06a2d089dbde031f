"""Batch shares by measured speed: how each step's global batch is split over ranks of unequal speed.

Synchronous data parallelism runs at the pace of its slowest rank. The data order lets ranks take
slices of any size with the same gradient (actors/data/order.py ``BatchSplit``; the loss is weighted
per sample), so a rank twice as fast can take twice the samples. Every rank measures its compute rate
(samples per second of its own forward and backward, without the wait for its peers:
actors/data/compute_clock.py); the stop vote's all-reduce hands every rank's rate to every rank, so all of
them run the same decisions below on the same figures and change the split after the same step.

The decisions, pure functions of the figures:

- ``Balancer.decide``: every ``DECISION_VOTES`` votes (the first such window of a generation, which
  carries its start-up, is skipped), the rates averaged over the window give the target split: shares
  proportional to the rates, none below ``min_size`` (the even share over ``straggler_factor``). The
  split changes only when the target's predicted step time is ``REBALANCE_GAIN`` shorter than the
  current split's (hysteresis: noise in the rates does not move shares). A rank's time has a fixed part
  as well as a part per sample, so one decision rarely lands on equal times; each next one moves closer
  (shares proportional to the rates are a fixed point only where every rank's time is the same). The
  prediction takes the better of two bounds: all of a rank's time per sample (the rates), and every
  rank equally fast per sample (the ranks' mean time): with the first alone, a small share whose time is
  mostly fixed cost looks slow per sample and would never grow back once its rank caught up;
- stragglers: a rank held at its minimum share whose compute still takes longer than the others' (so
  slower than them by more than ``straggler_factor``) in ``STRAGGLER_DECISIONS`` decisions in a row;
- ``carry_split``: a new generation's split from the last shares by worker: a newcomer starts at the
  mean share, a lost worker's share is spread over the others in proportion.

Example::

    balancer = Balancer(BatchSplit.even(64, 3), straggler_factor=4.0)
    balancer.decide((400.0, 410.0, 200.0))   # at the end of a decision window: BatchSplit((26, 26, 12))
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from raylastic.actors.data.batch_split import BatchSplit

REBALANCE_GAIN = 0.10
"""A new split must predict a step at least this much shorter than the current one."""
DECISION_VOTES = 8
"""Votes whose rates are averaged for one decision (a vote's own rates cover a few steps: noisy)."""
STRAGGLER_DECISIONS = 3
"""Consecutive decisions that must find a rank a straggler before it is reported."""


def proportional_sizes(total: int, weights: Sequence[float], min_size: int = 1) -> tuple[int, ...]:
    """``total`` split in proportion to ``weights``, no part below ``min_size``; largest remainders, ties to the
    lower rank (deterministic: every rank computes the same parts from the same weights)."""
    count = len(weights)
    assert count and total >= count * min_size, (total, count, min_size)
    weights = [max(float(w), 0.0) for w in weights]
    if sum(weights) <= 0:
        weights = [1.0] * count
    floored: set[int] = set()
    while True:  # parts whose proportional size falls below min_size are held at it; the rest share what is left
        free = [i for i in range(count) if i not in floored]
        budget = total - min_size * len(floored)
        weight = sum(weights[i] for i in free)
        ideal = {i: budget * weights[i] / weight if weight > 0 else budget / len(free) for i in free}
        low = {i for i in free if ideal[i] < min_size}
        if not low:
            break
        floored |= low
    sizes = [min_size if i in floored else int(ideal[i]) for i in range(count)]
    left = total - sum(sizes)
    for i in sorted(free, key=lambda i: (-(ideal[i] - int(ideal[i])), i))[:left]:
        sizes[i] += 1
    return tuple(sizes)


def predicted_step_s(split: BatchSplit, rates: Sequence[float]) -> float:
    """The step's compute time under ``split``: its slowest rank's share over that rank's rate."""
    return max(size / rate for size, rate in zip(split.sizes, rates, strict=True))


def min_share(global_batch_size: int, world_size: int, straggler_factor: float) -> int:
    """The smallest share a rank is given: the even share over ``straggler_factor``, at least one sample."""
    return max(1, int(global_batch_size / world_size / straggler_factor))


def carry_split(previous: Mapping[str, int], members: Sequence[str], global_batch_size: int,
                straggler_factor: float) -> BatchSplit:
    """The split for a new generation of ``members`` (in rank order) from each worker's last share: a member with
    none (a newcomer) starts at the mean of the others; a lost worker's share goes to the rest in proportion."""
    known = [previous[name] for name in members if previous.get(name)]
    mean = statistics.fmean(known) if known else 1.0
    weights = [previous.get(name) or mean for name in members]
    smallest = min_share(global_batch_size, len(members), straggler_factor)
    return BatchSplit(proportional_sizes(global_batch_size, weights, smallest))


@dataclass(frozen=True)
class BalanceDecision:
    split: BatchSplit | None = None
    """The split from the next step on (None: keep the current one)."""
    stragglers: tuple[int, ...] = ()
    """Ranks reported as stragglers by this vote (each once per generation)."""


@dataclass
class Balancer:
    """One generation's balancing, fed the rates of every vote (the same on every rank)."""

    split: BatchSplit
    straggler_factor: float
    rates: tuple[float, ...] | None = None
    """The rates the last decision took (a window's means)."""
    windows: int = 0
    _window: list[tuple[float, ...]] = field(default_factory=list)
    _slow_decisions: dict[int, int] = field(default_factory=dict)
    _reported: set[int] = field(default_factory=set)

    def decide(self, rates: Sequence[float]) -> BalanceDecision:
        """Take a vote's rates (samples per second of compute, one per rank; 0: not measured yet)."""
        if len(rates) != self.split.world_size or min(rates) <= 0:
            return BalanceDecision()
        self._window.append(tuple(rates))
        if len(self._window) < DECISION_VOTES:
            return BalanceDecision()
        self.windows += 1
        self.rates = tuple(statistics.fmean(column) for column in zip(*self._window, strict=True))
        self._window = []
        if self.windows == 1:
            return BalanceDecision()
        smallest = min_share(self.split.global_batch_size, self.split.world_size, self.straggler_factor)
        target = BatchSplit(proportional_sizes(self.split.global_batch_size, self.rates, smallest))
        times = [size / rate for size, rate in zip(self.split.sizes, self.rates, strict=True)]
        target_s = min(predicted_step_s(target, self.rates), statistics.fmean(times))
        gain = 1 - target_s / max(times)
        changed = target != self.split and gain >= REBALANCE_GAIN
        if changed:
            self.split = target
        return BalanceDecision(split=target if changed else None, stragglers=self._stragglers(smallest))

    def _stragglers(self, smallest: int) -> tuple[int, ...]:
        """Ranks held at the minimum share whose compute still takes longer than the others' (by more than the
        hysteresis). Times, not rates: a rank's fixed costs per step lower its rate as its share shrinks."""
        times = [size / rate for size, rate in zip(self.split.sizes, self.rates, strict=True)]
        found = []
        for rank, own in enumerate(times):
            others = statistics.median(t for i, t in enumerate(times) if i != rank)
            slow = self.split.sizes[rank] <= smallest and own > others * (1 + REBALANCE_GAIN)
            self._slow_decisions[rank] = self._slow_decisions.get(rank, 0) + 1 if slow else 0
            if self._slow_decisions[rank] >= STRAGGLER_DECISIONS and rank not in self._reported:
                self._reported.add(rank)
                found.append(rank)
        return tuple(found)
