"""The fault paths real jobs hit, on a real local Ray (gloo): who is to blame, what is counted, what ends a run.

A lost or hung worker is replaced and the run carries on; an error of the job itself ends the run at
once with its traceback; every wait on a worker is bounded; a replicated run that loses every worker
goes on from its newest checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray

from raylastic.actors.rendezvous.keys import RendezvousKeys, beside_this_process
from raylastic.actors.status.run import Event, RunFailed, RunStatus
from raylastic.actors.status.worker import WorkerStatus
from raylastic.actors.worker.actor import TrainWorkerActor, WorkerSpec
from raylastic.actors.worker.mailbox import StatusMailbox
from raylastic.actors.worker.training_loop import LOOP_EXIT_GRACE_S
from raylastic.actors.worker_group.membership import Member
from raylastic.actors.worker_group.poller import GenerationPoller
from raylastic.cluster.job import train
from raylastic.jobconfig.naming import controller_name
from raylastic.strategies.checkpoint import Checkpointer
from raylastic.strategies.checkpoint_catalogue import latest_checkpoint
from raylastic.strategies.group_assignment import GroupAssignment, new_store_prefix
from raylastic.workloads.digits import Digits
from tests.support.distributed_harness import run_distributed
from tests.support.fault_workloads import marker_path
from tests.support.helpers import assert_states_close, job, load_model
from tests.support.strategy_runs import train_job_alone

pytestmark = pytest.mark.usefixtures("ray_local")

STEPS = 30
BASE = (f"training.steps={STEPS}", "scaling.min_workers=2", "scaling.max_workers=2", "failure.step_timeout_s=4")
LONG_TIMEOUT_S = 90
"""A failure timeout set long where a test checks that it was not waited out (asserting well under it)."""


def events_of(result_or_run_dir, kind: str) -> list[Event]:
    events = ([Event.from_dict(e) for e in json.loads((result_or_run_dir / "result.json").read_text())["events"]]
              if not hasattr(result_or_run_dir, "events") else result_or_run_dir.events)
    return [e for e in events if e.type == kind]


@pytest.fixture(scope="module")
def undisturbed():
    """The parameters of the undisturbed job, trained on one rank (world-size independence makes them a run's)."""
    return run_distributed(train_job_alone, 1, job(*BASE, name="undisturbed"))[0]


def test_a_bug_in_the_workload_fails_the_run_at_once_with_its_traceback(tmp_path):
    run_dir = tmp_path / "bug"
    config = job(*BASE, "workload.name=tests.support.fault_workloads:BuggyDigits",
                 "workload.options={step: 8, rank: 1}",
                 f"failure.collective_timeout_s={LONG_TIMEOUT_S}", f"failure.step_timeout_s={LONG_TIMEOUT_S}",
                 name="bug")
    with pytest.raises(RunFailed) as raised:
        train(config, run_dir=run_dir)
    message = str(raised.value)
    assert "shapes do not match in the user's loss" in message and "Traceback" in message
    assert "fault_workloads.py" in message  # the user's own frame, not only the first line
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "failed" and result["final_step"] == 7
    failed = events_of(run_dir, "worker_failed")
    assert len(failed) == 1 and "shapes do not match" in failed[0].details["traceback"]
    assert failed[0].time_s - result["history"][-1]["time_s"] < LONG_TIMEOUT_S / 3  # no timeout waited out
    assert not events_of(run_dir, "generation_formed")[1:]  # never re-formed: nothing was retried


def test_a_collective_that_fails_on_every_rank_fails_the_run_at_once_not_as_a_lost_worker(tmp_path):
    run_dir = tmp_path / "mismatch"
    config = job(*BASE, "workload.name=tests.support.fault_workloads:MismatchedCollectiveDigits",
                 "workload.options={step: 5}", "failure.collective_timeout_s=3", "failure.max_failures=3",
                 name="mismatch")
    with pytest.raises(RunFailed) as raised:
        train(config, run_dir=run_dir)
    message = str(raised.value)
    assert "every rank" in message and "Timed out" in message and "fault_workloads.py" in message
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "failed" and result["final_step"] == 4
    assert not events_of(run_dir, "generation_formed")[1:]  # never re-formed: nothing was retried
    assert not events_of(run_dir, "recovered")


def test_replicated_run_losing_every_worker_goes_on_from_its_checkpoint(tmp_path, undisturbed):
    run_dir = tmp_path / "all"
    faults = "faults=[{action: kill, rank: 0, step: 17}, {action: kill, rank: 1, step: 17}]"
    slow = ("workload.name=tests.support.user_workload:SlowDigits", "workload.options={pause_s: 0.2}")
    result = train(job(*BASE, faults, *slow, "checkpoint.every_steps=5", "checkpoint.num_to_keep=2", name="all"),
                   run_dir=run_dir)
    formed = events_of(result, "generation_formed")
    assert [e.details["state_source"] for e in formed[1:]] == ["checkpoint"]
    # Step 15's checkpoint, unless the Controller had heard of no step past 14 when both died (step results
    # come with polls, at least every second): it restores no step it never heard was committed.
    assert formed[1].step in (10, 15), formed
    assert_states_close(load_model(run_dir), undisturbed)
    assert latest_checkpoint(run_dir / "checkpoints").manifest.step == STEPS  # its new checkpoints are kept


def test_a_hung_worker_is_blamed_not_the_peers_that_timed_out_waiting_for_it(tmp_path, undisturbed):
    run_dir = tmp_path / "hang"
    config = job(*BASE, "workload.name=tests.support.fault_workloads:HangingDigits",
                 f"workload.options={{step: 10, rank: 1, marker: {marker_path(tmp_path, 'hang')}}}",
                 "failure.collective_timeout_s=30", "failure.step_timeout_s=10", name="hang")  # the defaults
    result = train(config, run_dir=run_dir)
    failed = events_of(result, "worker_failed")
    assert len(failed) == 1 and failed[0].details["reason"].startswith("hung")
    assert failed[0].details["worker"] == "raylastic:hang:worker2"  # rank 1: the one stuck in its step
    assert_states_close(load_model(run_dir), undisturbed)


def test_a_step_that_never_ends_is_caught_by_the_watchdog(tmp_path):
    run_dir = tmp_path / "alone"
    config = job(f"training.steps={STEPS}", "scaling.min_workers=1", "scaling.max_workers=1",
                 "workload.name=tests.support.fault_workloads:HangingDigits",
                 f"workload.options={{step: 10, rank: 0, marker: {marker_path(tmp_path, 'alone')}}}",
                 "failure.max_step_s=3", "checkpoint.every_steps=5", name="alone")
    result = train(config, run_dir=run_dir)
    failed = events_of(result, "worker_failed")
    assert len(failed) == 1 and "failure.max_step_s=3" in failed[0].details["reason"]
    assert result.final_step == STEPS


def test_the_first_generation_waits_for_a_slow_worker_to_start(tmp_path, undisturbed):
    config = job(*BASE, "workload.name=tests.support.fault_workloads:SlowStartDigits",
                 f"workload.options={{delay_s: 6, marker: {marker_path(tmp_path, 'slow')}}}",
                 "failure.collective_timeout_s=2", name="slow")
    result = train(config, run_dir=tmp_path / "slow")
    assert not events_of(result, "worker_failed")
    assert_states_close(load_model(tmp_path / "slow"), undisturbed)


def test_a_stop_asked_while_the_group_forms_is_not_lost(tmp_path):
    run_dir = tmp_path / "stop"
    config = job("training.steps=2000", "scaling.min_workers=1", "scaling.max_workers=1", "strategy.name=zero2",
                 "workload.name=tests.support.fault_workloads:SlowBuildDigits", "workload.options={delay_s: 3}",
                 name="stop")
    asked = threading.Event()

    def stop_at_once(progress: RunStatus) -> None:
        if not asked.is_set():
            asked.set()
            ray.get_actor(controller_name("stop")).stop.remote()

    with pytest.raises(RunFailed, match="stopped by the user"):  # lost, it would train all 2000 steps
        train(config, run_dir=run_dir, on_progress=stop_at_once)
    assert json.loads((run_dir / "result.json").read_text())["final_step"] == 0  # stopped before its first step


@dataclass
class BareWorkers:
    """TrainWorker actors driven directly, as the Controller drives them, around one rendezvous store."""

    actors: list
    store: object
    prefix: str

    def assignment(self, generation: int, rank: int, world_size: int, timeout_s: float = 10) -> GroupAssignment:
        return GroupAssignment(generation=generation, rank=rank, world_size=world_size, store=self.store,
                               store_prefix=self.prefix, timeout_s=timeout_s)

    def join_all(self, generation: int = 0) -> None:
        ray.get([a.join.remote(self.assignment(generation, rank, len(self.actors)))
                 for rank, a in enumerate(self.actors)])


def bare_workers(tmp_path, count: int, *overrides: str) -> BareWorkers:
    config = job("training.steps=3", *overrides, name="bare")
    spec = WorkerSpec(workload=config.workload, training=config.training, optim=config.optim,
                      strategy=config.strategy, data=config.data, eval=config.eval, use_gpu=False, torch_threads=1,
                      checkpointer=Checkpointer(root=str(tmp_path / "ckpt"), every_steps=0, num_to_keep=1,
                                                config_hash="h", global_batch_size=config.training.global_batch_size))
    actors = [TrainWorkerActor.options(num_cpus=0.5, max_concurrency=2).remote(spec) for _ in range(count)]
    return BareWorkers(actors, RendezvousKeys.options(**beside_this_process()).remote(), new_store_prefix())


def test_a_receiver_whose_source_is_lost_mid_hand_over_rebuilds_its_state_and_a_join_gives_up_on_a_hung_thread(
        tmp_path):
    """The receiver, alone in generation 1, hangs in its second step there (its 5th: HangingDigits counts the
    process's steps; the source, rank 0 before, took 3); its join of generation 2 gives up on the training thread."""
    workers = bare_workers(tmp_path, 2, "workload.name=tests.support.fault_workloads:HangingDigits",
                           f"workload.options={{step: 5, rank: 0, marker: {marker_path(tmp_path, 'join')}}}")
    source, receiver = workers.actors
    workers.join_all()
    ray.get([source.train.remote(3), receiver.train.remote(3)])
    while ray.get(receiver.poll.remote(1.0)).phase != "finished":
        pass
    ray.kill(source)  # gone before it sent anything: the receiver's hand-over fails part way
    with pytest.raises(ray.exceptions.RayTaskError):
        ray.get(receiver.sync_state.remote(0), timeout=60)
    report = ray.get(receiver.join.remote(workers.assignment(1, 0, 1)), timeout=60)
    assert report.step == 0  # not 3: the half-received state is never offered as a source
    ray.get(receiver.train.remote(3))
    # It gives up after the assignment's collective timeout and the grace, not forever (ray.get's bound).
    gave_up_after = rf"TrainingThreadHung: the training thread is still running {1 + LOOP_EXIT_GRACE_S:.0f}s after"
    with pytest.raises(ray.exceptions.RayTaskError, match=gave_up_after):
        ray.get(receiver.join.remote(workers.assignment(2, 0, 1, timeout_s=1)), timeout=120)
    ray.kill(receiver)


def test_the_full_model_is_gathered_on_every_rank_and_returned_by_one(tmp_path):
    workers = bare_workers(tmp_path, 2, "strategy.name=zero3")
    workers.join_all()
    first, second = ray.get([workers.actors[0].full_state_dict.remote(True),
                             workers.actors[1].full_state_dict.remote(False)])
    assert second is None  # what the Controller receives: one copy, not one per rank
    assert first["0.weight"].shape == Digits().build_model().state_dict()["0.weight"].shape  # gathered whole
    for actor in workers.actors:
        ray.kill(actor)


def test_a_failed_final_evaluation_leaves_a_loadable_checkpoint_of_the_last_step(tmp_path):
    config = job(*BASE, "strategy.name=zero2", "workload.name=tests.support.fault_workloads:FailingEvaluationDigits",
                 name="evalfails")
    with pytest.raises(RunFailed, match="the evaluation set is empty"):
        train(config, run_dir=tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "failed" and "the evaluation set is empty" in result["error"]
    checkpoint = latest_checkpoint(str(tmp_path / "checkpoints"))  # one whose manifest and files verify
    assert checkpoint is not None and checkpoint.manifest.step == STEPS and checkpoint.path in result["error"]
    assert load_model(tmp_path).keys() == Digits().build_model().state_dict().keys()  # model.pt, gathered first


def test_a_replacement_that_cannot_be_built_fails_the_run_naming_its_error_after_its_retries(tmp_path):
    marker = marker_path(tmp_path, "healthy")
    config = job(*BASE, "workload.name=tests.support.fault_workloads:MissingDataOnNewNodes",
                 f"workload.options={{marker: {marker}}}", "faults=[{action: kill, rank: 1, step: 5}]",
                 "failure.max_start_failures=2", name="nodata")
    with pytest.raises(RunFailed, match="data_dir /data/digits does not exist") as raised:
        train(config, run_dir=tmp_path / "run")
    assert "2 new workers in a row could not start (failure.max_start_failures=2)" in str(raised.value)
    started = events_of(tmp_path / "run", "worker_start_failed")
    assert len(started) == 2 and all("data_dir /data/digits" in e.details["error"] and e.details["node_id"]
                                     for e in started)


def test_a_resume_passes_over_a_checkpoint_whose_loaders_find_a_file_altered(tmp_path):
    base = (*BASE, "strategy.name=zero2", "checkpoint.every_steps=10")
    train(job(*base, name="altered"), run_dir=tmp_path)
    newest = latest_checkpoint(str(tmp_path / "checkpoints"))
    shard = sorted(Path(newest.path).glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size: only a checksum tells
    shard.write_bytes(bytes(data))
    result = train(job(*base, f"training.steps={STEPS + 10}", name="altered"), run_dir=tmp_path)
    [rejected] = events_of(result, "checkpoint_rejected")
    assert rejected.details["path"] == newest.path and "does not match its checksum" in rejected.details["reason"]
    formed = events_of(result, "generation_formed")[0]
    assert (formed.details["state_source"], formed.step) == ("checkpoint", STEPS - 10)
    assert result.final_step == STEPS + 10


@ray.remote(num_cpus=0, max_concurrency=2)
class _WorkerMailbox:
    """A worker's status mailbox alone in an actor, training: what the Controller's polls reach, without torch."""

    def __init__(self) -> None:
        self.status = StatusMailbox()
        self.status.set_phase("training")

    def pid(self) -> int:
        return os.getpid()

    def poll(self, wait_s: float, seen: int) -> WorkerStatus:
        return self.status.poll(wait_s, seen)

    def answer_now(self) -> None:
        self.status.answer_now()


def test_a_generation_ended_by_a_death_does_not_wait_out_the_survivors_long_polls():
    """Survivors blocked in a collective with a lost peer have no news, and their long polls are in flight: the
    generation's end asks them to answer at once instead of waiting the polls out (60 s here)."""
    members = [Member(actor=_WorkerMailbox.remote(), slot=None, name=f"worker{rank}") for rank in range(3)]
    try:
        poller = GenerationPoller(members, wait_s=60.0)
        poller.poll(timeout_s=10.0)  # every first poll answers at once; the next ones wait for news
        os.kill(ray.get(members[1].actor.pid.remote()), signal.SIGKILL)
        deadline = time.monotonic() + 30.0
        while not poller.statuses()[1].dead and time.monotonic() < deadline:
            poller.poll(timeout_s=1.0)
        assert poller.statuses()[1].dead and not poller.statuses()[0].dead
        started = time.monotonic()
        poller.finish()
        assert time.monotonic() - started < 10.0
    finally:
        for member in members:
            ray.kill(member.actor)
