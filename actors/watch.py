"""Watching one generation train: polls, metrics, failure detection and the stall watchdog.

``Watcher.watch`` starts the step loop on every member and polls them all at once until the
generation ends, returning what ended it: the run finished, workers failed (died, hung, or
raised), the user stopped it, or the membership should change at a step boundary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

if TYPE_CHECKING:
    from actors.controller import Controller, Member

POLL_INTERVAL_S = 0.05
SCALING_INTERVAL_S = 0.1
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
class StoppedAtBoundary:
    """Every member stopped after the same step because a membership change was asked for."""


WatchOutcome = Finished | Interrupted | WorkersFailed | StoppedAtBoundary


@dataclass
class _MemberView:
    last_answer: float
    phase: str = "training"
    error: str | None = None
    dead: str | None = None


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
        first_error_at: float | None = None
        next_scaling_check = now + SCALING_INTERVAL_S
        boundary_requested = False
        while True:
            self._poll(members)
            self._fire_ray_kills(members)
            if not boundary_requested and time.monotonic() >= next_scaling_check:
                next_scaling_check = time.monotonic() + SCALING_INTERVAL_S
                if self.controller.consider_scaling():
                    self.controller.request_boundary()
                    boundary_requested = True
            failed = [(m, v.dead) for m in members if (v := self.views[m.name]).dead]
            if failed:
                return WorkersFailed(failed)
            errors = [(m, v.error) for m in members if (v := self.views[m.name]).error]
            if errors:
                first_error_at = first_error_at or time.monotonic()
                if time.monotonic() - first_error_at > ERROR_GRACE_S:
                    return WorkersFailed([(m, f"raised {e.splitlines()[0]}") for m, e in errors])
            phases = {self.views[m.name].phase for m in members}
            if phases == {"finished"}:
                return Finished()
            if phases <= {"finished", "stopped"}:
                return Interrupted() if self.controller.stopping else StoppedAtBoundary()
            time.sleep(POLL_INTERVAL_S)

    def _poll(self, members: list[Member]) -> None:
        """Poll every member at once; record results; mark members dead or hung."""
        refs = [m.actor.poll.remote() for m in members]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0)
        ready = set(ready)
        now = time.monotonic()
        stall_timeout = self.controller.job.failure.step_timeout_s
        for rank, (member, ref) in enumerate(zip(members, refs, strict=True)):
            view = self.views[member.name]
            if ref not in ready:
                if now - view.last_answer > stall_timeout:
                    view.dead = f"no answer for {now - view.last_answer:.1f}s (failure.step_timeout_s=" \
                                f"{stall_timeout})"
                continue
            try:
                status = ray.get(ref, timeout=0)
            except RayActorError as error:
                view.dead = _death_reason(error)
                continue
            except GetTimeoutError:
                continue
            view.last_answer, view.phase, view.error = now, status.phase, status.error
            self._record(status, rank)

    def _record(self, status: Any, rank: int) -> None:
        controller, log = self.controller, self.controller.log
        for result in status.results:
            log.add_step(result.step, result.finished_at, generation=controller.generation, rank=rank,
                         loss=result.loss, samples_per_s=round(result.samples / result.duration_s, 2),
                         world_size=len(controller.members), bytes_sent=result.bytes_sent,
                         uncompressed_bytes=result.uncompressed_bytes, step_s=round(result.duration_s, 5),
                         comm_s=round(result.comm_s, 5), exposed_comm_s=round(result.exposed_comm_s, 5),
                         **({"skipped": True} if result.skipped else {}))
            if result.sample_ids is not None:
                log.add_samples(result.step, result.sample_ids)
            if result.step > controller.step:
                controller.step = result.step
                controller.on_step_committed(result.finished_at)
                controller.metrics.step_committed(step=result.step, loss=result.loss,
                                                  samples_per_s=result.samples / result.duration_s,
                                                  world_size=len(controller.members))
        for event in status.events:
            log.event(event.pop("type"), event.pop("step"), **event)

    def _fire_ray_kills(self, members: list[Member]) -> None:
        """The ``ray_kill`` fault: a worker that reached it waits mid-step for Ray to kill it from outside."""
        for member in members:
            if self.views[member.name].phase == "awaiting_kill":
                ray.kill(member.actor, no_restart=True)

    def _dead_members(self, members: list[Member], error: RayActorError) -> list[tuple[Member, str]]:
        self._poll(members)
        found = [(m, v.dead) for m in members if (v := self.views[m.name]).dead]
        return found or [(members[0], _death_reason(error))]


def _death_reason(error: RayActorError) -> str:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"actor died: {first_line[:200]}"
