"""Jobs on a real ``ray start --head``: ``ray job submit --working-dir .`` and the ``ray submit`` entry script.

One head node for the module (started and stopped here, see ``tests/support/ray_head.py``), with token
authentication on as Ray 2.60 sets it up and its dashboard/job server on 127.0.0.1 only. Checks, in
the order a user meets them: the ``ray job`` CLI without ``RAY_AUTH_MODE=token`` is refused with
Ray's "no authentication token was found"; with it, ``ray job submit --working-dir . -- python -m
cluster train ...`` reaches SUCCEEDED with the final metrics in its logs; a bad config reaches
FAILED with the one-line reason; ``cluster/entry.py``, copied to a home directory and run from
there the way ``ray submit`` runs it, trains a workload that lives only in the repository
(laptop mode: ``train --address auto`` against ``ray start --head``); and with no cluster at all
``raylastic train`` starts its own Ray, without a job server, and leaves no process behind.
Drivers find the head through ``RAY_ADDRESS``: on this shared machine plain ``auto`` could pick
another user's cluster.

Last, the observability of a running job: a slowed job (``tests.support.user_workload:SlowDigits``) in which
rank 1 is killed at step 5, so the run also has a failure and a recovery to report. While it trains, Ray's
Prometheus endpoint (the head's known metrics-export port) is scraped over loopback until every
``ray_raylastic_*`` series carries the run's tag, and ``raylastic status`` is run as a user would run it. The
job is then stopped with Ctrl-C (SIGINT).

    python -m pytest tests/test_cluster_submit.py -q
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.support.helpers import with_ctrl_c_enabled
from tests.support.ray_head import (
    PRESTART_OFF,
    VENV_BIN,
    RayHead,
    auth_token,
    listening_addresses,
    python_without_raylastic,
    session_processes,
    start_head,
    stop_head,
)

pytestmark = pytest.mark.processes

REPO_ROOT = Path(__file__).resolve().parent.parent
EXCLUDES = [".venv", ".git", "runs", "benchmarks/results", "*.egg-info", "**/__pycache__", ".pytest_cache",
            ".ruff_cache"]
SHORT_JOB = ["--set", "training.steps=20", "--set", "training.global_batch_size=48",
             "--set", "scaling.cpus_per_worker=0.5"]
ONE_WORKER = ["--set", "scaling.min_workers=1", "--set", "scaling.max_workers=1"]  # where distribution is not the point
JOB_TIMEOUT_S = 150
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


@pytest.fixture(scope="module")
def head():
    # Workers push their metrics to the node's agent every second instead of every 10 s.
    head = start_head(extra_env={"RAY_metrics_report_interval_ms": "1000"})
    try:
        yield head
    finally:
        stop_head(head)


def _run(command: list[str], head: RayHead, *, cwd: Path = REPO_ROOT, timeout: float = JOB_TIMEOUT_S,
         **env: str) -> subprocess.CompletedProcess:
    """Run ``command`` against the head: a ``ray job`` command by the dashboard URL, anything else as a driver."""
    driver = not (Path(command[0]).name == "ray" and command[1] == "job")
    try:
        return subprocess.run(command, cwd=cwd, env=head.client_env(driver=driver, **env), capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{command[:4]} timed out after {timeout} s:\n{error.stdout}\n{error.stderr}\n"
                    f"head log:\n{head.log()[-2000:]}")


def _jobs_client(head: RayHead):
    """The SDK with the token passed explicitly, so this process's Ray auth mode is not changed."""
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(head.dashboard_url, headers={"Authorization": f"Bearer {auth_token()}"})


def _wait_for_end(client, job_id: str, timeout_s: float = JOB_TIMEOUT_S):
    from ray.job_submission import JobStatus

    deadline = time.monotonic() + timeout_s
    while (status := client.get_job_status(job_id)) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        if time.monotonic() > deadline:
            client.stop_job(job_id)
            pytest.fail(f"job {job_id} still {status} after {timeout_s} s:\n{client.get_job_logs(job_id)[-3000:]}")
        time.sleep(0.5)
    return status


