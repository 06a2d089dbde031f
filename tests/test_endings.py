"""How a run ends from outside, on a real local Ray: SIGTERM to a ``raylastic train`` driver (what ``ray job stop``
sends), a Controller that does not stop in time, a Controller killed under a long-lived driver. Each leaves
result.json saying how the run ended and no placement group of the run behind. And where the job's processes
import the user's modules from: after the standard library.

    python -m pytest tests/test_endings.py -q
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch

from raylastic.actors.status.run import RunStatus
from raylastic.cluster.import_path import after_standard_library
from raylastic.cluster.job import RunFailed, RunStopped, train
from raylastic.cluster.termination import StopRequest, sigterm_asks
from raylastic.jobconfig.naming import controller_name
from raylastic.strategies.checkpoint_manifest import read_manifest
from tests.support.helpers import held_slots, job, wait_until_gone, with_ctrl_c_enabled

REPO_ROOT = Path(__file__).resolve().parent.parent
SLOW = ("workload.name=tests.support.user_workload:SlowDigits", "workload.options={pause_s: 0.05}")
STALLING = ("workload.name=tests.support.stall_workload:StallingDigits",
            "workload.options={stall_from: 3, stall_s: 600}",
            "scaling.min_workers=1", "scaling.max_workers=1")


def raylastic() -> list[str]:
    script = shutil.which("raylastic", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "raylastic"]


class Lines:
    """A subprocess's output, line by line, read in a thread so that every wait for a line has a bound."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout_s: float = 240) -> re.Match:
        for line in self._lines(timeout_s):
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no line matched {pattern!r} in:\n{''.join(self.seen)}")

    def drain(self, timeout_s: float = 30) -> None:
        """Take in the lines left, up to the end of the output (the process has ended)."""
        for _ in self._lines(timeout_s):
            pass

    def _lines(self, timeout_s: float) -> Iterator[str]:
        """The next lines, each kept in ``seen``, until the output ends or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            if line is None:
                return
            self.seen.append(line)
            yield line


# -- Ctrl-C and SIGTERM to a driver ---------------------------------------------------------------------------

STOP_STEPS = 100


class Driver:
    """``raylastic train`` as a user runs it, in a subprocess joined to this module's Ray (which outlives it, so
    what it leaves behind can be looked at); the same command every time."""

    def __init__(self, run_dir: Path, *overrides: str) -> None:
        self.command = [*raylastic(), "train", *[f"--set={item}" for item in overrides], "--run-dir", str(run_dir),
                        "--address", ray.get_runtime_context().gcs_address]
        self.env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "CI": "true",
                    "PYTHONUNBUFFERED": "1"}

    def start(self) -> tuple[subprocess.Popen, Lines]:
        process = subprocess.Popen(with_ctrl_c_enabled(self.command), cwd=REPO_ROOT, env=self.env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return process, Lines(process)

    def stop_past(self, step: int, signum: signal.Signals) -> tuple[int, str, float]:
        """Run the command, send it ``signum`` once a progress line is past ``step``; its exit code, its output and
        the seconds from the signal to its exit."""
        process, lines = self.start()
        try:
            while int(lines.wait_for(rf"^step (\d+)/{STOP_STEPS}").group(1)) <= step:
                pass
            process.send_signal(signum)
            signalled = time.monotonic()
            process.wait(timeout=120)
            took = time.monotonic() - signalled
        finally:
            process.kill()
        lines.drain()
        return process.returncode, "".join(lines.seen), took


def read_stop(run_dir: Path) -> dict:
    """result.json of a stopped run, checked: it names the checkpoint of the step it stopped at, model.pt is beside
    it, and its history is every step up to there."""
    saved = json.loads((run_dir / "result.json").read_text())
    assert saved["status"] == "stopped", saved.get("error")
    step = saved["final_step"]
    assert Path(saved["checkpoint"]).name == f"step_{step:08d}", saved
    assert read_manifest(saved["checkpoint"]).step == step
    model = torch.load(run_dir / "model.pt", weights_only=True)
    assert model and all(isinstance(tensor, torch.Tensor) for tensor in model.values())
    assert f"at step {step}" in saved["error"], saved["error"]
    return saved


@pytest.mark.usefixtures("ray_local")
def test_ctrl_c_then_sigterm_each_keep_their_step_and_the_same_command_resumes_from_it_and_finishes(tmp_path,
                                                                                                    monkeypatch):
    """Default settings (no periodic checkpoint): each stop saves the step it stopped at and model.pt, and
    result.json names that checkpoint; the same command resumes from it. SIGTERM is what ``ray job stop`` sends."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file: stores behind this switch
    run_dir, mlruns = tmp_path / "run", (tmp_path / "mlruns").as_uri()
    driver = Driver(run_dir, *SLOW, "name=stops", f"training.steps={STOP_STEPS}", "scaling.cpus_per_worker=0.5",
                    f"tracking.mlflow_uri={mlruns}")

    code, output, interrupt_s = driver.stop_past(20, signal.SIGINT)
    assert code == 1 and "Traceback" not in output, output
    interrupted = read_stop(run_dir)
    assert "Ctrl-C" in interrupted["error"] and 20 < interrupted["final_step"] < STOP_STEPS, interrupted["error"]
    steps = [row["step"] for row in interrupted["history"]]
    assert steps == list(range(1, interrupted["final_step"] + 1))  # a boundary: every step up to it, none after

    first_model = (run_dir / "model.pt").stat().st_mtime_ns
    code, output, terminate_s = driver.stop_past(interrupted["final_step"] + 10, signal.SIGTERM)
    assert code == 1 and "Traceback" not in output, output
    terminated = read_stop(run_dir)
    assert (run_dir / "model.pt").stat().st_mtime_ns != first_model
    assert "SIGTERM" in terminated["error"] and interrupted["final_step"] + 10 < terminated["final_step"] < STOP_STEPS
    assert [(e["type"], e["step"]) for e in terminated["events"] if e["type"] == "resumed"] == [
        ("resumed", interrupted["final_step"])]

    process, lines = driver.start()
    process.wait(timeout=300)
    lines.drain()
    assert process.returncode == 0, "".join(lines.seen)
    finished = json.loads((run_dir / "result.json").read_text())
    assert (finished["status"], finished["final_step"]) == ("finished", STOP_STEPS)
    assert [(e["type"], e["step"]) for e in finished["events"] if e["type"] == "resumed"] == [
        ("resumed", terminated["final_step"])]
    assert finished["history"][0]["step"] == terminated["final_step"] + 1
    print(f"signal to exit: Ctrl-C {interrupt_s:.2f} s, SIGTERM {terminate_s:.2f} s")

    import mlflow

    client = mlflow.MlflowClient(mlruns)
    runs = client.search_runs([client.get_experiment_by_name("raylastic").experiment_id],
                              order_by=["attributes.start_time ASC"])
    assert [run.info.status for run in runs] == ["KILLED", "KILLED", "FINISHED"]
    assert {artifact.path for artifact in client.list_artifacts(runs[1].info.run_id)} >= {"result.json", "events.json",
                                                                                          "model.pt"}
    assert held_slots("stops") == []
    wait_until_gone(controller_name("stops"))


