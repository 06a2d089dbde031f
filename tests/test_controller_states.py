"""The Controller's state machine, driven with a fake WorkerGroup (tests/support/fake_group.py): every transition
and every decision it acts on - each test in milliseconds, no Ray. A failure in every state, double
failures and stop requests: tests/test_controller_failures.py.

    python -m pytest tests/test_controller_states.py -q
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from raylastic.actors.controller.states import (
    Failed,
    Finishing,
    Forming,
    Recovering,
    Resizing,
    Running,
    WaitingForWorkers,
)
from raylastic.actors.status.group import LostWorker
from raylastic.jobconfig import FaultConfig
from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.strategies.peer_restore import ShardCopy
from tests.support.fake_group import (
    STEPS,
    advance,
    controller,
    events,
    states_until_end,
    with_member,
    write_checkpoint,
)

pytestmark = pytest.mark.timeout(10)


# -- the transitions --------------------------------------------------------------------------------------------


def test_a_run_places_forms_trains_and_finishes(tmp_path):
    run, group = controller(tmp_path)
    assert run.progress().state == "placing"
    assert states_until_end(run) == ["forming", "running", "finishing", "finished"]
    result = run.state.result
    assert result.final_step == STEPS and [row["step"] for row in result.history] == list(range(1, STEPS + 1))
    assert run.progress().state == "finished" and run.failures == 0
    assert group.calls[:3] == ["place", "join", "sync_state"]  # replicated: rank 0's state is handed to all


def test_run_returns_the_result_and_shuts_the_group_down(tmp_path):
    run, group = controller(tmp_path)
    assert run.run().final_step == STEPS and group.shut_down


def test_too_few_workers_placed_fails_naming_the_field(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=2", placeable=1)
    assert advance(run) == Failed(run.state.reason)
    assert "only 1 of scaling.min_workers=2 workers could be placed" in run.state.reason
    assert [e["worker"] for e in events(run, "worker_failed")] == ["w1"]


def test_resume_restores_the_newest_checkpoint(tmp_path):
    run, group = controller(tmp_path, "checkpoint.resume=auto")
    write_checkpoint(tmp_path / "step_00000003", 3, 2, run.job.math_hash())
    forming = advance(run)
    assert isinstance(forming, Forming) and forming.restore.manifest.step == 3
    assert isinstance(advance(run), Running) and run.step == 3 and "restore" in group.calls
    assert events(run, "generation_formed")[0]["state_source"] == "checkpoint"
    assert events(run, "resumed")[0]["step"] == 3


def test_resume_refuses_another_jobs_checkpoint(tmp_path):
    run, group = controller(tmp_path, "checkpoint.resume=auto")
    write_checkpoint(tmp_path / "step_00000003", 3, 2, "another job")
    assert isinstance(advance(run), Failed) and "written by a job with another workload" in run.state.reason


def test_a_recovery_refuses_another_jobs_checkpoint(tmp_path):
    run, group = controller(tmp_path, "strategy.name=zero2", "scaling.min_workers=1")
    write_checkpoint(tmp_path / "step_00000005", 5, 2, run.job.math_hash())
    write_checkpoint(tmp_path / "step_00000010", 10, 2, "another job")  # appeared while the run trained
    run.state, run.step = Recovering((LostWorker("w1", "actor died", 1),), recovering_since=time.time()), 12
    assert isinstance(advance(run), Forming)  # the lost shard has no copy: the newest checkpoint is looked at
    assert isinstance(advance(run), Failed) and "written by a job with another workload" in run.state.reason
    assert "restore" not in group.calls


def test_sharded_state_kept_by_the_survivors_is_restored_from_memory_not_disk(tmp_path):
    run, group = controller(tmp_path, "strategy.name=zero3", "strategy.replicas=2", "scaling.min_workers=1",
                            workers=4)
    write_checkpoint(tmp_path / "step_00000005", 5, 4, run.job.math_hash())  # older than what the peers hold
    run.state, run.step = Recovering((LostWorker("w1", "actor died", 1),), recovering_since=time.time()), 9
    group.shard_copies = [(ShardCopy(generation=0, world_size=4, replicas=2, rank=rank, step=9),) for rank in (0, 2, 3)]
    advance(run)
    assert isinstance(advance(run), Running) and run.step == 9
    formed = events(run, "generation_formed")[0]
    assert (formed["state_source"], formed["steps_lost"]) == ("peers", 0)
    assert "restore_from_peers" in group.calls and "restore" not in group.calls


def test_a_sharded_run_that_lost_both_copies_of_a_shard_goes_to_its_checkpoint(tmp_path):
    run, group = controller(tmp_path, "strategy.name=zero3", "strategy.replicas=2", "scaling.min_workers=1",
                            workers=3)
    write_checkpoint(tmp_path / "step_00000005", 5, 4, run.job.math_hash())
    run.state, run.step = Recovering((LostWorker("w1", "actor died", 1),), recovering_since=time.time()), 9
    # old ranks 1 and 3 held shard 1: both gone
    group.shard_copies = [(ShardCopy(generation=0, world_size=4, replicas=2, rank=rank, step=9),) for rank in (0, 2)]
    advance(run)
    advance(run)
    formed = events(run, "generation_formed")[0]
    assert (formed["state_source"], formed["steps_lost"], run.step) == ("checkpoint", 4, 5)


def test_a_sharded_scale_up_moves_the_state_over_in_memory_without_a_save(tmp_path):
    run, group = controller(tmp_path, "strategy.name=zero2", "scaling.max_workers=3", free_slots=1)
    run.state = Forming()
    advance(run)
    group.on_poll(lambda status: dataclasses.replace(status, num_placeable=1))
    assert isinstance(advance(run), Resizing)
    step = run.step
    group.shard_copies = [(ShardCopy(generation=0, world_size=2, replicas=1, rank=r, step=step),)
                          for r in (0, 1)] + [()]
    advance(run)
    advance(run)
    assert "save_checkpoint" not in group.calls and events(run, "generation_formed")[-1]["state_source"] == "peers"
    assert run.step == step and group.size == 3


def test_replicated_state_comes_from_the_most_advanced_member(tmp_path):
    run, group = controller(tmp_path)
    run.state, run.step, group.steps = Forming(), 5, {"w0": 4, "w1": 5}
    advance(run)
    formed = events(run, "generation_formed")[0]
    assert formed["state_source"] == 1 and run.step == 5 and set(group.steps.values()) == {5}


def test_replicated_run_that_lost_every_holder_of_its_state_restores_the_newer_checkpoint(tmp_path):
    run, group = controller(tmp_path)
    write_checkpoint(tmp_path / "step_00000005", 5, 2, run.job.math_hash())
    run.state, run.step, group.steps = Forming(), 7, {"w0": 0, "w1": 0}  # fresh replacements only
    advance(run)
    formed = events(run, "generation_formed")[0]
    assert formed["state_source"] == "checkpoint" and run.step == 5 and formed["steps_lost"] == 2


def test_sharded_generation_without_a_checkpoint_starts_from_the_seed(tmp_path):
    run, group = controller(tmp_path, "strategy.name=zero2")
    run.state = Forming()
    advance(run)
    assert events(run, "generation_formed")[0]["state_source"] == "initialisation" and run.step == 0
    assert "sync_state" not in group.calls and "restore" not in group.calls


def test_a_ready_joiner_stops_the_group_at_a_boundary_and_comes_in(tmp_path):
    run, group = controller(tmp_path, "scaling.max_workers=3", free_slots=1)
    run.state = Forming()
    advance(run)
    group.on_poll(lambda status: dataclasses.replace(status, num_placeable=1))  # a slot became ready
    assert isinstance(advance(run), Resizing)
    assert isinstance(advance(run), Forming) and group.size == 3
    assert [e["worker"] for e in events(run, "worker_joined")] == ["w2"]
    assert states_until_end(run)[-1] == "finished" and run.state.result.final_step == STEPS


def test_a_drained_worker_leaves_at_a_boundary(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=1")
    run.state = Forming()
    advance(run)
    assert run.drain(rank=1) == ["w1"]
    assert isinstance(advance(run), Resizing)
    assert isinstance(advance(run), Forming) and group.member_names == ["w0"]
    assert events(run, "worker_left")[0]["reason"] == "drained" and run.failures == 0


def test_a_drain_asked_while_the_drained_leave_is_taken_at_the_next_boundary(tmp_path):
    """``Controller.drain`` answers from another thread (a threaded actor) while the run's thread removes the drained
    members at a boundary: a drain asked after who leaves was read, before the drains are cleared, is not lost."""
    run, group = controller(tmp_path, "scaling.min_workers=1", workers=3)
    run.state = Forming()
    advance(run)
    asked: list[list[str]] = []

    class AskedWhileRead(set):
        def __contains__(self, name: object) -> bool:
            if name == group.members[-1] and not askers:  # who leaves is read: the user drains w0 now
                askers.append(threading.Thread(target=lambda: asked.append(run.drain(rank=0))))
                askers[0].start()
                askers[0].join(timeout=2)  # where the ask has to wait its turn, the boundary goes on without it
            return super().__contains__(name)

    askers: list[threading.Thread] = []
    assert run.drain(rank=1) == ["w1"]
    group.draining = AskedWhileRead(group.draining)
    assert isinstance(advance(run), Resizing)
    assert isinstance(advance(run), Forming)
    askers[0].join(timeout=30)
    assert asked == [["w0"]] and [e["worker"] for e in events(run, "worker_left")] == ["w1"]
    assert group.member_names == ["w0", "w2"] and group.draining == {"w0"}  # leaves at the next boundary
    advance(run)
    assert isinstance(advance(run), Resizing) and isinstance(advance(run), Forming)
    assert group.member_names == ["w2"] and [e["worker"] for e in events(run, "worker_left")] == ["w1", "w0"]


def test_progress_reads_the_layout_once_while_the_next_generation_forms(tmp_path):
    """``progress`` answers from another thread while the run's thread forms a generation and sets its layout."""

    class FormedBetweenReads:
        """A tp2 generation's layout at the first read, the next (data-parallel) generation's at every later one."""

        def __init__(self) -> None:
            self.reads = 0

        def __get__(self, group: object, owner: type) -> ParallelLayout | None:
            self.reads += 1
            return ParallelLayout(tp=2) if self.reads == 1 else None

        def __set__(self, group: object, value: object) -> None:
            pass

    run, group = controller(tmp_path)
    group.__class__ = type("FormingMeanwhile", (type(group),), {"layout": FormedBetweenReads()})
    assert run.progress().layout == "tp2"


