"""Sweeps on a real local Ray: Tune runs whole Raylastic jobs as trials, Optuna proposes, ASHA stops.

One sweep of 5 digits trials is interrupted while its fourth trial runs, once its job has saved a
checkpoint (SIGUSR1, Tune's Ctrl-C), and resumed by name (the searcher proposes the fifth then); the tests read
what it left. Trials run one at a time so the sweep is deterministic: the first three values are given
(``points_to_evaluate``) - a terrible learning rate first (the first trial at a rung always goes on,
so it completes: the "worst"), a good one, then a bad one that ASHA must stop at its first rung.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
import torch
from ray import tune

from raylastic.jobconfig import JobConfig
from raylastic.jobconfig.naming import controller_name, trial_run_name
from raylastic.strategies.checkpoint_catalogue import latest_checkpoint
from raylastic.strategies.checkpoint_manifest import read_manifest
from raylastic.tuning import EarlyStopping, SweepResult, sweep
from tests.support.helpers import job, wait_until_cpus_free

pytestmark = pytest.mark.usefixtures("ray_local")

STEPS = 40
NUM_SAMPLES = 5
SPACE = {"optim.lr": {"loguniform": [1e-5, 1e-1]}, "training.global_batch_size": {"choice": [32, 64]}}
FIRST = [{"optim.lr": 1e-5, "training.global_batch_size": 32},   # terrible: completes, the worst
         {"optim.lr": 3e-3, "training.global_batch_size": 32},   # good
         {"optim.lr": 3e-5, "training.global_batch_size": 32}]   # bad: stopped by ASHA at step 10
ASHA = EarlyStopping(grace_period_steps=10, reduction_factor=2)
CHECKPOINT_EVERY = 5  # the interrupted trial has saved one before ASHA's first rung (step 10) can stop it


class InterruptTrial(tune.Callback):
    """Sends this process SIGUSR1 (Tune's Ctrl-C) when the ``number``-th trial (0-based) reports step
    ``after_step``; past a multiple of ``CHECKPOINT_EVERY``, its job has a checkpoint to resume from.

    Tune saves callbacks with the sweep and restores them on resume: the flag file keeps this one
    from interrupting the resumed sweep too.
    """

    def __init__(self, number: int, after_step: int, flag: Path) -> None:
        self.number, self.after_step, self.flag, self.seen = number, after_step, flag, []

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if trial.trial_id not in self.seen:
            self.seen.append(trial.trial_id)
        chosen = len(self.seen) > self.number and trial.trial_id == self.seen[self.number]
        if chosen and result.get("step", 0) >= self.after_step and not self.flag.exists():
            self.flag.touch()
            os.kill(os.getpid(), signal.SIGUSR1)


def base_job() -> JobConfig:
    return job(f"training.steps={STEPS}", "scaling.min_workers=1", "scaling.max_workers=1",
               "scaling.cpus_per_worker=0.25", f"checkpoint.every_steps={CHECKPOINT_EVERY}", name="tune")


def run_sweep(storage: Path, **options) -> SweepResult:
    return sweep(base_job(), SPACE, num_samples=NUM_SAMPLES, metric="accuracy", mode="max", name="digits",
                 storage_path=storage, max_concurrent_trials=1, early_stopping=ASHA, points_to_evaluate=FIRST,
                 **options)


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """The sweep interrupted while its 4th trial runs, what its jobs had written then, the resumed sweep."""
    storage = tmp_path_factory.mktemp("sweeps")
    interrupted = run_sweep(storage, callbacks=[InterruptTrial(3, CHECKPOINT_EVERY + 1, storage / "interrupted")])
    jobs = storage / "digits" / "jobs"
    unfinished = set(interrupted.dataframe.query("status == 'unfinished'")["trial_id"])  # its job wrote "killed"
    written = {path: path.stat().st_mtime_ns for path in jobs.glob("*/result.json")
               if path.parent.name not in unfinished}
    checkpoints = {path.parent.name: latest_checkpoint(str(path)) for path in jobs.glob("*/checkpoints")}
    resumed = run_sweep(storage, resume=True)
    return interrupted, Snapshot(written, checkpoints), resumed


@dataclass
class Snapshot:
    results: dict[Path, int]
    """Each finished trial's job result.json, with its mtime."""
    checkpoints: dict[str, object]
    """Newest complete checkpoint of each trial's job (by trial id), or None."""


def test_sweep_ranks_five_trials_and_the_best_beats_the_worst(sweeps):
    _, _, result = sweeps
    frame = result.dataframe
    assert len(frame) == NUM_SAMPLES and frame["trial_id"].is_unique
    assert set(frame["status"]) <= {"completed", "early_stopped"}
    completed = result.completed
    assert len(completed) >= 2
    best, worst = completed["accuracy"].max(), completed["accuracy"].min()
    assert best > 0.75 and best - worst > 0.4, frame.to_string()
    best_job = result.best_config
    assert isinstance(best_job, JobConfig) and best_job.name == "digits-best"
    assert best_job.optim.lr == pytest.approx(result.best["optim.lr"])
    assert best_job.training.global_batch_size in (32, 64)
    row = frame.iloc[0]
    assert (row["optim.lr"], row["status"], row["steps"], row["failures"]) == (1e-5, "completed", STEPS, 0)
    saved = json.loads((Path(row["run_dir"]) / "result.json").read_text())
    assert saved["name"] == f"digits-{row['trial_id']}" and saved["config"]["optim"]["lr"] == 1e-5


def test_asha_stops_a_bad_trial_early(sweeps):
    _, _, result = sweeps
    frame = result.dataframe
    stopped = frame[frame["status"] == "early_stopped"]
    assert len(stopped) >= 1, frame.to_string()
    assert (stopped["steps"] < STEPS).all() and stopped["accuracy"].isna().all()
    assert frame.iloc[2]["status"] == "early_stopped"  # lr 3e-5, worse than the median at step 10
    # each stopped job kept the step it stopped at, as a Ctrl-C does; the sweep's last trial is left out: Tune ends
    # the experiment by terminating its actor without waiting for the trial's thread (docs/sweeps.md)
    kept = stopped[stopped.index != frame.index[-1]]
    assert len(kept) >= 1, frame.to_string()
    for run_dir in kept["run_dir"]:
        saved = json.loads((Path(run_dir) / "result.json").read_text())
        assert saved["status"] == "stopped" and read_manifest(saved["checkpoint"]).step == saved["final_step"], saved
        assert torch.load(Path(run_dir) / "model.pt", weights_only=True)


def test_resume_continues_without_rerunning_finished_trials(sweeps):
    interrupted, snapshot, resumed = sweeps
    assert interrupted.interrupted and not resumed.interrupted
    before = interrupted.dataframe.set_index("trial_id")
    finished = before[before["status"] != "unfinished"]
    assert len(finished) == 3 and (before["status"] == "unfinished").sum() == 1
    after = resumed.dataframe.set_index("trial_id")
    assert set(before.index) <= set(after.index)
    assert len(after) == NUM_SAMPLES  # the searcher's state came back: 5 trials in all, not 5 more
    assert len(snapshot.results) >= 2 and all(p.stat().st_mtime_ns == t for p, t in snapshot.results.items())
    for trial_id, row in finished.iterrows():
        assert (after.loc[trial_id, "status"], after.loc[trial_id, "steps"]) == (row["status"], row["steps"])


def test_an_interrupted_trial_continues_from_its_jobs_checkpoint(sweeps):
    interrupted, snapshot, resumed = sweeps
    frame = interrupted.dataframe
    trial_id = frame.loc[frame["status"] == "unfinished", "trial_id"].item()
    row = resumed.dataframe.set_index("trial_id").loc[trial_id]
    assert row["status"] == "completed" and row["steps"] == STEPS
    events = json.loads((Path(row["run_dir"]) / "result.json").read_text())["events"]
    checkpoint = snapshot.checkpoints[trial_id]
    assert checkpoint is not None and checkpoint.manifest.step >= CHECKPOINT_EVERY
    resumed_at = [e["step"] for e in events if e["type"] == "resumed"]
    # (a write racing the kill of the stopped job's workers may add a newer one)
    assert len(resumed_at) == 1 and resumed_at[0] >= checkpoint.manifest.step, (checkpoint, events)


def test_an_existing_sweep_is_only_continued_on_purpose(sweeps, tmp_path):
    _, _, result = sweeps
    with pytest.raises(ValueError, match="already exists .* resume it"):
        run_sweep(result.path.parent)
    with pytest.raises(ValueError, match="its base job differs"):
        sweep(job("training.steps=41", "scaling.min_workers=1", "scaling.max_workers=1",
                  "scaling.cpus_per_worker=0.25", name="tune"), SPACE, num_samples=NUM_SAMPLES, metric="accuracy",
              mode="max", name="digits", storage_path=result.path.parent, resume=True)


def test_nothing_is_left_running_after_a_sweep(sweeps):
    _, _, result = sweeps
    for trial_id in result.dataframe["trial_id"]:
        with pytest.raises(ValueError):
            ray.get_actor(controller_name(trial_run_name("digits", trial_id)))
    wait_until_cpus_free()


def test_plots_and_notebook_display(sweeps, tmp_path):
    _, _, result = sweeps
    paths = result.plots(tmp_path)
    assert sorted(p.name for p in paths) == ["accuracy_vs_optim.lr.png", "accuracy_vs_training.global_batch_size.png",
                                             "optimization_history.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000 for p in paths)
    page = result._repr_html_()
    assert page.count("<img") == 3 and "<table" in page and "best accuracy" in page


def test_worker_killed_inside_a_trial_the_trial_still_completes(tmp_path):
    """Also the default objective: the training loss, minimized."""
    base = job("training.steps=30", "scaling.min_workers=1", "scaling.max_workers=2", "scaling.cpus_per_worker=0.25",
               "failure.step_timeout_s=4", "faults=[{action: kill, rank: 1, step: 10}]", name="tune-fault")
    result = sweep(base, {"optim.lr": {"choice": [3e-3]}}, num_samples=1, name="fault", storage_path=tmp_path,
                   early_stopping=None)
    row = result.dataframe.iloc[0]
    assert (row["status"], row["steps"], row["failures"]) == ("completed", 30, 1), result.dataframe.to_string()
    assert result.metric == "loss" and 0 < row["loss"] < 1.5 and result.best["trial_id"] == row["trial_id"]
    saved = json.loads((Path(row["run_dir"]) / "result.json").read_text())
    events = [e["type"] for e in saved["events"]]
    assert events.count("worker_failed") == 1 and "recovered" in events
    assert saved["metrics"]["accuracy"] > 0.5
