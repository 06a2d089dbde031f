"""How the tests' ``ray start`` nodes are waited for (tests/support/ray_head.py): a start that ends before its node is
up (Ray's raylet aborting when its dashboard agent is slow to start, START_ATTEMPTS) is told apart from one that is up
and from one that hangs, so the first is started again and the others are not."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
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


LAPTOP_RUN = """
import psutil, ray
from raylastic.cluster.connect import ray_session
with ray_session():
    print("answer", ray.get(ray.remote(lambda: 42).remote(), timeout=60), flush=True)
left = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
print("left", [" ".join(p.cmdline())[:120] for p in left], flush=True)
"""


@dataclass
class LaptopRun:
    process: subprocess.Popen
    slowed_once: Path
    """Made once the first start's agent was held."""


@pytest.fixture(scope="module")
def laptop_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaptopRun]:
    """What ``train`` does with no cluster (laptop mode), its first start's agent held: started before the head's test
    so that the two held starts wait out their raylets' 15 s and their agents' 20 s at the same time."""
    directory = tmp_path_factory.mktemp("laptop")
    (directory / "sitecustomize.py").write_text(SLOW_FIRST_AGENT)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(directory), SLOWED_ONCE=str(directory / "slowed_once"))
    process = subprocess.Popen([sys.executable, "-c", LAPTOP_RUN], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        yield LaptopRun(process, directory / "slowed_once")
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.processes
@pytest.mark.usefixtures("laptop_run")
def test_a_head_whose_raylet_gave_up_on_a_slow_dashboard_agent_is_started_again(tmp_path: Path):
    (tmp_path / "sitecustomize.py").write_text(SLOW_FIRST_AGENT)
    slowed_once = tmp_path / "slowed_once"
    head = start_head(extra_env={"PYTHONPATH": str(tmp_path), "SLOWED_ONCE": str(slowed_once)})
    try:
        assert slowed_once.exists()  # the first start's agent was held past its raylet's 15 s: that start exited 1
        assert head.process.poll() is None and "Ray runtime started" in head.log()
    finally:
        stop_head(head)


@pytest.mark.processes
def test_a_local_instance_whose_raylet_gave_up_on_a_slow_dashboard_agent_is_started_again(
        laptop_run: LaptopRun):
    """The first start's agent is held past its raylet's 15 s, so ``ray.init`` fails; the failed start's processes
    are ended and the instance started again, and the run's Ray answers. Nothing of either start is left once the
    session ends."""
    stdout, stderr = laptop_run.process.communicate(timeout=240)
    assert laptop_run.process.returncode == 0, stderr[-3000:]
    assert laptop_run.slowed_once.exists()  # the first start was held up
    assert "did not come up (attempt 1 of 3" in stderr, stderr[-3000:]
    assert "answer 42" in stdout and "left []" in stdout, (stdout, stderr[-3000:])
