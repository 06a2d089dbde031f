"""The TrainWorker as the Controller starts and calls it: its spec, what it reports, the error of a hung
training thread, and the Ray actor. Imports no torch: the actor builds its TrainWorker
(actors/worker/train_worker.py) in the worker's own process, so the Controller's process, which starts workers,
never imports the training modules.

Example::

    worker = TrainWorkerActor.options(name="raylastic:run:worker1", num_cpus=1).remote(spec)
    report = ray.get(worker.join.remote(assignment))
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import ray

from raylastic.actors.processes.priority import run_at_normal_priority
from raylastic.actors.processes.setup_hook import ProcessStart
from raylastic.jobconfig import (
    DataConfig,
    EvalConfig,
    FaultConfig,
    JobConfig,
    LinkConfig,
    OptimConfig,
    ParallelConfig,
    StrategyConfig,
    TrainingConfig,
    WorkloadConfig,
)
from raylastic.strategies.checkpoint_catalogue import CheckpointSettings
from raylastic.strategies.group_assignment import GroupAssignment
from raylastic.strategies.model_limits import ModelLimits
from raylastic.strategies.peer_restore import PeerRestorePlan, ShardCopy
from raylastic.strategies.region_plan import RegionCopy, RegionRestorePlan, RestoreTraffic


class TrainingThreadHung(RuntimeError):
    """The step-loop thread did not end when asked: the Controller replaces this worker."""


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """Everything a worker needs to build its part of the job; each piece is its own config."""

    workload: WorkloadConfig
    training: TrainingConfig
    optim: OptimConfig
    strategy: StrategyConfig
    data: DataConfig
    eval: EvalConfig
    use_gpu: bool
    torch_threads: int
    checkpointer: CheckpointSettings
    profile_dir: str | None = None
    """Where rank 0 writes its torch profiler trace when training.profile_steps > 0."""
    balance: str = "auto"
    """scaling.balance: "auto", the batch split follows the ranks' speeds; "off", even."""
    straggler_factor: float = 4.0
    """scaling.straggler_factor."""
    link: LinkConfig = LinkConfig()
    """An emulated slow link (tests and demos)."""
    parallel: ParallelConfig = ParallelConfig()

    @classmethod
    def for_job(cls, job: JobConfig, checkpointer: CheckpointSettings, profile_dir: str | None = None) -> WorkerSpec:
        """The spec of ``job``'s workers (one torch thread per whole CPU of a worker's slot)."""
        return cls(workload=job.workload, training=job.training, optim=job.optim, strategy=job.strategy,
                   data=job.data, eval=job.eval, use_gpu=job.scaling.use_gpu,
                   torch_threads=max(1, int(job.scaling.cpus_per_worker)), checkpointer=checkpointer,
                   profile_dir=profile_dir, balance="auto" if job.balances_shares else "off",
                   straggler_factor=job.scaling.straggler_factor, link=job.link, parallel=job.parallel)


@dataclass(frozen=True)
class JoinReport:
    node_id: str
    step: int
    """Committed optimizer steps this worker holds (its candidate state for the hand-over). A worker whose
    state a hand-over left half-received has rebuilt it from the seed: 0."""
    shard_copies: tuple[ShardCopy, ...] = ()
    """Sharded strategies: the shards of an earlier generation's state this worker keeps in memory (its own,
    and its buddy's), for ``plan_peer_restore``; none for a new worker, a replicated strategy, at step 0."""
    region_copies: tuple[RegionCopy, ...] = ()
    """Under model parallelism: its part of an earlier generation's state, kept in memory, for
    ``plan_region_restore``; none for a new worker, at step 0."""
    model_limits: ModelLimits | None = None
    """How far the model splits (the workload's ``model_limits``), for the Controller's re-plans."""
    store_calls: int = 0
    """Calls this worker made to the run's rendezvous keys while it joined (its groups' set-up)."""


class TrainWorkerProcess:
    """One worker's process: every call goes to its TrainWorker (actors/worker/train_worker.py has what each does)."""

    def __init__(self, spec: WorkerSpec) -> None:
        run_at_normal_priority()  # before the imports (seconds of CPU), which Ray's niceness would let others starve
        self.worker = importlib.import_module("raylastic.actors.worker.train_worker").TrainWorker(spec)

    def pid(self) -> int:
        return self.worker.pid()

    def alive(self) -> bool:
        return self.worker.alive()

    def process_start(self) -> ProcessStart:
        return self.worker.process_start()

    def join(self, assignment: GroupAssignment) -> JoinReport:
        return self.worker.join(assignment)

    def leave(self, collective_timeout_s: float) -> tuple[RegionCopy, ...]:
        return self.worker.leave(collective_timeout_s)

    def kept_part(self, copy: RegionCopy) -> Any:
        return self.worker.kept_part(copy)

    def sync_state(self, source_rank: int) -> int:
        return self.worker.sync_state(source_rank)

    def restore(self, path: str | None, step: int) -> str | None:
        return self.worker.restore(path, step)

    def restore_from_peers(self, plan: PeerRestorePlan) -> int:
        return self.worker.restore_from_peers(plan)

    def restore_regions(self, plan: RegionRestorePlan, *delivered: Any) -> RestoreTraffic:
        """``delivered``: parts spares kept (KeptRegions), sent here through Ray's object store."""
        return self.worker.restore_regions(plan, *delivered)

    def train(self, until_step: int, faults: tuple[FaultConfig, ...] = (), shares: tuple[int, ...] | None = None
              ) -> None:
        return self.worker.train(until_step, faults, shares)

    def request_stop(self) -> None:
        return self.worker.request_stop()

    def request_checkpoint(self, number: int) -> None:
        return self.worker.request_checkpoint(number)

    def poll(self, wait_s: float = 0.0, seen: int = -1) -> Any:
        """The worker's WorkerStatus (actors/worker/mailbox.py)."""
        return self.worker.status.poll(wait_s, seen)

    def answer_now(self) -> None:
        self.worker.loop.report_now()  # the steps its thread has not read yet (on a CPU)
        self.worker.status.answer_now()

    def save_checkpoint(self) -> str:
        return self.worker.save_checkpoint()

    def full_state_dict(self, keep: bool = True) -> dict[str, Any] | None:
        return self.worker.full_state_dict(keep)

    def full_model_file(self, keep: bool = True) -> bytes | None:
        return self.worker.full_model_file(keep)

    def evaluate(self) -> dict[str, float]:
        return self.worker.evaluate()

    def memory(self) -> dict[str, int]:
        return self.worker.memory()


TrainWorkerActor = ray.remote(TrainWorkerProcess)
