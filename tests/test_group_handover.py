"""What survivors see when a peer is lost mid-step (real gloo, 2-3 processes).

- The step fails: every communication hook's future fails with the lost collective, so DDP raises
  and the step is discarded. (The all-gathering hooks and the hierarchical hook once swallowed the
  error and handed DDP whatever their output buffer held: survivors of a 1-bit run stepped on
  garbage for 5 steps before something else failed.)
- A survivor leaves the broken group while a collective of the failed step is still in flight (its
  stop vote, a DDP bucket), even one waiting on a live peer that waits on it: moving its state on to the
  next group must not hang, nor leave the peer waiting. This is what
  TrainWorker.join does; the stalled-worker test in test_elastic.py hung in CI when the old DDP
  wrapper still held the group as it was destroyed.
"""

from __future__ import annotations

import gc
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from raylastic.actors.worker.stop_vote import StopVote
from raylastic.strategies.compression import CompressionOptions, make_comm_hook
from raylastic.strategies.ddp import DDPStrategy
from raylastic.strategies.group_connections import GroupConnections
from raylastic.strategies.hierarchical import make_hierarchical_hook
from raylastic.strategies.process_group import leave_group
from tests.support.distributed_harness import FakeBucket, run_distributed

LOST_PEER_LEAVES_AFTER_S = 1.0
GROUP_TIMEOUT_S = 120
"""The group's timeout: what a leaving that hangs would wait out (the test asserts well under it)."""


def _leave_with_a_vote_in_flight() -> float:
    """Rank 1 is the lost peer: it never votes and leaves after a while. Rank 0 opens a vote, then
    leaves the group as join() does. Returns how long rank 0's leaving took."""
    state = DDPStrategy().setup(lambda: torch.nn.Linear(8, 8),
                                lambda model: torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"),
                                previous=None)
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
    left_after_s, _ = run_distributed(_leave_with_a_vote_in_flight, 2, timeout_s=GROUP_TIMEOUT_S)
    assert left_after_s < GROUP_TIMEOUT_S / 3  # the vote fails once the peer is gone; leaving waits for that only


LOST_RANK = 2
GATHERING_KINDS = ("topk", "onebit", "int8")
"""The hooks that all-gather payloads (1-bit without warm-up, so it compresses at once)."""


def _hooks_with_a_lost_peer() -> dict[str, str]:
    """Rank 2 helps build the hierarchical hook's groups (nodes [0, 1] and [2]), then is lost. The
    survivors run one bucket through each hook; returns, per hook, what waiting for its future did."""
    hierarchical = make_hierarchical_hook(["a", "a", "b"])
    if dist.get_rank() == LOST_RANK:
        return {}
    hooks = {kind: make_comm_hook(kind, options=CompressionOptions(onebit_warmup_steps=0))
             for kind in GATHERING_KINDS}
    outcomes = {}
    for kind, (state, hook) in {**hooks, "hierarchical": hierarchical}.items():
        bucket = FakeBucket(0, [torch.zeros(43)], torch.randn(43))
        try:
            hook(state, bucket).wait()
            outcomes[kind] = "returned a gradient"
        except RuntimeError:
            outcomes[kind] = "raised"
    return outcomes


def test_every_hook_fails_the_step_when_a_peer_is_lost():
    outcomes = run_distributed(_hooks_with_a_lost_peer, 3, timeout_s=60)
    expected = dict.fromkeys((*GATHERING_KINDS, "hierarchical"), "raised")
    assert outcomes[:LOST_RANK] == [expected, expected]


PEER_STAYS_S = 60.0


class _Leftover:
    """An object in a reference cycle holding a group, as a failed step's leftovers do (a pipeline stage, its
    activations' autograd graph, FSDP's state): garbage, but freed only when the garbage collector runs."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.itself = group, self


def _peer_blocked_while_another_leaves_with_garbage_holding_the_group(done_flag: str) -> float | None:
    """Rank 0 all-reduces alone; rank 1 leaves the group with a leftover still holding it, then stays alive (as a
    worker joining the next generation does) until rank 0 is released. Returns how long rank 0 was blocked."""
    if dist.get_rank() == 0:
        started = time.monotonic()
        try:
            dist.all_reduce(torch.zeros(4))
        except RuntimeError:
            return time.monotonic() - started
        finally:
            Path(done_flag).touch()
        raise AssertionError("the all_reduce completed without its peer")
    gc.disable()  # the leftover must be collected by leave_group itself, not by an automatic collection
    _Leftover(dist.group.WORLD)
    time.sleep(1.0)
    leave_group()
    gc.enable()
    deadline = time.monotonic() + PEER_STAYS_S
    while not Path(done_flag).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return None


def test_leaving_releases_a_blocked_peer_even_when_garbage_still_holds_the_group(tmp_path):
    """A gloo group's connections close only when the last reference to it goes; a cycle keeps it until the garbage
    collector runs, and the peer waited out the collective timeout (a pp2 x dp2 run's survivor did, and was taken as
    hung)."""
    blocked_for_s, _ = run_distributed(_peer_blocked_while_another_leaves_with_garbage_holding_the_group, 2,
                                       str(tmp_path / "done"), timeout_s=GROUP_TIMEOUT_S)
    assert blocked_for_s < PEER_STAYS_S / 3


def _members_blocked_on_each_other_then_one_leaves(store_path: str) -> dict[str, float]:
    """As in a group of many that lost a member: each rank's collectives wait on the other, live, rank (rank 0 in an
    all-reduce rank 1 never joins; rank 1 in a broadcast and an all-reduce of its own), and rank 1 leaves the group
    as TrainWorker.join does. Returns how long its leaving took, and how long rank 0 stayed blocked."""
    rank = dist.get_rank()
    dist.destroy_process_group()  # the harness's group: this one is formed with its connections kept
    connections = GroupConnections()
    with connections.forming():
        dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    started = time.monotonic()
    if dist.get_rank() == 0:
        try:
            dist.all_reduce(torch.zeros(4))
        except RuntimeError:
            return {"blocked_s": time.monotonic() - started}
        raise AssertionError("the all_reduce completed without its peer")
    in_flight = [dist.broadcast(torch.zeros(8), src=1, async_op=True), dist.all_reduce(torch.zeros(3), async_op=True)]
    time.sleep(1.0)
    leaving = time.monotonic()
    leave_group(connections)
    del in_flight
    return {"leaving_s": time.monotonic() - leaving}


def test_leaving_releases_peers_and_itself_whatever_is_in_flight(tmp_path):
    """gloo's destroy waits for the group's collectives in flight; one waiting on a live peer that waits in turn (a
    cycle through the group) ended only at the group's timeout: a recovery at 16 workers waited it out. The
    connections are shut down first, so leaving ends them all at once, here and at the peer."""
    blocked, left = run_distributed(_members_blocked_on_each_other_then_one_leaves, 2, str(tmp_path / "store"),
                                    timeout_s=GROUP_TIMEOUT_S * 2)
    assert left["leaving_s"] < GROUP_TIMEOUT_S / 10 and blocked["blocked_s"] < GROUP_TIMEOUT_S / 10, (blocked, left)

