"""Shared fixtures: one real local Ray instance per test process, shared by the modules that use it."""

from __future__ import annotations

import compileall
import contextlib
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("raylastic", "actors", "cluster", "jobconfig", "strategies", "tuning", "workloads", "tests")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def pytest_configure(config) -> None:
    """Compile our packages' bytecode once, in the main process: where PYTHONDONTWRITEBYTECODE is set (this
    project's machines set it), every process a test starts (each Ray worker, ~4 per run) would compile our
    sources again, ~0.2 s of CPU each; with the bytecode there, they only read it."""
    if not hasattr(config, "workerinput"):  # the main process, before pytest-xdist starts its workers
        for package in PACKAGES:
            compileall.compile_dir(REPO_ROOT / package, quiet=1)


STARTS_RAY = frozenset({"ray_local", "local_ray", "head"})
"""Fixtures that start a Ray instance: a test that uses one (directly or through another fixture) is no unit test."""


def pytest_collection_modifyitems(config, items) -> None:
    """Mark ``unit`` every test that starts no Ray, no process group (tests/support/distributed_harness.py) and no
    processes of its own (the ``processes`` marker): ``pytest -m unit`` runs them in seconds."""
    for item in items:
        module_values = vars(item.module).values() if getattr(item, "module", None) else ()
        process_groups = any(getattr(value, "__module__", None) == "tests.support.distributed_harness"
                             and getattr(value, "__name__", None) == "run_distributed" for value in module_values)
        if not (process_groups or item.get_closest_marker("processes")
                or STARTS_RAY & set(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.unit)


class LocalRay:
    """The local Ray of one test process (a pytest-xdist worker), shared by every module that uses ``ray_local``: a
    start and a stop cost ~6 s of CPU, and ~30 modules use it. A module that connects to a Ray of its own (a
    multi-node ``Cluster``, logical GPUs) stops it first; the next module that needs it starts it again."""

    def __init__(self) -> None:
        self._session = contextlib.ExitStack()
        self.running = False

    def start(self) -> None:
        from raylastic.cluster.connect import ray_session

        if not self.running:
            self._session.enter_context(ray_session(min_cpus=4))
            self.running = True

    def stop(self) -> None:
        self._session.close()
        self.running = False


@pytest.fixture(scope="session")
def local_ray():
    ray = LocalRay()
    try:
        yield ray
    finally:
        ray.stop()


@pytest.fixture(scope="module")
def ray_local(local_ray: LocalRay):
    """A local Ray with 4 logical CPUs (workers use fractions of them on this 2-core machine), started here as
    ``train()`` starts one, kept for the modules after this one."""
    cwd = os.getcwd()
    os.chdir(REPO_ROOT)  # workers put the repo root on their path, so tests.* workloads import
    try:
        local_ray.start()
        yield
    finally:
        os.chdir(cwd)
