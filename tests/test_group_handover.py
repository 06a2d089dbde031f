"""A survivor leaves a broken group while a collective of the failed step is still in flight (its
stop vote, a DDP bucket): moving its state on to the next group must not hang (real gloo, 2 processes).

This is what TrainWorker.join does after a peer is lost; the stalled-worker test in test_elastic.py
hung in CI when the old DDP wrapper still held the group as it was destroyed.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist

from actors.stop_vote import StopVote
from strategies.ddp import DDPStrategy
from strategies.process_group import leave_group
from tests.distributed_harness import run_distributed

LOST_PEER_LEAVES_AFTER_S = 1.0


def _leave_with_a_vote_in_flight() -> float:
    """Rank 1 is the lost peer: it never votes and leaves after a while. Rank 0 opens a vote, then
    leaves the group as join() does. Returns how long rank 0's leaving took."""
    state = DDPStrategy().setup(lambda: torch.nn.Linear(8, 8), lambda p: torch.optim.SGD(p, lr=0.1),
                                torch.device("cpu"), previous=None)
    if dist.get_rank() == 1:
        time.sleep(LOST_PEER_LEAVES_AFTER_S)
        return 0.0
    vote = StopVote(first_step=0, device=torch.device("cpu"))
    vote.open(0, stop=False)
    del vote  # the step loop that opened it ended with the failed step
    started = time.monotonic()
    kept = state.kept_across_groups()
    del state
    gc.collect()
    leave_group()
    assert isinstance(kept.model, torch.nn.Linear) and kept.wrapped is kept.model
    del kept
    return time.monotonic() - started


def test_leaving_a_group_with_a_collective_in_flight_does_not_hang():
    left_after_s, _ = run_distributed(_leave_with_a_vote_in_flight, 2, timeout_s=30)
    assert left_after_s < 20  # the vote fails once the peer is gone; leaving waits for that, not longer
