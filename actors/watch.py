"""Watching one generation train: polls, metrics, failure detection and the stall watchdog.

``Watcher.watch`` starts the step loop on every member and keeps one long poll in flight per
member until the generation ends, returning what ended it: the run finished, workers failed
(died, hung, or raised), the user stopped it, or the membership should change at a step
boundary. A poll answers at once on news (a phase change, an error, an event) and at least every
LONG_POLL_S otherwise; a worker's death fails its poll at once; a worker that stops answering
for ``failure.step_timeout_s``, or whose step runs for ``failure.max_step_s``, counts as failed.

Who is to blame: a worker whose collective lost its peer is a survivor. If no death explains the
survivors' errors, the members still training - the ones their collectives timed out waiting for -
are hung. An error of the job itself (a bug, a NaN, out of memory) ends the run: it would happen
again on a replacement.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

if TYPE_CHECKING:
    from actors.controller import Controller, Member

LONG_POLL_S = 1.0
"""Longest a worker's poll waits for news: how fresh step results are when nothing else happens.
Each poll costs the Controller, the worker and Ray's services CPU that a small model's steps,
on a machine with no core to spare, would otherwise have had."""
SCALING_INTERVAL_S = 0.1
"""How often the watcher looks again while something is under way (slots or joiners awaited, a
drain, an error's grace period); otherwise the polls' answers set its pace."""
DONE_PHASES = frozenset({"finished", "stopped", "failed"})
"""A worker reports its last step results with these phases: it is no longer polled in this generation."""
ERROR_GRACE_S = 2.0
"""How long a collective error may precede the report of the death that caused it."""


@dataclass(frozen=True)
class Finished:
    pass


@dataclass(frozen=True)
class Interrupted:
    pass


@dataclass(frozen=True)
class WorkersFailed:
    failed: list[tuple[Member, str]]

    def describe(self) -> str:
        return "; ".join(f"{member.name} ({reason})" for member, reason in self.failed)


@dataclass(frozen=True)
class JobFailed:
    """A worker raised an error of the job itself; ``errors`` holds each such worker's traceback."""

    errors: list[tuple[Member, str]]


@dataclass(frozen=True)
class StoppedAtBoundary:
    """Every member stopped after the same step because a membership change was asked for."""


WatchOutcome = Finished | Interrupted | WorkersFailed | JobFailed | StoppedAtBoundary


@dataclass
class _MemberView:
    last_answer: float
    phase: str = "training"
    error: str | None = None
    error_cause: str | None = None
    step_running_s: float | None = None
    dead: str | None = None
    seen: int = -1
    """The version of the worker's news last heard (its long poll answers when there is newer)."""


@dataclass
class Watcher:
    controller: Controller
    views: dict[str, _MemberView] = field(default_factory=dict)

    def watch(self, until_step: int) -> WatchOutcome:
        members = self.controller.members
        now = time.monotonic()
        self.views = {m.name: _MemberView(last_answer=now) for m in members}
        try:
            ray.get([m.actor.train.remote(until_step, self.controller.faults_for(rank))
                     for rank, m in enumerate(members)])
        except RayActorError as error:
            return WorkersFailed(self._dead_members(members, error))
        stall_timeout = self.controller.job.failure.step_timeout_s
        wait_s = min(LONG_POLL_S, stall_timeout / 4)  # every live worker answers well within the stall timeout
        polls = {m.name: self._poll(m, wait_s) for m in members}
        try:
            outcome = self._until_outcome(members, polls, wait_s, stall_timeout)
        finally:  # polls still in flight carry step results: take them in before the next generation
            live = {name: ref for name, ref in polls.items() if not self.views[name].dead}
            if live:
                ray.wait(list(live.values()), num_returns=len(live), timeout=wait_s + 1.0)
            for rank, member in enumerate(members):
                if member.name in live:
                    self._answer(member, rank, live[member.name])
            self.controller.log.close_generation(self.controller.generation)
        if isinstance(outcome, WorkersFailed):  # a lost node takes several workers: every death heard by now
            named = {member.name for member, _ in outcome.failed}
            outcome = WorkersFailed(outcome.failed + [(m, v.dead) for m in members
                                                      if (v := self.views[m.name]).dead and m.name not in named])
        return outcome

    def _until_outcome(self, members: list[Member], polls: dict[str, ray.ObjectRef], wait_s: float,
                       stall_timeout: float) -> WatchOutcome:
        first_error_at: float | None = None
        next_scaling_check = time.monotonic() + SCALING_INTERVAL_S
        boundary_requested = False
        while True:
            busy = first_error_at is not None or self.controller.membership.changes_pending()
            ready = self._wait_for_answers(polls, SCALING_INTERVAL_S if busy else wait_s)
            for rank, member in enumerate(members):
                if member.name in polls and polls[member.name] in ready:
                    self._answer(member, rank, polls.pop(member.name))
                    if self.views[member.name].phase not in DONE_PHASES:  # a done worker has nothing more to say
                        polls[member.name] = self._poll(member, wait_s)
            self._mark_stalled([m for m in members if m.name in polls], stall_timeout)
            self._mark_hung_steps(members)
            self._fire_ray_kills(members)
            if not boundary_requested and time.monotonic() >= next_scaling_check:
                next_scaling_check = time.monotonic() + SCALING_INTERVAL_S
                if self.controller.consider_scaling():
                    self.controller.request_boundary()
                    boundary_requested = True
            failed = [(m, v.dead) for m in members if (v := self.views[m.name]).dead]
            if failed:
                return WorkersFailed(failed)
            job_errors = [(m, v.error) for m in members if (v := self.views[m.name]).error_cause == "job"]
            if job_errors:
                return JobFailed(job_errors)
            if any(self.views[m.name].error for m in members):
                first_error_at = first_error_at or time.monotonic()
                if time.monotonic() - first_error_at > ERROR_GRACE_S:
                    return WorkersFailed(self._blamed_for_peer_errors(members))
            phases = {self.views[m.name].phase for m in members}
            if phases == {"finished"}:
                return Finished()
            if phases <= {"finished", "stopped"}:
                return Interrupted() if self.controller.stopping else StoppedAtBoundary()

    @staticmethod
    def _wait_for_answers(polls: dict[str, ray.ObjectRef], timeout_s: float) -> list[ray.ObjectRef]:
        """The polls answered within ``timeout_s`` (all that are, once one is)."""
        if not polls:
            time.sleep(timeout_s)
            return []
        ready, _ = ray.wait(list(polls.values()), num_returns=1, timeout=timeout_s)
        if ready:
            ready, _ = ray.wait(list(polls.values()), num_returns=len(polls), timeout=0)
        return ready

    def _poll(self, member: Member, wait_s: float) -> ray.ObjectRef:
        return member.actor.poll.remote(wait_s, self.views[member.name].seen)

    def _answer(self, member: Member, rank: int, ref: ray.ObjectRef) -> None:
        """Take in a finished poll: record its results, or mark the member dead."""
        view = self.views[member.name]
        try:
            status = ray.get(ref, timeout=0)
        except RayActorError as error:
            view.dead = death_reason(error)
            return
        except GetTimeoutError:
            return
        view.last_answer, view.phase, view.error, view.seen = time.monotonic(), status.phase, status.error, \
            status.version
        view.error_cause, view.step_running_s = status.error_cause, status.step_running_s
        self._record(status, rank)

    def _mark_stalled(self, members: list[Member], stall_timeout: float) -> None:
        """A worker whose process no longer answers (stopped, swapping, deadlocked) counts as failed."""
        now = time.monotonic()
        for member in members:
            view = self.views[member.name]
            if not view.dead and now - view.last_answer > stall_timeout:
                view.dead = f"no answer for {now - view.last_answer:.1f}s (failure.step_timeout_s={stall_timeout})"

    def _blamed_for_peer_errors(self, members: list[Member]) -> list[tuple[Member, str]]:
        """No death explains the survivors' collective errors: the members still training are hung (none: a
        transient fault of the network, and the whole group re-forms)."""
        timeout = self.controller.job.failure.collective_timeout_s
        return [(m, f"hung: its peers' collectives gave up waiting for it (failure.collective_timeout_s={timeout})")
                for m in members if self.views[m.name].phase == "training" and not self.views[m.name].error]

    def _mark_hung_steps(self, members: list[Member]) -> None:
        """A worker that answers but whose step has run for failure.max_step_s is hung (e.g. a deadlock in the
        workload with no peer to time out)."""
        limit = self.controller.job.failure.max_step_s
        for member in members:
            view = self.views[member.name]
            if not view.dead and view.step_running_s is not None and view.step_running_s > limit:
                view.dead = f"hung: its step has run {view.step_running_s:.0f}s (failure.max_step_s={limit})"

    def _record(self, status: Any, rank: int) -> None:
        controller, log = self.controller, self.controller.log
        completed = None
        for result in status.results:
            timings = {} if result.comm_s is None else {"comm_s": round(result.comm_s, 5),
                                                        "exposed_comm_s": round(result.exposed_comm_s, 5)}
            row = log.add_step(result.step, result.finished_at, generation=controller.generation, rank=rank,
                               world_size=len(controller.members), loss_sum=result.loss_sum, samples=result.samples,
                               step_s=result.duration_s, bytes_sent=result.bytes_sent,
                               uncompressed_bytes=result.uncompressed_bytes, lr=result.lr,
                               grad_norm=round(result.grad_norm, 6), **timings,
                               **({"skipped": True} if result.skipped else {}))
            completed = row or completed
            if result.sample_ids is not None:
                log.add_samples(result.step, result.sample_ids, generation=controller.generation, rank=rank)
            if result.step > controller.step:
                controller.step = result.step
                controller.on_step_committed(result.finished_at)
        if completed:  # the gauges show the newest complete step (setting them for every step costs the Controller)
            controller.metrics.step_committed(step=completed["step"], loss=completed["loss"],
                                              samples_per_s=completed["samples_per_s"],
                                              world_size=completed["world_size"])
        for event in status.events:
            log.event(event.pop("type"), event.pop("step"), **event)
        for evaluation in status.evaluations:
            log.add_evaluation(evaluation.pop("step"), evaluation.pop("time"), evaluation)

    def _fire_ray_kills(self, members: list[Member]) -> None:
        """The ``ray_kill`` fault: a worker that reached it waits mid-step for Ray to kill it from outside."""
        for member in members:
            if self.views[member.name].phase == "awaiting_kill":
                ray.kill(member.actor, no_restart=True)

    def _dead_members(self, members: list[Member], error: RayActorError) -> list[tuple[Member, str]]:
        refs = [self._poll(m, 0.0) for m in members]
        ray.wait(refs, num_returns=len(refs), timeout=1.0)
        for rank, (member, ref) in enumerate(zip(members, refs, strict=True)):
            self._answer(member, rank, ref)
        found = [(m, v.dead) for m in members if (v := self.views[m.name]).dead]
        return found or [(members[0], death_reason(error))]


def death_reason(error: RayActorError) -> str:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"actor died: {first_line[:200]}"
