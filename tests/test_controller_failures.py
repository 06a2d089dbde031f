"""The Controller's state machine under failures, with a fake WorkerGroup (tests/support/fake_group.py): a lost worker
and a job error in every state that calls the workers, double failures, failures while forming, and stop
requests in every state - each test in milliseconds, no Ray.

    python -m pytest tests/test_controller_failures.py -q
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from raylastic.actors.controller.controller import Controller
from raylastic.actors.controller.policies import FailurePolicy, RunPolicies
from raylastic.actors.controller.states import (
    Failed,
    Finished,
    Finishing,
    Forming,
    Placing,
    Recovering,
    Resizing,
    Running,
    Stopped,
    Stopping,
    WaitingForWorkers,
)
from raylastic.actors.status.group import LostWorker
from raylastic.actors.status.run import RunFailed, RunStopped
from raylastic.actors.worker_group.group import MemberRaised
from raylastic.strategies.checkpoint_catalogue import latest_checkpoint
from raylastic.strategies.checkpoint_manifest import read_manifest
from raylastic.strategies.peer_restore import ShardCopy
from tests.support.fake_group import (
    STEPS,
    FakeGroup,
    advance,
    controller,
    events,
    lose,
    states_until_end,
    with_member,
    write_checkpoint,
)
from tests.support.helpers import job

pytestmark = pytest.mark.timeout(10)


# -- a failure in every state -----------------------------------------------------------------------------------

FAILING_CALLS = [
    ("forming", "join", "ddp"),
    ("forming", "sync_state", "ddp"),
    ("forming", "restore", "zero2"),
    ("running", "train", "ddp"),
    ("resizing", "save_checkpoint", "zero1"),
    ("finishing", "evaluate", "ddp"),
    ("finishing", "full_model_file", "ddp"),
    ("finishing", "full_model_file", "zero3"),
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
        # w0 and w1 (should w2 be lost) hold their own shards and, as buddies, w2's and w0's
        group.shard_copies = [tuple(ShardCopy(0, 3, 1, rank, 3, holder) for rank, holder in held)
                              for held in ([(0, "own"), (2, "buddy")], [(1, "own"), (0, "buddy")])]
    else:
        run.state, run.step, group.steps = Finishing(), STEPS, {name: STEPS for name in group.members}
    return run, group


@pytest.mark.parametrize(("state", "method", "strategy"), FAILING_CALLS)
def test_members_lost_in_any_state_are_recovered_from(tmp_path, state, method, strategy):
    run, group = _in_state(tmp_path, state, strategy)
    group.fail(method, lose("w2", 2))
    recovering = advance(run)
    assert isinstance(recovering, Recovering) and recovering.lost[0].name == "w2", recovering
    assert states_until_end(run)[-1] == "finished", run.state
    assert run.failures == 1 and group.member_names == ["w0", "w1"] and run.state.result.final_step == STEPS


@pytest.mark.parametrize(("state", "method", "strategy"), FAILING_CALLS)
def test_a_job_error_in_any_state_fails_the_run(tmp_path, state, method, strategy):
    run, group = _in_state(tmp_path, state, strategy)
    group.fail(method, MemberRaised("w1", "Traceback: OSError: disk full", where=f"in {method}"))
    assert isinstance(advance(run), Failed)
    first_line, traceback = run.state.reason.split("\n", 1)
    assert first_line.startswith(f"w1 raised an error in {method} (not retried") and "checkpoint" in first_line
    assert traceback == "Traceback: OSError: disk full"
    assert events(run, "worker_failed")[-1]["traceback"] == traceback  # as an error found by a poll is logged


def test_a_failure_while_forming_keeps_the_checkpoint_the_generation_was_to_load(tmp_path):
    run, group = controller(tmp_path, "checkpoint.resume=auto", "scaling.min_workers=1")
    write_checkpoint(tmp_path / "step_00000003", 3, 2, run.job.math_hash())
    group.fail("join", lose("w1", 1))
    advance(run)  # placing -> forming(restore step 3)
    recovering = advance(run)
    assert isinstance(recovering, Recovering) and recovering.restore.manifest.step == 3
    forming = advance(run)
    assert forming.restore.manifest.step == 3
    advance(run)
    assert run.step == 3 and events(run, "generation_formed")[0]["state_source"] == "checkpoint"


def test_a_second_failure_while_recovering_is_counted_and_recovered_from(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=1", "failure.max_failures=2", workers=3)
    run.state = Forming()
    advance(run)
    group.on_poll(lambda status: with_member(status, "w2", dead="actor died"))
    group.fail("join", lose("w1", 1))  # the re-formation loses another
    names = states_until_end(run)
    assert names[:5] == ["recovering", "forming", "recovering", "forming", "running"], names
    assert names[-1] == "finished" and run.failures == 2 and group.member_names == ["w0"]


def test_a_second_failure_beyond_max_failures_fails_the_run(tmp_path):
    run, group = controller(tmp_path, "scaling.min_workers=1", "failure.max_failures=1", workers=3)
    run.state = Forming()
    advance(run)
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

NOTHING_TO_KEEP = [Forming(), Running(), Resizing(), WaitingForWorkers(needed=1, deadline=float("inf"))]
"""At step 0 nothing was trained; below min_workers no generation is formed to save from."""


@pytest.mark.parametrize("state", NOTHING_TO_KEEP, ids=lambda s: s.name)
def test_a_stop_with_nothing_to_keep_ends_the_state_before_it_acts(tmp_path, state):
    run, group = controller(tmp_path)
    run.state = state
    if isinstance(state, WaitingForWorkers):
        run.step = 3
    run.stop()
    assert isinstance(advance(run), Stopped) and group.calls == []
    with pytest.raises(RunStopped, match=f"run stopped by the user at step {run.step}") as stopped:
        run.run()
    assert stopped.value.result is None


def test_a_stop_during_formation_takes_effect_once_the_generation_is_formed(tmp_path):
    run, group = controller(tmp_path)
    run.state = Forming()
    original_form = group.form

    def form_while_the_user_stops(**kwargs):
        run.stop()
        return original_form(**kwargs)

    group.form = form_while_the_user_stops
    assert isinstance(advance(run), Running)
    assert isinstance(advance(run), Stopped) and "train" not in group.calls
    with pytest.raises(RunFailed, match="run stopped by the user at step 0"):
        run.run()


def test_a_stop_asked_as_training_starts_is_asked_of_the_members_again(tmp_path):
    """The stop came after the generation's members forgot stop requests (at their join), before they trained."""
    run, group = controller(tmp_path)
    run.state = Forming()
    advance(run)
    original_start = group.start_training

    def start_while_the_user_stops(*args, **kwargs):
        run.stop()
        original_start(*args, **kwargs)  # the fake's members, like the real ones, start with no stop request

    group.start_training = start_while_the_user_stops
    assert isinstance(advance(run), Resizing)
    assert isinstance(advance(run), Stopping)
    assert isinstance(advance(run), Stopped) and 0 < run.step < STEPS


