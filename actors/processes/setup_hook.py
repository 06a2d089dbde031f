"""Warm processes: a new worker placed on a process started ahead of time, with torch and our modules imported.

A worker's cold start is ~2.5 s on a CPU: the process and Ray (~0.7 s), torch (~0.8 s), torch._dynamo and the
distributed modules the first optimizer step imports (~0.9 s), then the workload and model (~0.3 s). Two Ray
mechanisms take all but the last off the path of a replacement or a joiner:

- ``import_training_modules`` is the job's ``worker_process_setup_hook`` (``cluster.connect.job_runtime_env``):
  every process Ray starts for an actor that trains (in the runtime environment ``TRAINS``) imports them before
  it takes work.
- ``WarmProcesses`` (actors/processes/warm_processes.py) asks a node's raylet to start a process for the job
  ahead of the next worker placed there (Ray's ``PrestartWorkers``, which keeps it idle for ``keep_alive_s``).
  Ray gives an idle process of the workers' runtime environment to the next actor placed on that node.

Every other process of the job skips the imports (~2.5 s of CPU and ~0.3 GB each): the Controller and the rendezvous
keys, a Ray Tune trial that drives a run, a plain task, and the processes Ray starts in the job's own environment
ahead of a first driver's tasks, which never host a worker (the workers' environment is ``TRAINS``). Ray merges a
parent's env_vars into its children's, so an actor that trains sets ``TRAINS`` and a task started from one that
trains nothing sets ``TRAINS_NOTHING``.

A run's workers are all started in one environment, ``worker_runtime_env(scaling)``: ``TRAINS``, the user's
scaling.worker_env, and for GPU workers ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` (every GPU worker sees its
node's GPUs: strategies/device_binding.py). A process started ahead for them is started in the same environment
(``ProcessStart.runtime_env``), so it is set when the process starts, before Ray places a GPU actor in it.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray

from raylastic.actors.processes.priority import run_at_normal_priority
from raylastic.jobconfig import ScalingConfig
from raylastic.strategies.device_binding import NOSET_VISIBLE_DEVICES

logger = logging.getLogger(__name__)

SETUP_HOOK = "raylastic.actors.processes.setup_hook.import_training_modules"
AHEAD = ("torch._dynamo", "raylastic.actors.worker.train_worker")
"""What the hook imports: the first optimizer step's import (DTensor, sympy: the largest part), then the worker
with all it imports. By name: this role sits below the worker's."""
KEEP_ALIVE_S = 3600
"""How long a raylet keeps a started process idle for the job before it may reclaim it."""


@dataclass(frozen=True)
class ImportTimes:
    began_at: float
    done_at: float
    """``time.time()`` seconds."""


imported: ImportTimes | None = None
"""When this process's setup hook imported the training modules; None: the hook did not run here (or failed)."""


ROLE_VARIABLE = "RAYLASTIC_PROCESS_ROLE"
TRAINS = {"env_vars": {ROLE_VARIABLE: "trains"}}
"""``.options(runtime_env=TRAINS)`` for an actor that trains: its process imports the training modules."""
TRAINS_NOTHING = {"env_vars": {ROLE_VARIABLE: "trains nothing"}}
"""``.options(runtime_env=TRAINS_NOTHING)`` for an actor or task that trains nothing (the Controller, the rendezvous
keys, a task started from a worker): its process skips these imports, whatever its parent's role."""


def worker_runtime_env(scaling: ScalingConfig) -> dict[str, Any]:
    """``.options(runtime_env=...)`` for the run's workers: ``TRAINS``, scaling.worker_env, and for GPU workers
    the node's GPUs all visible (Ray leaves CUDA_VISIBLE_DEVICES as the node has it; each worker binds its own)."""
    gpu = {NOSET_VISIBLE_DEVICES: "1"} if scaling.use_gpu else {}
    return {"env_vars": {**scaling.worker_env, **gpu, **TRAINS["env_vars"]}}


def import_training_modules() -> None:
    """Import what a worker needs before it can train, without touching CUDA: Ray assigns the process its GPUs
    (CUDA_VISIBLE_DEVICES) only when an actor is placed on it, and CUDA reads them once, at its first use."""
    global imported
    if os.environ.get(ROLE_VARIABLE) != TRAINS["env_vars"][ROLE_VARIABLE]:
        return
    run_at_normal_priority()  # first: at Ray's niceness, a busy node's other processes starve these imports
    began_at = time.time()
    try:
        with collector_paused():
            for module in AHEAD:
                importlib.import_module(module)
    except Exception:  # noqa: BLE001 - Ray ends a process whose hook raises: this one can still serve, cold
        logger.warning("the training modules could not be imported ahead; workers here will start cold",
                       exc_info=True)
        return
    imported = ImportTimes(began_at, time.time())


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, then everything that exists frozen out of its reach.

    Importing torch and torch._dynamo creates ~0.5 million objects that live as long as the process; the collector
    would scan them again and again as they are made (a third of the imports' CPU: 3.4 CPU-s instead of 2.2 on
    this project's machines), and every full collection afterwards, in the middle of a step, would scan them once
    more (~0.3 s each). ``gc.freeze`` moves them to a generation that no collection visits."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


@dataclass(frozen=True)
class ProcessStart:
    """What a constructed worker says of its process, for the Controller to tell a warm start from a cold one."""

    pid: int
    imported: ImportTimes | None
    """When the job's setup hook imported the training modules here; None: it did not."""
    runtime_env: str = ""
    """The process's runtime environment, serialized as Ray matches it: a process started ahead for the next
    worker must be started in it."""

    @classmethod
    def of_this_process(cls) -> ProcessStart:
        return cls(pid=os.getpid(), imported=imported, runtime_env=ray.get_runtime_context().get_runtime_env_string())

    def warmth(self, requested_at: float) -> Warmth:
        """How far the process had come when the actor was asked for (``requested_at``, ``time.time()``)."""
        return Warmth(started_ahead=self.imported is not None and self.imported.began_at < requested_at,
                      imported=self.imported is not None and self.imported.done_at < requested_at)


@dataclass(frozen=True)
class Warmth:
    """How far a new worker's process had come when the actor was asked for."""

    started_ahead: bool = False
    """It was started ahead: its setup hook had begun importing the training modules (on a loaded machine a
    process started seconds before may still be importing them)."""
    imported: bool = False
    """It had imported them: the actor's construction waited for none of it."""
