"""Observability of a running job: Ray's Prometheus endpoint carries its metrics, ``raylastic status`` shows it.

A real ``ray start --head`` with a known metrics-export port (``tests/support/ray_head.py``), and one
slowed job (``tests.support.user_workload:SlowDigits``) in which rank 1 is killed at step 5, so the run also
has a failure and a recovery to report. While it trains: the endpoint is scraped over loopback
until every ``ray_raylastic_*`` series carries the run's tag, and ``raylastic status`` is run as a
user would run it. The job is then stopped with Ctrl-C (SIGINT).

    python -m pytest tests/test_status_metrics.py -q
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.helpers import with_ctrl_c_enabled
from tests.support.ray_head import RayHead, start_head, stop_head

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN = "observed"
SERIES = ("ray_raylastic_step", "ray_raylastic_loss", "ray_raylastic_samples_per_s", "ray_raylastic_world_size",
          "ray_raylastic_failures_total", "ray_raylastic_recoveries_total")
METRICS_TIMEOUT_S = 60.0
RECOVERY_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def head():
    # Workers push their metrics to the node's agent every second instead of every 10 s.
    head = start_head(extra_env={"RAY_metrics_report_interval_ms": "1000"})
    try:
        yield head
    finally:
        stop_head(head)


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
