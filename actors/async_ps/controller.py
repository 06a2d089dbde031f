"""AsyncController: owns one asynchronous run - its servers, its workers and the books of its steps.

It answers the workers (``lease``, ``admit``, ``give_back``) and the driver (``progress``, ``stop``, the
same as the synchronous Controller's) from threads of its own, while ``run`` supervises:

- a worker that dies gives its leased steps back, and its admitted update if no server got it (the
  servers skip that number); a replacement takes its index, up to ``failure.max_failures``; a worker
  whose step exceeds ``failure.max_step_s`` is killed as hung; an error in user code fails the run;
- a server that dies sends every server back to the newest complete checkpoint (or the start) in a new
  epoch: the updates after it are taken back and their steps computed again, so each step's samples
  still reach the parameters exactly once;
- ``eval.every_steps`` evaluates the servers' parameters here; at the end the servers write the final
  checkpoint and their shares make the model.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.async_ps.checkpoints import newest_complete, prune
from actors.async_ps.heartbeats import Heartbeats
from actors.async_ps.leases import Lease, StepReport
from actors.async_ps.server import ParameterServerActor, ServerSpec
from actors.async_ps.shards import assign_parameters
from actors.async_ps.tickets import TicketBook
from actors.async_ps.worker import AsyncWorkerActor, AsyncWorkerSpec
from actors.controller import RunFailed
from actors.evaluation import Evaluator
from actors.events import RunLog
from actors.placement import ReservedBundles
from actors.recipe import learning_rate
from actors.run_status import RunResult, RunStatus
from jobconfig import JobConfig
from jobconfig.naming import controller_name
from workloads import load_workload

SUPERVISE_S = 0.2
"""How often ``run`` looks at its workers and servers."""


class AsyncController:
    def __init__(self, job: JobConfig, checkpoint_root: str, reserved: ReservedBundles | None = None,
                 profile_dir: str | None = None) -> None:
        """``reserved``: bundles for the workers (the first max_workers) and the servers (the rest), e.g. a Ray Tune
        trial's; None: Ray places each actor where its resources are free."""
        self.job, self.checkpoint_root, self.reserved = job, checkpoint_root, reserved
        self.log = RunLog()
        self.book = TicketBook(total_steps=job.training.steps, max_staleness=job.strategy.max_staleness)
        self.lock = threading.Lock()
        self.state = "placing"
        self.epoch = 0
        self.failures = 0
        self.stop_requested = False
        self.servers: list[Any] = []
        self.shards: tuple[tuple[str, ...], ...] = ()
        self.workers: dict[str, tuple[int, Any, Any]] = {}
        """Name -> (index, actor, its ``run`` ref)."""
        self.starts: dict[int, int] = {}
        """Workers started per index (the next one's name is worker<index>.<starts>)."""
        self.in_flight: dict[int, str] = {}
        """Admitted updates whose worker has not asked for its next step yet (it may still be pushing)."""
        self.lease_started: dict[str, float] = {}
        """Worker -> when it leased the step it computes (and pushes) now: failure.max_step_s bounds it."""
        self.heartbeats = Heartbeats(job.failure.step_timeout_s)
        self.killed_because: dict[str, str] = {}
        """Workers killed as hung -> why (their death's own message says only that they were killed)."""
        self.working: set[str] = set()
        """Workers that asked for a step: constructed (importing torch, loading data: seconds on a busy machine,
        during which a ping waits), so from now on a ping unanswered for failure.step_timeout_s means hung."""
        self.server_faults = [f for f in job.faults if f.action == "kill_server"]
        self.worker_faults = [f for f in job.faults if f.action != "kill_server"]
        self.next_evaluation = job.eval.every_steps
        self.pruned_at = 0
        """The version at which old checkpoints were last pruned."""
        self.prefix = controller_name(job.name).removesuffix("controller")

    # -- the driver's API ------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        try:
            self._start()
            while True:
                if self.stop_requested:
                    self.state = "stopped"
                    raise RunFailed(f"run stopped by the user at step {self.book.steps_applied}{self._note()}")
                self._supervise()
                if self.book.done and self._servers_caught_up():
                    return self._finish()
        except RunFailed:
            self.state = "failed" if self.state != "stopped" else "stopped"
            raise
        except Exception as error:  # a defect of ours, or a server's: a failed run with its reason
            self.state = "failed"
            raise RunFailed(f"the asynchronous run failed at step {self.book.steps_applied}: "
                            f"{type(error).__name__}: {error}{self._note()}\n{traceback.format_exc()}") from None
        finally:
            self.stop_requested = True  # every lease from now on says finished
            for _, actor, _ in self.workers.values():
                ray.kill(actor)
            for server in self.servers:
                ray.kill(server)
            self.log.close()

    def progress(self, history_since: int = 0, events_since: int = 0, evaluations_since: int = 0,
                 wait_s: float = 0.0) -> RunStatus:
        if wait_s > 0:
            self.log.wait_for_news(events_since, wait_s)
        return RunStatus(state=self.state, generation=self.epoch, world_size=len(self.workers),
                         step=self.book.steps_applied, members=sorted(self.workers), failures=self.failures,
                         history=self.log.history(history_since), events=self.log.events(events_since),
                         evaluations=self.log.evaluations(evaluations_since))

    def stop(self) -> None:
        self.stop_requested = True

    # -- the workers' API ------------------------------------------------------------------------------------
    def lease(self, worker: str) -> Lease:
        with self.lock:
            self.working.add(worker)
            self.lease_started.pop(worker, None)
            for update in [u for u, holder in self.in_flight.items() if holder == worker]:
                del self.in_flight[update]  # its pushes returned before it asked again
            if self.stop_requested or self.book.done:
                return Lease(None, finished=True)
            if self.state != "running":
                return Lease(None)
            ticket = self.book.lease(worker)
            if ticket is not None:
                self.lease_started[worker] = time.monotonic()
            return Lease(ticket, self.epoch, tuple(self.servers), self.shards)

    def admit(self, worker: str, report: StepReport) -> int | None:
        """The update number ``report``'s gradient is applied as, or None (too stale, or a restore took its lease)."""
        with self.lock:
            if self.book.leases.get(report.ticket) != worker:
                return None
            admission = self.book.admit(report.ticket, worker, report.read_versions)
            if admission.update is None:
                return None
            update = admission.update
            self.in_flight[update] = worker
            extra = {"skipped": True} if report.skipped else {}
            if report.link_delay_s:
                extra["link_delay_s"] = round(report.link_delay_s, 5)
            row = self.log.add_step(update, time.time(), generation=self.epoch, rank=0, world_size=1,
                              loss_sum=report.loss_sum, samples=report.samples, step_s=report.step_s,
                              bytes_sent=report.bytes_sent, uncompressed_bytes=report.bytes_sent,
                              compute_s=report.compute_s, bytes_received=report.bytes_received,
                              lr=learning_rate(update - 1, self.job.optim, self.job.training.steps),
                              grad_norm=round(report.grad_norm, 6), staleness=admission.staleness,
                              ticket=report.ticket, worker=worker, **extra)
            row["world_size"] = len(self.workers)  # one worker reports an update; readers want the workers training
            if report.sample_ids is not None:
                self.log.add_samples(update, tuple(report.sample_ids), generation=self.epoch, rank=0)
            return update

    def give_back(self, worker: str, ticket: int) -> None:
        with self.lock:
            self.lease_started.pop(worker, None)
            self.book.give_back(ticket, worker)

    # -- starting ------------------------------------------------------------------------------------------
    def _start(self) -> None:
        job = self.job
        self.workload = load_workload(job.workload.name, job.workload.options)
        self.evaluator = Evaluator(self.workload, batch_size=job.eval.batch_size, device=torch.device("cpu"))
        sizes = {name: p.numel() for name, p in self.workload.build_model().named_parameters()}
        names = assign_parameters(sizes, job.strategy.num_servers)
        self.shards = tuple(tuple(shard) for shard in names)
        self.servers = [self._start_server(index) for index in range(job.strategy.num_servers)]
        resume = newest_complete(self.checkpoint_root) if job.checkpoint.resume == "auto" else None
        self._restore_servers(resume[0] if resume else None)
        if resume is not None:
            self.log.event("resumed", self.book.steps_applied, path=resume[0], version=resume[1])
        for index in range(job.scaling.max_workers):
            self._start_worker(index)
        self.state = "running"

    def _start_server(self, index: int) -> Any:
        job = self.job
        spec = ServerSpec(workload=job.workload, optim=job.optim, training=job.training,
                          max_staleness=job.strategy.max_staleness, num_servers=job.strategy.num_servers,
                          predict_weights=job.strategy.predict_weights,
                          checkpoint_root=self.checkpoint_root, every_steps=job.checkpoint.every_steps,
                          config_hash=job.math_hash(), torch_threads=max(1, int(job.strategy.server_cpus)),
                          faults=tuple(f for f in self.server_faults if f.rank == index))
        return ParameterServerActor.options(
            name=f"{self.prefix}server{index}", num_cpus=job.strategy.server_cpus, max_restarts=0,
            scheduling_strategy=self._bundle(job.scaling.max_workers + index),
        ).remote(spec, index=index, names=list(self.shards[index]))

    def _start_worker(self, index: int) -> None:
        job = self.job
        self.starts[index] = self.starts.get(index, -1) + 1
        name = f"{self.prefix}worker{index}.{self.starts[index]}"
        spec = AsyncWorkerSpec(name=name, workload=job.workload, training=job.training, optim=job.optim,
                               data=job.data, use_gpu=job.scaling.use_gpu,
                               torch_threads=max(1, int(job.scaling.cpus_per_worker)),
                               server_timeout_s=job.failure.collective_timeout_s,
                               faults=tuple(f for f in self.worker_faults if f.rank == index), link=job.link)
        actor = AsyncWorkerActor.options(
            name=name, num_cpus=job.scaling.cpus_per_worker, num_gpus=1 if job.scaling.use_gpu else 0,
            resources=job.scaling.resources_per_worker or None, max_restarts=0, scheduling_strategy=self._bundle(index),
        ).remote(spec, ray.get_runtime_context().current_actor)
        self.workers[name] = (index, actor, actor.run.remote())
        if self.state == "running":
            self.log.event("worker_joined", self.book.steps_applied, worker=name)

    def _bundle(self, position: int) -> PlacementGroupSchedulingStrategy | None:
        """The reserved bundle at ``position`` (workers first, then servers), if bundles were reserved."""
        if self.reserved is None:
            return None
        return PlacementGroupSchedulingStrategy(placement_group=self.reserved.placement_group,
                                                placement_group_bundle_index=self.reserved.bundle_indices[position])

    def _restore_servers(self, directory: str | None) -> None:
        """Every server to ``directory`` (None: the initial state) in a new epoch, the books with them; logged as
        a generation formed at that version (the ledger keeps no later update of an earlier epoch)."""
        started = time.time()
        with self.lock:
            self.epoch += 1
            versions = ray.get([s.restore.remote(self.epoch, directory) for s in self.servers],
                               timeout=self.job.scaling.placement_timeout_s)
            before = self.book.steps_applied
            self.book.rewind(versions[0], ray.get(self.servers[0].tickets_applied.remote()))
            self.in_flight.clear()
            self.lease_started.clear()
        self.log.event("generation_formed", versions[0], generation=self.epoch, world_size=self.job.scaling.max_workers,
                       state_source="checkpoint" if directory else "start", path=directory,
                       steps_lost=max(0, before - self.book.steps_applied),
                       duration_s=round(time.time() - started, 3))

    # -- supervising -----------------------------------------------------------------------------------------
    def _supervise(self) -> None:
        refs = {ref: name for name, (_, _, ref) in self.workers.items()}
        ended, _ = ray.wait(list(refs), num_returns=1, timeout=SUPERVISE_S)
        for ref in ended:
            self._worker_ended(refs[ref], ref)
        self._check_heartbeats()
        self._kill_hung_workers()
        self._bring_workers_back()
        self._evaluate_when_due()
        every = self.job.checkpoint.every_steps
        if every and self.book.version // every > self.pruned_at // every:
            self.pruned_at = self.book.version
            prune(self.checkpoint_root, self.job.checkpoint.num_to_keep)

    def _worker_ended(self, name: str, ref: Any) -> None:
        index, actor, _ = self.workers.pop(name)
        self.heartbeats.forget(name)
        self.working.discard(name)
        try:
            ray.get(ref)
            ray.kill(actor)  # it was told there are no more steps: its slot is free for one that may be needed
            return
        except ray.exceptions.RayTaskError as error:  # an error in the job's code: retrying would repeat it
            raise RunFailed(f"{name} raised: {error.cause!r}{self._note()}\n{error}") from None
        except ray.exceptions.RayError as error:
            reason = self.killed_because.pop(name, None) or next(
                (line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        with self.lock:
            self.book.worker_lost(name)
            self.lease_started.pop(name, None)
            lost = [u for u, holder in self.in_flight.items() if holder == name]
        for update in lost:
            self._withdraw_if_undelivered(update)
        self.log.event("worker_failed", self.book.steps_applied, worker=name, reason=reason)
        self._count_failure(f"{name} was lost: {reason}")
        self.worker_faults = [f for f in self.worker_faults if f.rank != index or f.action == "throttle"]
        self._start_worker(index)

    def _withdraw_if_undelivered(self, update: int) -> None:
        """A dead worker's admitted update: servers that never got it skip it; if none did, its step goes back."""
        delivered = ray.get([s.skip.remote(self.epoch, update) for s in self.servers])
        with self.lock:
            self.in_flight.pop(update, None)
            if not any(delivered):
                self.book.withdraw(update)

    def _check_heartbeats(self) -> None:
        """Servers and workers that died or hang (a stalled process answers nothing)."""
        self.heartbeats.ping({f"server{i}": server.version_now for i, server in enumerate(self.servers)}
                             | {name: actor.ping for name, (_, actor, _) in self.workers.items()
                                if name in self.working})
        late = self.heartbeats.overdue()
        lost = [(i, late[f"server{i}"]) for i in range(len(self.servers)) if f"server{i}" in late]
        if lost:
            self._recover_servers(lost)
        for name, why in late.items():
            if name in self.workers:
                self.killed_because[name] = why
                ray.kill(self.workers[name][1])  # its run ref raises next: replaced as a lost worker

    def _recover_servers(self, lost: list[tuple[int, str]]) -> None:
        self.state = "recovering"
        for index, reason in lost:
            self.log.event("server_failed", self.book.steps_applied, server=index, reason=reason)
            ray.kill(self.servers[index])
            self.heartbeats.forget(f"server{index}")
            self._count_failure(f"parameter server {index} was lost: {reason}")
            self.server_faults = [f for f in self.server_faults if f.rank != index]  # it fired
            self.servers[index] = self._start_server(index)
        found = newest_complete(self.checkpoint_root)
        self._restore_servers(found[0] if found else None)
        self.state = "running"

    def _bring_workers_back(self) -> None:
        """Workers that left when there were no more steps, if a server restore took steps back since."""
        if self.book.done or self.stop_requested:
            return
        present = {index for index, _, _ in self.workers.values()}
        for index in range(self.job.scaling.max_workers):
            if index not in present:
                self._start_worker(index)

    def _kill_hung_workers(self) -> None:
        now = time.monotonic()
        with self.lock:
            hung = [name for name, started in self.lease_started.items() if now - started > self.job.failure.max_step_s]
        for name in hung:
            if name in self.workers:
                self.killed_because[name] = f"its step ran over failure.max_step_s={self.job.failure.max_step_s}s"
                ray.kill(self.workers[name][1])  # its run ref raises next: replaced as a lost worker

    def _count_failure(self, what: str) -> None:
        self.failures += 1
        if self.failures > self.job.failure.max_failures:
            raise RunFailed(f"{what}; that is failure {self.failures}, more than failure.max_failures="
                            f"{self.job.failure.max_failures}{self._note()}")

    def _servers_caught_up(self) -> bool:
        try:
            return all(v == self.book.version for v in ray.get([s.version_now.remote() for s in self.servers]))
        except ray.exceptions.RayError:  # a server is lost: the heartbeats find it next and the servers are restored
            return False

    # -- evaluating and finishing ---------------------------------------------------------------------------
    def _model(self) -> torch.nn.Module:
        """The servers' parameters and buffers now, in a model built here."""
        model = self.workload.build_model()
        state = {}
        for share in ray.get([s.state.remote() for s in self.servers]):
            state |= {name.removeprefix("buffer."): tensor for name, tensor in share.items()}
        model.load_state_dict(state)
        return model

    def _evaluate(self, model: torch.nn.Module | None = None) -> dict[str, float]:
        return self.evaluator.run(model or self._model())

    def _evaluate_when_due(self) -> None:
        every = self.job.eval.every_steps
        step = self.book.steps_applied
        if every and step >= self.next_evaluation and step < self.job.training.steps:
            self.next_evaluation = (step // every + 1) * every
            self.log.add_evaluation(step, time.time(), self._evaluate())

    def _finish(self) -> RunResult:
        self.state = "finishing"
        step = self.book.steps_applied
        path = ray.get([s.save.remote() for s in self.servers])[0]
        self.log.event("checkpointed", step, path=path, reason="end of run")
        model = self._model()
        metrics = self._evaluate(model)
        if self.job.eval.every_steps:
            self.log.add_evaluation(step, time.time(), metrics)
        stats = ray.get([s.stats.remote() for s in self.servers])
        history = self.log.history()
        recent = history[-self.job.scaling.max_workers:]  # the last updates, one per worker: a mean over a batch each
        metrics = {"loss": sum(r["loss"] for r in recent) / len(recent), **metrics,
                   "refused_stale": self.book.refused,
                   "max_applied_staleness": max(s["max_applied_staleness"] for s in stats)}
        self.log.event("finished", step, **{k: round(v, 6) for k, v in metrics.items()})
        self.state = "finished"
        return RunResult(final_step=step, metrics=metrics, history=history, events=self.log.events(),
                         model_state={k: v.detach().clone() for k, v in model.state_dict().items()}, checkpoint=path,
                         eval_history=self.log.evaluations(),
                         ledger=self.log.ledger() if self.job.training.record_samples else None)

    def _note(self) -> str:
        found = newest_complete(self.checkpoint_root)
        return f"; last checkpoint: {found[0]} (update {found[1]})" if found else "; no checkpoint was written yet"


AsyncControllerActor = ray.remote(num_cpus=0, max_concurrency=32)(AsyncController)
