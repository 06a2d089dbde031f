"""The Controller's pure decisions: how many workers, recover or give up, what a poll of the training group
means, and where a new generation's state comes from.

    python -m pytest tests/test_policies.py -q
"""

from __future__ import annotations

import itertools

import pytest

from raylastic.actors.controller.policies import (
    AllStopped,
    FailurePolicy,
    FromCheckpoint,
    FromPeers,
    FromRank,
    FromSeed,
    GenerationFinished,
    GenerationJudge,
    JobError,
    KeepTraining,
    Noop,
    Raise,
    Recover,
    Resize,
    ScalingPolicy,
    ScalingState,
    StateLost,
    WorkersLost,
    choose_state_source,
    needs_checkpoint_lookup,
    read_drain_notices,
    workers_missing,
)
from raylastic.actors.status.group import GroupStatus, LostWorker, MemberStatus
from raylastic.strategies.checkpoint_catalogue import Checkpoint
from raylastic.strategies.checkpoint_manifest import CheckpointManifest
from raylastic.strategies.peer_restore import PeerRestorePlan

# -- ScalingPolicy ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_workers", "num_placeable"), [(2, 0), (2, 1), (2, 10), (0, 5)])
def test_fixed_size_never_resizes_once_formed(num_workers, num_placeable):
    policy = ScalingPolicy(min_workers=2, max_workers=2)
    decision = policy.decide(ScalingState(num_workers=num_workers, num_placeable=num_placeable))
    assert decision == (Noop() if num_workers == 2 else Resize(2))


@pytest.mark.parametrize(("num_workers", "num_placeable", "expected"), [
    (2, 2, Resize(4)),   # grows to max when the resources are ready
    (2, 1, Resize(3)),   # grows as far as the ready resources allow
    (2, 50, Resize(4)),  # never above max
    (3, 1, Resize(4)),
    (0, 2, Resize(2)),   # a fresh start with just enough
    (4, 0, Noop()),      # already at max
    (4, 3, Noop()),
    (3, 0, Noop()),      # nothing ready to grow onto
    (0, 1, Noop()),      # never a Resize below min
    (1, 0, Noop()),
])
def test_elastic_decisions(num_workers, num_placeable, expected):
    policy = ScalingPolicy(min_workers=2, max_workers=4)
    assert policy.decide(ScalingState(num_workers=num_workers, num_placeable=num_placeable)) == expected


def test_resize_always_within_bounds_and_to_the_target():
    for min_workers, max_workers in itertools.combinations_with_replacement(range(1, 6), 2):
        policy = ScalingPolicy(min_workers=min_workers, max_workers=max_workers)
        for num_workers, num_placeable in itertools.product(range(7), range(6)):
            decision = policy.decide(ScalingState(num_workers=num_workers, num_placeable=num_placeable))
            target = min(max_workers, num_workers + num_placeable)
            case = (min_workers, max_workers, num_workers, num_placeable, decision)
            if isinstance(decision, Resize):
                assert min_workers <= decision.num_workers <= max_workers, case
                assert decision.num_workers == target != num_workers, case
            else:
                assert decision == Noop(), case
                assert target == num_workers or target < min_workers, case


# -- FailurePolicy ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_failures", [0, 1, 3])
def test_recovers_up_to_max_failures_then_raises(max_failures):
    policy = FailurePolicy(max_failures=max_failures)
    for failures in range(1, max_failures + 1):
        assert isinstance(policy.decide(failures_so_far=failures), Recover), failures
    decision = policy.decide(failures_so_far=max_failures + 1)
    assert isinstance(decision, Raise)
    assert f"failure.max_failures={max_failures}" in decision.reason
    assert isinstance(policy.decide(failures_so_far=max_failures + 5), Raise)


def test_max_failures_zero_raises_on_the_first():
    assert isinstance(FailurePolicy(max_failures=0).decide(failures_so_far=1), Raise)


@pytest.mark.parametrize(("state", "decision", "new_spares"), [
    (ScalingState(2, 0, num_spares_ready=1, num_spares=1), Noop(), 0),                  # at max: the spare waits
    (ScalingState(2, 1, num_spares_ready=0, num_spares=0), Noop(), 1),                  # a free slot: a new spare
    (ScalingState(1, 1, num_spares_ready=1, num_spares=1), Resize(2, from_spares=1), 1),  # spare in, slot for a new
    (ScalingState(1, 0, num_spares_ready=0, num_spares=1), Noop(), 0),                  # the spare still starts
    (ScalingState(1, 0, num_spares_ready=1, num_spares=1), Noop(), 0),  # below max, it waits for new resources
])
def test_scaling_with_spares(state, decision, new_spares):
    policy = ScalingPolicy(min_workers=1, max_workers=2, spare_workers=1)
    assert policy.decide(state) == decision
    assert policy.spares_to_start(state, decision) == new_spares


