"""Warm processes (actors/processes/): the job's setup hook and processes started ahead, on a real local Ray."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid

import psutil
import pytest
import ray

from raylastic.actors.processes.setup_hook import TRAINS, ProcessStart
from raylastic.actors.processes.warm_processes import WarmProcesses
from raylastic.cluster.job import train
from raylastic.jobconfig.naming import controller_name
from tests.conftest import REPO_ROOT
from tests.support.helpers import job
from tests.support.process_imports import training_imports

pytestmark = pytest.mark.usefixtures("ray_local")

SETTLE_S = 1.0
"""How long the test keeps looking for idle processes after the first one the top-up brought appeared."""
ENVIRONMENT_MARKER = "RAYLASTIC_TEST_ENVIRONMENT"
"""Set in a runtime environment of the test's own, to tell its processes from the others."""


def test_the_setup_hook_imports_the_training_modules_without_touching_cuda_and_freezes_them():
    """Ray gives a process its GPUs only when an actor is placed on it, and CUDA reads them at its first use:
    a process started ahead must not have used CUDA. What the imports made is out of the garbage collector's
    reach afterwards, and the collector is on again."""
    script = """
import gc, os, sys, torch
calls = []
for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "set_device"):
    original = getattr(torch.cuda, name)
    setattr(torch.cuda, name, lambda *a, _name=name, _original=original, **k: calls.append(_name) or _original(*a, **k))
from raylastic.actors.processes import setup_hook
assert setup_hook.imported is None
os.environ.update(setup_hook.TRAINS["env_vars"])  # a process started for an actor that trains
setup_hook.import_training_modules()
assert setup_hook.imported is not None and setup_hook.imported.began_at <= setup_hook.imported.done_at
assert {"torch._dynamo", "raylastic.actors.worker.train_worker"} <= set(sys.modules), "not imported"
assert calls == [], calls
assert gc.isenabled() and gc.get_freeze_count() > len(sys.modules) * 100, gc.get_freeze_count()
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a niceness needs root (or CAP_SYS_NICE)")
def test_a_training_process_leaves_rays_niceness_before_it_imports_torch():
    """Ray starts its processes at niceness 15 unless told otherwise (a cluster started without
    RAY_worker_niceness=0, a test's ``Cluster``). The setup hook and the worker actor go to niceness 0 before they
    import the training modules: at 15, a loaded 2-core machine's other processes took those seconds of CPU first,
    and a worker was not constructed within its 60 s placement timeout."""
    script = """
import importlib, os
seen, ours = [], {"torch._dynamo", "raylastic.actors.worker.train_worker"}
original = importlib.import_module
def recording(name, *args, **kwargs):
    if name in ours:
        seen.append((name, os.getpriority(os.PRIO_PROCESS, 0)))
    return original(name, *args, **kwargs)
importlib.import_module = recording
from raylastic.actors.processes import setup_hook
from raylastic.actors.worker.actor import TrainWorkerProcess
os.environ.update(setup_hook.TRAINS["env_vars"])
os.setpriority(os.PRIO_PROCESS, 0, 15)
setup_hook.import_training_modules()
os.setpriority(os.PRIO_PROCESS, 0, 15)
try:
    TrainWorkerProcess(spec=None)  # the worker module imported, then its TrainWorker refuses the missing spec
except AttributeError:
    pass
assert set(seen) == {(name, 0) for name in ours} and seen[-1][0] == "raylastic.actors.worker.train_worker", seen
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a niceness needs root (or CAP_SYS_NICE)")
def test_the_controller_and_the_rendezvous_store_leave_rays_niceness(tmp_path):
    """On a Ray that keeps its default worker niceness (15), the training workers go to 0; the Controller and the
    run's rendezvous store must too: at 15 beside them, under load, a set and a get took the store 77-87 ms against
    5-6 ms at 0 (benchmarks/rendezvous.py's load, the store's niceness set by hand), what a failure's survivors
    wait on first."""
    script = f"""
import os
from pathlib import Path
for task in Path("/proc/self/task").iterdir():
    os.setpriority(os.PRIO_PROCESS, int(task.name), 15)
from raylastic.actors.rendezvous.keys import RendezvousKeysStore
from tests.support.fake_group import controller
niceness = lambda: {{os.getpriority(os.PRIO_PROCESS, int(t.name)) for t in Path("/proc/self/task").iterdir()}}
RendezvousKeysStore()
after_store = niceness()
for task in Path("/proc/self/task").iterdir():
    os.setpriority(os.PRIO_PROCESS, int(task.name), 15)
controller(Path({str(tmp_path)!r}))
assert (after_store, niceness()) == ({{0}}, {{0}}), (after_store, niceness())
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@ray.remote(num_cpus=0)
class ProcessReporter:
    def start(self) -> ProcessStart:
        return ProcessStart.of_this_process()


def idle_processes(raylet: psutil.Process) -> set[int]:
    """The raylet's idle processes for this task's runtime environment (others may start meanwhile: Ray keeps a
    pool for the job's own environment)."""
    marker = os.environ[ENVIRONMENT_MARKER]
    idle = set()
    for process in raylet.children():
        with contextlib.suppress(psutil.Error):
            if process.cmdline()[:1] == ["ray::IDLE"] and process.environ().get(ENVIRONMENT_MARKER) == marker:
                idle.add(process.pid)
    return idle


@ray.remote(num_cpus=0)
def place_an_actor(top_up: bool) -> tuple[ProcessStart, float, set[int]]:
    """In a runtime environment of its own (so no other process can serve it): optionally start a process
    ahead on this node, wait for Ray to report it idle, then place an actor there."""
    raylet = psutil.Process().parent()
    before = idle_processes(raylet)
    started_ahead: set[int] = set()
    if top_up:
        WarmProcesses().top_up({ray.get_runtime_context().get_node_id()})
        deadline = time.monotonic() + 60
        while not (started_ahead := idle_processes(raylet) - before) and time.monotonic() < deadline:
            time.sleep(0.05)
        settled = time.monotonic() + SETTLE_S  # Ray may start another process for the environment meanwhile
        while time.monotonic() < settled:
            time.sleep(0.05)
            started_ahead |= idle_processes(raylet) - before
    requested_at = time.time()
    return ray.get(ProcessReporter.remote().start.remote(), timeout=120), requested_at, started_ahead


@pytest.mark.parametrize("top_up", [True, False])
def test_an_actor_placed_after_a_top_up_takes_the_process_started_ahead(top_up):
    own_environment = {"env_vars": {ENVIRONMENT_MARKER: uuid.uuid4().hex, **TRAINS["env_vars"]}}
    start, requested_at, started_ahead = ray.get(
        place_an_actor.options(runtime_env=own_environment).remote(top_up), timeout=180)
    assert start.imported is not None  # the job's setup hook ran in the actor's process
    if top_up:  # Ray reports a process idle before its setup hook starts: the pid tells which one it is
        assert start.pid in started_ahead
    else:
        assert start.imported.began_at > requested_at


@ray.remote(num_cpus=0)
def imports_of_a_task() -> dict:
    return training_imports(None)


def test_a_process_in_the_jobs_own_environment_skips_the_training_imports():
    """Ray starts processes in the job's runtime environment that never host a worker: ahead of a first driver's
    tasks, for a Ray Tune trial that drives a run, for a plain task. Only a process started for an actor that trains
    (``TRAINS``, which WarmProcesses starts ahead too) imports torch, torch._dynamo and the worker's modules. (An
    environment variable of the test's own gives the task a process of its own: Ray reuses a task's process for
    later tasks, which may have imported torch themselves.)"""
    own_environment = {"env_vars": {ENVIRONMENT_MARKER: uuid.uuid4().hex}}
    assert ray.get(imports_of_a_task.options(runtime_env=own_environment).remote(), timeout=120) == {
        "imported": False, "torch": False, "dynamo": False}


class Probed(Exception):
    """Raised by the test's on_progress once it has looked: the run stops at its next step boundary."""


def test_a_runs_controller_skips_the_training_imports_and_the_workers_it_starts_take_them(tmp_path):
    """The Controller trains nothing and starts every run: its process skips the setup hook's imports and imports
    no torch itself while the run trains, while the workers it starts (children, which inherit its runtime
    environment) still get them."""
    seen = {}

    def probe(progress) -> None:
        if progress.state == "running":
            controller = ray.get_actor(controller_name("hook-roles"))
            seen["controller"] = ray.get(controller.__ray_call__.remote(training_imports), timeout=60)
            seen["workers"] = ray.get([ray.get_actor(name).__ray_call__.remote(training_imports)
                                       for name in progress.members], timeout=60)
            raise Probed

    with pytest.raises(Probed):
        train(job("training.steps=100000", name="hook-roles"), run_dir=tmp_path, on_progress=probe)
    assert seen["controller"] == {"imported": False, "torch": False, "dynamo": False}
    assert seen["workers"] == [{"imported": True, "torch": True, "dynamo": True}] * 2