@pytest.mark.usefixtures("ray_local")
def test_a_controller_that_does_not_stop_within_the_bound_is_ended_and_result_json_still_says_stopped(
        tmp_path, monkeypatch):
    assert threading.current_thread() is threading.main_thread(), "the SIGTERM handler needs the main thread"
    # The stalled step takes 600 s; within the bound, the watcher below reads result.json's first word.
    monkeypatch.setattr("raylastic.cluster.job.stop_bound_s", lambda job: 10.0)  # not failure.max_step_s + 15 s
    run_dir = tmp_path / "run"
    stopping: list[dict] = []

    def sigterm_after_step_2(progress: RunStatus) -> None:
        if progress.step >= 2 and not stopping:
            stopping.append({})
            os.kill(os.getpid(), signal.SIGTERM)  # as `ray job stop` does; step 3 stalls
            threading.Thread(target=watch_result_json, daemon=True).start()

    def watch_result_json() -> None:  # result.json says "stopped" while the driver still waits for the Controller
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not stopping[0]:
            if (run_dir / "result.json").exists():
                stopping[0] = json.loads((run_dir / "result.json").read_text())
            time.sleep(0.02)

    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunStopped, match=r"did not stop within 10 s") as stopped:
        train(job(*STALLING, name="stalled"), run_dir=run_dir, on_progress=sigterm_after_step_2,
              stop_on_sigterm=True)
    assert signal.getsignal(signal.SIGTERM) is handler  # put back after the run
    assert "SIGTERM" in str(stopped.value)
    early, saved = stopping[0], json.loads((run_dir / "result.json").read_text())
    assert (early["status"], early["final_step"]) == ("stopped", 2), early
    assert early["error"].startswith("terminated (SIGTERM): stopping at the next step boundary"), early  # not the last
    assert (saved["status"], saved["final_step"]) == ("stopped", 2) and "did not stop within" in saved["error"]
    assert held_slots("stalled") == []
    wait_until_gone(controller_name("stalled"))


