"""How a run ends from outside, on a real local Ray: SIGTERM to a ``raylastic train`` driver (what ``ray job stop``
sends), a Controller that does not stop in time, a Controller killed under a long-lived driver. Each leaves
result.json saying how the run ended and no placement group of the run behind. And where the job's processes
import the user's modules from: after the standard library.

    python -m pytest tests/test_endings.py -q
"""

from __future__ import annotations

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
from pathlib import Path

import pytest
import ray

from raylastic.actors.status.run import RunStatus
from raylastic.cluster.import_path import after_standard_library
from raylastic.cluster.job import RunStopped, train
from raylastic.cluster.termination import StopRequest, sigterm_asks
from raylastic.jobconfig.naming import controller_name
from tests.support.helpers import held_slots, job, wait_until_gone

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
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no line matched {pattern!r} in:\n{''.join(self.seen)}")


# -- SIGTERM to a driver -------------------------------------------------------------------------------------


@pytest.mark.usefixtures("ray_local")
def test_sigterm_to_raylastic_train_stops_at_a_step_boundary_writes_stopped_and_ends_the_mlflow_run(tmp_path,
                                                                                                   monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file: stores behind this switch
    run_dir, mlruns = tmp_path / "run", (tmp_path / "mlruns").as_uri()
    overrides = [*SLOW, "name=sigterm", "training.steps=400", "scaling.min_workers=1", "scaling.max_workers=1",
                 "scaling.cpus_per_worker=0.5", f"tracking.mlflow_uri={mlruns}"]
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "CI": "true", "PYTHONUNBUFFERED": "1"}
    # The driver joins this module's Ray, which outlives it: what it leaves behind can be looked at.
    command = [*raylastic(), "train", *[f"--set={item}" for item in overrides], "--run-dir", str(run_dir),
               "--address", ray.get_runtime_context().gcs_address]
    driver = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        lines = Lines(driver)
        shown = int(lines.wait_for(r"^step (\d+)/400").group(1))  # mid-run: plain progress lines every 20 steps
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=120)
    finally:
        driver.kill()
    output = "".join(lines.seen)
    assert driver.returncode == 1, output

    saved = json.loads((run_dir / "result.json").read_text())
    assert saved["status"] == "stopped" and "SIGTERM" in saved["error"], saved.get("error")
    steps = [row["step"] for row in saved["history"]]
    assert shown <= saved["final_step"] < 400 and steps == list(range(1, saved["final_step"] + 1))  # a boundary
    assert f"at step {saved['final_step']}" in saved["error"], saved["error"]

    import mlflow

    client = mlflow.MlflowClient(mlruns)
    [run] = client.search_runs([client.get_experiment_by_name("raylastic").experiment_id])
    assert run.info.status == "KILLED" and run.info.end_time is not None
    assert {artifact.path for artifact in client.list_artifacts(run.info.run_id)} >= {"result.json", "events.json"}
    assert held_slots("sigterm") == []
    wait_until_gone(controller_name("sigterm"))


@pytest.mark.usefixtures("ray_local")
def test_a_controller_that_does_not_stop_within_the_bound_is_ended_and_result_json_still_says_stopped(
        tmp_path, monkeypatch):
    assert threading.current_thread() is threading.main_thread(), "the SIGTERM handler needs the main thread"
    # The stalled step takes 600 s; within the bound, the watcher below reads result.json's first word.
    monkeypatch.setattr("raylastic.cluster.job.STOP_TIMEOUT_S", 10.0)
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

