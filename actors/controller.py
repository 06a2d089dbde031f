"""Controller: owns one run - its workers, generations, failures, rescaling and checkpoints.

It executes; the policies in ``actors.policies`` decide. A run is a loop of generations::

    place >= min_workers -> form generation g (join group, hand state over) -> train + watch
          ^                                                                      |
          +-- workers failed / new workers ready / workers drained --------------+

Survivors are never restarted: they leave the broken group and join generation g+1 in the
same process, and the most advanced state among them is broadcast to everyone. The
Controller is a threaded actor: ``run`` blocks in one thread while ``progress`` and ``drain``
answer from others.
"""

from __future__ import annotations

import re
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from actors.events import RunLog
from actors.failures import is_peer_loss
from actors.membership import Member, Membership
from actors.placement import ReservedSlots, SlotShape, WorkerSlots
from actors.policies import FailurePolicy, Raise, Resize, ScalingPolicy, ScalingState
from actors.run_metrics import RunMetrics
from actors.watch import Finished, Interrupted, JobFailed, Watcher, WorkersFailed, death_reason
from actors.worker import TrainingThreadHung, WorkerSpec
from jobconfig import FaultConfig, JobConfig
from strategies import build_strategy
from strategies.checkpoint import Checkpoint, Checkpointer, latest_checkpoint, newest_loadable, read_manifest
from strategies.process_group import GroupAssignment, host_store, new_store_prefix

START_GRACE_S = 1.0
"""After min_workers are placed, how long the start waits for the rest of max_workers."""
COLLECTIVE_GRACE_S = 5.0
"""Beyond failure.collective_timeout_s: how long members may take to give up on a dead peer."""
JOIN_RENDEZVOUS = 3
"""Rendezvous a join holds (the group, the checkpoint group, the node ids): each may wait one collective timeout."""


@dataclass(frozen=True)
class RunResult:
    final_step: int
    metrics: dict[str, float]
    history: list[dict[str, Any]]
    events: list[dict[str, Any]]
    model_state: dict[str, Any]
    checkpoint: str | None
    memory: list[dict[str, int]] | None = None
    """Per rank: bytes of parameters, gradients and optimizer state held at the end of the run."""
    ledger: dict[int, list[dict[str, Any]]] | None = None
    """training.record_samples: every application of every step (``RunLog.ledger`` has its shape)."""
    eval_history: list[dict[str, Any]] | None = None
    """The periodic evaluations (eval.every_steps): ``{"step", "time_s", metrics...}`` each."""


@dataclass(frozen=True)
class ReservedBundles:
    """Bundles of a placement group reserved for this run's workers (e.g. by a Ray Tune trial)."""

    placement_group: Any
    bundle_indices: tuple[int, ...]


class RunFailed(RuntimeError):
    """The run ended with an error; the message says what failed and where the last checkpoint is."""


class MembersFailed(Exception):
    """A call made on every member found some of them dead or hung (``failed``; empty when every member's
    collective lost a peer that is nonetheless still there: the group re-forms as it is)."""

    def __init__(self, failed: list[tuple[Member, str]]) -> None:
        super().__init__("; ".join(f"{member.name} ({reason})" for member, reason in failed))
        self.failed = failed


