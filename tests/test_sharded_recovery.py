"""Sharded runs with the defaults (strategy.replicas 1, the buddy copy, a time-based checkpoint) lose at most one
step to a worker SIGKILLed from outside: its shard comes from its buddy's CPU copy (strategies/buddy_copy.py). With
two copies the survivors' own shards suffice; a worker lost with its buddy sends the run to its newest checkpoint
(checkpoint.every_steps, or the default's checkpoint.every_minutes), and with none the run fails, saying so, rather
than start over from step 0. The failure timeouts are the defaults.

    python -m pytest tests/test_sharded_recovery.py -q     # about 2 minutes on 2 cores
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from raylastic.actors.controller.run_checkpoints import default_checkpoint_root
from raylastic.actors.status.run import RunFailed, RunStatus
from raylastic.cluster.job import train
from raylastic.strategies.checkpoint_catalogue import complete_checkpoints
from tests.support.distributed_harness import run_distributed
from tests.support.helpers import REORDERED_SUMS_ATOL, assert_states_close, job, load_model, sigkill_ranks_once
from tests.support.strategy_runs import train_job_alone

STEPS = 100
KILL_AT = 40
WORKLOAD = ("workload.name=tests.support.user_workload:SlowDigits", "workload.options={pause_s: 0.01}")
DEFAULT_TIMEOUTS = ("failure.collective_timeout_s=30",)  # tests.support.helpers.job shortens it; these are the defaults

pytestmark = pytest.mark.usefixtures("ray_local")


def sharded_job(name: str, strategy: str, *overrides: str, workers: int = 3):
    return job(f"strategy.name={strategy}", f"scaling.min_workers={workers - 1}", f"scaling.max_workers={workers}",
               f"training.steps={STEPS}", *WORKLOAD, *DEFAULT_TIMEOUTS, *overrides, name=name)


def formed_after_failure(events) -> dict:
    failed = next(i for i, e in enumerate(events) if e.type == "worker_failed")
    return next(e for e in events[failed:] if e.type == "generation_formed").details


@pytest.fixture(scope="module")
def undisturbed():
    """The same job trained on one rank, without the pause (it changes no math)."""
    return run_distributed(train_job_alone, 1, sharded_job("undisturbed", "zero3"), {"pause_s": 0.0})[0]


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])  # zero3: tests/test_zero3_recovery.py
def test_an_outside_sigkill_loses_at_most_one_step_with_the_defaults(tmp_path, undisturbed, strategy):
    on_progress, killed = sigkill_ranks_once(KILL_AT, (1,))
    result = train(sharded_job(f"buddy{strategy}", strategy), run_dir=tmp_path, on_progress=on_progress)
    formed = formed_after_failure(result.events)
    where = f"killed {killed} at step {killed.get('step')}: {formed}"
    assert killed and result.final_step == STEPS, where
    assert formed["state_source"] == "buddy" and formed["steps_lost"] <= 1, where
    assert_states_close(load_model(tmp_path), undisturbed, atol=REORDERED_SUMS_ATOL)


def test_with_two_copies_no_buddy_copy_is_read(tmp_path, undisturbed):
    """strategy.replicas=2 at 4 workers: every shard has a second copy, so a lost worker's shards come from the
    survivors' memory, and the replacement's from its peers. No checkpoint is written before the end (the
    default), so none can have been read."""
    on_progress, killed = sigkill_ranks_once(KILL_AT, (1,))
    result = train(sharded_job("replicas2", "zero3", "strategy.replicas=2", workers=4), run_dir=tmp_path,
                   on_progress=on_progress)
    formed = [e.details for e in result.events if e.type == "generation_formed"]
    assert killed and result.final_step == STEPS and formed[0]["world_size"] == 4, formed
    assert (formed[1]["state_source"], formed[1]["steps_lost"], formed[1]["world_size"]) == ("peers", 0, 3), formed
    assert [details["state_source"] for details in formed[2:]] == ["peers"] * (len(formed) - 2), formed
    assert not [e for e in result.events if e.type == "checkpointed" and e.step < STEPS]
    assert_states_close(load_model(tmp_path), undisturbed, atol=REORDERED_SUMS_ATOL)


def after_a_checkpoint(on_progress: Callable[[RunStatus], None]) -> Callable[[RunStatus], None]:
    """``on_progress``, from the first progress that has seen a checkpoint written on."""
    written = []

    def wrapped(progress: RunStatus) -> None:
        written.extend(e for e in progress.events if e.type == "checkpointed")
        if written:
            on_progress(progress)

    return wrapped


def test_a_zero3_worker_lost_with_its_buddy_resumes_from_the_time_based_checkpoint_of_the_defaults(tmp_path):
    """checkpoint.every_minutes is the one setting changed (0.3 s, so that a checkpoint comes within the test); the
    pair is killed once one has been written (its 150 steps take 1.5 s at least: the workload's pause). The run goes
    back to its newest checkpoint: none older than one the run had reported before the kill (checkpoint.every_steps'
    checkpoints are found the same way: tests/test_elastic.py's zero3 runs resume from their newest)."""
    steps = 150
    on_progress, killed = sigkill_ranks_once(1, (1, 2))  # rank 2 holds rank 1's copy
    config = sharded_job("timed", "zero3", "checkpoint.every_minutes=0.005", f"training.steps={steps}",
                         "scaling.min_workers=2", workers=4)
    result = train(config, run_dir=tmp_path, on_progress=after_a_checkpoint(on_progress))
    failed = next(i for i, e in enumerate(result.events) if e.type == "worker_failed")
    formed = next(i for i, e in enumerate(result.events) if i > failed and e.type == "generation_formed")
    restored = result.events[formed]
    saved_before = [e.step for e in result.events[:formed] if e.type == "checkpointed"]
    saved_before_the_kill = [e.step for e in result.events[:failed] if e.type == "checkpointed"]
    assert killed and result.final_step == steps, restored
    assert restored.details["state_source"] == "checkpoint" and restored.step in saved_before, (saved_before, restored)
    assert restored.step >= max(saved_before_the_kill), (saved_before_the_kill, restored)  # the newest one
    kept = complete_checkpoints(default_checkpoint_root(tmp_path))
    assert 1 <= len(kept) <= config.checkpoint.num_to_keep, kept  # pruned as checkpoint.every_steps' are


def test_a_worker_lost_with_its_buddy_and_no_checkpoint_fails_the_run_saying_why(tmp_path):
    on_progress, killed = sigkill_ranks_once(KILL_AT, (1, 2))
    with pytest.raises(RunFailed, match=r"sharded state of step \d+ is lost: a worker and its buddy") as failure:
        train(sharded_job("pairnone", "zero2", "scaling.min_workers=2", "checkpoint.every_minutes=0", workers=4),
              run_dir=tmp_path, on_progress=on_progress)
    result = json.loads((tmp_path / "result.json").read_text())
    assert killed and result["status"] == "failed" and "start over from step 0" in result["error"], failure.value
    types = [e["type"] for e in result["events"]]
    assert "generation_formed" not in types[types.index("worker_failed"):], types  # no generation from step 0
