"""How the tests' ``ray start`` nodes are waited for (tests/support/ray_head.py): a start that ends before its node is
up (Ray's raylet aborting when its dashboard agent is slow to start, START_ATTEMPTS) is told apart from one that is up
and from one that hangs, so the first is started again and the others are not."""

from __future__ import annotations

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