def test_head_has_token_auth_and_the_job_cli_needs_ray_auth_mode(head: RayHead) -> None:
    assert "Token authentication is enabled" in head.log()
    dashboard_and_job_server = listening_addresses(int(head.dashboard_url.rsplit(":", 1)[1]))
    assert dashboard_and_job_server and dashboard_and_job_server <= LOOPBACK, dashboard_and_job_server
    refused = _run([str(VENV_BIN / "ray"), "job", "list", "--address", head.dashboard_url], head, timeout=60)
    assert refused.returncode != 0
    assert "no authentication token was found" in refused.stdout + refused.stderr


@pytest.fixture(scope="module")
def bad_config_job(head: RayHead) -> str:
    """A job whose config is invalid, submitted through the SDK (it runs alongside the next test's job)."""
    return _jobs_client(head).submit_job(entrypoint="python -m raylastic train --set training.steps=0",
                                         runtime_env={"working_dir": str(REPO_ROOT), "excludes": EXCLUDES})


def test_ray_job_submit_to_a_head_without_raylastic_trains_to_success_with_metrics_in_the_logs(tmp_path) -> None:
    """The head's Python has raylastic's dependencies and not raylastic: the job's driver and workers import it
    from the uploaded working directory (as they do on any head: the working directory comes first)."""
    bin_dir = python_without_raylastic(tmp_path / "venv")
    bare_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # it may name a checkout
    missing = subprocess.run([str(bin_dir / "python"), "-c", "import raylastic"], cwd=tmp_path, env=bare_env,
                             capture_output=True, text=True)
    assert "No module named 'raylastic'" in missing.stderr
    bare = start_head(bin_dir=bin_dir, without=("PYTHONPATH",))
    try:
        where = "python -c 'import raylastic; print(\"raylastic from\", raylastic.__file__)'"
        job = shlex.join(["python", "-m", "raylastic", "train", "--set", "name=bare", *SHORT_JOB, *ONE_WORKER])
        job_id = f"raylastic-ok-{uuid.uuid4().hex[:8]}"
        submitted = _run([str(bin_dir / "ray"), "job", "submit", "--address", bare.dashboard_url, "--working-dir", ".",
                          "--submission-id", job_id, "--runtime-env-json", json.dumps({"excludes": EXCLUDES}), "--",
                          "sh", "-c", f"{where} && {job}"], bare, RAY_AUTH_MODE="token")
        output = submitted.stdout + submitted.stderr
        assert submitted.returncode == 0 and f"Job '{job_id}' succeeded" in output, output[-4000:]

        from ray.job_submission import JobStatus

        client = _jobs_client(bare)
        assert client.get_job_status(job_id) == JobStatus.SUCCEEDED
        logs = client.get_job_logs(job_id)
    finally:
        stop_head(bare)
    assert re.search(r"raylastic from \S*working_dir_files\S*/raylastic/__init__.py", logs), logs[-4000:]
    assert "finished step 20: loss " in logs and "accuracy" in logs, logs[-3000:]
    assert "step 20/20  loss" in logs  # progress lines stream into the job's logs
    assert "generation_formed" in logs


def test_job_with_a_bad_config_fails_with_the_reason_in_its_logs(head: RayHead, bad_config_job: str) -> None:
    from ray.job_submission import JobStatus

    client = _jobs_client(head)
    assert _wait_for_end(client, bad_config_job) == JobStatus.FAILED
    logs = client.get_job_logs(bad_config_job)
    assert "error: training.steps must be a positive integer, got 0" in logs, logs[-3000:]
    assert "Traceback" not in logs
    assert "exit code 2" in (client.get_job_info(bad_config_job).message or "")


