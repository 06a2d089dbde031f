"""Shared fixtures: one real local Ray instance per test module, shut down after it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray with 4 logical CPUs (workers use fractions of them on this 2-core machine)."""
    from cluster.connect import ray_session

    cwd = os.getcwd()
    os.chdir(REPO_ROOT)  # workers put the repo root on their path, so tests.* workloads import
    try:
        with ray_session(min_cpus=4):
            yield
    finally:
        os.chdir(cwd)
