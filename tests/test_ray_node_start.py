"""How the tests' ``ray start`` nodes are waited for (tests/support/ray_head.py): a start that ends before its node is
up (Ray's raylet aborting when its dashboard agent is slow to start, START_ATTEMPTS) is told apart from one that is up
and from one that hangs, so the first is started again and the others are not."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.ray_head import start_head, stop_head, wait_until_up

SLOW_FIRST_AGENT = """
import os, sys, time
if sys.argv and sys.argv[0].endswith("dashboard/agent.py") and not os.path.exists(os.environ["SLOWED_ONCE"]):
    open(os.environ["SLOWED_ONCE"], "w").close()
    time.sleep(20)
"""
"""A sitecustomize that holds the first dashboard agent started 20 s before its imports, as a loaded machine did."""


def python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_a_start_that_exits_before_it_is_up_is_told_apart():
    process = python("import sys; sys.exit(1)")
    assert wait_until_up(process, lambda: False, timeout_s=30) is False
    assert process.returncode == 1


def test_a_start_that_is_up_is_kept_running():
    process = python("import time; time.sleep(30)")
    began = time.monotonic()
    try:
        assert wait_until_up(process, lambda: time.monotonic() - began > 0.6, timeout_s=30) is True
        assert process.poll() is None
    finally:
        process.kill()
        process.wait()


def test_a_start_that_is_never_up_fails_after_its_timeout_naming_the_command():
    process = python("import time; time.sleep(30)")
    try:
        with pytest.raises(RuntimeError, match=r"-c import time.* was not up within 1 s"):
            wait_until_up(process, lambda: False, timeout_s=1)
    finally:
        process.kill()
        process.wait()


@pytest.mark.processes
def test_a_head_whose_raylet_gave_up_on_a_slow_dashboard_agent_is_started_again(tmp_path: Path):
    (tmp_path / "sitecustomize.py").write_text(SLOW_FIRST_AGENT)
    slowed_once = tmp_path / "slowed_once"
    head = start_head(extra_env={"PYTHONPATH": str(tmp_path), "SLOWED_ONCE": str(slowed_once)})
    try:
        assert slowed_once.exists()  # the first start's agent was held past its raylet's 15 s: that start exited 1
        assert head.process.poll() is None and "Ray runtime started" in head.log()
    finally:
        stop_head(head)


LAPTOP_RUN = """
import psutil, ray
from raylastic.cluster.connect import ray_session
with ray_session():
    print("answer", ray.get(ray.remote(lambda: 42).remote(), timeout=60), flush=True)
left = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
print("left", [" ".join(p.cmdline())[:120] for p in left], flush=True)
"""


@pytest.mark.processes
def test_a_local_instance_whose_raylet_gave_up_on_a_slow_dashboard_agent_is_started_again(tmp_path: Path):
    """What ``train`` does with no cluster (laptop mode): the first start's agent is held past its raylet's 15 s, so
    ``ray.init`` fails; the failed start's processes are ended and the instance started again, and the run's Ray
    answers. Nothing of either start is left once the session ends."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_FIRST_AGENT)
    slowed_once = tmp_path / "slowed_once"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(tmp_path), SLOWED_ONCE=str(slowed_once))
    done = subprocess.run([sys.executable, "-c", LAPTOP_RUN], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert slowed_once.exists()  # the first start was held up
    assert "did not come up (attempt 1 of 3" in done.stderr, done.stderr[-3000:]
    assert "answer 42" in done.stdout and "left []" in done.stdout, (done.stdout, done.stderr[-3000:])