def test_entry_script_runs_as_ray_submit_runs_it(head: RayHead, tmp_path: Path) -> None:
    """``ray submit`` copies the script to ~/entry.py on the head and runs ``python ~/entry.py ARGS`` from ~."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / "raylastic").symlink_to(REPO_ROOT)  # what cluster.yaml's file_mounts put there
    (home / ".ray" / "auth_token").write_text(auth_token())
    script = Path(shutil.copy(REPO_ROOT / "cluster" / "entry.py", home / "entry.py"))
    # tests.support.user_workload is importable only from the repository: the script must find it, and the workers too.
    finished = _run(["python", str(script), "train", "--set", "name=entry",
                     "--set", "workload.name=tests.support.user_workload:Parity", *SHORT_JOB, *ONE_WORKER],
                    head, cwd=home, HOME=str(home))
    output = finished.stdout + finished.stderr
    assert finished.returncode == 0, output[-4000:]
    assert "finished step 20: loss " in output and "accuracy" in output
    assert json.loads((home / "runs" / "entry" / "result.json").read_text())["status"] == "finished"


def test_entry_passes_the_commands_exit_code_and_adds_address_auto_only_when_none_is_given(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from raylastic.cluster import entry

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    assert entry.main(["train", "--set", "scaling.min_workers=3", "--set", "scaling.max_workers=2"]) == 2
    assert "error: scaling.min_workers (3)" in capsys.readouterr().err  # bad config: refused before Ray starts
    assert entry.with_default_address(["train", "--set", "a=1"]) == ["train", "--set", "a=1", "--address", "auto"]
    assert entry.with_default_address(["train", "--address=10.0.0.1:6379"]) == ["train", "--address=10.0.0.1:6379"]
    assert entry.with_default_address(["status"]) == ["status"]


def test_without_a_cluster_train_starts_and_stops_its_own_local_instance(head: RayHead, tmp_path: Path) -> None:
    """Laptop mode with no cluster: the CLI starts Ray for the run (no dashboard HTTP server, so no job
    server) and every process of that instance is gone after it. The module's head is not used. The console
    script runs where the user's workload module is, without PYTHONPATH: the driver and the workers import it
    from there."""
    (tmp_path / "my_workload.py").write_text(
        "from raylastic.workloads.digits import Digits\n\n\nclass MyDigits(Digits):\n    pass\n")
    env = {k: v for k, v in head.client_env(driver=False, **PRESTART_OFF).items() if k != "PYTHONPATH"}
    command = [str(VENV_BIN / "raylastic"), "train", "--set", "name=local", "--run-dir", "run",
               "--set", "workload.name=my_workload:MyDigits", *SHORT_JOB, *ONE_WORKER]
    driver = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    seen: dict[int, str] = {}
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while driver.poll() is None and time.monotonic() < deadline:
        seen.update(session_processes(f"_{driver.pid}"))  # the session of a ray.init ends in its driver's pid
        time.sleep(0.3)
    if driver.poll() is None:
        driver.kill()
    output = driver.communicate()[0]
    assert driver.returncode == 0, output[-3000:]
    assert "finished step 20: loss " in output
    assert any("raylet" in command for command in seen.values()), "the run's own Ray instance was not seen"
    dashboards = [command for command in seen.values() if "dashboard/dashboard.py" in command]
    assert all("--host=127.0.0.1" in c and "--modules-to-load=UsageStatsHead" in c for c in dashboards), dashboards
    deadline = time.monotonic() + 60
    while (left := session_processes(f"_{driver.pid}")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of the run's Ray instance outlived it: {left}"
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert (result["status"], result["config"]["workload"]["name"]) == ("finished", "my_workload:MyDigits")


# -- a running job observed ------------------------------------------------------------------------------------

RUN = "observed"
"""The observed job's name."""
SERIES = ("ray_raylastic_step", "ray_raylastic_loss", "ray_raylastic_samples_per_s", "ray_raylastic_world_size",
          "ray_raylastic_failures_total", "ray_raylastic_recoveries_total")