def test_each_transition_of_a_training_generation_takes_one_poll(tmp_path):
    run, group = controller(tmp_path)
    run.state = Forming()
    run.advance()
    for polls in (1, 2, 3):
        state = run.advance()
        assert isinstance(state, Running) and state.started and group.calls.count("poll") == polls
    assert group.calls.count("train") == 1 and run.step == 3  # the fake commits a step per poll


def test_a_stop_while_training_ends_at_the_next_boundary_with_its_checkpoint_and_model(tmp_path):
    """A stop is a finish asked early: the step's checkpoint and the full model, as a finish writes them, and no
    evaluation (it has to fit the grace period of ``ray job stop``)."""
    run, group = controller(tmp_path)
    run.state = Forming()
    advance(run)
    group.on_poll(lambda status: (run.stop(), status)[1])
    assert isinstance(advance(run), Resizing)  # every member stopped after the same step
    assert isinstance(advance(run), Stopping) and run.progress().state == "stopping"
    stopped = advance(run)
    assert isinstance(stopped, Stopped) and 0 < run.step < STEPS
    assert [c for c in group.calls if c in ("save_checkpoint", "full_model_file", "evaluate")] == [
        "save_checkpoint", "full_model_file"]
    kept = stopped.result
    assert (kept.final_step, kept.model_state) == (run.step, b"model.pt")  # the fake's gathered model
    assert read_manifest(kept.checkpoint).step == run.step == latest_checkpoint(tmp_path).manifest.step
    assert events(run, "stopped") == [{"type": "stopped", "step": run.step, "time_s": events(run, "stopped")[0][
        "time_s"], "checkpoint": kept.checkpoint}]
    with pytest.raises(RunStopped, match=f"run stopped by the user at step {run.step}; checkpoint: ") as raised:
        run.run()
    assert raised.value.result is kept and group.shut_down


def test_a_stop_after_a_recovery_forms_the_survivors_and_keeps_their_step(tmp_path):
    """The survivors hold steps that no checkpoint has (checkpoint.every_steps=0): they form, then save them."""
    run, group = controller(tmp_path, "scaling.min_workers=1")
    run.state, run.step, group.steps = Recovering((LostWorker("w1", "actor died", 1),), recovering_since=time.time()), \
        4, {"w0": 4, "w1": 4}
    run.stop()
    assert isinstance(advance(run), Forming) and "drop w1" in group.calls and run.failures == 1
    assert isinstance(advance(run), Running) and "train" not in group.calls
    assert isinstance(advance(run), Stopping)
    stopped = advance(run)
    assert isinstance(stopped, Stopped) and read_manifest(stopped.result.checkpoint).step == 4


