"""Shared fixtures: one real local Ray instance per test module, shut down after it."""

from __future__ import annotations

import compileall
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("actors", "cluster", "jobconfig", "strategies", "tuning", "workloads", "tests")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def pytest_configure(config) -> None:
    """Compile our packages' bytecode once, in the main process: where PYTHONDONTWRITEBYTECODE is set (this
    project's machines set it), every process a test starts (each Ray worker, ~4 per run) would compile our
    sources again, ~0.2 s of CPU each; with the bytecode there, they only read it."""
    if not hasattr(config, "workerinput"):  # the main process, before pytest-xdist starts its workers
        for package in PACKAGES:
            compileall.compile_dir(REPO_ROOT / package, quiet=1)


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
