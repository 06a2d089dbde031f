"""Every rank stops after the same step: a vote every few steps, with one tiny all-reduce.

A rank asked to stop (Ctrl-C, a membership change at a step boundary) cannot just stop: its peers
would wait for it in the next step's collectives. So the ranks vote, at steps all of them know in
advance, with one all-reduce (MAX) of ``[stop, -proposed interval]``: a vote to stop from any rank
stops every rank after that step, and the next vote comes after the smallest interval any rank
proposed. Each rank proposes as many steps as fit in ``VOTE_PERIOD_S`` at the step time it has
measured, so a stop lands within about that long whatever the step takes, while a 2 ms step pays for
one tiny all-reduce every ~25 steps instead of one every step (a gloo round trip costs 0.5-2 ms of CPU
on a small machine: a quarter of such a step). The all-reduce starts before the step and is awaited
after it, so it overlaps the step's compute. The first step of a generation always votes.

With ``share_rates``, the ballot also carries one slot per rank: each rank fills its own with its
compute rate (the rest 0), so after the MAX every rank holds every rank's rate (``rates``), the
same figures everywhere, for actors/data/balance.py.

The ballot also carries the time-based checkpoints asked of the ranks (actors/controller/timed_checkpoints.py),
by number: the highest asked and the highest already saved for. After the MAX every rank holds the same two, so
every rank saves after the same step (``checkpoint_due``), and a request that reached some ranks only after
one vote is not saved for again at the next.

Usage, in the step loop of every rank::

    vote = StopVote(first_step=step, device=device)
    while ...:
        voting = vote.due(step)
        if voting:
            vote.open(step, stop=asked_to_stop)
        train_step(step)                   # commits the step (the optimizer steps) ...
        record(step)                       # ... so count it before the vote can fail
        if voting and vote.close(step):
            break                          # every rank breaks after this same step
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

VOTE_PERIOD_S = 0.05
"""About how long apart votes are, so about how long a stop request waits for its step boundary."""
MAX_VOTE_INTERVAL = 100
"""The most steps between two votes, however fast a step."""


def stops_early(stop_voted: bool, step: int, until_step: int) -> bool:
    """Whether a generation stops after ``step`` short of its end: only for a stop voted before ``until_step``. A stop
    voted at the last step (a joiner's boundary, Ctrl-C) finishes the run in the layout that trained it."""
    return stop_voted and step < until_step


def proposed_interval(step_s: float | None) -> int:
    """Steps until the next vote for a step time of ``step_s`` seconds (None: not measured yet)."""
    if step_s is None:
        return 1
    if step_s <= 0:
        return MAX_VOTE_INTERVAL
    return max(1, min(MAX_VOTE_INTERVAL, int(VOTE_PERIOD_S / step_s)))


@dataclass
class CheckpointAsks:
    """The time-based checkpoints asked of this worker, by number (a worker's, kept across generations)."""

    asked: int = 0
    """The highest number the Controller asked of this worker."""
    served: int = 0
    """The highest number saved for, as this worker's last vote agreed."""


SLOTS = 4
"""stop, -proposed interval, checkpoint asked, checkpoint served; then the rates, when shared."""


class StopVote:
    """The votes of one process-group generation, on the current default group."""

    def __init__(self, first_step: int, device: torch.device, share_rates: bool = False) -> None:
        self.next_vote_step = first_step
        """The 0-based step index of the next vote: the same on every rank."""
        self._ballot = torch.zeros(SLOTS + (dist.get_world_size() if share_rates else 0), device=device)
        self.rates: tuple[float, ...] = ()
        """After ``close`` with ``share_rates``: every rank's rate as cast in that vote, in rank order."""
        self.checkpoint_due = False
        """After ``close``: every rank saves a checkpoint of the step voted after (a time-based one was asked)."""
        self._asks: CheckpointAsks | None = None
        self._work: dist.Work | None = None
        self._last_vote: tuple[int, float] | None = None
        """(step index, time.perf_counter()) of this rank's previous vote: its measured step time."""

    def due(self, step_index: int) -> bool:
        return step_index == self.next_vote_step

    def open(self, step_index: int, *, stop: bool, rate: float = 0.0, asks: CheckpointAsks | None = None) -> None:
        """Cast this rank's vote for stopping after step ``step_index`` (and its ``rate``, when rates are
        shared, and the checkpoints ``asks`` holds, which ``close`` updates); call before training that step."""
        now = time.perf_counter()
        step_s = None
        if self._last_vote is not None:
            last_step, last_time = self._last_vote
            step_s = (now - last_time) / (step_index - last_step)
        self._last_vote = (step_index, now)
        ballot = torch.zeros(len(self._ballot))
        ballot[0], ballot[1] = float(stop), -float(proposed_interval(step_s))
        self._asks = asks
        if asks is not None:
            ballot[2], ballot[3] = float(asks.asked), float(asks.served)
        if len(ballot) > SLOTS:
            ballot[SLOTS + dist.get_rank()] = rate
        self._ballot.copy_(ballot)
        if dist.get_world_size() > 1:
            self._work = dist.all_reduce(self._ballot, op=dist.ReduceOp.MAX, async_op=True)

    def close(self, step_index: int) -> bool:
        """The result, once step ``step_index`` is trained: True if every rank stops after it."""
        if self._work is not None:
            self._work.wait()  # a peer lost meanwhile fails here, if the step itself did not already
            self._work = None
        stop, negative_interval, asked, served, *rates = self._ballot.tolist()
        self.rates = tuple(rates)
        self.checkpoint_due = asked > served
        if self._asks is not None:
            self._asks.served = int(max(asked, served))
        self.next_vote_step = step_index + int(-negative_interval)
        return stop > 0
