"""Controller: owns one run - its workers, generations, failures, rescaling and checkpoints.

It executes; the policies in ``actors.policies`` decide. A run is a loop of generations::

    place >= min_workers  ->  form generation g (join group, hand state over)  ->  train + watch
          ^                                                                         |
          +---- a worker failed / resources appeared / a worker is drained ---------+

The Controller is a threaded actor: ``run`` blocks in one thread while ``progress`` and
``drain`` answer from others.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.events import RunLog
from actors.placement import SlotShape, WorkerSlots
from actors.policies import FailurePolicy, Raise, ScalingPolicy
from actors.watch import Finished, Interrupted, WatchOutcome, Watcher, WorkersFailed
from actors.worker import TrainWorkerActor, WorkerSpec
from cluster.config import JobConfig
from strategies.checkpoint import Checkpointer, latest_checkpoint
from strategies.process_group import GroupAssignment, host_store


@dataclass
class Member:
    actor: Any
    slot: Any
    name: str
    node_id: str = ""


@dataclass(frozen=True)
class RunResult:
    final_step: int
    metrics: dict[str, float]
    history: list[dict[str, Any]]
    events: list[dict[str, Any]]
    model_state: dict[str, Any]
    checkpoint: str | None


class RunFailed(RuntimeError):
    """The run ended with an error; the message says what failed and where the last checkpoint is."""


class Controller:
    def __init__(self, job: JobConfig, checkpoint_root: str) -> None:
        self.job = job
        self.log = RunLog()
        self.checkpoint_root = checkpoint_root
        self.scaling_policy = ScalingPolicy(min_workers=job.scaling.min_workers,
                                            max_workers=job.scaling.max_workers)
        self.failure_policy = FailurePolicy(max_failures=job.failure.max_failures)
        self.slots = WorkerSlots(SlotShape(cpus=job.scaling.cpus_per_worker, gpus=int(job.scaling.use_gpu)),
                                 job.name)
        self.node_ip = ray.util.get_node_ip_address()
        self.store = host_store(self.node_ip)
        self.members: list[Member] = []
        self.generation = -1
        self.step = 0
        self.failures = 0
        self.spawned = 0
        self.stopping = False
        self.checkpointer = Checkpointer(root=checkpoint_root, every_steps=job.checkpoint.every_steps,
                                         num_to_keep=job.checkpoint.num_to_keep,
                                         config_hash=job.math_hash(),
                                         global_batch_size=job.training.global_batch_size)

    # -- public API (called by the driver, the CLI and tests) -------------------------------------------
    def run(self) -> RunResult:
        """Train to ``training.steps``; raises RunFailed with the reason when the run cannot go on."""
        try:
            self._start_members()
            self._resume_from_checkpoint()
            while True:
                self._form_generation()
                outcome = Watcher(self).watch(until_step=self.job.training.steps)
                if isinstance(outcome, Finished):
                    return self._finish()
                self._handle(outcome)
        finally:
            self._shutdown_members()

    def progress(self, history_since: int = 0, events_since: int = 0) -> dict[str, Any]:
        """New history rows and events since the given positions, and the current membership."""
        return {"history": self.log.history(history_since), "events": self.log.events(events_since),
                "generation": self.generation, "world_size": len(self.members), "step": self.step,
                "members": [m.name for m in self.members], "failures": self.failures}

    def stop(self) -> None:
        """End the run at the next step boundary (Ctrl-C); workers are shut down, nothing orphaned."""
        self.stopping = True
        for member in self.members:
            member.actor.request_stop.remote()

    # -- generations -------------------------------------------------------------------------------------
    def _start_members(self) -> None:
        scaling = self.job.scaling
        self.slots.request(scaling.max_workers)
        slots = self.slots.take_ready(scaling.max_workers, at_least=scaling.min_workers,
                                      timeout_s=scaling.placement_timeout_s)
        if len(slots) < scaling.min_workers:
            raise RunFailed(f"only {len(slots)} of scaling.min_workers={scaling.min_workers} workers could be "
                            f"placed within scaling.placement_timeout_s={scaling.placement_timeout_s}s "
                            f"(each needs {scaling.cpus_per_worker} CPU"
                            f"{' and 1 GPU' if scaling.use_gpu else ''}); the cluster has "
                            f"{ray.cluster_resources()}")
        self.members = self._spawn(slots)

    def _spawn(self, slots: list) -> list[Member]:
        spec = WorkerSpec(workload=self.job.workload, training=self.job.training, optim=self.job.optim,
                          strategy=self.job.strategy, use_gpu=self.job.scaling.use_gpu,
                          torch_threads=max(1, int(self.job.scaling.cpus_per_worker)),
                          checkpointer=self.checkpointer)
        members = []
        for slot in slots:
            self.spawned += 1
            name = f"raylastic:{self.job.name}:worker{self.spawned}"
            actor = TrainWorkerActor.options(
                name=name, num_cpus=self.job.scaling.cpus_per_worker, num_gpus=int(self.job.scaling.use_gpu),
                max_restarts=0, max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=slot),
            ).remote(spec)
            members.append(Member(actor=actor, slot=slot, name=name))
        return members

    def _resume_from_checkpoint(self) -> None:
        if self.job.checkpoint.resume != "auto":
            return
        found = latest_checkpoint(self.checkpoint_root)
        if found is None:
            return
        if found.manifest.config_hash != self.job.math_hash():
            raise RunFailed(f"checkpoint {found.path} was written by a job with a different workload, optimizer, "
                            "global batch or seed; use another --run-dir or set checkpoint.resume=never")
        self.step = ray.get(self.members[0].actor.load_checkpoint.remote(str(found.path)))
        self.log.event("resumed", self.step, path=str(found.path))

    def _form_generation(self) -> None:
        """Every member joins generation g+1; the most advanced one's state is handed to all."""
        started = time.time()
        self.generation += 1
        world_size = len(self.members)
        reports = ray.get([m.actor.join.remote(GroupAssignment(
            generation=self.generation, rank=rank, world_size=world_size, store_host=self.node_ip,
            store_port=self.store.port, timeout_s=self.job.failure.collective_timeout_s))
            for rank, m in enumerate(self.members)])
        for member, report in zip(self.members, reports):
            member.node_id = report.node_id
        source = max(range(world_size), key=lambda r: reports[r].step)
        self.step = reports[source].step
        behind = sum(1 for r in reports if r.step != self.step)
        ray.get([m.actor.sync_state.remote(source) for m in self.members])
        self.log.event("generation_formed", self.step, generation=self.generation, world_size=world_size,
                       state_source_rank=source, ranks_updated=behind,
                       duration_s=round(time.time() - started, 4))

    def _handle(self, outcome: WatchOutcome) -> None:
        if isinstance(outcome, Interrupted):
            raise RunFailed(f"run stopped by the user at step {self.step}{self._checkpoint_note()}")
        assert isinstance(outcome, WorkersFailed), outcome
        self.failures += len(outcome.failed)
        decision = self.failure_policy.decide(self.failures)
        if isinstance(decision, Raise):
            raise RunFailed(f"{decision.reason}; last failure: {outcome.describe()}{self._checkpoint_note()}")
        raise RunFailed(f"worker failed: {outcome.describe()}{self._checkpoint_note()}")

    # -- the end -----------------------------------------------------------------------------------------
    def _finish(self) -> RunResult:
        leader = self.members[0].actor
        metrics_ref, state_ref = leader.evaluate.remote(), leader.full_state_dict.remote()
        path = ray.get(leader.save_checkpoint.remote(len(self.members)))
        self.log.event("checkpointed", self.step, path=path)
        metrics = ray.get(metrics_ref)
        history = self.log.history()
        metrics = {"loss": history[-1]["loss"] if history else float("nan"), **metrics}
        self.log.event("finished", self.step, **{k: round(v, 6) for k, v in metrics.items()})
        return RunResult(final_step=self.step, metrics=metrics, history=history, events=self.log.events(),
                         model_state=ray.get(state_ref), checkpoint=path)

    def _checkpoint_note(self) -> str:
        found = latest_checkpoint(self.checkpoint_root)
        return f"; last checkpoint: {found.path} (step {found.manifest.step})" if found else \
            "; no checkpoint was written (set checkpoint.every_steps)"

    def _shutdown_members(self) -> None:
        for member in self.members:
            ray.kill(member.actor)
            self.slots.release(member.slot)
        self.slots.release_pending()
        self.members = []


ControllerActor = ray.remote(num_cpus=0, max_concurrency=8)(Controller)


def default_checkpoint_root(run_dir: str | Path) -> str:
    return str(Path(run_dir).resolve() / "checkpoints")
