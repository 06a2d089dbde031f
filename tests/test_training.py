"""Core training on a real local Ray with gloo: world-size independence (the DataLoader path's too), periodic
evaluation, buckets, user workloads."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import ray

from raylastic.actors.status.run import RunStatus
from raylastic.cluster.job import train
from raylastic.jobconfig.naming import controller_name, worker_name
from raylastic.strategies.checkpoint_catalogue import latest_checkpoint
from tests.support.helpers import assert_states_close, job, load_model

pytestmark = pytest.mark.usefixtures("ray_local")


def run(tmp_path, name, *overrides):
    run_dir = tmp_path / name
    result = train(job(*overrides, name=name), run_dir=run_dir)
    return result, run_dir


@pytest.fixture(scope="module")
def world_size_runs(ray_local, tmp_path_factory) -> dict:
    """The same job at 1, 2 and 3 workers (micro-batches of 7: a rank's part of 48 samples is cut unevenly); at 1
    and 3 evaluated every 5 steps, at 3 with 2 DataLoader processes a rank; at 2 with buckets of 10 kB, at 3 with
    the default 25 MB (the whole model in one bucket)."""
    tmp_path = tmp_path_factory.mktemp("world-sizes")
    recipes = {1: ["eval.every_steps=5"], 2: ["strategy.bucket_cap_mb=0.01"],
               3: ["eval.every_steps=5", "data.num_workers=2"]}
    return {workers: run(tmp_path, f"ws{workers}", f"scaling.min_workers={workers}", f"scaling.max_workers={workers}",
                         "training.micro_batch_size=7", *recipe) for workers, recipe in recipes.items()}


def test_same_parameters_and_losses_at_world_size_1_2_3(world_size_runs):
    states, losses = {}, {}
    for workers, (result, run_dir) in world_size_runs.items():
        assert result.final_step == 20
        assert {row["world_size"] for row in result.history} == {workers}
        assert {row["samples"] for row in result.history} == {48}  # every rank's part of the batch was summed
        states[workers] = load_model(run_dir)
        losses[workers] = [row["loss"] for row in result.history]
    assert_states_close(states[1], states[2])
    assert_states_close(states[1], states[3])
    assert losses[2] == pytest.approx(losses[1], rel=1e-5) and losses[3] == pytest.approx(losses[1], rel=1e-5)


def test_dataloader_workers_keep_world_size_independence_and_periodic_evaluation(world_size_runs):
    evaluations = {workers: world_size_runs[workers][0].eval_history for workers in (1, 3)}
    assert [e["step"] for e in evaluations[3]] == [5, 10, 15, 20]
    for single, spread in zip(evaluations[1], evaluations[3], strict=True):
        assert spread["accuracy"] == pytest.approx(single["accuracy"])
        assert spread["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-4)


def test_bucket_size_does_not_change_the_result(world_size_runs):
    """Buckets of 10 kB (2 ranks) against the default 25 MB, which holds the whole model in one bucket (3 ranks)."""
    saved = {workers: json.loads((world_size_runs[workers][1] / "result.json").read_text()) for workers in (2, 3)}
    assert [saved[workers]["config"]["strategy"]["bucket_cap_mb"] for workers in (2, 3)] == [0.01, 25]
    assert_states_close(load_model(world_size_runs[2][1]), load_model(world_size_runs[3][1]))


def test_user_workload_from_outside_the_package_trains(tmp_path):
    result, run_dir = run(tmp_path, "user", "workload.name=tests.support.user_workload:Parity", "training.steps=60",
                          "optim.lr=0.01")
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    assert result.metrics["accuracy"] > 0.8
    saved = json.loads((run_dir / "result.json").read_text())
    assert saved["status"] == "finished" and saved["final_step"] == 60


def test_result_json_and_plain_model_file(world_size_runs):
    import torch

    from raylastic.workloads.digits import Digits

    result, run_dir = world_size_runs[2]
    saved = json.loads((run_dir / "result.json").read_text())
    assert {"final_step", "metrics", "history", "events"} <= saved.keys()
    assert {"step", "time_s", "loss", "samples_per_s", "world_size"} <= saved["history"][0].keys()
    assert [row["step"] for row in saved["history"]] == list(range(1, 21))
    assert all({"type", "step", "time_s"} <= e.keys() for e in saved["events"])
    model = Digits().build_model()
    model.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True))
    assert Digits().evaluate(model)["accuracy"] == pytest.approx(result.metrics["accuracy"])


@pytest.fixture(scope="module")
def readme_runs(ray_local, tmp_path_factory):
    """The README's main job (examples/digits_elastic.yaml) run twice in the same run directory, as its command
    run a second time; the newest checkpoint's manifest before and after the second run; what ``priority_probe``
    saw in the first."""
    from raylastic.jobconfig import load_job_config
    from tests.conftest import REPO_ROOT

    config = load_job_config(REPO_ROOT / "examples" / "digits_elastic.yaml", ["scaling.cpus_per_worker=0.5"])
    run_dir = tmp_path_factory.mktemp("readme")
    look, seen = priority_probe(config.name)
    first = train(config, run_dir=run_dir, on_progress=look)
    kept = latest_checkpoint(run_dir / "checkpoints").manifest
    again = train(config, run_dir=run_dir)
    return config, first, again, (kept, latest_checkpoint(run_dir / "checkpoints").manifest), seen


def test_readme_main_job_survives_its_killed_worker_and_reaches_accuracy_and_runs_again(readme_runs):
    config, result, again, (kept, after), _ = readme_runs
    assert result.final_step == config.training.steps
    assert result.metrics["accuracy"] >= 0.90
    types = [e.type for e in result.events]
    assert types.count("worker_failed") == 1 and "recovered" in types
    assert again.final_step == config.training.steps and again.metrics["accuracy"] == result.metrics["accuracy"]
    assert [(e.type, e.step) for e in again.events if e.type == "resumed"] == [("resumed", config.training.steps)]
    assert after == kept  # the finished run's checkpoint is not deleted and written again


def test_export_command_writes_a_plain_state_dict_with_identical_outputs(tmp_path):
    import subprocess
    import sys

    import torch

    from raylastic.workloads.digits import Digits
    from tests.conftest import REPO_ROOT

    result, run_dir = run(tmp_path, "export", "training.steps=5", "strategy.name=zero3")
    exported = tmp_path / "exported.pt"
    done = subprocess.run([sys.executable, "-m", "raylastic", "export", result.checkpoint, str(exported)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    plain, ours = Digits().build_model(), Digits().build_model()
    plain.load_state_dict(torch.load(exported, weights_only=True))
    ours.load_state_dict(load_model(run_dir))
    inputs = torch.rand(16, 64)
    assert torch.equal(plain(inputs), ours(inputs))


def _niceness_of_threads(pid: int) -> dict[int, int]:
    """Thread id -> niceness, for every thread of process ``pid`` (field 19 of /proc/<pid>/task/<tid>/stat)."""
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return {int(task.name): int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]) for task in tasks}


def priority_probe(run_name: str) -> tuple[Callable[[RunStatus], None], dict]:
    """An on_progress callback that reads, once the run has trained 3 steps (before any fault), the niceness of
    the threads of workers 1 and 2 and of the Controller's main thread, and whether worker 1 keeps freed memory;
    the dict it writes them to."""
    seen = {}

    def look(progress: RunStatus) -> None:
        if progress.step >= 3 and not seen:
            seen["workers"] = [_niceness_of_threads(ray.get(ray.get_actor(worker_name(run_name, i)).pid.remote()))
                               for i in (1, 2)]
            seen["keeps_freed_memory"] = ray.get(ray.get_actor(worker_name(run_name, 1)).__ray_call__.remote(
                lambda process: process.worker.keeps_freed_memory))
            controller_pid = ray.get(ray.get_actor(controller_name(run_name)).__ray_call__.remote(
                lambda self: os.getpid()))
            seen["controller"] = _niceness_of_threads(controller_pid)[controller_pid]

    return look, seen


def test_training_workers_run_at_normal_priority_and_keep_freed_memory(readme_runs):
    """Ray's default worker niceness is 15. A local instance starts its workers at 0 (no root needed);
    a training worker, the Controller and the rendezvous store lower any higher niceness themselves where they may
    (cluster heads started without RAY_worker_niceness=0; test_warm_start.py starts them at 15). A worker fixes
    glibc's malloc thresholds (actors/processes/allocator.py; their effect is
    tests/test_allocator.py's, in a fresh process: a live worker's faults depend on what it freed before,
    as glibc's own adaptation follows that history to the same ceilings). Seen in the README's run, at step 3."""
    seen = readme_runs[-1]
    assert [set(threads.values()) for threads in seen["workers"]] == [{0}, {0}]  # the step loop, gloo's, Ray's
    assert seen["controller"] == 0
    assert seen["keeps_freed_memory"] is True