def test_a_stop_while_finishing_lets_the_run_finish(tmp_path):
    run, group = controller(tmp_path)
    run.state, run.step, group.steps = Finishing(), STEPS, {"w0": STEPS, "w1": STEPS}
    run.stop()
    assert isinstance(advance(run), Finished)


def test_progress_reports_the_state(tmp_path):
    run, group = controller(tmp_path)
    assert run.progress().state == "placing"
    advance(run)
    status = run.progress()
    assert (status.state, status.generation, status.world_size, status.members) == ("forming", -1, 2, ["w0", "w1"])
    advance(run)
    assert run.progress().state == "running" and run.progress().generation == 0
    assert Placing().name == "placing"


# -- what a failed run keeps, and what it refuses to do ---------------------------------------------------------


def test_finishing_saves_then_gathers_then_evaluates_and_a_failed_evaluation_keeps_both(tmp_path):
    run, group = controller(tmp_path, "strategy.name=zero3")
    run.state, run.step, group.steps = Finishing(), STEPS, {"w0": STEPS, "w1": STEPS}
    group.fail("evaluate", MemberRaised("w0", "Traceback: ValueError: empty eval set", where="in evaluate"))
    failed = advance(run)
    assert [c for c in group.calls if c in ("save_checkpoint", "full_model_file", "evaluate")] == [
        "save_checkpoint", "full_model_file", "evaluate"]
    assert isinstance(failed, Failed) and failed.model_state == b"model.pt"  # the fake's gathered model
    assert "empty eval set" in failed.reason and f"step_{STEPS:08d}" in failed.reason.split("\n")[0]
    with pytest.raises(RunFailed) as raised:
        run.run()
    assert raised.value.model_state == b"model.pt"


def test_a_sharded_run_that_lost_a_shard_with_no_copy_and_no_checkpoint_fails_rather_than_restart(tmp_path):
    run, group = controller(tmp_path, "strategy.name=zero2", "scaling.min_workers=1", workers=3)
    run.state, run.step = Recovering((LostWorker("w1", "actor died", 1),), recovering_since=time.time()), 9
    advance(run)
    failed = advance(run)
    assert isinstance(failed, Failed) and "join" in group.calls and "restore" not in group.calls
    assert failed.reason.startswith("the sharded state of step 9 is lost: a worker and its buddy")
    assert "rather than start over from step 0" in failed.reason and not events(run, "generation_formed")


def test_workers_that_cannot_start_are_reported_and_fail_the_run_naming_the_error(tmp_path):
    from raylastic.actors.worker_group.membership import StartFailure, WorkersCannotStart

    run, group = controller(tmp_path, "scaling.min_workers=1")
    run.state = Recovering((LostWorker("w1", "actor died", 1),), recovering_since=time.time())
    group.start_failures = [StartFailure("w7", "node-b", "ModuleNotFoundError: No module named 'mypkg'")]
    group.fail("admit_ready_joiners", WorkersCannotStart("3 new workers in a row could not start: ModuleNotFoundError"))
    failed = advance(run)
    assert isinstance(failed, Failed) and "ModuleNotFoundError" in failed.reason
    [started] = events(run, "worker_start_failed")
    assert (started["worker"], started["node_id"], started["error"]) == (
        "w7", "node-b", "ModuleNotFoundError: No module named 'mypkg'")


def test_a_checkpoint_its_loaders_refuse_is_passed_over_for_the_next_one(tmp_path):
    run, group = controller(tmp_path, "strategy.name=zero2", "scaling.min_workers=1", workers=3)
    for step in (5, 10):
        write_checkpoint(tmp_path / f"step_{step:08d}", step, 3, run.job.math_hash())
    newest = str(tmp_path / "step_00000010")
    group.refused[newest] = "__1_0.distcp does not match its checksum"
    run.state, run.step = Recovering((LostWorker("w1", "actor died", 1),), recovering_since=time.time()), 12
    advance(run)
    assert isinstance(advance(run), Forming) and run.step == 12  # refused: nothing loaded, formed again
    assert isinstance(advance(run), Running) and run.step == 5
    [rejected] = events(run, "checkpoint_rejected")
    assert (rejected["path"], rejected["reason"]) == (newest, "__1_0.distcp does not match its checksum")
    assert events(run, "generation_formed")[-1]["state_source"] == "checkpoint"


def test_the_controller_asks_the_policies_it_is_given_not_the_jobs(tmp_path):
    """The job allows 3 failures; the FailurePolicy the Controller is given allows none."""
    config = job(f"training.steps={STEPS}", "failure.max_failures=3")
    strict = replace(RunPolicies.for_job(config), failure=FailurePolicy(max_failures=0))
    run, _ = controller(tmp_path, "failure.max_failures=3", policies=strict)
    run.state = Recovering((LostWorker("w1", "actor died", 1),), recovering_since=time.time())
    failed = advance(run)
    assert isinstance(failed, Failed) and "max_failures" in failed.reason and run.failures == 1
