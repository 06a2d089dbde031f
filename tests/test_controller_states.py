"""The Controller's state machine, driven with a fake WorkerGroup (tests/fake_group.py): every transition, a
failure in every state, double failures, and stop requests - each test in milliseconds, no Ray.

    python -m pytest tests/test_controller_states.py -q
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from actors.controller import Controller, RunFailed
from actors.group_status import LostWorker
from actors.run_states import (
    Failed,
    Finished,
    Finishing,
    Forming,
    Placing,
    Recovering,
    Resizing,
    Running,
    Stopped,
    WaitingForWorkers,
)
from actors.worker_group import MemberRaised, MembersFailed
from jobconfig import FaultConfig
from strategies import build_strategy
from strategies.checkpoint import latest_checkpoint
from strategies.peer_restore import ShardCopy
from tests.fake_group import FakeGroup, with_member, write_checkpoint
from tests.helpers import job

pytestmark = pytest.mark.timeout(10)
STEPS = 6


def controller(tmp_path, *overrides: str, **group_options) -> tuple[Controller, FakeGroup]:
    config = job(f"training.steps={STEPS}", "checkpoint.every_steps=0", *overrides)
    group = FakeGroup(checkpoint_root=tmp_path, config_hash=config.math_hash(),
                      replicated=build_strategy(config.strategy).replicated, **group_options)
    return Controller(config, str(tmp_path), group=group), group


def states_until_end(run: Controller) -> list[str]:
    names = []
    while not isinstance(run.state, Finished | Failed | Stopped):
        names.append(run.advance().name)
    return names


def events(run: Controller, type_: str) -> list[dict]:
    return [e.to_dict() for e in run.log.events() if e.type == type_]


def lose(name: str, rank: int) -> MembersFailed:
    return MembersFailed([LostWorker(name, "actor died: killed", rank)])


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
    assert run.advance() == Failed(run.state.reason)
    assert "only 1 of scaling.min_workers=2 workers could be placed" in run.state.reason
    assert [e["worker"] for e in events(run, "worker_failed")] == ["w1"]


def test_resume_restores_the_newest_checkpoint(tmp_path):
    run, group = controller(tmp_path, "checkpoint.resume=auto")
    write_checkpoint(tmp_path / "step_00000003", 3, 2, run.job.math_hash())
    forming = run.advance()
    assert isinstance(forming, Forming) and forming.restore.manifest.step == 3
    assert isinstance(run.advance(), Running) and run.step == 3 and "restore" in group.calls
    assert events(run, "generation_formed")[0]["state_source"] == "checkpoint"
    assert events(run, "resumed")[0]["step"] == 3


def test_resume_refuses_another_jobs_checkpoint(tmp_path):
    run, group = controller(tmp_path, "checkpoint.resume=auto")
    write_checkpoint(tmp_path / "step_00000003", 3, 2, "another job")
    assert isinstance(run.advance(), Failed) and "written by a job with another workload" in run.state.reason


def test_a_recovery_refuses_another_jobs_checkpoint(tmp_path):
    run, group = controller(tmp_path, "strategy.name=zero2", "scaling.min_workers=1")
    write_checkpoint(tmp_path / "step_00000005", 5, 2, run.job.math_hash())
    write_checkpoint(tmp_path / "step_00000010", 10, 2, "another job")  # appeared while the run trained
    run.state, run.step = Recovering((LostWorker("w1", "actor died", 1),), recovering_since=time.time()), 12
    assert isinstance(run.advance(), Forming)  # the lost shard has no copy: the newest checkpoint is looked at
    assert isinstance(run.advance(), Failed) and "written by a job with another workload" in run.state.reason
    assert "restore" not in group.calls


def test_sharded_state_kept_by_the_survivors_is_restored_from_memory_not_disk(tmp_path):
    run, group = controller(tmp_path, "strategy.name=zero3", "strategy.replicas=2", "scaling.min_workers=1",
                            workers=4)
    write_checkpoint(tmp_path / "step_00000005", 5, 4, run.job.math_hash())  # older than what the peers hold
    run.state, run.step = Recovering((LostWorker("w1", "actor died", 1),), recovering_since=time.time()), 9
    group.shard_copies = [ShardCopy(generation=0, world_size=4, replicas=2, rank=rank, step=9) for rank in (0, 2, 3)]
    run.advance()
    assert isinstance(run.advance(), Running) and run.step == 9
    formed = events(run, "generation_formed")[0]
    assert (formed["state_source"], formed["steps_lost"]) == ("peers", 0)
    assert "restore_from_peers" in group.calls and "restore" not in group.calls


def test_a_sharded_run_that_lost_both_copies_of_a_shard_goes_to_its_checkpoint(tmp_path):
    run, group = controller(tmp_path, "strategy.name=zero3", "strategy.replicas=2", "scaling.min_workers=1",
                            workers=3)
    write_checkpoint(tmp_path / "step_00000005", 5, 4, run.job.math_hash())
    run.state, run.step = Recovering((LostWorker("w1", "actor died", 1),), recovering_since=time.time()), 9
    # old ranks 1 and 3 held shard 1: both gone
    group.shard_copies = [ShardCopy(generation=0, world_size=4, replicas=2, rank=rank, step=9) for rank in (0, 2)]
    run.advance()
    run.advance()
    formed = events(run, "generation_formed")[0]
    assert (formed["state_source"], formed["steps_lost"], run.step) == ("checkpoint", 4, 5)


def test_a_sharded_scale_up_moves_the_state_over_in_memory_without_a_save(tmp_path):
    run, group = controller(tmp_path, "strategy.name=zero2", "scaling.max_workers=3", free_slots=1)
    run.state = Forming()
    run.advance()
    group.on_poll(lambda status: dataclasses.replace(status, num_placeable=1))
    assert isinstance(run.advance(), Resizing)
    step = run.step
    group.shard_copies = [ShardCopy(generation=0, world_size=2, replicas=1, rank=r, step=step) for r in (0, 1)] + [None]
    run.advance()
    run.advance()
    assert "save_checkpoint" not in group.calls and events(run, "generation_formed")[-1]["state_source"] == "peers"
    assert run.step == step and group.size == 3


def test_replicated_state_comes_from_the_most_advanced_member(tmp_path):
    run, group = controller(tmp_path)
    run.state, run.step, group.steps = Forming(), 5, {"w0": 4, "w1": 5}
    run.advance()
    formed = events(run, "generation_formed")[0]
    assert formed["state_source"] == 1 and run.step == 5 and set(group.steps.values()) == {5}


def test_replicated_run_that_lost_every_holder_of_its_state_restores_the_newer_checkpoint(tmp_path):
    run, group = controller(tmp_path)
    write_checkpoint(tmp_path / "step_00000005", 5, 2, run.job.math_hash())
    run.state, run.step, group.steps = Forming(), 7, {"w0": 0, "w1": 0}  # fresh replacements only
    run.advance()
    formed = events(run, "generation_formed")[0]
    assert formed["state_source"] == "checkpoint" and run.step == 5 and formed["steps_lost"] == 2


def test_sharded_generation_without_a_checkpoint_starts_from_the_seed(tmp_path):
    run, group = controller(tmp_path, "strategy.name=zero2")
    run.state = Forming()
    run.advance()
    assert events(run, "generation_formed")[0]["state_source"] == "initialisation" and run.step == 0
    assert "sync_state" not in group.calls and "restore" not in group.calls


def test_a_ready_joiner_stops_the_group_at_a_boundary_and_comes_in(tmp_path):
    run, group = controller(tmp_path, "scaling.max_workers=3", free_slots=1)
    run.state = Forming()
    run.advance()
    group.on_poll(lambda status: dataclasses.replace(status, num_placeable=1))  # a slot became ready
    assert isinstance(run.advance(), Resizing)
    assert isinstance(run.advance(), Forming) and group.size == 3
    assert [e["worker"] for e in events(run, "worker_joined")] == ["w2"]
    assert states_until_end(run)[-1] == "finished" and run.state.result.final_step == STEPS


def test_a_drained_worker_leaves_at_a_boundary(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=1")
    run.state = Forming()
    run.advance()
    assert run.drain(rank=1) == ["w1"]
    assert isinstance(run.advance(), Resizing)
    assert isinstance(run.advance(), Forming) and group.member_names == ["w0"]
    assert events(run, "worker_left")[0]["reason"] == "drained" and run.failures == 0


def test_workers_on_a_draining_node_leave_at_a_boundary_and_are_replaced(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=1", workers=3)
    group.nodes = {"w0": "head", "w1": "spot", "w2": "spot"}
    run.state = Forming()
    run.advance()
    group.draining_nodes = {"spot": time.time() + 60}  # a preemption notice, 60 s ahead
    assert isinstance(run.advance(), Resizing)
    draining = events(run, "node_draining")[0]
    assert draining["workers"] == ["w1", "w2"] and 55 < draining["deadline_s"] <= 60
    assert isinstance(run.advance(), Forming) and group.member_names == ["w0"]
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
    run.advance()
    group.draining_nodes = {"spot": None}

    def call_off(status):
        group.draining_nodes = {}  # the next poll finds the drain cancelled
        return status

    group.on_poll(call_off)
    assert isinstance(run.advance(), Resizing)  # the boundary was asked for before the drain was called off
    assert events(run, "node_draining")[0]["deadline_s"] is None and events(run, "node_drain_cancelled")
    assert isinstance(run.advance(), Forming) and group.member_names == ["w0", "w1"]
    assert not events(run, "drained") and not events(run, "worker_left")


def test_a_drain_below_min_workers_waits_for_replacements(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=2", workers=2, free_slots=1)
    group.nodes = {"w0": "head", "w1": "spot"}
    run.state = Forming()
    run.advance()
    group.draining_nodes = {"spot": time.time() + 30}
    run.advance()
    waiting = run.advance()
    assert isinstance(waiting, WaitingForWorkers) and waiting.recovering_since is None and run.failures == 0
    assert isinstance(run.advance(), Forming) and group.member_names == ["w0", "w2"]


def test_sharded_resize_saves_first_and_the_new_generation_loads_it(tmp_path):
    run, group = controller(tmp_path, "strategy.name=zero1", "scaling.min_workers=1")
    run.state = Forming()
    run.advance()
    run.drain(rank=1)
    run.advance()  # running -> resizing
    forming = run.advance()
    assert forming.restore is not None and forming.restore.manifest.step == run.step > 0
    run.advance()
    assert events(run, "generation_formed")[-1]["state_source"] == "checkpoint"
    assert group.calls.count("save_checkpoint") == 1 and "restore" in group.calls


def test_a_dead_member_leads_to_recovery_and_the_run_goes_on_without_it(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=1")
    run.state = Forming()
    run.advance()
    group.on_poll(lambda status: with_member(status, "w1", dead="actor died: SIGKILL"))
    recovering = run.advance()
    assert isinstance(recovering, Recovering) and [w.name for w in recovering.lost] == ["w1"]
    assert isinstance(run.advance(), Forming) and run.failures == 1 and "drop w1" in group.calls
    assert states_until_end(run)[-1] == "finished"
    recovered = events(run, "recovered")
    assert len(recovered) == 1 and recovered[0]["world_size"] == 1


def test_a_lost_node_drops_every_worker_whose_death_is_heard_by_the_end(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=1", workers=3)
    run.state = Forming()
    run.advance()
    group.on_poll(lambda status: with_member(status, "w1", dead="actor died"))
    original_end = group.end_generation
    group.end_generation = lambda: with_member(original_end(), "w2", dead="actor died")
    recovering = run.advance()
    assert sorted(w.name for w in recovering.lost) == ["w1", "w2"]
    run.advance()
    assert group.member_names == ["w0"] and run.failures == 1  # one incident, however many workers it took


@pytest.mark.parametrize(("change", "reason"), [
    ({"silent_s": 11.0}, "no answer for 11.0s (failure.step_timeout_s=10.0)"),
    ({"step_running_s": 601.0}, "hung: its step has run 601s (failure.max_step_s=600.0)"),
])
def test_silent_or_hung_members_are_lost(tmp_path, change, reason):
    run, group = controller(tmp_path)
    run.state = Running()
    group.on_poll(lambda status: with_member(status, "w0", **change))
    recovering = run.advance()
    assert recovering.lost == (LostWorker("w0", reason, 0),)


def test_a_failure_takes_a_warm_spare_at_once_and_a_new_spare_starts_behind_it(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=2", "scaling.spare_workers=1", idle_spares=1)
    run.state = Forming()
    run.advance()
    group.on_poll(lambda status: with_member(status, "w1", dead="actor died"))
    run.advance()
    assert isinstance(run.advance(), Forming) and group.member_names == ["w0", "spare0"]  # no waiting
    assert events(run, "spares_taken")[0] | {"workers": 1, "reason": "failure"} == events(run, "spares_taken")[0]
    group.free_slots = 1  # the failed worker's slot is placed again
    run.advance()
    run.advance()  # the generation trains; its first poll starts a spare on the free slot
    assert group.idle == ["w2"] and group.member_names == ["w0", "spare0"]  # the new spare waits, idle
    assert states_until_end(run)[-1] == "finished"


def test_a_scale_up_takes_a_ready_spare_at_the_next_boundary(tmp_path):
    run, group = controller(tmp_path, "scaling.max_workers=3", "scaling.spare_workers=1", idle_spares=1)
    run.state = Forming()
    run.advance()
    group.free_slots = 1  # resources for a third worker appear: the spare takes them at once
    assert isinstance(run.advance(), Resizing)
    assert isinstance(run.advance(), Forming) and group.member_names == ["w0", "w1", "spare0"]
    assert events(run, "spares_taken")[0]["reason"] == "scale-up"
    assert group.idle == ["w2"]  # and a new spare starts on the new slot


def test_below_max_an_idle_spare_waits_for_new_resources(tmp_path):
    run, group = controller(tmp_path, "scaling.max_workers=3", "scaling.spare_workers=1", idle_spares=1)
    run.state = Forming()
    run.advance()
    assert isinstance(run.advance(), Finishing) and group.member_names == ["w0", "w1"] and group.idle == ["spare0"]


def test_below_min_workers_the_run_waits_then_forms_with_a_replacement(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=2", free_slots=1)
    run.state = Running()
    group.on_poll(lambda status: with_member(status, "w1", dead="actor died"))
    run.advance()
    waiting = run.advance()
    assert isinstance(waiting, WaitingForWorkers) and waiting.needed == 1
    assert events(run, "waiting_for_resources")[0]["needed"] == 1
    assert isinstance(run.advance(), Forming) and group.member_names == ["w0", "w2"]


def test_waiting_goes_on_until_its_deadline_then_fails(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=2")
    group.members = ["w0"]
    run.state = WaitingForWorkers(needed=1, deadline=time.monotonic() + 60, recovering_since=time.time())
    assert run.advance() is run.state and isinstance(run.state, WaitingForWorkers)  # no spare yet: still waiting
    run.state = dataclasses.replace(run.state, deadline=time.monotonic())
    assert isinstance(run.advance(), Failed)
    assert "only 1 of scaling.min_workers=2 workers are available after the failure" in run.state.reason


def test_one_failure_too_many_fails_the_run(tmp_path):
    run, group = controller(tmp_path, "failure.max_failures=0", "scaling.min_workers=1")
    run.state = Recovering((LostWorker("w1", "actor died", 1),), recovering_since=time.time())
    assert isinstance(run.advance(), Failed)
    assert "1 failures, more than failure.max_failures=0; last failure: w1 (actor died)" in run.state.reason


def test_a_job_error_fails_the_run_at_once_with_its_traceback(tmp_path):
    run, group = controller(tmp_path)
    run.state = Forming()
    run.advance()
    group.on_poll(lambda status: with_member(status, "w0", phase="failed", error="Traceback: ZeroDivisionError",
                                             error_cause="job"))
    assert isinstance(run.advance(), Failed)
    assert "w0 raised an error at step" in run.state.reason and "ZeroDivisionError" in run.state.reason
    assert events(run, "worker_failed")[0]["traceback"] == "Traceback: ZeroDivisionError" and run.failures == 0


def test_injected_faults_of_failed_ranks_are_disarmed(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=1")
    run.job = dataclasses.replace(run.job, faults=(FaultConfig(action="kill", rank=1, step=3),))
    run.faults = type(run.faults)(run.job.faults)
    run.step = 2
    run.state = Recovering((LostWorker("w1", "actor died", 1),), recovering_since=time.time())
    run.advance()
    assert run.faults.for_rank(1) == ()


def test_a_defect_of_the_controller_is_a_failed_run_with_its_traceback(tmp_path):
    run, group = controller(tmp_path)
    run.state = Forming()
    group.form = None  # not callable: a TypeError inside the action
    assert isinstance(run.advance(), Failed)
    assert "the Controller failed at step 0 while forming: TypeError" in run.state.reason
    assert "Traceback" in run.state.reason


# -- a failure in every state -----------------------------------------------------------------------------------

FAILING_CALLS = [
    ("forming", "join", "ddp"),
    ("forming", "sync_state", "ddp"),
    ("forming", "restore", "zero2"),
    ("running", "train", "ddp"),
    ("resizing", "save_checkpoint", "zero1"),
    ("finishing", "evaluate", "ddp"),
    ("finishing", "full_state_dict", "ddp"),
    ("finishing", "full_state_dict", "zero3"),
    ("finishing", "memory", "ddp"),
    ("finishing", "save_checkpoint", "ddp"),
]


def _in_state(tmp_path, state: str, strategy: str) -> tuple[Controller, FakeGroup]:
    run, group = controller(tmp_path, f"strategy.name={strategy}", "scaling.min_workers=1", workers=3)
    if state == "forming":
        checkpoint = None
        if strategy != "ddp":
            write_checkpoint(tmp_path / "step_00000002", 2, 3, run.job.math_hash())
            checkpoint = latest_checkpoint(tmp_path)
        run.state, run.step = Forming(restore=checkpoint), 2
    elif state == "running":
        run.state = Running()
    elif state == "resizing":  # w2 leaves: its shards are saved first
        run.state, run.step, group.steps, group.draining = Resizing(), 3, {name: 3 for name in group.members}, {"w2"}
    else:
        run.state, run.step, group.steps = Finishing(), STEPS, {name: STEPS for name in group.members}
    return run, group


@pytest.mark.parametrize(("state", "method", "strategy"), FAILING_CALLS)
def test_members_lost_in_any_state_are_recovered_from(tmp_path, state, method, strategy):
    run, group = _in_state(tmp_path, state, strategy)
    group.fail(method, lose("w2", 2))
    recovering = run.advance()
    assert isinstance(recovering, Recovering) and recovering.lost[0].name == "w2", recovering
    assert states_until_end(run)[-1] == "finished", run.state
    assert run.failures == 1 and group.member_names == ["w0", "w1"] and run.state.result.final_step == STEPS


@pytest.mark.parametrize(("state", "method", "strategy"), FAILING_CALLS)
def test_a_job_error_in_any_state_fails_the_run(tmp_path, state, method, strategy):
    run, group = _in_state(tmp_path, state, strategy)
    group.fail(method, MemberRaised(f"w1 raised an error in {method}\nTraceback: OSError: disk full"))
    assert isinstance(run.advance(), Failed)
    first_line, traceback = run.state.reason.split("\n", 1)
    assert first_line.startswith(f"w1 raised an error in {method}; ") and "checkpoint" in first_line
    assert traceback == "Traceback: OSError: disk full"


def test_a_failure_while_forming_keeps_the_checkpoint_the_generation_was_to_load(tmp_path):
    run, group = controller(tmp_path, "checkpoint.resume=auto", "scaling.min_workers=1")
    write_checkpoint(tmp_path / "step_00000003", 3, 2, run.job.math_hash())
    group.fail("join", lose("w1", 1))
    run.advance()  # placing -> forming(restore step 3)
    recovering = run.advance()
    assert isinstance(recovering, Recovering) and recovering.restore.manifest.step == 3
    forming = run.advance()
    assert forming.restore.manifest.step == 3
    run.advance()
    assert run.step == 3 and events(run, "generation_formed")[0]["state_source"] == "checkpoint"


def test_a_second_failure_while_recovering_is_counted_and_recovered_from(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=1", "failure.max_failures=2", workers=3)
    run.state = Forming()
    run.advance()
    group.on_poll(lambda status: with_member(status, "w2", dead="actor died"))
    group.fail("join", lose("w1", 1))  # the re-formation loses another
    names = states_until_end(run)
    assert names[:5] == ["recovering", "forming", "recovering", "forming", "running"], names
    assert names[-1] == "finished" and run.failures == 2 and group.member_names == ["w0"]


def test_a_second_failure_beyond_max_failures_fails_the_run(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=1", "failure.max_failures=1", workers=3)
    run.state = Forming()
    run.advance()
    group.on_poll(lambda status: with_member(status, "w2", dead="actor died"))
    group.fail("join", lose("w1", 1))
    assert states_until_end(run) == ["recovering", "forming", "recovering", "failed"]
    assert "2 failures, more than failure.max_failures=1; last failure: w1" in run.state.reason


def test_a_recovery_is_timed_from_the_first_failure_to_the_next_committed_step(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=1", workers=3)
    failed_at = time.time() - 5
    run.state = Recovering((LostWorker("w2", "actor died", 2),), recovering_since=failed_at)
    group.fail("join", lose("w1", 1))
    states_until_end(run)
    recovered = events(run, "recovered")
    assert len(recovered) == 1 and recovered[0]["recovery_s"] >= 5


# -- stop requests ----------------------------------------------------------------------------------------------

STOPPABLE_STATES = [Forming(), Running(), Resizing(),
                    WaitingForWorkers(needed=1, deadline=float("inf"), recovering_since=0.0)]


@pytest.mark.parametrize("state", STOPPABLE_STATES, ids=lambda s: s.name)
def test_a_stop_ends_a_stoppable_state_before_it_acts(tmp_path, state):
    run, group = controller(tmp_path)
    run.state = state
    run.stop()
    assert isinstance(run.advance(), Stopped) and group.calls == []


def test_a_stop_during_formation_takes_effect_once_the_generation_is_formed(tmp_path):
    run, group = controller(tmp_path)
    run.state = Forming()
    original_form = group.form

    def form_while_the_user_stops(**kwargs):
        run.stop()
        return original_form(**kwargs)

    group.form = form_while_the_user_stops
    assert isinstance(run.advance(), Running)
    assert isinstance(run.advance(), Stopped) and "train" not in group.calls
    with pytest.raises(RunFailed, match="run stopped by the user at step 0"):
        run.run()


def test_a_stop_while_training_ends_at_the_next_boundary(tmp_path):
    run, group = controller(tmp_path)
    run.state = Forming()
    run.advance()
    group.on_poll(lambda status: (run.stop(), status)[1])
    assert isinstance(run.advance(), Resizing)  # every member stopped after the same step
    assert isinstance(run.advance(), Stopped) and 0 < run.step < STEPS


def test_a_recovery_completes_before_a_stop_takes_effect(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=1")
    run.state = Recovering((LostWorker("w1", "actor died", 1),), recovering_since=time.time())
    run.stop()
    assert isinstance(run.advance(), Forming) and "drop w1" in group.calls and run.failures == 1
    assert isinstance(run.advance(), Stopped)


def test_a_stop_while_finishing_lets_the_run_finish(tmp_path):
    run, group = controller(tmp_path)
    run.state, run.step, group.steps = Finishing(), STEPS, {"w0": STEPS, "w1": STEPS}
    run.stop()
    assert isinstance(run.advance(), Finished)


def test_progress_reports_the_state(tmp_path):
    run, group = controller(tmp_path)
    assert run.progress().state == "placing"
    run.advance()
    status = run.progress()
    assert (status.state, status.generation, status.world_size, status.members) == ("forming", -1, 2, ["w0", "w1"])
    run.advance()
    assert run.progress().state == "running" and run.progress().generation == 0
    assert Placing().name == "placing"