def test_spares_taken_after_a_failure_fill_up_to_max():
    policy = ScalingPolicy(min_workers=1, max_workers=4, spare_workers=2)
    assert [policy.spares_to_take(num_workers=n, num_spares_ready=2) for n in (1, 2, 3, 4)] == [2, 2, 1, 0]


def test_workers_missing():
    assert [workers_missing(min_workers=2, num_workers=n) for n in range(4)] == [2, 1, 0, 0]


# -- GenerationJudge --------------------------------------------------------------------------------------

JUDGE = GenerationJudge(step_timeout_s=10.0, max_step_s=600.0, collective_timeout_s=30.0)


def group(*members: MemberStatus, errors_for_s: float | None = None) -> GroupStatus:
    return GroupStatus(generation=0, members=members, errors_for_s=errors_for_s)


def test_training_members_keep_training():
    assert JUDGE.decide(group(MemberStatus("a"), MemberStatus("b", step_running_s=599.0))) == KeepTraining()


@pytest.mark.parametrize(("phases", "verdict"), [
    (("finished", "finished"), GenerationFinished()),
    (("finished", "stopped"), AllStopped()),  # one trained to the end as the others stopped: the last stop vote
    (("stopped", "stopped"), AllStopped()),
    (("stopped", "training"), KeepTraining()),
])
def test_phases(phases, verdict):
    assert JUDGE.decide(group(*(MemberStatus(f"w{i}", phase=p) for i, p in enumerate(phases)))) == verdict


def test_dead_silent_and_hung_members_are_lost_with_their_reasons():
    verdict = JUDGE.decide(group(MemberStatus("a", dead="actor died: SIGKILL"), MemberStatus("b", silent_s=10.5),
                                 MemberStatus("c", step_running_s=601.0), MemberStatus("d", silent_s=9.0)))
    assert verdict == WorkersLost((
        LostWorker("a", "actor died: SIGKILL", 0),
        LostWorker("b", "no answer for 10.5s (failure.step_timeout_s=10.0)", 1),
        LostWorker("c", "hung: its step has run 601s (failure.max_step_s=600.0)", 2)))


def test_a_done_member_is_not_silent():
    assert JUDGE.decide(group(MemberStatus("a", phase="finished", silent_s=99.0),
                              MemberStatus("b", phase="finished"))) == GenerationFinished()


def test_a_job_error_is_judged_after_deaths():
    failed = MemberStatus("a", phase="failed", error="Traceback: ValueError", error_cause="job")
    assert JUDGE.decide(group(failed, MemberStatus("b"))) == JobError((("a", "Traceback: ValueError"),))
    assert isinstance(JUDGE.decide(group(failed, MemberStatus("b", dead="actor died"))), WorkersLost)


def test_peer_errors_wait_for_a_death_then_blame_the_members_still_training():
    survivor = MemberStatus("a", phase="failed", error="gloo: connection reset", error_cause="peer_lost")
    assert JUDGE.decide(group(survivor, MemberStatus("b"), errors_for_s=1.0)) == KeepTraining()
    verdict = JUDGE.decide(group(survivor, MemberStatus("b"), errors_for_s=2.5))
    assert verdict == WorkersLost((LostWorker(
        "b", "hung: its peers' collectives gave up waiting for it (failure.collective_timeout_s=30.0)", 1),))


def test_a_collective_error_on_every_rank_with_nobody_lost_is_the_jobs_error():
    failed = [MemberStatus(n, phase="failed", error=f"gloo: timeout on {n}", error_cause="peer_lost") for n in "ab"]
    assert JUDGE.decide(group(*failed, errors_for_s=1.0)) == KeepTraining()  # a death may still be reported
    verdict = JUDGE.decide(group(*failed, errors_for_s=2.5))
    assert isinstance(verdict, JobError) and [name for name, _ in verdict.errors] == ["a", "b"]
    assert "gloo: timeout on a" in verdict.reason(step=7) and "every rank" in verdict.reason(step=7)
    assert isinstance(JUDGE.decide(group(failed[0], MemberStatus("b", dead="actor died"), errors_for_s=2.5)),
                      WorkersLost)


# -- where a generation's state comes from ----------------------------------------------------------------


def checkpoint(step: int) -> Checkpoint:
    return Checkpoint(f"/ckpt/step_{step}", CheckpointManifest(step=step, world_size=2, strategy="ddp",
                                                               samples_consumed=0, config_hash="h"))


@pytest.mark.parametrize("replicated", [True, False])
def test_a_pending_checkpoint_is_always_loaded(replicated):
    assert choose_state_source(replicated=replicated, pending=checkpoint(4), member_steps=[9, 9], run_step=9,
                               newest_checkpoint=checkpoint(8)) == FromCheckpoint(checkpoint(4))


def test_replicated_state_comes_from_the_first_most_advanced_member():
    assert choose_state_source(replicated=True, pending=None, member_steps=[3, 7, 7], run_step=7) == FromRank(1)


