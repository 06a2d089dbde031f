"""Leaving Ray's niceness (actors/processes/priority.py) while the process's threads come and go."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.processes,
              pytest.mark.skipif(os.geteuid() != 0, reason="lowering niceness needs root or CAP_SYS_NICE")]


def test_a_thread_that_ends_while_the_niceness_is_lowered_is_passed_over():
    """A thread listed in /proc/self/task can end before its niceness is set (Ray's and gloo's threads come and go);
    that failed a worker's construction with ProcessLookupError. In a process of its own, at niceness 10."""
    script = textwrap.dedent("""
        import os, threading
        from raylastic.actors.processes import priority
        os.setpriority(os.PRIO_PROCESS, 0, 10)
        ended = threading.Thread(target=lambda: None)
        ended.start()
        ended.join()
        listed = priority._thread_ids()
        priority._thread_ids = lambda: listed + [ended.native_id]  # listed, then gone before it is reached
        assert priority.run_at_normal_priority() is None
        assert os.getpriority(os.PRIO_PROCESS, 0) == 0
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