def test_workers_on_a_draining_node_leave_at_a_boundary_and_are_replaced(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=1", workers=3)
    group.nodes = {"w0": "head", "w1": "spot", "w2": "spot"}
    run.state = Forming()
    advance(run)
    group.draining_nodes = {"spot": time.time() + 600}  # a preemption notice, 600 s ahead
    assert isinstance(advance(run), Resizing)
    draining = events(run, "node_draining")[0]
    assert draining["workers"] == ["w1", "w2"] and 300 < draining["deadline_s"] <= 600  # the seconds left
    assert isinstance(advance(run), Forming) and group.member_names == ["w0"]
    assert "drain spot and replace" in group.calls  # Ray places the replacements on other nodes
    assert events(run, "drained") == [dict(events(run, "drained")[0], node_id="spot", workers=["w1", "w2"],
                                           steps_lost=0)]
    assert run.failures == 0 and not events(run, "worker_failed")
    assert states_until_end(run)[-1] == "finished"
    assert len(events(run, "node_draining")) == 1  # the node still drains: acted on once


def test_a_drain_called_off_before_the_boundary_keeps_the_workers(tmp_path):
    run, group = controller(tmp_path, workers=2)
    group.nodes = {"w0": "head", "w1": "spot"}
    run.state = Forming()
    advance(run)
    group.draining_nodes = {"spot": None}

    def call_off(status):
        group.draining_nodes = {}  # the next poll finds the drain cancelled
        return status

    group.on_poll(call_off)
    assert isinstance(advance(run), Resizing)  # the boundary was asked for before the drain was called off
    assert events(run, "node_draining")[0]["deadline_s"] is None and events(run, "node_drain_cancelled")
    assert isinstance(advance(run), Forming) and group.member_names == ["w0", "w1"]
    assert not events(run, "drained") and not events(run, "worker_left")


def test_a_drain_below_min_workers_waits_for_replacements(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=2", workers=2, free_slots=1)
    group.nodes = {"w0": "head", "w1": "spot"}
    run.state = Forming()
    advance(run)
    group.draining_nodes = {"spot": time.time() + 30}
    advance(run)
    waiting = advance(run)
    assert isinstance(waiting, WaitingForWorkers) and waiting.recovering_since is None and run.failures == 0
    assert isinstance(advance(run), Forming) and group.member_names == ["w0", "w2"]


def test_sharded_resize_saves_first_and_the_new_generation_loads_it(tmp_path):
    run, group = controller(tmp_path, "strategy.name=zero1", "scaling.min_workers=1")
    run.state = Forming()
    advance(run)
    run.drain(rank=1)
    advance(run)  # running -> resizing
    forming = advance(run)
    assert forming.restore is not None and forming.restore.manifest.step == run.step > 0
    advance(run)
    assert events(run, "generation_formed")[-1]["state_source"] == "checkpoint"
    assert group.calls.count("save_checkpoint") == 1 and "restore" in group.calls


def test_a_dead_member_leads_to_recovery_and_the_run_goes_on_without_it(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=1")
    run.state = Forming()
    advance(run)
    group.on_poll(lambda status: with_member(status, "w1", dead="actor died: SIGKILL"))
    recovering = advance(run)
    assert isinstance(recovering, Recovering) and [w.name for w in recovering.lost] == ["w1"]
    assert isinstance(advance(run), Forming) and run.failures == 1 and "drop w1" in group.calls
    assert states_until_end(run)[-1] == "finished"
    recovered = events(run, "recovered")
    assert len(recovered) == 1 and recovered[0]["world_size"] == 1


def test_a_lost_node_drops_every_worker_whose_death_is_heard_by_the_end(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=1", workers=3)
    run.state = Forming()
    advance(run)
    group.on_poll(lambda status: with_member(status, "w1", dead="actor died"))
    original_end = group.end_generation
    group.end_generation = lambda: with_member(original_end(), "w2", dead="actor died")
    recovering = advance(run)
    assert sorted(w.name for w in recovering.lost) == ["w1", "w2"]
    advance(run)
    assert group.member_names == ["w0"] and run.failures == 1  # one incident, however many workers it took


@pytest.mark.parametrize(("change", "reason"), [
    ({"silent_s": 11.0}, "no answer for 11.0s (failure.step_timeout_s=10.0)"),
    ({"step_running_s": 601.0}, "hung: its step has run 601s (failure.max_step_s=600.0)"),
])
def test_silent_or_hung_members_are_lost(tmp_path, change, reason):
    run, group = controller(tmp_path)
    run.state = Running()
    group.on_poll(lambda status: with_member(status, "w0", **change))
    recovering = advance(run)
    assert recovering.lost == (LostWorker("w0", reason, 0),)


def test_a_failure_takes_a_warm_spare_at_once_and_a_new_spare_starts_behind_it(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=2", "scaling.spare_workers=1", idle_spares=1)
    run.state = Forming()
    advance(run)
    group.on_poll(lambda status: with_member(status, "w1", dead="actor died"))
    advance(run)
    assert isinstance(advance(run), Forming) and group.member_names == ["w0", "spare0"]  # no waiting
    assert events(run, "spares_taken")[0] | {"workers": 1, "reason": "failure"} == events(run, "spares_taken")[0]
    group.free_slots = 1  # the failed worker's slot is placed again
    advance(run)
    advance(run)  # the generation trains; its first poll starts a spare on the free slot
    assert group.idle == ["w2"] and group.member_names == ["w0", "spare0"]  # the new spare waits, idle
    assert states_until_end(run)[-1] == "finished"


def test_a_scale_up_takes_a_ready_spare_at_the_next_boundary(tmp_path):
    run, group = controller(tmp_path, "scaling.max_workers=3", "scaling.spare_workers=1", idle_spares=1)
    run.state = Forming()
    advance(run)
    group.free_slots = 1  # resources for a third worker appear: the spare takes them at once
    assert isinstance(advance(run), Resizing)
    assert isinstance(advance(run), Forming) and group.member_names == ["w0", "w1", "spare0"]
    assert events(run, "spares_taken")[0]["reason"] == "scale-up"
    assert group.idle == ["w2"]  # and a new spare starts on the new slot


def test_below_max_an_idle_spare_waits_for_new_resources(tmp_path):
    run, group = controller(tmp_path, "scaling.max_workers=3", "scaling.spare_workers=1", idle_spares=1)
    run.state = Forming()
    advance(run)
    assert isinstance(advance(run), Finishing) and group.member_names == ["w0", "w1"] and group.idle == ["spare0"]


def test_below_min_workers_the_run_waits_then_forms_with_a_replacement(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=2", free_slots=1)
    run.state = Running()
    group.on_poll(lambda status: with_member(status, "w1", dead="actor died"))
    advance(run)
    waiting = advance(run)
    assert isinstance(waiting, WaitingForWorkers) and waiting.needed == 1
    assert events(run, "waiting_for_resources")[0]["needed"] == 1
    assert isinstance(advance(run), Forming) and group.member_names == ["w0", "w2"]


def test_waiting_goes_on_until_its_deadline_then_fails(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=2")
    group.members = ["w0"]
    run.state = WaitingForWorkers(needed=1, deadline=time.monotonic() + 60, recovering_since=time.time())
    assert advance(run) is run.state and isinstance(run.state, WaitingForWorkers)  # no spare yet: still waiting
    run.state = dataclasses.replace(run.state, deadline=time.monotonic())
    assert isinstance(advance(run), Failed)
    assert "only 1 of scaling.min_workers=2 workers are available after the failure" in run.state.reason


def test_one_failure_too_many_fails_the_run(tmp_path):
    run, group = controller(tmp_path, "failure.max_failures=0", "scaling.min_workers=1")
    run.state = Recovering((LostWorker("w1", "actor died", 1),), recovering_since=time.time())
    assert isinstance(advance(run), Failed)
    assert "1 failures, more than failure.max_failures=0; last failure: w1 (actor died)" in run.state.reason


def test_a_job_error_fails_the_run_at_once_with_its_traceback(tmp_path):
    run, group = controller(tmp_path)
    run.state = Forming()
    advance(run)
    group.on_poll(lambda status: with_member(status, "w0", phase="failed", error="Traceback: ZeroDivisionError",
                                             error_cause="job"))
    assert isinstance(advance(run), Failed)
    assert "w0 raised an error at step" in run.state.reason and "ZeroDivisionError" in run.state.reason
    assert events(run, "worker_failed")[0]["traceback"] == "Traceback: ZeroDivisionError" and run.failures == 0


def test_injected_faults_of_failed_ranks_are_disarmed(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=1")
    run.job = dataclasses.replace(run.job, faults=(FaultConfig(action="kill", rank=1, step=3),))
    run.faults = type(run.faults)(run.job.faults)
    run.step = 2
    run.state = Recovering((LostWorker("w1", "actor died", 1),), recovering_since=time.time())
    advance(run)
    assert run.faults.for_rank(1) == ()


def test_a_defect_of_the_controller_is_a_failed_run_with_its_traceback(tmp_path):
    run, group = controller(tmp_path)
    run.state = Forming()
    group.form = None  # not callable: a TypeError inside the action
    assert isinstance(advance(run), Failed)
    assert "the Controller failed at step 0 while forming: TypeError" in run.state.reason
    assert "Traceback" in run.state.reason
