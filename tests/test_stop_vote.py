"""The stop vote: every rank stops after the same step, votes come at the same steps on every rank,
and their spacing follows the step time (real gloo groups of 1, 2 and 3 processes)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from raylastic.actors.worker.stop_vote import MAX_VOTE_INTERVAL, VOTE_PERIOD_S, StopVote, proposed_interval, stops_early
from tests.support.distributed_harness import run_distributed


def test_proposed_interval_fits_the_vote_period_in_steps():
    assert proposed_interval(None) == 1  # nothing measured yet: vote again at the next step
    assert proposed_interval(VOTE_PERIOD_S / 10) == 10
    assert proposed_interval(VOTE_PERIOD_S * 3) == 1  # slow steps vote every step
    assert proposed_interval(1e-7) == proposed_interval(0.0) == MAX_VOTE_INTERVAL


def _vote_loop(step_s: float, stop_from: int, steps: int = 400) -> tuple[list[int], int]:
    """Steps of ``step_s`` (plus a gradient-like all-reduce); the last rank asks to stop from step
    ``stop_from`` on. Returns the steps this rank voted at and the step it stopped after."""
    vote = StopVote(first_step=0, device=torch.device("cpu"))
    asking = dist.get_rank() == dist.get_world_size() - 1
    voted = []
    for step in range(steps):
        voting = vote.due(step)
        if voting:
            voted.append(step)
            vote.open(step, stop=asking and step >= stop_from)
        time.sleep(step_s * (1 + dist.get_rank() / 4))  # ranks differ in speed, so their proposals differ
        dist.all_reduce(torch.ones(4))
        if voting and vote.close(step):
            return voted, step
    return voted, -1


def test_a_stop_voted_at_the_last_step_finishes_the_generation():
    """A joiner's boundary voted at the run's last step forms no generation that trains nothing: the run finishes in
    the layout that trained it, and its final checkpoint names that layout (test_tensor_parallel checks the run)."""
    assert stops_early(True, step=5, until_step=8)
    assert not stops_early(True, step=8, until_step=8)
    assert not stops_early(False, step=5, until_step=8)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_rank_stops_after_the_same_step(world_size: int) -> None:
    step_s, stop_from = 0.002, 60
    per_rank = run_distributed(_vote_loop, world_size, step_s, stop_from)
    voted, stopped = per_rank[0]
    assert all(rank_result == (voted, stopped) for rank_result in per_rank)  # one schedule, one stop step
    assert voted[:2] == [0, 1]  # a generation's first vote has no step time to go by
    intervals = [b - a for a, b in zip(voted, voted[1:], strict=False)]
    assert max(intervals) > 1  # fast steps vote less often than every step (a step under VOTE_PERIOD_S / 2) ...
    assert max(intervals) <= VOTE_PERIOD_S / step_s  # ... yet at least every VOTE_PERIOD_S
    assert stopped == min(v for v in voted if v >= stop_from)  # the first vote after the request stops