METRICS_TIMEOUT_S = 60.0
RECOVERY_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def running_job(head: RayHead, tmp_path_factory: pytest.TempPathFactory):
    """``raylastic train --address auto`` of a long, slowed run; yields once it has failed and recovered."""
    run_dir = tmp_path_factory.mktemp("run")
    output = run_dir / "driver.log"
    command = [sys.executable, "-m", "raylastic", "train", "--address", "auto", "--run-dir", str(run_dir),
               "--set", f"name={RUN}", "--set", "workload.name=tests.support.user_workload:SlowDigits",
               "--set", "workload.options={pause_s: 0.05}", "--set", "training.steps=5000",
               "--set", "scaling.min_workers=1", "--set", "scaling.max_workers=2",
               "--set", "scaling.cpus_per_worker=0.5", "--set", "faults=[{action: kill, rank: 1, step: 5}]"]
    with open(output, "w") as log:
        driver = subprocess.Popen(with_ctrl_c_enabled(command), cwd=REPO_ROOT, env=head.client_env(), stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while ": recovered" not in output.read_text():
            if driver.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the job did not recover while running:\n{output.read_text()[-3000:]}")
            time.sleep(0.5)
        yield driver
    finally:
        if driver.poll() is None:
            driver.send_signal(signal.SIGINT)  # Ctrl-C: the run stops at the next step boundary
            try:
                driver.wait(timeout=30)
            except subprocess.TimeoutExpired:
                driver.kill()
                driver.wait()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def _run_series(text: str) -> dict[str, float]:
    """Our series tagged with this run: name -> value."""
    found = {}
    for line in text.splitlines():
        match = re.match(r"(ray_raylastic_\w+)\{([^}]*)\} (\S+)$", line)
        if match and f'run="{RUN}"' in match.group(2):
            found[match.group(1)] = float(match.group(3))
    return found


def test_run_metrics_reach_rays_prometheus_endpoint(head: RayHead, running_job: subprocess.Popen) -> None:
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    while not set(SERIES) <= (series := _run_series(_scrape(head.metrics_port))).keys():
        if time.monotonic() > deadline:
            pytest.fail(f"after {METRICS_TIMEOUT_S} s, only {sorted(series)} of {SERIES} carry run={RUN!r}")
        time.sleep(1.0)
    assert running_job.poll() is None, "the job should still be running"
    assert series["ray_raylastic_step"] >= 5
    assert series["ray_raylastic_loss"] > 0 and series["ray_raylastic_samples_per_s"] > 0
    assert series["ray_raylastic_world_size"] in (1, 2)
    assert series["ray_raylastic_failures_total"] >= 1 and series["ray_raylastic_recoveries_total"] >= 1


def _status(head: RayHead, *args: str) -> subprocess.Popen:
    return subprocess.Popen(["python", "-m", "raylastic", "status", *args], cwd=REPO_ROOT, env=head.client_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_status_shows_the_running_job(head: RayHead, running_job: subprocess.Popen) -> None:
    started = {"all": _status(head), "missing": _status(head, "no-such-run")}
    done = {key: (p.wait(timeout=90), *p.communicate()) for key, p in started.items()}

    code, out, err = done["all"]  # the runs on the cluster, and the details of the only one
    assert code == 0, out + err
    live = "(placing|forming|running|resizing|recovering|waiting_for_workers)"  # the Controller's state
    assert re.search(rf"{RUN}: {live}, step ", out), out
    assert re.search(rf"run {RUN}: {live}  step \d+  generation \d+  world size [12]  failures [1-9]", out), out
    assert re.search(rf"0  raylastic:{RUN}:worker\d+  [0-9a-f]{{56}}", out), out  # members: rank, name, node id
    assert "worker_failed" in out and "recovered" in out  # recent events
    assert "loss" in out and "samples/s" in out

    code, out, err = done["missing"]
    assert code == 1
    assert "no run named 'no-such-run' is running on this cluster" in err and RUN in err