class Controller:
    def __init__(self, job: JobConfig, checkpoint_root: str, reserved: ReservedBundles | None = None,
                 profile_dir: str | None = None) -> None:
        self.job = job
        self.log = RunLog()
        self.metrics = RunMetrics(job.name)
        self.checkpoint_root = checkpoint_root
        scaling = job.scaling
        self.scaling_policy = ScalingPolicy(min_workers=scaling.min_workers, max_workers=scaling.max_workers)
        self.failure_policy = FailurePolicy(max_failures=job.failure.max_failures)
        self.checkpointer = Checkpointer(root=checkpoint_root, every_steps=job.checkpoint.every_steps,
                                         num_to_keep=job.checkpoint.num_to_keep, config_hash=job.math_hash(),
                                         global_batch_size=job.training.global_batch_size,
                                         async_save=job.checkpoint.async_save)
        self.replicated = build_strategy(job.strategy).replicated
        spec = WorkerSpec(workload=job.workload, training=job.training, optim=job.optim, strategy=job.strategy,
                          data=job.data, eval=job.eval,
                          use_gpu=scaling.use_gpu, torch_threads=max(1, int(scaling.cpus_per_worker)),
                          checkpointer=self.checkpointer, profile_dir=profile_dir)
        shape = SlotShape(cpus=scaling.cpus_per_worker, gpus=int(scaling.use_gpu),
                          custom=dict(scaling.resources_per_worker))
        slots = (ReservedSlots(reserved.placement_group, list(reserved.bundle_indices), shape) if reserved
                 else WorkerSlots(shape, job.name))
        self.membership = Membership(run_name=job.name, spec=spec, slots=slots,
                                     cpus=shape.cpus, gpus=shape.gpus, resources=shape.custom)
        self.node_ip = ray.util.get_node_ip_address()
        self.store = host_store(self.node_ip)
        self.store_prefix = new_store_prefix()
        self.generation = -1
        self.step = 0
        self.failures = 0
        self.stopping = False
        self.pending_faults: list[FaultConfig] = list(job.faults)
        self.recovering_since: float | None = None
        self.ranked: list[Member] = []
        """The members of the generation formed last, in rank order."""
        self.restore_from: Checkpoint | None = None
        """The checkpoint the next generation loads (resume; sharded state after a failure or resize)."""

    @property
    def members(self) -> list[Member]:
        return self.membership.members

    # -- public API (the driver, the CLI, an autoscaler, tests) --------------------------------------------
    def run(self) -> RunResult:
        """Train to ``training.steps``; raises RunFailed with the reason when the run cannot go on."""
        try:
            self._start()
            while True:
                self._form_generation()
                self._unless_stopping()
                outcome = Watcher(self).watch(until_step=self.job.training.steps)
                try:
                    if isinstance(outcome, Finished):
                        return self._finish()
                    if isinstance(outcome, Interrupted):
                        raise self._stopped()
                    if isinstance(outcome, JobFailed):
                        self._fail_on_job_error(outcome)
                    if isinstance(outcome, WorkersFailed):
                        self._recover(outcome)
                    else:
                        self._change_membership()
                except MembersFailed as lost:  # while finishing or saving before a resize: recover, go on
                    self._recover(WorkersFailed(lost.failed))
        except RunFailed:
            raise
        except Exception as error:  # a defect of ours: still a failed run with a reason, never a bare traceback
            raise RunFailed(f"the Controller failed at step {self.step}: {type(error).__name__}: {error}"
                            f"{self._checkpoint_note()}\n{traceback.format_exc()}") from None
        finally:
            self.membership.shutdown()
            self.log.close()

    def progress(self, history_since: int = 0, events_since: int = 0, evaluations_since: int = 0,
                 wait_s: float = 0.0) -> dict[str, Any]:
        """New history rows, events and evaluations since the given positions, and the current membership;
        waits up to ``wait_s`` for an event past ``events_since`` (or the run's end) before answering."""
        if wait_s > 0:
            self.log.wait_for_news(events_since, wait_s)
        return {"history": self.log.history(history_since), "events": self.log.events(events_since),
                "evaluations": self.log.evaluations(evaluations_since),
                "generation": self.generation, "world_size": self.membership.size, "step": self.step,
                "members": [m.name for m in self.members], "failures": self.failures}

    def drain(self, *, rank: int | None = None, node_id: str | None = None) -> list[str]:
        """Planned removal: the worker of ``rank`` (or every worker on ``node_id``) leaves at the next
        step boundary, with nothing discarded. Returns the names of the workers that will leave."""
        names = {m.name for r, m in enumerate(self.members) if r == rank or (node_id and m.node_id == node_id)}
        self.membership.drain(names)
        return sorted(names)

    def stop(self) -> None:
        """End the run at the next step boundary (Ctrl-C); workers are shut down, nothing orphaned. A stop
        asked while a generation forms or the run waits for workers takes effect as soon as that ends."""
        self.stopping = True
        self.request_boundary()

    def _unless_stopping(self) -> None:
        if self.stopping:
            raise self._stopped()

    def _stopped(self) -> RunFailed:
        return RunFailed(f"run stopped by the user at step {self.step}{self._checkpoint_note()}")

    def request_boundary(self) -> None:
        for member in self.members:
            member.actor.request_stop.remote()

    # -- membership -----------------------------------------------------------------------------------------
    def _start(self) -> None:
        scaling = self.job.scaling
        self.membership.slots.request(scaling.max_workers)
        slots = self.membership.slots.take_ready(scaling.max_workers, at_least=scaling.min_workers,
                                                 timeout_s=scaling.placement_timeout_s)
        if len(slots) < scaling.max_workers:  # slots placed together become ready a moment apart
            slots += self.membership.slots.take_ready(scaling.max_workers - len(slots), at_least=scaling.max_workers
                                                      - len(slots), timeout_s=START_GRACE_S)
        self.membership.admit(self.membership.spawn(slots))
        self._wait_for_construction()
        self._require_min_workers("could be placed")
        self._resume_from_checkpoint()

    def _wait_for_construction(self) -> None:
        """Every first member has built its workload before the first rendezvous, which would otherwise
        time out on a slow node's worker. One that could not build it ends the run with its error."""
        members = list(self.members)
        ray.wait([m.ready for m in members], num_returns=len(members),
                 timeout=self.job.scaling.placement_timeout_s)
        for member in members:
            try:
                ray.get(member.ready, timeout=0)
            except ray.exceptions.RayActorError as error:
                if error.actor_init_failed:
                    raise RunFailed(f"worker {member.name} could not start: {_plain(str(error))}") from None
                self.membership.drop(member)
                self.log.event("worker_failed", self.step, worker=member.name, reason=death_reason(error))
            except ray.exceptions.GetTimeoutError:
                self.membership.drop(member)
                self.log.event("worker_failed", self.step, worker=member.name, reason=(
                    f"not started within scaling.placement_timeout_s={self.job.scaling.placement_timeout_s}s"))

    def _require_min_workers(self, what: str) -> None:
        scaling = self.job.scaling
        if self.membership.size < scaling.min_workers:
            raise RunFailed(
                f"only {self.membership.size} of scaling.min_workers={scaling.min_workers} workers {what} within "
                f"scaling.placement_timeout_s={scaling.placement_timeout_s}s (each needs "
                f"{self.membership.slots.shape.bundle()}); the cluster has {ray.cluster_resources()}"
                f"{self._checkpoint_note()}")

    def consider_scaling(self) -> bool:
        """Start joiners if the policy wants more workers; True when a membership change is ready."""
        scaling_state = ScalingState(num_workers=self.membership.size + len(self.membership.joining),
                                     num_placeable=self.membership.slots.count_ready())
        decision = self.scaling_policy.decide(scaling_state)
        if isinstance(decision, Resize) and decision.num_workers > scaling_state.num_workers:
            self.membership.add_joiners(decision.num_workers - scaling_state.num_workers)
        return bool(self.membership.draining or self.membership.ready_joiners())

    def _change_membership(self) -> None:
        """At a step boundary: drained workers leave, ready joiners come in. Sharded state is saved
        by the old group first and loaded, resharded, by the new one: nothing is discarded."""
        if not self.replicated:
            path = self._on_every_member("save_checkpoint")[0]
            self.log.event("checkpointed", self.step, path=path, reason="membership change")
            self.restore_from = Checkpoint(path, read_manifest(path))
        for member in self.membership.remove_drained():
            self.log.event("worker_left", self.step, worker=member.name, reason="drained")
        self._admit_ready_joiners()

    def _admit_ready_joiners(self) -> None:
        joiners = self.membership.ready_joiners()
        self.membership.admit(joiners)
        for member in joiners:
            self.log.event("worker_joined", self.step, worker=member.name)

    def _recover(self, outcome: WorkersFailed) -> None:
        """Drop the failed workers, ask the policy, keep the survivors and wait for min_workers if needed."""
        self.recovering_since = self.recovering_since or time.time()
        for member, reason in outcome.failed:
            self.membership.drop(member)
            self.log.event("worker_failed", self.step, worker=member.name, reason=reason)
        self.failures += 1  # one incident, however many workers it took
        self.metrics.failed(len(outcome.failed))
        self._disarm_faults([member for member, _ in outcome.failed])
        decision = self.failure_policy.decide(self.failures)
        if isinstance(decision, Raise):
            raise RunFailed(f"{decision.reason}; last failure: {outcome.describe()}{self._checkpoint_note()}")
        if not self.replicated:  # the failed workers' shards are gone: the group restarts from a checkpoint
            self.restore_from = self._newest_checkpoint(max_step=self.step)
        time.sleep(decision.backoff_s)
        self._unless_stopping()
        missing = self.job.scaling.min_workers - self.membership.size
        if missing > 0:
            self.log.event("waiting_for_resources", self.step, workers=self.membership.size, needed=missing)
            deadline = time.monotonic() + self.job.scaling.placement_timeout_s
            self.membership.add_joiners(missing - len(self.membership.joining),
                                        timeout_s=self.job.scaling.placement_timeout_s)
            self.membership.wait_for_joiners(max(0.0, deadline - time.monotonic()))
            self._unless_stopping()
            self._admit_ready_joiners()
            self._require_min_workers("are available after the failure")
        else:
            self._admit_ready_joiners()

    # -- generations ----------------------------------------------------------------------------------------
    def _fail_on_job_error(self, outcome: JobFailed) -> None:
        """An error of the workload (or a checkpoint that cannot be written) fails the run at once, with the
        worker's full traceback: a replacement would only meet it again."""
        for member, error in outcome.errors:
            self.log.event("worker_failed", self.step, worker=member.name, reason="raised an error",
                           traceback=error)
        member, error = outcome.errors[0]
        raise RunFailed(f"{member.name} raised an error at step {self.step + 1} (not retried: it is the job's, "
                        f"not a lost worker){self._checkpoint_note()}\n{error}")

    def _resume_from_checkpoint(self) -> None:
        found = self._newest_checkpoint() if self.job.checkpoint.resume == "auto" else None
        if found is None:
            return
        self._require_same_job(found)
        self.restore_from = found
        self.log.event("resumed", found.manifest.step, path=found.path, saved_world_size=found.manifest.world_size,
                       saved_strategy=found.manifest.strategy)

    def _require_same_job(self, found: Checkpoint) -> None:
        if found.manifest.config_hash != self.job.math_hash():
            raise RunFailed(f"checkpoint {found.path} was written by a job with another workload, optimizer, global "
                            "batch or seed; use another --run-dir or checkpoint.path")

    def _newest_checkpoint(self, max_step: int | None = None) -> Checkpoint | None:
        """The newest intact checkpoint (of at most ``max_step``); newer ones that fail verification are reported
        and skipped."""
        found, rejected = newest_loadable(self.checkpoint_root, max_step)
        for bad in rejected:
            self.log.event("checkpoint_rejected", self.step, path=bad.path, reason=bad.reason)
        return found

    def _form_generation(self) -> None:
        """Every member joins generation g+1; the most advanced one's state is handed to all.

        A member dying here is a failure like any other: it is dropped and the next generation formed.
        """
        while True:
            try:
                return self._try_form_generation()
            except MembersFailed as lost:
                self._recover(WorkersFailed(lost.failed))

    def _try_form_generation(self) -> None:
        started = time.time()
        self.generation += 1
        members, world_size = list(self.members), self.membership.size
        self.ranked = members
        reports = self._on_every_member("join", [(GroupAssignment(
            generation=self.generation, rank=rank, world_size=world_size, store_host=self.node_ip,
            store_port=self.store.port, store_prefix=self.store_prefix, timeout_s=self.job.failure.collective_timeout_s,
            run_step=self.step),)
            for rank in range(world_size)], rendezvous=JOIN_RENDEZVOUS)
        for member, report in zip(members, reports, strict=True):
            member.node_id = report.node_id
        before = self.step
        best = max(range(world_size), key=lambda r: reports[r].step)
        if self.replicated and self.restore_from is None and reports[best].step < self.step:
            self.restore_from = self._newer_checkpoint_than(reports[best].step)  # every holder of newer state lost
        if self.restore_from is not None or (not self.replicated and self.generation > 0):
            source = "checkpoint"
            self.step = self._restore()
        elif not self.replicated:  # a fresh sharded start: every rank initialised identically from the seed
            source = "initialisation"
        else:
            source = best
            self.step = reports[source].step
            self._on_every_member("sync_state", [(source,)] * world_size)
        self.log.event("generation_formed", self.step, generation=self.generation, world_size=world_size,
                       state_source=source, steps_lost=max(0, before - self.step),
                       duration_s=round(time.time() - started, 4))

    def _newer_checkpoint_than(self, step: int) -> Checkpoint | None:
        found = self._newest_checkpoint(max_step=self.step)
        return found if found is not None and found.manifest.step > step else None

    def _restore(self) -> int:
        """Every member loads ``restore_from`` resharded to the new group (no checkpoint: step 0, afresh)."""
        found = self.restore_from
        if found is not None:
            self._require_same_job(found)
        path, step = (found.path, found.manifest.step) if found else (None, 0)
        self._on_every_member("restore", [(path, step)] * self.membership.size)
        self.restore_from = None
        return step

    def _on_every_member(self, method: str, args: list[tuple] | None = None, *, rendezvous: int = 1) -> list[Any]:
        """Call a collective ``method`` on every member (with ``args[rank]``) and return the results.

        When one member's call fails, the others may still wait for it inside the collective, for up to
        failure.collective_timeout_s per rendezvous the call holds: they must have ended before the next
        generation's calls run beside them in the same processes. A member whose call has not ended by
        then is hung. Raises MembersFailed naming the dead and hung (those whose collective merely lost a
        peer are survivors), or RunFailed when a member raised an error of the job itself.
        """
        members = list(self.members)
        calls = [getattr(m.actor, method).remote(*(args[rank] if args else ())) for rank, m in enumerate(members)]
        results: list[Any] = [None] * len(calls)
        pending = dict(zip(calls, range(len(calls)), strict=True))
        failed: list[tuple[Member, str]] = []
        survivors_saw_a_loss, deadline = False, None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not ready:
                break
            for ref in ray.wait(list(pending), num_returns=len(pending), timeout=0)[0]:
                member = members[rank := pending.pop(ref)]
                try:
                    results[rank] = ray.get(ref)
                    continue
                except ray.exceptions.RayActorError as error:
                    failed.append((member, death_reason(error)))
                except ray.exceptions.RayTaskError as error:
                    if isinstance(error.cause, TrainingThreadHung):
                        failed.append((member, f"hung: {error.cause}"))
                    elif is_peer_loss(error.cause):
                        survivors_saw_a_loss = True
                    else:
                        raise RunFailed(f"{member.name} raised an error in {method}{self._checkpoint_note()}\n"
                                        f"{_plain(str(error))}") from None
                deadline = deadline or time.monotonic() + rendezvous * self.job.failure.collective_timeout_s \
                    + COLLECTIVE_GRACE_S
        failed += [(members[rank], f"hung: its {method} call did not end within {rendezvous} collective timeout(s) "
                    "of the failure") for rank in pending.values()]
        if failed or survivors_saw_a_loss:
            raise MembersFailed(failed)
        return results

    def faults_for(self, rank: int) -> tuple[FaultConfig, ...]:
        return tuple(f for f in self.pending_faults if f.rank == rank)

    def _disarm_faults(self, failed: list[Member]) -> None:
        """Injected faults fire once: drop those of steps already begun, and the one each failed member
        was given first (it may have fired after the last step the Controller heard of)."""
        ranks = {rank for rank, member in enumerate(self.ranked) if member in failed}
        fired = [min((f for f in self.pending_faults if f.rank == rank and f.step > self.step), key=lambda f: f.step,
                     default=None) for rank in ranks]
        self.pending_faults = [f for f in self.pending_faults if f.step > self.step + 1 and f not in fired]

    def on_step_committed(self, finished_at: float) -> None:
        """Called by the Watcher for each newly committed step; closes a recovery when one is open."""
        if self.recovering_since is not None:
            self.log.event("recovered", self.step, world_size=self.membership.size,
                           recovery_s=round(finished_at - self.recovering_since, 3))
            self.recovering_since = None
            self.metrics.recovered()

    # -- the end --------------------------------------------------------------------------------------------
    def _finish(self) -> RunResult:
        """Evaluate, gather the full model and write the final checkpoint (collective on every member)."""
        metrics = self._on_every_member("evaluate")[0]
        if self.job.eval.every_steps:  # the curve of eval rows ends with the final metrics
            self.log.add_evaluation(self.step, time.time(), metrics)
        world_size = self.membership.size
        if self.replicated:  # every rank holds it all: one copy, from rank 0, with no collective
            model_state = ray.get(self.members[0].actor.full_state_dict.remote())
        else:
            model_state = self._on_every_member("full_state_dict", [(rank == 0,) for rank in range(world_size)])[0]
        memory = self._on_every_member("memory")
        path = self._on_every_member("save_checkpoint")[0]
        if not any(e["type"] == "checkpointed" and e["step"] == self.step for e in self.log.events()):
            self.log.event("checkpointed", self.step, path=path, reason="end of run")  # else the loop's save, reported
        history = self.log.history()
        metrics = {**({"loss": history[-1]["loss"]} if history else {}), **metrics}  # none when resumed at the end
        self.log.event("finished", self.step, **{k: round(v, 6) for k, v in metrics.items()})
        return RunResult(final_step=self.step, metrics=metrics, history=history, events=self.log.events(),
                         model_state=model_state, checkpoint=path, memory=memory, eval_history=self.log.evaluations(),
                         ledger=self.log.ledger() if self.job.training.record_samples else None)

    def _checkpoint_note(self) -> str:
        found = latest_checkpoint(self.checkpoint_root)
        if found is None:
            return "; no checkpoint was written yet (checkpoint.every_steps)"
        return f"; last checkpoint: {found.path} (step {found.manifest.step})"


def _plain(text: str) -> str:
    """``text`` without the terminal colour codes Ray puts in the errors it relays."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


ControllerActor = ray.remote(num_cpus=0, max_concurrency=8)(Controller)


def default_checkpoint_root(run_dir: str | Path) -> str:
    return str(Path(run_dir).resolve() / "checkpoints")
