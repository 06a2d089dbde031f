"""Elastic training on a real local Ray (gloo): failures, stalls, scale-up, drains, driver loss.

Every disturbed run ends with parameters allclose to the undisturbed run of the same job, and
its sample ledger shows every step applied exactly once - the same samples as the undisturbed run -
and so every sample of the epoch consumed exactly once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import ray

from raylastic.actors.processes.setup_hook import TRAINS_NOTHING
from raylastic.actors.status.run import RunFailed
from raylastic.cluster.job import train
from raylastic.jobconfig.naming import controller_name, worker_name
from raylastic.strategies.checkpoint_catalogue import latest_checkpoint
from raylastic.strategies.export import load_full_model_state
from raylastic.workloads.digits import Digits
from tests.conftest import REPO_ROOT
from tests.support.helpers import (
    applied_samples,
    assert_states_close,
    job,
    load_model,
    wait_until_gone,
    with_ctrl_c_enabled,
)
from tests.support.strategy_runs import undisturbed_run

pytestmark = pytest.mark.usefixtures("ray_local")

STEPS = 40
BASE = (f"training.steps={STEPS}", "training.record_samples=true", "scaling.min_workers=2",
        "scaling.max_workers=3", "failure.step_timeout_s=4")
NUM_TRAIN_SAMPLES = len(Digits().train_dataset())
LONG_COLLECTIVE_TIMEOUT_S = 120
"""Set where a test checks that survivors did not wait out the collective timeout (asserting well under it)."""


@pytest.fixture(scope="module")
def reference() -> tuple[dict[int, list[int]], dict]:
    """The undisturbed run, computed: each step's samples (its global batch, in the run's sample order) and the
    parameters that training on them on one rank ends with."""
    return undisturbed_run(job(*BASE, name="reference"), NUM_TRAIN_SAMPLES)


def run_disturbed(tmp_path, name, *overrides, on_progress=None):
    run_dir = tmp_path / name
    result = train(job(*BASE, *overrides, name=name), run_dir=run_dir, on_progress=on_progress)
    return result, load_model(run_dir)


def event_types(result):
    return [e.type for e in result.events]


def assert_same_as_reference(result, state, reference):
    _, reference_state = reference
    assert result.final_step == STEPS
    assert_states_close(state, reference_state)
    assert_applied_as_reference(result, reference)


def assert_applied_as_reference(result, reference):
    """Every step applied exactly once, with the samples the undisturbed run gives it."""
    assert applied_samples(result.ledger, STEPS, NUM_TRAIN_SAMPLES) == reference[0]


def test_workers_killed_by_sigkill_and_by_ray_kill_in_quick_succession_survivors_carry_on(tmp_path, reference):
    """The second kill comes at the first step of the generation the first one formed."""
    result, state = run_disturbed(tmp_path, "kills", "faults=[{action: kill, rank: 1, step: 12}, "
                                  "{action: ray_kill, rank: 1, step: 13}]", "scaling.min_workers=1",
                                  f"failure.collective_timeout_s={LONG_COLLECTIVE_TIMEOUT_S}")
    assert_same_as_reference(result, state, reference)
    failed = [e for e in result.events if e.type == "worker_failed"]
    recovered = [e for e in result.events if e.type == "recovered"]
    assert len(failed) == 2 and len(recovered) == 2 and recovered[0].details["world_size"] == 2, result.events
    assert all(e.details["recovery_s"] < LONG_COLLECTIVE_TIMEOUT_S / 3 for e in recovered)  # not waited out
    assert all(e.details["steps_lost"] == 0 for e in result.events if e.type == "generation_formed")


def test_stalled_worker_is_detected_and_replaced(tmp_path, reference):
    result, state = run_disturbed(tmp_path, "stall", "faults=[{action: stall, rank: 2, step: 10}]",
                                  f"failure.collective_timeout_s={LONG_COLLECTIVE_TIMEOUT_S}")
    assert_same_as_reference(result, state, reference)
    failed = next(e for e in result.events if e.type == "worker_failed")
    assert "no answer" in failed.details["reason"]  # found by failure.step_timeout_s (4 s)
    recovered = next(e for e in result.events if e.type == "recovered")
    assert recovered.details["recovery_s"] < LONG_COLLECTIVE_TIMEOUT_S / 3  # the survivors did not wait it out


def test_failures_beyond_max_end_the_run_with_a_loadable_checkpoint(tmp_path):
    run_dir = tmp_path / "fatal"
    config = job(*BASE, "failure.max_failures=0", "checkpoint.every_steps=5",
                 "faults=[{action: kill, rank: 1, step: 13}]", name="fatal")
    with pytest.raises(RunFailed) as raised:
        train(config, run_dir=run_dir)
    message = str(raised.value)
    assert "failure.max_failures=0" in message and "raylastic:fatal:worker2" in message
    assert "last checkpoint" in message and "step_00000010" in message
    found = latest_checkpoint(run_dir / "checkpoints")
    assert found.manifest.step == 10
    model = Digits().build_model()
    model.load_state_dict(load_full_model_state(found.path))


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_scale_up_when_resources_appear_then_drain_back_down(tmp_path, reference, strategy):
    # 4 logical CPUs: the blocker leaves room for exactly 2 workers of 0.5 CPU until it ends, at the run's first
    # step. Steps of 2 s until the third worker has joined leave it a minute to start (3.5 s on an idle machine, 10+ s
    # on a slow one, more beside a second test suite); 0.4 s after it, for the drain to come before the end.
    blocker = ray.remote(num_cpus=3)(_Blocker).options(runtime_env=TRAINS_NOTHING).remote()
    ray.get(blocker.ready.remote())
    actions = {}

    def act(progress):
        if progress.step >= 1 and "released" not in actions:
            ray.kill(blocker)
            actions["released"] = progress.step
        if progress.world_size == 3 and progress.step >= 25 and "drained" not in actions:
            controller = ray.get_actor(controller_name("scale"))
            actions["drained"] = ray.get(controller.drain.remote(rank=1))

    result, state = run_disturbed(tmp_path, "scale", "workload.name=tests.support.user_workload:SlowUntilGrown",
                                  f"strategy.name={strategy}", on_progress=act)
    _, reference_state = reference
    assert_states_close(state, reference_state)
    assert_applied_as_reference(result, reference)
    sizes = [row["world_size"] for row in result.history]
    assert sizes[0] == 2 and 3 in sizes and sizes[-1] == 2
    types = event_types(result)
    assert "worker_joined" in types and "worker_left" in types and "worker_failed" not in types
    assert all(e.details["steps_lost"] == 0 for e in result.events if e.type == "generation_formed")
    if strategy == "zero3":  # scale-up: the shards move over in memory; drain: the leaver's from its buddy's copy
        # (the old group saves a checkpoint first, for a leaver whose buddy leaves with it; here it is not needed)
        assert sum(e.details.get("reason") == "membership change" for e in result.events) == 1
        formed = [e for e in result.events if e.type == "generation_formed"]
        assert [e.details["state_source"] for e in formed[1:]] == ["peers", "buddy"], formed
    saved_steps = [e.step for e in result.events if e.type == "checkpointed"]
    assert len(saved_steps) == len(set(saved_steps))  # one event per save


def test_driver_killed_then_same_command_resumes_from_checkpoint(tmp_path, reference):
    run_dir = tmp_path / "driver"
    overrides = [*BASE, "checkpoint.every_steps=10", "workload.name=tests.support.user_workload:SlowDigits",
                 "workload.options={pause_s: 0.05}"]
    command = [sys.executable, "-m", "raylastic", "train", "--run-dir", str(run_dir),
               "--address", ray.get_runtime_context().gcs_address]
    for override in ["name=driver", "training.global_batch_size=48", "scaling.cpus_per_worker=0.5", *overrides]:
        command += ["--set", override]
    driver = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "CI": "true"})
    deadline = time.monotonic() + 120
    while (latest_checkpoint(run_dir / "checkpoints") is None or
           latest_checkpoint(run_dir / "checkpoints").manifest.step < 20) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    wait_until_gone(controller_name("driver"))

    result = train(job(*overrides, name="driver"), run_dir=run_dir)
    resumed = next(e for e in result.events if e.type == "resumed")
    assert resumed.step >= 20
    assert result.final_step == STEPS
    assert_states_close(load_model(run_dir), reference[1])
    final_saves = [e for e in result.events if e.type == "checkpointed" and e.step == STEPS]
    assert len(final_saves) == 1  # the loop's save of the last step (every 10) is the end of run's: reported once


class _Blocker:
    def ready(self) -> bool:
        return True


def test_zero3_worker_killed_without_a_buddy_copy_restores_lost_shards_from_checkpoint(tmp_path, reference):
    result, state = run_disturbed(tmp_path, "zero3", "strategy.name=zero3", "strategy.buddy_copy=false",
                                  "checkpoint.every_steps=5", "faults=[{action: kill, rank: 1, step: 13}]")
    assert_same_as_reference(result, state, reference)
    formed = [e for e in result.events if e.type == "generation_formed"]
    assert formed[1].details["state_source"] == "checkpoint" and formed[1].step == 10  # redoes steps 11-12 only
    redone = [(a["generation"], a["kept"]) for a in result.ledger[11]]
    assert redone == [(0, False), (formed[1].details["generation"], True)]  # the discarded attempt stays on record
    assert event_types(result).count("worker_failed") == 1


def test_ctrl_c_stops_the_run_and_leaves_no_actors(tmp_path):
    run_dir = tmp_path / "interrupted"
    command = [sys.executable, "-m", "raylastic", "train", "--run-dir", str(run_dir),
               "--address", ray.get_runtime_context().gcs_address]
    for override in ["name=interrupted", "training.steps=400", "scaling.cpus_per_worker=0.5",
                     "workload.name=tests.support.user_workload:SlowDigits", "workload.options={pause_s: 0.05}"]:
        command += ["--set", override]
    driver = subprocess.Popen(with_ctrl_c_enabled(command), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "CI": "true"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            ray.get_actor(worker_name("interrupted", 2))
            break
        except ValueError:
            time.sleep(0.2)
    time.sleep(3)  # training
    driver.send_signal(signal.SIGINT)
    _, stderr = driver.communicate(timeout=60)
    assert driver.returncode == 1
    assert "interrupted" in stderr and "Traceback" not in stderr
    for name in (controller_name("interrupted"), worker_name("interrupted", 1), worker_name("interrupted", 2)):
        wait_until_gone(name)


def test_below_min_workers_the_run_waits_for_a_replacement_placed_in_the_process_started_ahead(tmp_path, reference):
    """With scaling.warm_processes (the default), a process started ahead (its setup hook importing the training
    modules) waits on the workers' node by the time of the kill, ~10 s after the workers were built, and the
    replacement is placed in it. Whether it has finished its imports by then (``warm_process``, ~2.5 s on an idle
    machine) depends on the machine's load: under CI's it took over 12 s once."""
    result, state = run_disturbed(tmp_path, "waits", "scaling.min_workers=3",
                                  "workload.name=tests.support.user_workload:SlowDigits",
                                  "workload.options={pause_s: 0.4}",
                                  "faults=[{action: kill, rank: 0, step: 25}]")
    assert_same_as_reference(result, state, reference)
    types = event_types(result)
    assert types.index("waiting_for_resources") < types.index("worker_joined") < types.index("recovered")
    assert [e.details["started_ahead"] for e in result.events if e.type == "worker_joined"] == [True]
    assert {row["world_size"] for row in result.history} == {3}


def test_a_warm_spare_replaces_a_killed_worker_without_waiting(tmp_path, reference):
    result, state = run_disturbed(tmp_path, "spare", "scaling.min_workers=3", "scaling.spare_workers=1",
                                  "workload.name=tests.support.user_workload:SlowDigits",
                                  "workload.options={pause_s: 0.4}",
                                  "faults=[{action: kill, rank: 0, step: 12}]")  # the spare is built by then
    assert_same_as_reference(result, state, reference)
    types = event_types(result)
    assert "waiting_for_resources" not in types and types.count("worker_failed") == 1
    taken = [e for e in result.events if e.type == "spares_taken"]
    assert [(e.details["reason"], e.details["workers"]) for e in taken] == [("failure", 1)]
    assert types.index("spares_taken") < types.index("recovered")
    assert {row["world_size"] for row in result.history} == {3}


def test_zero3_that_loses_both_copies_of_a_shard_goes_back_to_its_checkpoint(tmp_path, reference):
    """Two workers lost together (as with a node) count as one failure: failure.max_failures=1 lets it go on."""
    result, state = run_disturbed(tmp_path, "hsdp-both", "strategy.name=zero3", "strategy.replicas=2",
                                  "scaling.min_workers=2", "scaling.max_workers=4", "checkpoint.every_steps=5",
                                  "faults=[{action: kill, rank: 1, step: 13}, {action: kill, rank: 3, step: 13}]",
                                  "failure.max_failures=1")
    assert_same_as_reference(result, state, reference)
    assert event_types(result).count("worker_failed") == 2
    formed = [e for e in result.events if e.type == "generation_formed"]
    assert formed[1].details["state_source"] == "checkpoint" and formed[1].step == 10, formed  # ranks 1, 3: shard 1