def test_a_newer_checkpoint_beats_members_that_lost_the_newest_state():
    lookup = {"replicated": True, "pending": None, "peer_plan": None, "run_step": 7}
    assert needs_checkpoint_lookup(member_steps=[0, 2], **lookup)
    assert not needs_checkpoint_lookup(member_steps=[0, 7], **lookup)
    assert choose_state_source(replicated=True, pending=None, member_steps=[0, 2], run_step=7,
                               newest_checkpoint=checkpoint(5)) == FromCheckpoint(checkpoint(5))
    assert choose_state_source(replicated=True, pending=None, member_steps=[0, 6], run_step=7,
                               newest_checkpoint=checkpoint(5)) == FromRank(1)


def test_sharded_state_starts_from_the_seed_only_at_step_0():
    assert choose_state_source(replicated=False, pending=None, member_steps=[0, 0], run_step=0) == FromSeed()


def test_sharded_state_past_step_0_with_no_copy_and_no_checkpoint_is_lost_not_restarted():
    assert choose_state_source(replicated=False, pending=None, member_steps=[0, 0], run_step=12) == StateLost(12)
    assert choose_state_source(replicated=False, pending=None, member_steps=[0, 0], run_step=12,
                               newest_checkpoint=checkpoint(5)) == FromCheckpoint(checkpoint(5))


def test_lost_state_is_explained_by_the_copies_its_layout_kept():
    """Under model parallelism a part's copies are its data-parallel copies (a buddy's only with one copy): losing
    both copies of a pipeline stage is not "a worker and its buddy"."""
    from raylastic.jobconfig import CheckpointConfig, StrategyConfig
    from raylastic.strategies.parallel_layout import ParallelLayout

    lost, none, every_5 = StateLost(20), CheckpointConfig(every_minutes=0), CheckpointConfig(every_steps=5)
    ddp, zero3 = StrategyConfig(name="ddp"), StrategyConfig(name="zero3")
    two_pipelines = lost.reason(ddp, none, lost_layout=ParallelLayout(pp=2, dp_replicate=2))
    assert two_pipelines.startswith("the sharded state of step 20 is lost: every copy of one part of the model was "
                                    "lost (pp2 x dp2 (2 copies) kept 2, one in each data-parallel copy)")
    assert "buddy" not in two_pipelines and "(checkpoint.every_steps=0, checkpoint.every_minutes=0)" in two_pipelines
    one_pipeline = lost.reason(zero3, every_5, lost_layout=ParallelLayout(pp=2, tp=2))
    assert "a worker and its buddy, which held the copy of its part of the model (strategy.buddy_copy)" in one_pipeline
    assert "a worker and its buddy, which held the copy of its shard" in lost.reason(zero3, none, lost_layout=None)


PLAN = PeerRestorePlan(generation=1, world_size=4, replicas=2, step=7, senders=(0, 2))


def test_sharded_state_kept_in_memory_wins_over_disk_unless_the_checkpoint_is_newer():
    sharded = {"replicated": False, "member_steps": [0, 0, 0], "run_step": 7}
    assert choose_state_source(pending=None, peer_plan=PLAN, newest_checkpoint=None, **sharded) == FromPeers(PLAN)
    assert choose_state_source(pending=checkpoint(7), peer_plan=PLAN, **sharded) == FromPeers(PLAN)  # a resize
    assert choose_state_source(pending=checkpoint(8), peer_plan=PLAN, **sharded) == FromCheckpoint(checkpoint(8))


def test_a_sharded_run_looks_at_its_checkpoints_only_when_a_shard_is_gone():
    sharded = {"replicated": False, "member_steps": [0, 0], "pending": None}
    assert not needs_checkpoint_lookup(run_step=9, peer_plan=PLAN, **sharded)  # nothing read from disk
    assert needs_checkpoint_lookup(run_step=9, peer_plan=None, **sharded)
    assert not needs_checkpoint_lookup(run_step=0, peer_plan=None, **sharded)  # nothing trained yet
    assert choose_state_source(peer_plan=None, newest_checkpoint=checkpoint(5), run_step=9, **sharded) == \
        FromCheckpoint(checkpoint(5))


# -- drain notices ----------------------------------------------------------------------------------------


def test_drain_notices_name_new_draining_nodes_of_members_and_called_off_drains():
    members = tuple(MemberStatus(name, node_id=node) for name, node in (("a", "head"), ("b", "spot1"), ("c", "spot2")))
    status = GroupStatus(generation=0, members=members,
                         draining_nodes={"spot1": 100.0, "spot2": None, "elsewhere": 50.0})
    notices = read_drain_notices(status, pending={"spot2"})
    assert notices.new == {"spot1": 100.0} and notices.called_off == ()  # "elsewhere" hosts none of the run's
    later = GroupStatus(generation=0, members=members, draining_nodes={"spot1": 100.0})
    assert read_drain_notices(later, pending={"spot1", "spot2"}).called_off == ("spot2",)