@pytest.mark.usefixtures("ray_local")
def test_a_second_ctrl_c_ends_the_run_at_once_and_result_json_names_the_newest_complete_checkpoint(tmp_path):
    """The first Ctrl-C asks for a stop that a stalled step holds up; the second ends the run without waiting."""
    assert threading.current_thread() is threading.main_thread(), "Ctrl-C reaches the main thread"
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background runner may ignore SIGINT
    run_dir = tmp_path / "run"
    asked: list[float] = []

    def ctrl_c_after_step_2(progress: RunStatus) -> None:
        if progress.step >= 2 and not asked:
            asked.append(time.monotonic())
            threading.Thread(target=ctrl_c_again_once_stopping, daemon=True).start()
            raise KeyboardInterrupt  # as Ctrl-C raises it in the main thread; step 3 stalls

    def ctrl_c_again_once_stopping() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                if "stopping at the next step boundary" in json.loads((run_dir / "result.json").read_text())["error"]:
                    break
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)

    try:
        with pytest.raises(RunStopped, match=r"interrupted \(Ctrl-C\), then again: ended at once after step 2"):
            train(job(*STALLING, "checkpoint.every_steps=1", name="twice"), run_dir=run_dir,
                  on_progress=ctrl_c_after_step_2)
    finally:
        signal.signal(signal.SIGINT, previous)
    saved = json.loads((run_dir / "result.json").read_text())
    assert (saved["status"], saved["final_step"]) == ("stopped", 2), saved
    assert Path(saved["checkpoint"]).name == "step_00000002" and read_manifest(saved["checkpoint"]).step == 2
    assert not (run_dir / "model.pt").exists()  # the stop's gathering never happened
    assert held_slots("twice") == []
    wait_until_gone(controller_name("twice"))


