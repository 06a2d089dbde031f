"""The run's event log and step history, shared by the Controller's threads.

Events are typed (``actors.status.run.Event``), stamped with the time since the run started as they
come in; result.json keeps them as ``Event.to_dict()``. A step's history row is built from
every rank's report of it: each rank trained part of the global batch, so the step's loss is the sum
of their summed losses over the sum of their samples.

The sample ledger (``training.record_samples``) is append-only: every time a generation commits a
step it is recorded, so a step redone after a recovery, or applied twice, shows up as such.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from raylastic.actors.status.run import Event, EventType

if TYPE_CHECKING:
    from raylastic.actors.status.worker import StepResult


@dataclass(slots=True)
class _RankReport:
    """Not frozen: a Controller makes one for every rank every step, and a frozen dataclass takes five times as long
    to make."""

    finished_at: float
    loss_sum: float
    samples: int
    step_s: float
    compute_s: float
    bytes_sent: int
    uncompressed_bytes: int
    timings: dict[str, Any] | StepResult
    """The row's other columns, or the StepResult to read them from if this rank's are the ones the row shows."""


@dataclass
class _Application:
    """One commit of a step by one generation: the samples it consumed and the ranks that reported it."""

    generation: int
    samples: list[int]
    ranks: set[int] = field(default_factory=set)
    withdrawn: bool = False
    """It reached no parameters (async_ps: its worker died before pushing it); its samples are applied again."""


@dataclass
class _StepReports:
    """What the ranks of one generation reported of one step."""

    generation: int
    world_size: int
    reporting: int
    """How many ranks report the step: the row is complete when they all have."""
    by_rank: dict[int, _RankReport] = field(default_factory=dict)
    row: dict[str, Any] | None = None
    """The history row, once every rank reported or the generation ended (a rank that died took its
    report along)."""


class RunLog:
    def __init__(self) -> None:
        self.started = time.time()
        self._lock = threading.Condition(threading.Lock())
        self._closed = False
        self._events: list[Event] = []
        self._steps: dict[int, _StepReports] = {}
        self._history_order: list[int] = []
        self._applications: dict[int, list[_Application]] = {}
        """By step, every commit of it in the order they came in (the ledger)."""
        self._evaluations: list[dict[str, Any]] = []
        self._layouts: dict[int, str] = {}
        """A model-parallel run's generations -> their layouts (``generation_formed``'s), for the history rows."""

    def event(self, type_: EventType, step: int, **details: Any) -> Event:
        """Log an event of ``type_`` at ``step``, stamped now."""
        return self.add_event(Event(type_, step, details=details))

    def clock(self, at: float) -> float:
        """``at`` (``time.time()``) on the events' clock: seconds since the run started."""
        return round(at - self.started, 4)

    def add_event(self, event: Event) -> Event:
        """Log ``event`` (e.g. one a worker reported), stamped now."""
        stamped = replace(event, time_s=self.clock(time.time()))
        with self._lock:
            if event.type == "generation_formed" and "layout" in event.details:
                self._layouts[event.details["generation"]] = event.details["layout"]
            self._events.append(stamped)
            self._lock.notify_all()
        return stamped

    def wait_for_news(self, events_since: int, timeout_s: float) -> None:
        """Block until an event past position ``events_since`` is logged, the log is closed, or
        ``timeout_s`` has passed: a reader's long poll, so that it hears of events at once without
        asking again and again."""
        with self._lock:
            self._lock.wait_for(lambda: self._closed or len(self._events) > events_since, timeout=timeout_s)

    def close(self) -> None:
        """The run is over: wake every reader waiting for news."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def add_step(self, step: int, finished_at: float, *, generation: int, rank: int, world_size: int,
                 loss_sum: float, samples: int, step_s: float, bytes_sent: int, uncompressed_bytes: int,
                 compute_s: float = 0.0, reporting: int | None = None, **timings: Any) -> dict[str, Any] | None:
        """Record ``rank``'s report of step ``step``; returns the step's row when this report completes
        it (every rank of the generation heard; ``reporting``: how many ranks report it, when not all of the
        ``world_size`` that trained do, as under async_ps, where one worker reports an update). A step redone in
        a later generation replaces the discarded attempt."""
        return self._add_report(step, _RankReport(finished_at, loss_sum, samples, step_s, compute_s, bytes_sent,
                                                  uncompressed_bytes, timings),
                                generation=generation, rank=rank, world_size=world_size, reporting=reporting)

    def _add_report(self, step: int, report: _RankReport, *, generation: int, rank: int, world_size: int,
                    reporting: int | None = None) -> dict[str, Any] | None:
        with self._lock:
            reports = self._steps.get(step)
            if reports is None:
                self._history_order.append(step)
            if reports is None or reports.generation != generation:
                reports = self._steps[step] = _StepReports(generation, world_size, reporting or world_size)
            reports.by_rank[rank] = report
            if len(reports.by_rank) == reports.reporting:
                reports.row = self._row(step, reports)
                reports.by_rank.clear()  # the row has it all: a long run of many workers keeps a row a step
            return reports.row

    def add_result(self, result: StepResult, *, generation: int, rank: int, world_size: int) -> dict[str, Any] | None:
        """``rank``'s StepResult: its report of the step (``add_step``) and, when recorded, the step's samples
        (``add_samples``). Returns the step's row when this report completes it."""
        if result.sample_ids is not None:
            self.add_samples(result.step, result.sample_ids, generation=generation, rank=rank)
        report = _RankReport(result.finished_at, result.loss_sum, result.samples, result.duration_s, result.compute_s,
                             result.bytes_sent, result.uncompressed_bytes, result)
        return self._add_report(result.step, report, generation=generation, rank=rank, world_size=world_size)

    def close_generation(self, generation: int) -> None:
        """The generation ended: its steps that some rank never reported get rows of what came in. A step heard
        only from ranks that report no samples (under model parallelism, one rank per copy of the model reports
        its share, and that one was lost) has no loss to show: it gets no row, and the step's redo makes one."""
        with self._lock:
            for step, reports in list(self._steps.items()):
                if reports.generation != generation or reports.row is not None:
                    continue
                if any(report.samples for report in reports.by_rank.values()):
                    reports.row = self._row(step, reports)
                else:
                    del self._steps[step]
                    self._history_order.remove(step)

    def _row(self, step: int, reports: _StepReports) -> dict[str, Any]:
        """The history row: loss and samples summed over the ranks heard (all of them, unless one died
        first), the lowest rank's timings, the step's traffic summed over the ranks, and each rank's share of
        the samples and compute time, in rank order."""
        ranks = [reports.by_rank[rank] for rank in sorted(reports.by_rank)]
        lowest = ranks[0]
        timings = lowest.timings if isinstance(lowest.timings, dict) else _timings(lowest.timings)
        samples = sum(r.samples for r in ranks)
        return {"step": step, "time_s": round(lowest.finished_at - self.started, 4),
                "loss": sum(r.loss_sum for r in ranks) / samples, "samples": samples,
                "samples_per_s": round(samples / lowest.step_s, 2), "world_size": reports.world_size,
                **({"layout": self._layouts[reports.generation]} if reports.generation in self._layouts else {}),
                "step_s": round(lowest.step_s, 5), **timings,
                "bytes_sent": sum(r.bytes_sent for r in ranks),
                "uncompressed_bytes": sum(r.uncompressed_bytes for r in ranks),
                "shares": [r.samples for r in ranks], "compute_s": [round(r.compute_s, 5) for r in ranks]}

    def add_evaluation(self, step: int, finished_at: float, metrics: dict[str, float]) -> None:
        """A periodic evaluation's metrics, taken after ``step`` (the eval history's row)."""
        with self._lock:
            self._evaluations.append({"step": step, "time_s": round(finished_at - self.started, 4), **metrics})

    def evaluations(self, since: int = 0) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._evaluations[since:])

    def add_samples(self, step: int, sample_ids: tuple[int, ...], *, generation: int, rank: int) -> None:
        """``rank`` of ``generation`` committed ``step``, which consumed ``sample_ids`` on all ranks. Every
        rank reports the same commit; a rank reporting a step again has applied it again."""
        samples = list(sample_ids)
        with self._lock:
            applied = self._applications.setdefault(step, [])
            same = (a for a in applied if (a.generation, a.samples) == (generation, samples) and rank not in a.ranks)
            application = next(same, None)
            if application is None:
                application = _Application(generation, samples)
                applied.append(application)
            application.ranks.add(rank)

    def withdraw(self, step: int, *, generation: int) -> None:
        """``generation``'s latest application of ``step`` reached no parameters: it is not kept."""
        with self._lock:
            applied = [a for a in self._applications.get(step, []) if a.generation == generation]
            if applied:
                applied[-1].withdrawn = True

    def ledger(self) -> dict[int, list[dict[str, Any]]]:
        """Every application of every step, in the order they happened::

            {step: [{"generation": g, "samples": [sample ids, in rank order], "kept": bool}, ...]}

        ``kept``: the application is part of the final state's lineage. A generation formed from the
        state at step s (handed over or restored from a checkpoint) discards every earlier generation's
        applications of steps after s; those are redone, and only the redo is kept. A withdrawn application
        (``withdraw``) is not kept. A run that applied
        each step exactly once has exactly one kept application per step.
        """
        with self._lock:
            formed = [(e.details["generation"], e.step) for e in self._events if e.type == "generation_formed"]

            def kept(step: int, application: _Application) -> bool:
                later = (at for generation, at in formed if generation > application.generation)
                return not application.withdrawn and all(at >= step for at in later)

            return {step: [{"generation": a.generation, "samples": a.samples, "kept": kept(step, a)} for a in applied]
                    for step, applied in sorted(self._applications.items())}

    def events(self, since: int = 0) -> list[Event]:
        with self._lock:
            return list(self._events[since:])

    def history(self, since: int = 0) -> list[dict[str, Any]]:
        """Complete step rows in the order steps were first committed, from position ``since`` up to the
        first step some rank has yet to report (so a reader never sees a loss over part of the batch)."""
        with self._lock:
            rows = []
            for step in self._history_order[since:]:
                row = self._steps[step].row
                if row is None:
                    break
                rows.append(row)
            return rows


def _timings(result: StepResult) -> dict[str, Any]:
    """A StepResult's columns of the history row besides the summed ones."""
    timings: dict[str, Any] = {"lr": result.lr, "grad_norm": round(result.grad_norm, 6)}
    if result.comm_s is not None:
        timings |= {"comm_s": round(result.comm_s, 5), "exposed_comm_s": round(result.exposed_comm_s, 5)}
    if result.link_delay_s:
        timings["link_delay_s"] = round(result.link_delay_s, 5)
    if result.skipped:
        timings["skipped"] = True
    return timings
