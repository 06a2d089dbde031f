"""Who is in the group between generations: ready spares taken, started joiners admitted, workers that could not
start logged, and whether ``scaling.min_workers`` are in to form the next generation. The Controller's recovery,
resize and wait for workers share these; the decisions are the scaling policy's
(``actors.controller.policies``), this carries them out on the WorkerGroup and logs them.

Example (the Controller, after a failure)::

    staffing = Staffing(group, log, policy=policies.scaling, scaling=job.scaling, note=checkpoints.note)
    staffing.take_spares(step=120, reason="failure")  # "spares_taken"
    staffing.admit_joiners(step=120)                  # "worker_joined" for each joiner ready
    staffing.form_or_wait(None, step=120)             # Forming(), or WaitingForWorkers(needed=1, ...)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from raylastic.actors.controller.policies import ScalingPolicy, workers_missing
from raylastic.actors.controller.run_log import RunLog
from raylastic.actors.controller.states import Forming, RunState, WaitingForWorkers
from raylastic.actors.status.group import GroupStatus
from raylastic.jobconfig import ScalingConfig
from raylastic.strategies.checkpoint_catalogue import Checkpoint


class Staffing:
    def __init__(self, group: Any, log: RunLog, *, policy: ScalingPolicy, scaling: ScalingConfig,
                 note: Callable[[], str]) -> None:
        """``group``: the WorkerGroup (or a test's fake); ``note``: what a failure's reason ends with (where the
        run's checkpoints are)."""
        self.group = group
        self.log = log
        self.policy = policy
        self.scaling = scaling
        self.note = note

    def missing(self) -> int:
        """How many workers short of ``scaling.min_workers`` the group is."""
        return workers_missing(min_workers=self.scaling.min_workers, num_workers=self.group.size)

    def take_spares(self, *, step: int, reason: str) -> None:
        """Ready spares join now, up to max_workers (their slots are asked for again by the failed workers)."""
        wanted = self.policy.spares_to_take(num_workers=self.group.size + self.group.num_joining,
                                            num_spares_ready=self.group.num_spares_ready)
        if wanted and (taken := self.group.grow(wanted)):  # the ready spares (a new worker for one that died since)
            self.log.event("spares_taken", step, workers=taken, reason=reason)

    def admit_joiners(self, *, step: int) -> None:
        for name, warmth in self.group.admit_ready_joiners().items():
            self.log.event("worker_joined", step, worker=name, warm_process=warmth.imported,
                           started_ahead=warmth.started_ahead)
        self.log_start_failures(step=step)

    def observe(self, status: GroupStatus, step: int) -> None:
        """Every poll of a training generation: the workers that could not start since the last."""
        self.log_start_failures(step=step)

    def log_start_failures(self, *, step: int) -> None:
        for failure in self.group.take_start_failures():
            self.log.event("worker_start_failed", step, worker=failure.worker, node_id=failure.node_id,
                           error=failure.error)

    def form_or_wait(self, restore: Checkpoint | None, *, step: int,
                     recovering_since: float | None = None) -> RunState:
        """Form the next generation, or wait for workers while fewer than min_workers are in."""
        missing = self.missing()
        if not missing:
            return Forming(restore=restore, recovering_since=recovering_since)
        self.log.event("waiting_for_resources", step, workers=self.group.size, needed=missing)
        return WaitingForWorkers(needed=missing, deadline=time.monotonic() + self.scaling.placement_timeout_s,
                                 recovering_since=recovering_since, restore=restore)

    def too_few(self, what: str) -> str:
        """Why a run without min_workers fails: how many ``what`` (e.g. "could be placed"), and where they were not."""
        return (f"only {self.group.size} of scaling.min_workers={self.scaling.min_workers} workers {what} within "
                f"scaling.placement_timeout_s={self.scaling.placement_timeout_s}s {self.group.capacity_note()}"
                f"{self.note()}")