@pytest.mark.usefixtures("ray_local")
def test_a_driver_whose_controller_stops_answering_gives_up_and_result_json_says_why(tmp_path, monkeypatch):
    """The Controller's process is stopped (SIGSTOP) mid-run: every progress call goes unanswered."""
    monkeypatch.setattr("raylastic.cluster.job.PROGRESS_ANSWER_S", 2.0)
    run_dir, stopped = tmp_path / "run", []

    def stop_the_controller_after_step_2(progress: RunStatus) -> None:
        if progress.step >= 2 and not stopped:
            controller = ray.get_actor(controller_name("silent"))
            stopped.append(ray.get(controller.__ray_call__.remote(lambda self: os.getpid()), timeout=60))
            os.kill(stopped[0], signal.SIGSTOP)

    try:
        with pytest.raises(RunFailed, match=r"did not answer 3 progress calls in a row \(each within 2 s\)"):
            train(job(*SLOW, "training.steps=400", "scaling.min_workers=1", "scaling.max_workers=1", name="silent"),
                  run_dir=run_dir, on_progress=stop_the_controller_after_step_2)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    saved = json.loads((run_dir / "result.json").read_text())
    assert saved["status"] == "failed" and saved["final_step"] >= 2, saved
    assert saved["error"].startswith(f"the Controller ({controller_name('silent')}) did not answer"), saved["error"]
    assert held_slots("silent") == []
    wait_until_gone(controller_name("silent"))


# -- the SIGTERM handler --------------------------------------------------------------------------------------


def test_sigterm_asks_for_a_stop_only_in_the_main_thread_and_the_previous_handler_comes_back():
    assert threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM)
    request = StopRequest()
    with sigterm_asks(request) as installed:
        assert installed
        os.kill(os.getpid(), signal.SIGTERM)  # the process lives on
        deadline = time.monotonic() + 30
        while request.reason is None and time.monotonic() < deadline:
            time.sleep(0.01)
    assert request.reason == "terminated (SIGTERM)"
    assert signal.getsignal(signal.SIGTERM) is before

    elsewhere: list[bool] = []

    def in_a_thread() -> None:
        with sigterm_asks(StopRequest()) as installed:
            elsewhere.append(installed)
            elsewhere.append(signal.getsignal(signal.SIGTERM) is before)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join(30)
    assert elsewhere == [False, True]


# -- where the job's processes import from ---------------------------------------------------------------------

PROBE = """
import sys
import ray
from raylastic.cluster.connect import ray_session

@ray.remote(num_cpus=0)
def imports():
    import sys
    import tabnanny
    import users_module
    return tabnanny.__file__, users_module.VALUE, sys.path

with ray_session(sys.argv[1]):
    print("PROBE", repr(ray.get(imports.remote(), timeout=120)))
"""


@pytest.mark.usefixtures("ray_local")
def test_workers_import_the_standard_library_before_the_working_directory_and_still_find_its_modules(tmp_path):
    (tmp_path / "tabnanny.py").write_text("raise ImportError('the working directory shadows the standard library')\n")
    (tmp_path / "users_module.py").write_text("VALUE = 42\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    probe = subprocess.run([sys.executable, "-c", PROBE, ray.get_runtime_context().gcs_address], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=300)
    found = re.search(r"^PROBE (.*)$", probe.stdout, re.MULTILINE)
    assert probe.returncode == 0 and found, probe.stdout + probe.stderr
    module_file, value, path = eval(found.group(1))  # noqa: S307 - our own repr of strings and ints
    standard_library = sysconfig.get_paths()["stdlib"]
    assert Path(module_file).parent == Path(standard_library) and value == 42
    assert path.index(str(tmp_path)) > path.index(standard_library), path
    assert path.count(str(tmp_path)) == 1, path


def test_after_standard_library_moves_every_copy_of_the_directories_behind_it():
    stdlib = "/py/lib/python3.11"
    sys_path = ["/work", "/ray/thirdparty", "/work", "/py/lib/python311.zip", stdlib, f"{stdlib}/lib-dynload",
                f"{stdlib}/site-packages", "/venv/site-packages"]
    assert after_standard_library(sys_path, ["/work", "/work/"], [stdlib]) == [
        "/ray/thirdparty", "/py/lib/python311.zip", stdlib, f"{stdlib}/lib-dynload", "/work",
        f"{stdlib}/site-packages", "/venv/site-packages"]
    assert after_standard_library(["/a", "/b"], ["/c"], [stdlib]) == ["/a", "/b", "/c"]  # no stdlib seen: last

