"""Controller: owns one run, as a state machine over a WorkerGroup.

The states are in ``actors.controller.states`` (placing, forming, running, resizing, recovering,
waiting_for_workers, finishing, stopping, and the ends finished, failed, stopped); ``advance`` takes one
transition, ``run`` takes them until an end. Each state's action executes through the WorkerGroup;
every decision (how many workers, whether a failure is one too many, what a poll of the training
group means, where a generation's state comes from) is taken by a pure policy in ``actors.controller.policies``.

Survivors are never restarted: they leave the broken group and join generation g+1 in the same
process, and the most advanced state among them is broadcast to everyone. The Controller is a
threaded actor: ``run`` blocks in one thread while ``progress``, ``drain`` and ``stop`` answer
from others.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from collections.abc import Callable

import ray

from raylastic.actors.controller.drains import Drains
from raylastic.actors.controller.layout_policy import LayoutsSeen
from raylastic.actors.controller.memory_restore import plan_memory_restore, restore_from_memory
from raylastic.actors.controller.policies import (
    AllStopped,
    FromCheckpoint,
    FromPeers,
    FromRank,
    GenerationFinished,
    KeepTraining,
    Raise,
    Resize,
    RunPolicies,
    ScalingState,
    StateLost,
    Verdict,
    choose_state_source,
    needs_checkpoint_lookup,
)
from raylastic.actors.controller.poll_intake import Progress, take_in
from raylastic.actors.controller.run_checkpoints import ForeignCheckpoint, RunCheckpoints, checkpoint_settings
from raylastic.actors.controller.run_log import RunLog
from raylastic.actors.controller.run_metrics import RunMetrics
from raylastic.actors.controller.share_book import ShareBook
from raylastic.actors.controller.staffing import Staffing
from raylastic.actors.controller.states import (
    TERMINAL,
    Failed,
    Finished,
    Finishing,
    Forming,
    Placing,
    Recovering,
    Resizing,
    Running,
    RunState,
    Stopped,
    Stopping,
    WaitingForWorkers,
    after_a_stop,
    ending,
)
from raylastic.actors.controller.timed_checkpoints import TimedCheckpoints
from raylastic.actors.faults.plan import FaultPlan
from raylastic.actors.processes.priority import run_at_normal_priority
from raylastic.actors.status.group import Failure, GroupStatus, JobError, LostWorker, WorkersLost
from raylastic.actors.status.run import RunResult, RunStatus
from raylastic.actors.worker_group.group import MemberRaised, MembersFailed, WorkerGroup
from raylastic.actors.worker_group.membership import WorkersCannotStart
from raylastic.actors.worker_group.placement import ReservedBundles
from raylastic.jobconfig import JobConfig
from raylastic.strategies.checkpoint_catalogue import Checkpoint
from raylastic.strategies.checkpoint_manifest import read_manifest

logger = logging.getLogger(__name__)

WAIT_SLICE_S = 1.0
"""While waiting for workers, how long one wait lasts before a stop request is looked at again."""


class Controller:
    def __init__(self, job: JobConfig, checkpoint_root: str, reserved: ReservedBundles | None = None,
                 profile_dir: str | None = None, *, group: WorkerGroup | None = None,
                 policies: RunPolicies | None = None) -> None:
        """``group``: the workers (built from ``job`` unless given, e.g. a test's fake); ``policies``: the decisions
        (``RunPolicies.for_job(job)`` unless given)."""
        warning = run_at_normal_priority("Controller")  # it acts first on a failure, beside nice-0 ranks
        if warning:
            logger.warning(warning)
        self.job = job
        self.log = RunLog()
        self.metrics = RunMetrics(job.name)
        self.checkpoints = RunCheckpoints(root=checkpoint_root, config_hash=job.math_hash(), log=self.log)
        self.replicated = job.replicated
        self.policies = policies or RunPolicies.for_job(job)
        self.faults = FaultPlan(job.faults)
        if group is None:
            group = WorkerGroup.for_job(job, checkpoint_settings(job, checkpoint_root), reserved=reserved,
                                        profile_dir=profile_dir)
        self.group = group
        self.state: RunState = Placing()
        self.step = 0
        """The newest step the run committed."""
        self.failures = 0
        self.stop_requested = False
        self.drains = Drains(self.group, self.log, min_workers=job.scaling.min_workers)
        self.shares = ShareBook(job.training.global_batch_size, job.scaling.straggler_factor)
        self.layouts_seen = LayoutsSeen()
        self.staffing = Staffing(self.group, self.log, policy=self.policies.scaling, scaling=job.scaling,
                                 note=self.checkpoints.note)
        self.training_progress = Progress(self.step)
        """The training generation's committed step and open recovery, as its polls bring them in."""
        self.timed_checkpoints = TimedCheckpoints(self.group, every_minutes=job.checkpoint.every_minutes)
        self.poll_observers: tuple[Callable[[GroupStatus, int], None], ...] = (
            self.shares.observe, self.drains.observe, self.staffing.observe, self.timed_checkpoints.observe)
        """What every poll of a training generation goes to, after the run's log and metrics."""
        self._actions = {Placing: self._place, Forming: self._form, Running: self._train, Resizing: self._resize,
                         Recovering: self._recover, WaitingForWorkers: self._wait_for_workers,
                         Finishing: self._finish, Stopping: self._finish}

    # -- public API (the driver, the CLI, an autoscaler, tests) --------------------------------------------
    def run(self) -> RunResult:
        """Train to ``training.steps``; raises RunFailed with the reason when the run cannot go on."""
        try:
            while not isinstance(self.state, TERMINAL):
                self.advance()
        finally:
            self.group.shutdown()
            self.log.close()
        return ending(self.state, step=self.step, note=self.checkpoints.note)

    def advance(self) -> RunState:
        """One transition: act in the current state and move to the next. A stop request takes a state that may
        stop to its stop before it acts (``after_a_stop``); a failure of workers in any state leads to recovering."""
        state = self.state
        try:
            stopped = after_a_stop(state, step=self.step) if self.stop_requested else None
            following = stopped if stopped is not None else self._actions[type(state)](state)
        except (MembersFailed, MemberRaised) as failure:  # a call on the members failed: the same verdicts as a poll's
            following = self._after_failure(failure.verdict, state)
        except ForeignCheckpoint as error:
            following = Failed(str(error))
        except WorkersCannotStart as error:
            self.staffing.log_start_failures(step=self.step)
            following = Failed(self.checkpoints.with_note(str(error)))
        except Exception as error:  # a defect of ours: still a failed run with a reason, never a bare traceback
            following = Failed(f"the Controller failed at step {self.step} while {state.name}: "
                               f"{type(error).__name__}: {error}{self.checkpoints.note()}\n{traceback.format_exc()}")
        self.state = following
        return following

    def _after_failure(self, failure: Failure, state: RunState) -> RunState:
        """Where every failure goes, whether a poll's judge or a call on the members found it: members lost while
        forming, training, resizing or finishing are recovered from (the recovery keeps when the first failure
        happened and the checkpoint a forming generation was to load); an error of the job ends the run."""
        if isinstance(failure, JobError):
            for name, error in failure.errors:
                self.log.event("worker_failed", self.step, worker=name, reason="raised an error", traceback=error)
            return Failed(self.checkpoints.with_note(failure.reason(self.step)))
        since = state.recovering_since if isinstance(state, Forming | Running) else None
        restore = state.restore if isinstance(state, Forming) else None
        return Recovering(failure.lost, recovering_since=since or time.time(), restore=restore)

    def progress(self, history_since: int = 0, events_since: int = 0, evaluations_since: int = 0,
                 wait_s: float = 0.0) -> RunStatus:
        """The run's state, and the history rows, events and evaluations since the given positions; waits up to
        ``wait_s`` for an event past ``events_since`` (or the run's end) before answering."""
        if wait_s > 0:
            self.log.wait_for_news(events_since, wait_s)
        layout = self.group.layout  # read once: the run's thread may form the next generation meanwhile
        return RunStatus(state=self.state.name, generation=self.group.generation, world_size=self.group.size,
                         step=self.step, members=self.group.member_names, failures=self.failures,
                         history=self.log.history(history_since), events=self.log.events(events_since),
                         evaluations=self.log.evaluations(evaluations_since),
                         layout=layout.describe() if layout is not None else None)

    def drain(self, *, rank: int | None = None, node_id: str | None = None) -> list[str]:
        """Planned removal: the worker of ``rank`` (or every worker on ``node_id``) leaves at the next
        step boundary, with nothing discarded. Returns the names of the workers that will leave."""
        return self.drains.ask(rank=rank, node_id=node_id)

    def stop(self) -> None:
        """End the run at the next step boundary (Ctrl-C) with that step's checkpoint and the full model, as a
        finish keeps them; workers are shut down, nothing orphaned. A stop asked while a generation forms takes
        effect once it has formed; one asked while the run waits for workers ends it at once."""
        self.stop_requested = True
        self.group.request_boundary()

    # -- the states' actions --------------------------------------------------------------------------------
    def _place(self, state: Placing) -> RunState:
        scaling = self.job.scaling
        for worker in self.group.place(max_workers=scaling.max_workers, min_workers=scaling.min_workers,
                                       spare_workers=scaling.spare_workers, timeout_s=scaling.placement_timeout_s):
            self.log.event("worker_failed", self.step, worker=worker.name, reason=worker.reason)
        if self.staffing.missing():
            return Failed(self.staffing.too_few("could be placed"))
        resume = self.checkpoints.resume_point(at_step=self.step) if self.job.checkpoint.resume == "auto" else None
        return Forming(restore=resume)

    def _form(self, state: Forming) -> RunState:
        """Every member joins generation g+1; the state is handed over or restored. Drained members that hand their
        parts over go after it, whatever happened."""
        try:
            return self._form_generation(state)
        finally:
            self.group.release_departed()

    def _form_generation(self, state: Forming) -> RunState:
        started, before, lost_layout = time.time(), self.step, self.group.layout
        seen = self.layouts_seen
        layout = self.policies.layout.decide(self.group.size, limits=seen.limits, current=self.group.layout,
                                             measured=seen.measured(self.log.history()))
        reports = self.group.form(run_step=self.step, layout=layout)
        seen.formed(layout, (report.model_limits for report in reports))
        member_steps = [report.step for report in reports]
        plan = None if self.replicated else plan_memory_restore(
            self.group, reports, model_parallel=self.job.parallel.model_parallel > 1)
        newest = None
        if needs_checkpoint_lookup(replicated=self.replicated, pending=state.restore, member_steps=member_steps,
                                   run_step=self.step, peer_plan=plan):
            newest = self.checkpoints.newest(max_step=self.step, at_step=self.step)
        source = choose_state_source(replicated=self.replicated, pending=state.restore, member_steps=member_steps,
                                     run_step=self.step, peer_plan=plan, newest_checkpoint=newest)
        if isinstance(source, StateLost):
            return Failed(source.reason(self.job.strategy, self.job.checkpoint, lost_layout)
                          + self.checkpoints.note())
        moved = {}
        if isinstance(source, FromPeers):
            label, moved = restore_from_memory(self.group, source.plan)
            self.step = source.plan.step
        elif isinstance(source, FromCheckpoint):
            found = source.checkpoint
            self.checkpoints.require_same_job(found)
            refused = self.group.restore(found.path, found.manifest.step)
            if refused is not None:  # its loaders found a file altered: form again from the next one
                self.checkpoints.reject(found, refused, at_step=self.step)
                restore = None if state.restore is None else self.checkpoints.newest(max_step=found.manifest.step)
                return Forming(restore=restore, recovering_since=state.recovering_since)
            self.step, label = found.manifest.step, "checkpoint"
        elif isinstance(source, FromRank):
            self.step, label = member_steps[source.rank], source.rank
            self.group.sync_state(source_rank=source.rank)
        else:
            self.step, label = 0, "initialisation"
        self.log.event("generation_formed", self.step, generation=self.group.generation, world_size=self.group.size,
                       state_source=label, steps_lost=max(0, before - self.step),
                       duration_s=round(time.time() - started, 4),
                       rendezvous_calls=sum(report.store_calls for report in reports),
                       **(layout.details() if layout else {}),
                       **moved)
        return Running(recovering_since=state.recovering_since)

    def _train(self, state: Running) -> RunState:
        """One poll of the training generation (started first, at the first transition): the poll's observers take
        it in, the judge decides whether the generation trains on, and a scale-up may ask for a boundary."""
        if not state.started:
            shares = self.shares.split_for(self.group.member_names) if self.job.balances_shares else None
            self.group.start_training(self.job.training.steps,
                                      [self.faults.for_rank(r) for r in range(self.group.size)], shares)
            self.training_progress = Progress(self.step, state.recovering_since)
        status = self.group.poll()
        self._take_in(status)
        verdict = self.policies.judge.decide(status)
        if isinstance(verdict, KeepTraining):
            boundary_requested = state.boundary_requested or self._consider_scaling(status)
            if self.stop_requested and not boundary_requested:  # a stop asked while the generation formed
                self.group.request_boundary()
                boundary_requested = True
            return Running(self.training_progress.recovering_since, started=True, boundary_requested=boundary_requested)
        final = self.group.end_generation()
        self._take_in(final)
        self.log.close_generation(self.group.generation)
        return self._after_generation(verdict, final)

    def _take_in(self, status: GroupStatus) -> None:
        """A poll's news into the run's log, metrics and progress; then every observer of the poll."""
        self.training_progress = take_in(status, self.log, self.metrics, self.training_progress)
        self.step = self.training_progress.step
        for observe in self.poll_observers:
            observe(status, self.step)

    def _after_generation(self, verdict: Verdict, final: GroupStatus) -> RunState:
        if isinstance(verdict, GenerationFinished):
            return Finishing()
        if isinstance(verdict, AllStopped):
            return Resizing()
        if isinstance(verdict, WorkersLost):  # a lost node takes several workers: every death heard by the end
            named = {worker.name for worker in verdict.lost}
            verdict = WorkersLost(verdict.lost + tuple(LostWorker(m.name, m.dead, rank)
                                                       for rank, m in enumerate(final.members)
                                                       if m.dead and m.name not in named))
        return self._after_failure(verdict, Running(self.training_progress.recovering_since))

    def _consider_scaling(self, status: GroupStatus) -> bool:
        """Take spares and start joiners if the policy wants more workers, and start spares on the slots left;
        True when a membership change was asked for."""
        state = ScalingState(num_workers=status.world_size + status.num_joining, num_placeable=status.num_placeable,
                             num_spares_ready=status.num_spares_ready, num_spares=status.num_spares)
        decision = self.policies.scaling.decide(state)
        wanted = decision.num_workers - state.num_workers if isinstance(decision, Resize) else 0
        taken = self.group.grow(wanted, spares=self.policies.scaling.spares_to_start(state, decision))
        if taken:
            self.log.event("spares_taken", self.step, workers=taken, reason="scale-up")
        if status.draining or self.policies.scaling.grows_at_a_boundary(world_size=status.world_size,
                                                                        ready=status.num_joiners_ready + taken):
            self.group.request_boundary()
            return True
        return False

    def _resize(self, state: Resizing) -> RunState:
        """At a step boundary: drained workers leave, ready joiners come in. Sharded state the leavers hold is
        saved by the old group first; the new one loads it, resharded, where the members' copies do not hold the
        same step (a leaver whose buddy leaves with it, or no buddy copy). Under model parallelism the leavers
        hand their parts over in memory instead, as spares do. With nobody leaving, every shard stays in the
        members' memory and goes over to the new layout from there. Nothing is discarded."""
        restore = None
        hand_over = not self.replicated and self.job.parallel.model_parallel > 1  # the parts, as spares hand theirs
        with self.drains.boundary():  # a drain asked meanwhile waits for the next boundary
            if not self.replicated and self.group.num_leaving and not hand_over:
                path = self.group.save_checkpoint()
                self.log.event("checkpointed", self.step, path=path, reason="membership change")
                restore = Checkpoint(path, read_manifest(path))
            self.drains.left(step=self.step, hand_over=hand_over)
        self.staffing.admit_joiners(step=self.step)
        return self.staffing.form_or_wait(restore, step=self.step)

    def _recover(self, state: Recovering) -> RunState:
        """Drop the failed workers, count the failure, keep the survivors; wait for workers below min_workers."""
        for worker in state.lost:
            self.group.drop(worker.name)
            self.log.event("worker_failed", self.step, worker=worker.name, reason=worker.reason,
                           found_s=self.log.clock(worker.found_at))
        self.failures += 1  # one incident, however many workers it took
        self.metrics.failed(len(state.lost))
        self.faults.disarm({worker.rank for worker in state.lost if worker.rank is not None}, self.step)
        decision = self.policies.failure.decide(self.failures)
        if isinstance(decision, Raise):
            last = "; ".join(worker.describe() for worker in state.lost)
            return Failed(f"{decision.reason}; last failure: {last}{self.checkpoints.note()}")
        self.staffing.take_spares(step=self.step, reason="failure")
        self.staffing.admit_joiners(step=self.step)
        return self.staffing.form_or_wait(state.restore, step=self.step, recovering_since=state.recovering_since)

    def _wait_for_workers(self, state: WaitingForWorkers) -> RunState:
        """Start replacements as their slots become ready; form again once min_workers are in, fail at the
        deadline. Each call waits at most WAIT_SLICE_S, so a stop request is heard."""
        self.staffing.take_spares(step=self.step, reason="failure")
        self.group.grow(self.staffing.missing() - self.group.num_joining,
                        wait_s=max(0.0, min(WAIT_SLICE_S, state.deadline - time.monotonic())))
        self.staffing.admit_joiners(step=self.step)
        if not self.staffing.missing():
            return Forming(restore=state.restore, recovering_since=state.recovering_since)
        if time.monotonic() >= state.deadline:
            return Failed(self.staffing.too_few("are available after the failure"))
        return state

    def _finish(self, state: Finishing | Stopping) -> RunState:
        """Write the final checkpoint, gather the full model, evaluate (collectives on every member), in that order:
        what comes first is kept when what comes after fails. A stop keeps the first two and ends there."""
        path = self.group.save_checkpoint()
        if not any(e.type == "checkpointed" and e.step == self.step for e in self.log.events()):
            reason = "stop" if isinstance(state, Stopping) else "end of run"
            self.log.event("checkpointed", self.step, path=path, reason=reason)  # else the loop's save, reported
        model_state = self.group.full_model_file(replicated=self.replicated)
        if isinstance(state, Stopping):
            self.log.event("stopped", self.step, checkpoint=path)
            return Stopped(self._result(self._last_loss(), model_state, path))
        try:
            metrics = self.group.evaluate()
        except MemberRaised as error:  # the model.pt is kept
            return dataclasses.replace(self._after_failure(error.verdict, state), model_state=model_state)
        if self.job.eval.every_steps:  # the curve of eval rows ends with the final metrics
            self.log.add_evaluation(self.step, time.time(), metrics)
        memory = self.group.memory()
        metrics = {**self._last_loss(), **metrics}
        self.log.event("finished", self.step, **{k: round(v, 6) for k, v in metrics.items()})
        return Finished(dataclasses.replace(self._result(metrics, model_state, path), memory=memory))

    def _last_loss(self) -> dict[str, float]:
        """The last step's loss; none when no step ran in this run (resumed at its end)."""
        history = self.log.history()
        return {"loss": history[-1]["loss"]} if history else {}

    def _result(self, metrics: dict[str, float], model_state: bytes, checkpoint: str) -> RunResult:
        """What the run gives its driver as it ends here (finished, or stopped keeping its step)."""
        return RunResult(final_step=self.step, metrics=metrics, history=self.log.history(), events=self.log.events(),
                         model_state=model_state, checkpoint=checkpoint, eval_history=self.log.evaluations(),
                         ledger=self.log.ledger() if self.job.training.record_samples else None)


ControllerActor = ray.remote(num_cpus=0, max_concurrency=8)(Controller)

