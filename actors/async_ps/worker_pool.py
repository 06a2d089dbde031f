"""The run's AsyncWorkers: one per index, a replacement taking the index of the worker it replaces.

    pool = WorkerPool(job, prefix="raylastic:x:", place=lambda index: None)
    name = pool.start(0)                 # "raylastic:x:worker0.0", computing steps it leases from the Controller
    pool.kill(name, "no answer for 10s") # its run ref raises next; ``ended`` gives back why it was killed
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raylastic.actors.async_ps.worker import AsyncWorkerActor, AsyncWorkerSpec
from raylastic.actors.processes.setup_hook import worker_runtime_env
from raylastic.actors.worker_group.placement import ReservedBundles
from raylastic.jobconfig import JobConfig


class WorkerPool:
    def __init__(self, job: JobConfig, *, prefix: str,
                 place: Callable[[int], PlacementGroupSchedulingStrategy | None]) -> None:
        """``place(index)``: where worker ``index`` goes (None: wherever Ray finds its resources)."""
        self.job, self.prefix, self.place = job, prefix, place
        self.workers: dict[str, tuple[int, Any, Any]] = {}
        """Name -> (index, actor, its ``run`` ref)."""
        self.starts: dict[int, int] = {}
        """Workers started per index (the next one's name is worker<index>.<starts>)."""
        self.working: set[str] = set()
        """Workers that asked for a step: constructed (importing torch, loading data: seconds on a busy machine,
        during which a ping waits), so from now on a ping unanswered for failure.step_timeout_s means hung."""
        self.killed_because: dict[str, str] = {}
        """Workers killed as hung -> why (their death's own message says only that they were killed)."""
        self.faults = [f for f in job.faults if f.action != "kill_server"]
        """The worker faults that have not fired yet."""

    def start(self, index: int) -> str:
        """A new worker at ``index``, computing steps at once; returns its name."""
        job = self.job
        self.starts[index] = self.starts.get(index, -1) + 1
        name = f"{self.prefix}worker{index}.{self.starts[index]}"
        spec = AsyncWorkerSpec(name=name, workload=job.workload, training=job.training, optim=job.optim, data=job.data,
                               use_gpu=job.scaling.use_gpu,
                               torch_threads=max(1, int(job.scaling.cpus_per_worker)),
                               server_timeout_s=job.failure.collective_timeout_s,
                               controller_timeout_s=job.failure.collective_timeout_s,
                               faults=tuple(f for f in self.faults if f.rank == index), link=job.link)
        actor = AsyncWorkerActor.options(
            name=name, num_cpus=job.scaling.cpus_per_worker, num_gpus=1 if job.scaling.use_gpu else 0,
            resources=job.scaling.resources_per_worker or None, max_restarts=0, scheduling_strategy=self.place(index),
            runtime_env=worker_runtime_env(job.scaling),
        ).remote(spec, ray.get_runtime_context().current_actor)
        self.workers[name] = (index, actor, actor.run.remote())
        return name

    def needs(self) -> str:
        """What Ray must find for one worker, as ``start`` asks for it (e.g. "0.5 CPU, 1 GPU")."""
        scaling = self.job.scaling
        return ", ".join([f"{scaling.cpus_per_worker} CPU"] + ["1 GPU"] * scaling.use_gpu
                         + [f"{amount} {name}" for name, amount in scaling.resources_per_worker.items()])

    def runs(self) -> dict[Any, str]:
        """Each worker's ``run`` ref -> its name."""
        return {ref: name for name, (_, _, ref) in self.workers.items()}

    def pings(self) -> dict[str, Any]:
        """The ping method of every worker that asked for a step."""
        return {name: actor.ping for name, (_, actor, _) in self.workers.items() if name in self.working}

    def kill(self, name: str, why: str) -> None:
        """Kill ``name`` as hung (its run ref raises next: replaced as a lost worker)."""
        if name in self.workers:
            self.killed_because[name] = why
            ray.kill(self.workers[name][1])

    def ended(self, name: str) -> tuple[int, Any, str | None]:
        """Forget ``name``, whose run ended: (its index, its actor, why it was killed if it was)."""
        index, actor, _ = self.workers.pop(name)
        self.working.discard(name)
        return index, actor, self.killed_because.pop(name, None)

    def lost(self, index: int) -> None:
        """The worker at ``index`` was lost: its faults fired (a throttle stays with the index)."""
        self.faults = [f for f in self.faults if f.rank != index or f.action == "throttle"]

    def missing(self) -> list[int]:
        """The indices with no worker (those that left when there were no more steps)."""
        present = {index for index, _, _ in self.workers.values()}
        return [index for index in range(self.job.scaling.max_workers) if index not in present]

    def kill_all(self) -> None:
        for _, actor, _ in self.workers.values():
            ray.kill(actor)


def reserved_bundle(reserved: ReservedBundles | None, position: int) -> PlacementGroupSchedulingStrategy | None:
    """The reserved bundle at ``position`` (workers first, then servers), if bundles were reserved."""
    if reserved is None:
        return None
    return PlacementGroupSchedulingStrategy(placement_group=reserved.placement_group,
                                            placement_group_bundle_index=reserved.bundle_indices[position])
