"""A run's directory on a real local Ray (gloo): refused before any actor starts when it cannot be used,
held by one run at a time, and left with result.json however the run ends (model.pt first on success)."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import ray

from raylastic.actors.status.run import RunFailed, RunStatus
from raylastic.cluster.job import train
from raylastic.jobconfig.naming import controller_name, worker_name
from tests.support.helpers import held_slots, job, strict_json, wait_until_gone

pytestmark = pytest.mark.usefixtures("ray_local")

ONE_WORKER = ("scaling.min_workers=1", "scaling.max_workers=1")
SLOW = ("workload.name=tests.support.user_workload:SlowDigits", "workload.options={pause_s: 0.05}")


class Background:
    """``train`` in a thread, as a second driver would run it; ``step`` is the newest step it heard of."""

    def __init__(self, config, run_dir: Path) -> None:
        self.step = 0
        self.outcome: object = None
        self.thread = threading.Thread(target=self._run, args=(config, run_dir), daemon=True)
        self.thread.start()

    def _run(self, config, run_dir: Path) -> None:
        try:
            self.outcome = train(config, run_dir=run_dir, on_progress=self._seen)
        except BaseException as error:  # noqa: BLE001 - the test inspects it
            self.outcome = error

    def _seen(self, progress: RunStatus) -> None:
        self.step = progress.step

    def wait_for_step(self, step: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while self.step < step and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.step >= step, (self.step, self.outcome)

    def result(self, timeout_s: float = 120) -> object:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "train() did not return"
        return self.outcome


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run with checkpoints at steps 2 and 4 (copy it before changing it)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train(job(*ONE_WORKER, "training.steps=4", "checkpoint.every_steps=2", name="finished"), run_dir=run_dir)
    return run_dir


# -- refused before any actor starts -------------------------------------------------------------------------


def file_in_the_way(tmp_path: Path) -> Path:
    (tmp_path / "a-file").write_text("not a directory")
    return tmp_path / "a-file" / "checkpoints"


def read_only(tmp_path: Path) -> Path:
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    (tmp_path / "read-only").mkdir(mode=0o500)
    return tmp_path / "read-only" / "checkpoints"


@pytest.mark.parametrize(("unwritable", "cause"), [(file_in_the_way, "NotADirectoryError"),
                                                   (read_only, "PermissionError")])
def test_a_checkpoint_path_that_takes_no_files_is_refused_before_any_actor_starts(tmp_path, unwritable, cause):
    path = unwritable(tmp_path)
    answers: list[RunStatus] = []
    with pytest.raises(RunFailed) as raised:
        train(job(*ONE_WORKER, f"checkpoint.path={path}", name="unwritable"), run_dir=tmp_path / "run",
              on_progress=answers.append)
    assert f"checkpoint path {path} is not writable: {cause}" in str(raised.value)
    assert answers == []  # no Controller ever answered: none was started
    assert not (tmp_path / "run" / "result.json").exists()  # not a run: the directory is left as it was


def test_resume_never_refuses_a_checkpoint_path_that_holds_checkpoints(finished, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    with pytest.raises(RunFailed) as raised:
        train(job(*ONE_WORKER, "training.steps=4", "checkpoint.resume=never", name="afresh"), run_dir=run_dir)
    message = str(raised.value)
    assert f"{run_dir / 'checkpoints'} holds checkpoints (step_00000002, step_00000004)" in message
    assert "delete that directory" in message and "checkpoint.path" in message
    assert strict_json(run_dir / "result.json")["status"] == "finished"  # the earlier run's record stays


def test_a_run_directory_or_checkpoint_path_in_use_is_refused_at_once_naming_the_holder(tmp_path):
    first_dir = tmp_path / "first"
    first = Background(job(*ONE_WORKER, *SLOW, "training.steps=40", name="first"), first_dir)
    first.wait_for_step(1)
    for run_dir, overrides, what in [
        (first_dir, (), f"run directory {first_dir}"),
        (tmp_path / "second", (f"checkpoint.path={first_dir / 'checkpoints'}",),
         f"checkpoint directory {first_dir / 'checkpoints'}"),
    ]:
        answers: list[RunStatus] = []
        with pytest.raises(RunFailed) as raised:
            train(job(*ONE_WORKER, *overrides, name="second"), run_dir=run_dir, on_progress=answers.append)
        assert f"{what} is in use by another run (pid {os.getpid()} on " in str(raised.value)
        assert answers == []  # refused before a Controller was started
    assert first.result().final_step == 40  # the first run never noticed
    assert strict_json(first_dir / "result.json")["status"] == "finished"


# -- every end leaves result.json ----------------------------------------------------------------------------


def test_a_controller_killed_mid_run_ends_it_with_result_json_naming_the_controller_and_no_slot_held(tmp_path):
    """As in a notebook: Ray stays up after the run, so nothing but the driver removes the killed Controller's
    placement groups."""
    run_dir = tmp_path / "run"
    running = Background(job(*SLOW, "training.steps=400", name="orphaned"), run_dir)
    running.wait_for_step(3)
    assert len(held_slots("orphaned")) == 2, held_slots("orphaned")
    ray.kill(ray.get_actor(controller_name("orphaned")))
    error = running.result(timeout_s=30)
    assert isinstance(error, RunFailed), error
    assert held_slots("orphaned") == []  # at once: train() removed them before it returned
    assert "the Controller (raylastic:orphaned:controller) died at step" in str(error)
    saved = strict_json(run_dir / "result.json")
    assert saved["status"] == "failed" and "raylastic:orphaned:controller" in saved["error"]
    assert saved["final_step"] >= 3 and [row["step"] for row in saved["history"]][:3] == [1, 2, 3]
    assert any(event["type"] == "generation_formed" for event in saved["events"])
    for number in (1, 2):  # they were the Controller's own actors
        wait_until_gone(worker_name("orphaned", number))


def test_a_model_file_that_cannot_be_written_fails_the_run_and_never_says_finished(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "model.pt").mkdir(parents=True)  # os.replace cannot put the model there, even as root
    (run_dir / "model.pt" / "keep").write_text("")
    with pytest.raises(RunFailed, match=r"could not write .*model\.pt: IsADirectoryError"):
        train(job(*ONE_WORKER, "training.steps=3", name="nomodel"), run_dir=run_dir)
    saved = strict_json(run_dir / "result.json")
    assert saved["status"] == "failed" and "model.pt" in saved["error"] and saved["final_step"] == 3
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(("model", "result"))) == [
        "model.pt", "result.json"]  # no temporary file left behind

