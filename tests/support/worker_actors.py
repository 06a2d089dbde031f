"""TrainWorker actors driven directly, as the Controller's WorkerGroup drives them (no Controller): for tests
that need to act between the calls of a generation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ray

from raylastic.actors.rendezvous.keys import RendezvousKeys, beside_this_process, call_off_generation
from raylastic.actors.worker.actor import JoinReport, TrainWorkerActor, WorkerSpec
from raylastic.jobconfig import FaultConfig
from raylastic.strategies.checkpoint import Checkpointer
from raylastic.strategies.group_assignment import GroupAssignment, new_store_prefix
from raylastic.strategies.peer_restore import plan_peer_restore
from tests.support.helpers import job


@dataclass
class Workers:
    """TrainWorker actors driven directly around one rendezvous store, as the Controller's WorkerGroup does."""

    spec: WorkerSpec
    store: object
    prefix: str
    collective_timeout_s: float = 30.0

    def start(self, count: int) -> list:
        return [TrainWorkerActor.options(num_cpus=0.5, max_concurrency=2).remote(self.spec) for _ in range(count)]

    def assignment(self, generation: int, rank: int, world_size: int) -> GroupAssignment:
        return GroupAssignment(generation=generation, rank=rank, world_size=world_size, store=self.store,
                               store_prefix=self.prefix, timeout_s=self.collective_timeout_s)

    def abort_rendezvous(self, generation: int) -> Callable[[], None]:
        """What the Controller calls when a member of a forming ``generation`` is lost."""
        return lambda: call_off_generation(self.store, self.prefix, generation)

    def join(self, generation: int, actors: list) -> list[JoinReport]:
        return ray.get([actor.join.remote(self.assignment(generation, rank, len(actors)))
                        for rank, actor in enumerate(actors)], timeout=120)

    def restore_from_peers(self, actors: list, reports: list[JoinReport]) -> int:
        plan = plan_peer_restore([report.shard_copies for report in reports])
        assert plan is not None, reports
        steps = ray.get([actor.restore_from_peers.remote(plan) for actor in actors], timeout=120)
        assert steps == [plan.step] * len(actors)
        return plan.step

    def train(self, actors: list, until_step: int, faults: dict[int, FaultConfig] | None = None) -> None:
        """Train to ``until_step``; with ``faults`` (by rank), start training and return at once."""
        faults = faults or {}
        ray.get([actor.train.remote(until_step, (faults[rank],) if rank in faults else ())
                 for rank, actor in enumerate(actors)])
        for actor in [] if faults else actors:
            assert wait_while(actor, "training") == ("finished", until_step)

    def model(self, actors: list) -> dict:
        return ray.get([actor.full_state_dict.remote(rank == 0) for rank, actor in enumerate(actors)])[0]


def wait_while(actor, phase: str) -> tuple[str, int]:
    """The actor's phase and step once it is no longer ``phase``."""
    status = ray.get(actor.poll.remote(0.0))
    while status.phase == phase:
        status = ray.get(actor.poll.remote(5.0, status.version), timeout=60)
    assert status.phase != "failed" or status.error_cause == "peer_lost", status.error
    return status.phase, status.step


def workers_of(tmp_path, steps: int, *overrides: str, collective_timeout_s: float = 30.0) -> Workers:
    """Workers of a short job (``overrides`` over tests.support.helpers.job's) that train up to ``steps``."""
    config = job(f"training.steps={steps}", *overrides, name="peers")
    checkpointer = Checkpointer(root=str(tmp_path / "checkpoints"), every_steps=0, num_to_keep=1, config_hash="h",
                                global_batch_size=config.training.global_batch_size)
    spec = WorkerSpec(workload=config.workload, training=config.training, optim=config.optim,
                      strategy=config.strategy, data=config.data, eval=config.eval, use_gpu=False, torch_threads=1,
                      checkpointer=checkpointer)
    keys = RendezvousKeys.options(**beside_this_process()).remote()
    return Workers(spec, keys, new_store_prefix(), collective_timeout_s)


