"""AsyncController: owns one asynchronous run - its servers, its workers and the books of its steps.

It answers the workers (``lease``, ``admit``, ``give_back``) and the driver (``progress``, ``stop``, the
same as the synchronous Controller's) from threads of its own, while ``run`` moves through the run's states
(states.py) one ``advance()`` at a time, as the synchronous Controller does, and supervises:

- a worker that dies gives its leased steps back, and its admitted update if no server got it (the
  servers skip that number); a replacement takes its index, up to ``failure.max_failures``; a worker
  whose step exceeds ``failure.max_step_s`` is killed as hung, one whose call here went unanswered for its bound
  (worker.py: ControllerUnanswered) is lost too; an error in user code fails the run;
- a server that dies, or leaves a heartbeat or any other call unanswered for its bound (server_group.py),
  is replaced, and every server goes back to the newest whole checkpoint (or the start) in a new epoch:
  the updates after it are taken back and their steps computed again, so each step's samples still reach
  the parameters exactly once; a server whose update raised fails the run with its traceback;
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

from raylastic.actors.async_ps.checkpoints import Cut, last_checkpoint_note, newest_complete, prune
from raylastic.actors.async_ps.heartbeats import Heartbeats
from raylastic.actors.async_ps.leases import Lease, StepReport
from raylastic.actors.async_ps.server import UnreadableCheckpoint
from raylastic.actors.async_ps.server_group import ServerGroup, ServersLost, first_line
from raylastic.actors.async_ps.shards import assign_parameters, model_from_shares
from raylastic.actors.async_ps.states import AsyncRunState, RestoringServers, StartingWorkers, Stopping, Training
from raylastic.actors.async_ps.tickets import TicketBook
from raylastic.actors.async_ps.worker import ControllerUnanswered
from raylastic.actors.async_ps.worker_pool import WorkerPool, reserved_bundle
from raylastic.actors.controller.policies import FailurePolicy, Raise
from raylastic.actors.controller.run_log import RunLog
from raylastic.actors.controller.states import TERMINAL, Failed, Finished, Finishing, Placing, Stopped, ending
from raylastic.actors.status.run import RunFailed, RunResult, RunStatus
from raylastic.actors.worker.evaluation import Evaluator
from raylastic.actors.worker.optimizer_recipe import learning_rate
from raylastic.actors.worker_group.placement import ReservedBundles
from raylastic.jobconfig import JobConfig
from raylastic.jobconfig.naming import controller_name
from raylastic.workloads import load_workload

SUPERVISE_S = 0.2
"""How long one supervising pass waits for a worker to end before it looks at the others and the servers."""


class AsyncController:
    def __init__(self, job: JobConfig, checkpoint_root: str, reserved: ReservedBundles | None = None,
                 profile_dir: str | None = None) -> None:
        """``reserved``: bundles for the workers (the first max_workers) and the servers (the rest), e.g. a Ray Tune
        trial's; None: Ray places each actor where its resources are free."""
        self.job, self.checkpoint_root, self.reserved = job, checkpoint_root, reserved
        self.prefix = controller_name(job.name).removesuffix("controller")
        self.log = RunLog()
        self.book = TicketBook(total_steps=job.training.steps, max_staleness=job.strategy.max_staleness)
        self.lock = threading.Lock()
        self.state: AsyncRunState = Placing()
        self.epoch = 0
        self.failures = 0
        self.failure_policy = FailurePolicy(max_failures=job.failure.max_failures)
        self.stop_requested = False
        self.restoring = False
        """The servers are being restored (no lock is held meanwhile): a lease says wait, an admission is refused."""
        self.group: ServerGroup | None = None
        self.shards: tuple[tuple[str, ...], ...] = ()
        self.pool = WorkerPool(job, prefix=self.prefix, place=lambda index: reserved_bundle(reserved, index))
        self.in_flight: dict[int, str] = {}
        """Admitted updates whose worker has not asked for its next step yet (it may still be pushing)."""
        self.lease_started: dict[str, float] = {}
        """Worker -> when it leased the step it computes (and pushes) now: failure.max_step_s bounds it."""
        self.heartbeats = Heartbeats(job.failure.step_timeout_s)
        self.next_evaluation = job.eval.every_steps
        self.pruned_at = 0
        """The version at which old checkpoints were last pruned."""
        self.rejected: set[Cut] = set()
        """Cuts a server could not load."""
        self._actions = {Placing: self._place, StartingWorkers: self._start_training, Training: self._train,
                         RestoringServers: self._restore, Finishing: self._finish, Stopping: self._stop}

    # -- the driver's API ------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Train to ``training.steps``; raises RunFailed with the reason when the run cannot go on."""
        try:
            while not isinstance(self.state, TERMINAL):
                self.advance()
        finally:
            self.stop_requested = True  # every lease from now on says finished
            self.pool.kill_all()
            if self.group is not None:
                self.group.kill_all()
            self.log.close()
        return ending(self.state, step=self.book.steps_applied, note=self._note)

    def advance(self) -> AsyncRunState:
        """One transition: act in the current state and move to the next. A stop request ends a training run
        before its next pass; servers lost in any state lead to restoring them."""
        state = self.state
        try:
            if self.stop_requested and isinstance(state, StartingWorkers | Training):
                following = (Stopping(deadline=time.monotonic() + self.job.failure.max_step_s)
                             if self.book.steps_applied else Stopped())
            else:
                following = self._actions[type(state)](state)
        except ServersLost as lost:
            following = RestoringServers(tuple(lost.servers))
        except RunFailed as failed:
            following = Failed(str(failed), model_state=failed.model_state)
        except Exception as error:  # a defect of ours: a failed run with its reason
            following = Failed(f"the asynchronous run failed at step {self.book.steps_applied} while {state.name}: "
                               f"{type(error).__name__}: {error}{self._note()}\n{traceback.format_exc()}")
        self.state = following
        return following

    def progress(self, history_since: int = 0, events_since: int = 0, evaluations_since: int = 0,
                 wait_s: float = 0.0) -> RunStatus:
        if wait_s > 0:
            self.log.wait_for_news(events_since, wait_s)
        return RunStatus(state=self.state.name, generation=self.epoch, world_size=len(self.pool.workers),
                         step=self.book.steps_applied, members=sorted(self.pool.workers), failures=self.failures,
                         history=self.log.history(history_since), events=self.log.events(events_since),
                         evaluations=self.log.evaluations(evaluations_since))

    def stop(self) -> None:
        self.stop_requested = True

    # -- the workers' API ------------------------------------------------------------------------------------
    def lease(self, worker: str) -> Lease:
        with self.lock:
            self.pool.working.add(worker)
            self.lease_started.pop(worker, None)
            for update in [u for u, holder in self.in_flight.items() if holder == worker]:
                del self.in_flight[update]  # its pushes returned before it asked again
            if self.stop_requested or self.book.done:
                return Lease(None, finished=True)
            if self.restoring or not isinstance(self.state, Training):
                return Lease(None)
            ticket = self.book.lease(worker)
            if ticket is not None:
                self.lease_started[worker] = time.monotonic()
            return Lease(ticket, self.epoch, tuple(self.group.servers), self.shards)

    def admit(self, worker: str, report: StepReport) -> int | None:
        """The update number ``report``'s gradient is applied as, or None (too stale, or a restore took its lease)."""
        with self.lock:
            if self.restoring or self.book.leases.get(report.ticket) != worker:
                return None
            admission = self.book.admit(report.ticket, worker, report.read_versions)
            if admission.update is None:
                return None
            update = admission.update
            self.in_flight[update] = worker
            extra = {"skipped": True} if report.skipped else {}
            if report.link_delay_s:
                extra["link_delay_s"] = round(report.link_delay_s, 5)
            self.log.add_step(update, time.time(), generation=self.epoch, rank=0, world_size=len(self.pool.workers),
                              reporting=1, loss_sum=report.loss_sum, samples=report.samples, step_s=report.step_s,
                              bytes_sent=report.bytes_sent, uncompressed_bytes=report.bytes_sent,
                              compute_s=report.compute_s, bytes_received=report.bytes_received,
                              lr=learning_rate(update - 1, self.job.optim, self.job.training.steps),
                              grad_norm=round(report.grad_norm, 6), staleness=admission.staleness,
                              ticket=report.ticket, worker=worker, **extra)
            if report.sample_ids is not None:
                self.log.add_samples(update, tuple(report.sample_ids), generation=self.epoch, rank=0)
            return update

    def give_back(self, worker: str, ticket: int) -> None:
        with self.lock:
            self.lease_started.pop(worker, None)
            self.book.give_back(ticket, worker)

    # -- the states' actions --------------------------------------------------------------------------------
    def _place(self, state: Placing) -> AsyncRunState:
        """The servers, restored to the checkpoint to resume from (checkpoint.resume=auto), then the workers."""
        job = self.job
        self.workload = load_workload(job.workload.name, job.workload.options)
        self.evaluator = Evaluator(self.workload, batch_size=job.eval.batch_size, device=torch.device("cpu"))
        sizes = {name: p.numel() for name, p in self.workload.build_model().named_parameters()}
        self.shards = tuple(tuple(shard) for shard in assign_parameters(sizes, job.strategy.num_servers))
        self.group = ServerGroup(job, self.checkpoint_root, self.shards, prefix=self.prefix,
                                 place=lambda index: reserved_bundle(self.reserved, job.scaling.max_workers + index))
        cut = self._recover([], from_disk=job.checkpoint.resume == "auto")
        if cut is not None:
            self.log.event("resumed", self.book.steps_applied, path=cut.directory, version=cut.version)
        for index in range(job.scaling.max_workers):
            self.pool.start(index)
        return StartingWorkers(deadline=time.monotonic() + job.scaling.placement_timeout_s)

    def _start_training(self, state: StartingWorkers) -> AsyncRunState:
        """One supervising pass (a worker that dies starting is replaced); training once min_workers asked."""
        self._supervise()
        scaling = self.job.scaling
        if self.book.done:  # resumed from its last step: the workers are told so and leave
            return Training()
        if len(self.pool.working) >= scaling.min_workers:
            self.log.event("workers_ready", self.book.steps_applied, workers=sorted(self.pool.working))
            return Training()
        if time.monotonic() >= state.deadline:
            return Failed(f"only {len(self.pool.working)} of scaling.min_workers={scaling.min_workers} workers asked "
                          f"for a step within scaling.placement_timeout_s={scaling.placement_timeout_s}s (each needs "
                          f"{self.pool.needs()} where Ray can place it){self._note()}")
        return state

    def _train(self, state: Training) -> AsyncRunState:
        """One supervising pass; finishing once every step is applied and every server has caught up."""
        self._supervise()
        if self.book.done and self._servers_caught_up():
            return Finishing()
        return state

    def _restore(self, state: RestoringServers) -> AsyncRunState:
        self._recover(list(state.lost))
        return Training()

    def _recover(self, lost: list[tuple[int, str]], *, from_disk: bool = True) -> Cut | None:
        """Replace the ``lost`` servers, then restore every server to the newest whole cut (``from_disk``; else the
        initial state), again until all of them answer; returns the cut."""
        while True:
            for index, reason in lost:
                self.log.event("server_failed", self.book.steps_applied, server=index, reason=reason)
                self.heartbeats.forget(f"server{index}")
                self._count_failure(f"parameter server {index} was lost: {reason}")
                self.group.replace(index)
            cut = newest_complete(self.checkpoint_root, frozenset(self.rejected)) if from_disk else None
            try:
                self._restore_servers(cut)
                return cut
            except ServersLost as again:
                lost = again.servers
            except UnreadableCheckpoint as error:
                self.rejected.add(cut)
                self.log.event("checkpoint_rejected", self.book.steps_applied, path=cut.directory, reason=str(error))
                lost = []

    def _restore_servers(self, cut: Cut | None) -> None:
        """Every server to ``cut`` (None: the initial state) in a new epoch, the books with them; logged as a
        generation formed at that version (the ledger keeps no later update of an earlier epoch). The files of
        the abandoned timeline, after the cut, are cleared. The servers' restore (up to scaling.placement_timeout_s)
        runs with no lock held: the workers' calls are answered meanwhile (wait; a gradient of the old epoch is
        refused)."""
        started = time.time()
        with self.lock:
            self.epoch += 1
            self.restoring = True
        try:
            restored = self.group.restore(self.epoch, cut)
            with self.lock:
                before = self.book.steps_applied
                self.book.rewind(restored.version, restored.tickets)
                self.in_flight.clear()
                self.lease_started.clear()
        finally:
            with self.lock:
                self.restoring = False
        self.log.event("generation_formed", restored.version, generation=self.epoch,
                       world_size=self.job.scaling.max_workers, state_source="checkpoint" if cut else "start",
                       path=cut.directory if cut else None, steps_lost=max(0, before - self.book.steps_applied),
                       duration_s=round(time.time() - started, 3))

    # -- supervising -----------------------------------------------------------------------------------------
    def _supervise(self) -> None:
        refs = self.pool.runs()
        if refs:
            ended, _ = ray.wait(list(refs), num_returns=1, timeout=SUPERVISE_S)
        else:  # every worker left: the servers are catching up
            ended = []
            time.sleep(SUPERVISE_S)
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
        index, actor, killed_because = self.pool.ended(name)
        self.heartbeats.forget(name)
        try:
            ray.get(ref)
            ray.kill(actor)  # it was told there are no more steps: its slot is free for one that may be needed
            return
        except ray.exceptions.RayTaskError as error:
            if not isinstance(error.cause, ControllerUnanswered):  # an error in the job's code: retrying repeats it
                raise RunFailed(f"{name} raised: {error.cause!r}{self._note()}\n{error}") from None
            reason = str(error.cause)
            ray.kill(actor)
        except ray.exceptions.RayError as error:
            reason = killed_because or first_line(error)
        with self.lock:
            self.book.worker_lost(name)
            self.lease_started.pop(name, None)
            lost = [u for u, holder in self.in_flight.items() if holder == name]
        self.log.event("worker_failed", self.book.steps_applied, worker=name, reason=reason)
        self._count_failure(f"{name} was lost: {reason}")
        self.pool.lost(index)
        self._start_worker(index)
        for update in lost:  # last: a server lost meanwhile restores every server, and this one's books with them
            self._withdraw_if_undelivered(update)

    def _withdraw_if_undelivered(self, update: int) -> None:
        """A dead worker's admitted update: servers that never got it skip it; if none did, its step goes back."""
        delivered = self.group.ask("skip", self.epoch, update)
        with self.lock:
            self.in_flight.pop(update, None)
            if not any(delivered):
                self.book.withdraw(update)
                self.log.withdraw(update, generation=self.epoch)

    def _check_heartbeats(self) -> None:
        """Servers and workers that died or hang (a stalled process answers nothing); a server's own error fails
        the run; ServersLost for the servers lost."""
        self.heartbeats.ping(self.group.pings() | self.pool.pings())
        heard = self.heartbeats.check()
        for name, why in heard.late.items():
            self.pool.kill(name, why)
        try:
            self.group.hear(heard)
        finally:
            self._log_failed_saves()

    def _log_failed_saves(self) -> None:
        for index, failure in self.group.take_failed_saves():
            self.log.event("checkpoint_failed", failure.version, path=failure.path, error=failure.error, server=index)

    def _bring_workers_back(self) -> None:
        """Workers that left when there were no more steps, if a server restore took steps back since."""
        if self.book.done or self.stop_requested:
            return
        for index in self.pool.missing():
            self._start_worker(index)

    def _kill_hung_workers(self) -> None:
        now = time.monotonic()
        with self.lock:
            hung = [name for name, started in self.lease_started.items() if now - started > self.job.failure.max_step_s]
        for name in hung:
            self.pool.kill(name, f"its step ran over failure.max_step_s={self.job.failure.max_step_s}s")

    def _start_worker(self, index: int) -> None:
        name = self.pool.start(index)
        self.log.event("worker_joined", self.book.steps_applied, worker=name)

    def _count_failure(self, what: str) -> None:
        """One more failure, decided on by the FailurePolicy the synchronous Controller asks too."""
        self.failures += 1
        decision = self.failure_policy.decide(self.failures)
        if isinstance(decision, Raise):
            raise RunFailed(f"{decision.reason}; last failure: {what}{self._note()}")

    def _servers_caught_up(self) -> bool:
        beats = self.group.beats()
        self._log_failed_saves()
        return all(beat.version == self.book.version for beat in beats)

    # -- evaluating and finishing ---------------------------------------------------------------------------
    def _model(self) -> torch.nn.Module:
        """The servers' parameters and buffers now, in a model built here."""
        return model_from_shares(self.workload, self.group.state())

    def _evaluate_when_due(self) -> None:
        every = self.job.eval.every_steps
        step = self.book.steps_applied
        if every and step >= self.next_evaluation and step < self.job.training.steps:
            metrics = self.evaluator.run(self._model())
            self.next_evaluation = (step // every + 1) * every
            self.log.add_evaluation(step, time.time(), metrics)

    def _finish(self, state: Finishing) -> AsyncRunState:
        """The final checkpoint, the model and its evaluation; nothing is logged until all of it is in hand (a
        server lost on the way restores the servers, and the run finishes again)."""
        step = self.book.steps_applied
        path = self._final_checkpoint()
        model = self._model()
        model_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        try:
            metrics = self.evaluator.run(model)
        except Exception as error:  # the workload's: the checkpoint is written, the model goes to model.pt
            raise RunFailed(f"the final evaluation raised at step {step}: {type(error).__name__}: {error}"
                            f"{self._note()}\n{traceback.format_exc()}", model_state=model_state) from None
        stats = self.group.ask("stats")
        if path is not None:
            self.log.event("checkpointed", step, path=path, reason="end of run")
        if self.job.eval.every_steps:
            self.log.add_evaluation(step, time.time(), metrics)
        metrics = {**self._recent_loss(), **metrics, "refused_stale": self.book.refused,
                   "max_applied_staleness": max(s["max_applied_staleness"] for s in stats)}
        self.log.event("finished", step, **{k: round(v, 6) for k, v in metrics.items()})
        return Finished(self._result(step, metrics, model_state, path))

    def _stop(self, state: Stopping) -> AsyncRunState:
        """One supervising pass while the steps leased before the stop are pushed; then the version every server
        holds is kept: its checkpoint and the model, no evaluation."""
        self._supervise()
        with self.lock:
            settled = not self.book.leases and not self.in_flight
        if not (settled and self._servers_caught_up()):
            return state if time.monotonic() < state.deadline else Stopped()
        step = self.book.steps_applied
        path = self._final_checkpoint()
        model_state = {k: v.detach().clone() for k, v in self._model().state_dict().items()}
        self.log.event("stopped", step, checkpoint=path)
        return Stopped(self._result(step, self._recent_loss(), model_state, path))

    def _recent_loss(self) -> dict[str, float]:
        """The mean loss of the last updates, one per worker (a mean over a batch each); none when none was applied
        in this run (resumed at its end)."""
        recent = self.log.history()[-self.job.scaling.max_workers:]
        return {"loss": sum(r["loss"] for r in recent) / len(recent)} if recent else {}

    def _result(self, step: int, metrics: dict[str, float], model_state: dict[str, torch.Tensor],
                checkpoint: str | None) -> RunResult:
        return RunResult(final_step=step, metrics=metrics, history=self.log.history(), events=self.log.events(),
                         model_state=model_state, checkpoint=checkpoint, eval_history=self.log.evaluations(),
                         ledger=self.log.ledger() if self.job.training.record_samples else None)

    def _final_checkpoint(self) -> str | None:
        """Every server's file of the last version, written by their savers while they answer heartbeats (within
        failure.max_step_s, as a step); None if one failed: checkpoint_failed says why, and the run still ends with
        its model."""
        version = self.book.version
        # A ping in flight carries the saves that failed before it was answered, which its server no longer holds;
        # from here on only the beats below ask, and each is heard.
        self.heartbeats.settle(set(self.group.pings()), timeout_s=self.job.failure.step_timeout_s)
        try:
            self.group.hear(self.heartbeats.check())
        finally:
            self._log_failed_saves()
        directory = self.group.ask("save")[0]
        deadline = time.monotonic() + self.job.failure.max_step_s
        while True:
            self.group.beats()
            self._log_failed_saves()
            if (saved := self.group.saved(directory, version)) is not None:
                return directory if saved else None
            if time.monotonic() > deadline:
                self.log.event("checkpoint_failed", version, path=directory, error=(
                    f"not written within failure.max_step_s={self.job.failure.max_step_s}s"))
                return None
            time.sleep(SUPERVISE_S)

    def _note(self) -> str:
        return last_checkpoint_note(self.checkpoint_root)


AsyncControllerActor = ray.remote(num_cpus=0, max_concurrency=32)(AsyncController)
