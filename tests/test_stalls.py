"""Workers stopped (SIGSTOP: a frozen VM, a stopped process) where no step runs: while the group forms, and
while a checkpoint is saved. Their peers and the Controller give up on them within the configured timeouts,
and the run goes on. The run-level tests use the default failure timeouts.

    python -m pytest tests/test_stalls.py -q     # about 2 minutes on 2 cores
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import psutil
import pytest
import ray

from raylastic.actors.status.run import RunStatus
from raylastic.actors.worker_group.group import JOIN_RENDEZVOUS
from raylastic.actors.worker_group.member_calls import COLLECTIVE_GRACE_S, CallBounds, MembersFailed, call_members
from raylastic.actors.worker_group.membership import Member
from raylastic.cluster.job import train
from tests.support.helpers import StoppedProcess, job
from tests.support.worker_actors import workers_of

pytestmark = pytest.mark.usefixtures("ray_local")

COLLECTIVE_TIMEOUT_S, STEP_TIMEOUT_S = 30, 10
DEFAULT_TIMEOUTS = (f"failure.collective_timeout_s={COLLECTIVE_TIMEOUT_S}", f"failure.step_timeout_s={STEP_TIMEOUT_S}")
"""The defaults (tests.support.helpers.job shortens the collective timeout)."""


def _stop_rank_while_forming(rank: int) -> tuple:
    """An on_progress callback that SIGSTOPs the worker of ``rank`` once the first generation is forming."""
    stopped: dict = {}

    def on_progress(progress: RunStatus) -> None:
        if not stopped and progress.state == "forming" and progress.generation == 0 and progress.members:
            actor = ray.get_actor(progress.members[rank])
            stopped.update(worker=progress.members[rank], at=time.monotonic(), wall=time.time(),
                           process=StoppedProcess(ray.get(actor.pid.remote())))

    return on_progress, stopped


def test_a_worker_stopped_while_the_group_forms_is_found_within_the_step_timeout(tmp_path):
    on_progress, stopped = _stop_rank_while_forming(1)
    config = job("strategy.name=zero2", "scaling.min_workers=1", "scaling.max_workers=2", "training.steps=30",
                 "workload.name=tests.support.fault_workloads:SlowBuildDigits", "workload.options={delay_s: 4}",
                 *DEFAULT_TIMEOUTS, name="joinstop")
    began = time.time()
    try:
        result = train(config, run_dir=tmp_path, on_progress=on_progress)
    finally:
        if stopped:
            stopped["process"].resume()
    failed = [e for e in result.events if e.type == "worker_failed"]
    stopped_s = stopped["wall"] - began if stopped else None  # on the events' clock, give or take a second
    assert stopped and [e.details["worker"] for e in failed] == [stopped["worker"]], (stopped_s, result.events)
    assert "no answer" in failed[0].details["reason"] and "join" in failed[0].details["reason"], failed
    assert failed[0].details["found_s"] - stopped_s < STEP_TIMEOUT_S + COLLECTIVE_TIMEOUT_S, (stopped_s, failed)
    # the other rank's join then ends within its bound: it may wait for the killed rank to connect to it
    join_bound_s = JOIN_RENDEZVOUS * COLLECTIVE_TIMEOUT_S + COLLECTIVE_GRACE_S
    assert failed[0].time_s - failed[0].details["found_s"] < join_bound_s, failed
    assert result.final_step == 30


def test_a_save_gives_up_on_a_stopped_peer_at_the_collective_timeout(tmp_path):
    workers = workers_of(tmp_path, 4, "strategy.name=zero2", collective_timeout_s=5.0)
    actors = workers.start(2)
    workers.join(0, actors)
    stopped = StoppedProcess(ray.get(actors[1].pid.remote()))
    try:
        started = time.monotonic()
        with pytest.raises(ray.exceptions.RayTaskError, match="could not write checkpoint|Timed out|timeout"):
            ray.get(actors[0].save_checkpoint.remote(), timeout=300)  # gloo's own default: 30 minutes
        assert time.monotonic() - started < 120
    finally:
        stopped.resume()
        for actor in actors:
            ray.kill(actor)


STOPPED_MEMBER_BOUNDS = CallBounds(collective_timeout_s=60.0, step_timeout_s=3.0, max_call_s=600.0)
"""A long collective timeout, which the tests below check is not waited out."""


@contextlib.contextmanager
def _second_member_stopped(actors: list) -> Iterator[tuple[list[Member], int]]:
    """The two actors as call_members' members, the second one's process SIGSTOPped (and its pid); at the end it is
    continued and killed."""
    stopped = StoppedProcess(ray.get(actors[1].pid.remote()))
    try:
        yield [Member(actor=actor, slot=None, name=f"worker{rank}") for rank, actor in enumerate(actors)], stopped.pid
    finally:
        stopped.resume()
        ray.kill(actors[1])


def test_a_stopped_member_is_killed_so_its_peer_stops_waiting_and_one_stopped_before_it_joins_ends_the_join(
        tmp_path):
    """A stopped member holds its peers in a collective until its process is gone: the call kills it the moment
    it is found hung, so the peer's wait ends then too. The peer then forms the next generation with a member
    stopped before it publishes its address: the peer waits in the rendezvous store for a key that never comes
    (killing the member does not end that wait); the call aborts the generation's rendezvous the moment it finds
    the member hung, so the peer's join raises then, not at the collective timeout."""
    workers = workers_of(tmp_path, 4, "strategy.name=zero2", collective_timeout_s=60.0)
    peer, member = workers.start(2)
    try:
        workers.join(0, [peer, member])
        with _second_member_stopped([peer, member]) as (members, pid):
            started = time.monotonic()
            with pytest.raises(MembersFailed) as failure:
                call_members(members, "save_checkpoint", None, bounds=STOPPED_MEMBER_BOUNDS)
            waited_s = time.monotonic() - started
            assert [lost.name for lost in failure.value.lost] == ["worker1"], failure.value.lost
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            assert waited_s < 30.0, waited_s  # the peer's collective would have waited out its 60 s
        with _second_member_stopped([peer, *workers.start(1)]) as (members, _):
            started = time.monotonic()
            with pytest.raises(MembersFailed) as failure:
                call_members(members, "join", [(workers.assignment(1, rank, 2),) for rank in range(2)],
                             bounds=STOPPED_MEMBER_BOUNDS, rendezvous=JOIN_RENDEZVOUS,
                             on_failure=workers.abort_rendezvous(1))
            waited_s = time.monotonic() - started
            assert [lost.name for lost in failure.value.lost] == ["worker1"], failure.value.lost
            assert waited_s < 30.0, waited_s  # the peer's wait for the key would have lasted its 60 s
    finally:
        ray.kill(peer)


def test_a_worker_stopped_amid_async_saves_is_replaced_and_its_peer_carries_on(tmp_path):
    config = job("scaling.min_workers=1", "scaling.max_workers=2", "training.steps=30", "checkpoint.every_steps=1",
                 "checkpoint.async_save=true", "faults=[{action: stall, rank: 1, step: 12}]", *DEFAULT_TIMEOUTS,
                 name="savestop")
    result = train(config, run_dir=tmp_path)
    failed = [e for e in result.events if e.type == "worker_failed"]
    assert len(failed) == 1 and "no answer" in failed[0].details["reason"], failed  # the survivor was not blamed
    assert result.final_step == 30
