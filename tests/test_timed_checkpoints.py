"""The time-based checkpoint (checkpoint.every_minutes): when the Controller asks for one (a pure decision and its
bookkeeping over polls, with a fake clock), and the ranks' vote that makes every rank save after the same step,
once per request, however late a request reaches some ranks (real gloo groups of 1 and 3 processes).
The run that needs it, a zero3 worker lost with its buddy: tests/test_sharded_recovery.py."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from raylastic.actors.controller.run_checkpoints import checkpoint_settings
from raylastic.actors.controller.timed_checkpoints import TimedCheckpoints, checkpoint_due
from raylastic.actors.status.group import GroupStatus, RankNews
from raylastic.actors.status.run import Event
from raylastic.actors.status.worker import WorkerStatus
from raylastic.actors.worker.stop_vote import CheckpointAsks, StopVote
from raylastic.jobconfig import load_job_config
from tests.support.distributed_harness import run_distributed


def test_a_checkpoint_is_due_once_the_period_passed_and_none_is_asked_for():
    assert not checkpoint_due(every_minutes=10, since_last_s=599.9, asked=False)
    assert checkpoint_due(every_minutes=10, since_last_s=600.0, asked=False)
    assert not checkpoint_due(every_minutes=10, since_last_s=6000.0, asked=True)  # one is on its way
    assert not checkpoint_due(every_minutes=0, since_last_s=1e9, asked=False)  # off
    assert checkpoint_due(every_minutes=0.01, since_last_s=0.6, asked=False)


def test_under_diloco_a_time_based_checkpoint_waits_for_an_outer_step():
    """Only after an outer step do diloco's ranks hold the same parameters; any step otherwise."""
    diloco = checkpoint_settings(load_job_config(None, ["strategy.name=diloco", "strategy.sync_every=10"]), "c")
    assert [step for step in range(1, 25) if diloco.may_save_at(step)] == [10, 20]
    assert all(checkpoint_settings(load_job_config(), "c").may_save_at(step) for step in range(1, 25))


class RecordingGroup:
    def __init__(self) -> None:
        self.asked: list[int] = []

    def request_checkpoint(self, number: int) -> None:
        self.asked.append(number)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def poll(generation: int = 0, *event_types: str) -> GroupStatus:
    events = [Event(kind, 5) for kind in event_types]
    return GroupStatus(generation=generation, members=(), news=(RankNews(0, WorkerStatus("training", 5, [], events)),))


def test_the_controller_asks_once_per_period_and_again_only_of_a_new_generation():
    group, clock = RecordingGroup(), Clock()
    timed = TimedCheckpoints(group, every_minutes=1.0, clock=clock)
    timed.observe(poll(), step=1)  # the clock starts at the first poll of training
    clock.now += 59.0
    timed.observe(poll(), step=2)
    assert group.asked == []
    clock.now += 1.0
    timed.observe(poll(), step=3)
    timed.observe(poll(), step=4)
    assert group.asked == [1]  # not asked again while it is on its way
    timed.observe(poll(1), step=4)  # the generation it went to may have ended before its vote
    assert group.asked == [1, 2]
    timed.observe(poll(1, "checkpointed"), step=5)  # saved: the clock starts again
    clock.now += 59.0
    timed.observe(poll(1), step=6)
    assert group.asked == [1, 2]
    clock.now += 1.0
    timed.observe(poll(1), step=7)
    assert group.asked == [1, 2, 3]


def test_a_failed_save_waits_a_period_and_any_checkpoint_restarts_the_clock():
    group, clock = RecordingGroup(), Clock()
    timed = TimedCheckpoints(group, every_minutes=1.0, clock=clock)
    timed.observe(poll(), step=1)
    clock.now += 50.0
    timed.observe(poll(0, "checkpointed"), step=2)  # one of checkpoint.every_steps counts too
    clock.now += 50.0
    timed.observe(poll(), step=3)
    assert group.asked == []
    clock.now += 10.0
    timed.observe(poll(), step=4)
    timed.observe(poll(0, "checkpoint_failed"), step=5)
    clock.now += 59.0
    timed.observe(poll(), step=6)
    assert group.asked == [1]  # a full disk is not tried again at every poll
    clock.now += 1.0
    timed.observe(poll(), step=7)
    assert group.asked == [1, 2]


def test_off_never_asks():
    group, clock = RecordingGroup(), Clock()
    timed = TimedCheckpoints(group, every_minutes=0.0, clock=clock)
    for step in range(3):
        timed.observe(poll(), step=step)
        clock.now += 1e6
    assert group.asked == []


def _saves_voted(asked_at: dict[int, int], steps: int = 120, served: int = 0) -> list[tuple[int, int]]:
    """Steps of ~1 ms with the stop vote; this rank is asked for checkpoint ``n`` before step ``asked_at[n]`` (each
    rank at its own steps). Returns (step, number) of every save the votes called for."""
    asks, vote, saves = CheckpointAsks(served=served), StopVote(first_step=0, device=torch.device("cpu")), []
    for step in range(steps):
        for number, at in asked_at.items():
            if step == at:
                asks.asked = max(asks.asked, number)
        voting = vote.due(step)
        if voting:
            vote.open(step, stop=False, asks=asks)
        time.sleep(0.001 * (1 + dist.get_rank()))
        dist.all_reduce(torch.ones(4))
        if voting:
            vote.close(step)
            if vote.checkpoint_due:
                saves.append((step, asks.served))
    return saves


def _asked_late_on_some_ranks() -> list[tuple[int, int]]:
    """Request 1 reaches rank r before step 10 + 15 r, request 2 every rank before step 70 (rank 2 never hears of
    it: a request is voted by any rank that holds it)."""
    rank = dist.get_rank()
    return _saves_voted({1: 10 + 15 * rank, **({2: 70} if rank < 2 else {})})


@pytest.mark.parametrize("world_size", [1, 3])
def test_every_rank_saves_after_the_same_step_once_per_request(world_size):
    per_rank = run_distributed(_asked_late_on_some_ranks, world_size)
    assert all(saves == per_rank[0] for saves in per_rank), per_rank  # the same steps on every rank
    steps, numbers = zip(*per_rank[0], strict=True)
    assert numbers == (1, 2), per_rank[0]  # each request once, the late ranks' votes for 1 not saved again
    assert 10 <= steps[0] < 70 <= steps[1], per_rank[0]


def _joiner_has_served_nothing() -> list[tuple[int, int]]:
    """Ranks 0 and 1 served request 3 in an earlier generation and still hold it; rank 2 joined fresh."""
    held = {3: 0} if dist.get_rank() < 2 else {}
    return _saves_voted(held, steps=40, served=3 if dist.get_rank() < 2 else 0)


def test_a_joiner_does_not_save_again_what_the_others_saved():
    assert run_distributed(_joiner_has_served_nothing, 3) == [[], [], []]
