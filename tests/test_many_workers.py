"""Eight workers on a real local Ray, a quarter of a logical CPU each (issue 34): one is SIGKILLed from outside
mid-run; the seven survivors go on without restarting and the run ends with the undisturbed run's parameters,
every step applied once, with the samples the undisturbed run gives it; each generation's rendezvous costs ~N
calls a member, not more. The failure timeouts are the defaults.
"""

from __future__ import annotations

import pytest

from raylastic.cluster.job import train
from raylastic.workloads.digits import Digits
from tests.support.helpers import (
    REORDERED_SUMS_ATOL,
    applied_samples,
    assert_states_close,
    job,
    load_model,
    sigkill_ranks_once,
)
from tests.support.strategy_runs import undisturbed_run

WORKERS = 8
STEPS = 40
KILL_AT = 15
SETTINGS = (f"scaling.min_workers={WORKERS - 1}", f"scaling.max_workers={WORKERS}", "scaling.cpus_per_worker=0.25",
            f"training.steps={STEPS}", f"training.global_batch_size={WORKERS * (WORKERS - 1)}",
            "training.record_samples=true", "failure.collective_timeout_s=30",  # the default; job() shortens it
            "workload.name=tests.support.user_workload:SlowDigits", "workload.options={pause_s: 0.01}")
NUM_TRAIN_SAMPLES = len(Digits().train_dataset())
GROUPS_A_JOIN = 2
"""The process groups a DDP member forms as it joins: the training group and the checkpoint group."""

pytestmark = pytest.mark.usefixtures("ray_local")


def test_eight_workers_lose_one_to_an_outside_sigkill_and_end_as_the_undisturbed_run(tmp_path):
    config = job(*SETTINGS, name="eight")
    samples, undisturbed = undisturbed_run(config, NUM_TRAIN_SAMPLES, {"pause_s": 0.0})
    on_progress, killed = sigkill_ranks_once(KILL_AT, (3,))
    result = train(config, run_dir=tmp_path, on_progress=on_progress)
    formed = [e.details for e in result.events if e.type == "generation_formed"]
    where = f"killed {killed}; generations formed: {formed}"
    assert killed and result.final_step == STEPS, where
    assert [e.details["worker"] for e in result.events if e.type == "worker_failed"] == killed["workers"], where
    assert formed[0]["world_size"] == WORKERS and formed[1]["world_size"] == WORKERS - 1, where
    assert formed[1]["state_source"] != "checkpoint" and formed[1]["steps_lost"] <= 1, where
    for details in formed[:2]:  # gloo's full mesh: each member waits for every peer's key, ~N calls a group
        assert details["rendezvous_calls"] <= 2 * GROUPS_A_JOIN * details["world_size"] ** 2, where
    assert applied_samples(result.ledger, STEPS, NUM_TRAIN_SAMPLES) == samples
    assert_states_close(load_model(tmp_path), undisturbed, atol=REORDERED_SUMS_ATOL)
