"""Taking in what a poll of the group brought: each member's step results, events and evaluations go into
the run's log and metrics; a step committed after a failure closes the recovery ("recovered")."""

from __future__ import annotations

from dataclasses import dataclass

from raylastic.actors.controller.run_log import RunLog
from raylastic.actors.controller.run_metrics import RunMetrics
from raylastic.actors.status.group import GroupStatus


@dataclass(frozen=True)
class Progress:
    step: int
    """The newest step the run committed."""
    recovering_since: float | None = None
    """When the open recovery began (None: none is open)."""


def take_in(status: GroupStatus, log: RunLog, metrics: RunMetrics, progress: Progress) -> Progress:
    """Record ``status``'s news; the run's progress after it."""
    step, recovering_since = progress.step, progress.recovering_since
    for news in status.news:
        completed = None
        for result in news.status.results:
            completed = log.add_result(result, generation=status.generation, rank=news.rank,
                                       world_size=status.world_size) or completed
            if result.step > step:
                step = result.step
                if recovering_since is not None:
                    log.event("recovered", step, world_size=status.world_size,
                              recovery_s=round(result.finished_at - recovering_since, 3))
                    metrics.recovered()
                    recovering_since = None
        if completed:  # the gauges show the newest complete step (setting them for every step costs us)
            metrics.step_committed(step=completed["step"], loss=completed["loss"],
                                   samples_per_s=completed["samples_per_s"], world_size=completed["world_size"])
        for event in news.status.events:
            log.add_event(event)
        for evaluation in news.status.evaluations:
            log.add_evaluation(evaluation.pop("step"), evaluation.pop("time"), evaluation)
    return Progress(step, recovering_since)
