"""actors.processes.allocator: a training thread's freed memory is reused, not faulted back in every step."""

import os
import subprocess
import sys

import pytest

from raylastic.actors.processes.allocator import keep_freed_memory

pytestmark = pytest.mark.processes

CHURN = ("import sys; from raylastic.actors.processes.allocator import keep_freed_memory; "
         "from tests.support.memory_churn import page_faults_per_round; "
         "applied = keep_freed_memory() if sys.argv[1] == 'keep' else None; "
         "print(applied, page_faults_per_round())")


def _churn_in_fresh_process(mode: str, **env: str) -> tuple[str, float]:
    done = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    applied, faults = done.stdout.split()
    return applied, float(faults)


def test_kept_memory_removes_the_training_threads_page_faults():
    """glibc's defaults fault the churned ~50 MiB back in every round in a secondary thread (the step loop's
    place in a TrainWorker); with the thresholds fixed the heap is reused."""
    _, default_faults = _churn_in_fresh_process("default")
    applied, kept_faults = _churn_in_fresh_process("keep")
    assert applied == "True"
    assert default_faults > 1000
    assert kept_faults < 0.05 * default_faults


def test_a_users_malloc_settings_are_kept(monkeypatch):
    applied, _ = _churn_in_fresh_process("keep", MALLOC_TRIM_THRESHOLD_="131072")
    assert applied == "False"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")
    assert keep_freed_memory() is False
