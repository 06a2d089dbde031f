"""Live progress of a run: a rich progress bar on a terminal, plain lines in logs and CI."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from raylastic.actors.status.run import Event, RunStatus

EVENT_STYLES = {"worker_failed": "bold red", "recovered": "bold green", "generation_formed": "cyan",
                "checkpointed": "dim", "checkpoint_failed": "bold yellow", "resumed": "yellow", "finished": "bold"}
LONG_FIELDS = ("traceback",)
"""Not shown in an event's line (a worker's traceback is printed once, with the run's error)."""


class ProgressDisplay:
    """Feed it the Controller's ``progress()``; it shows step, loss, samples/s, world size, state and events."""

    def __init__(self, total_steps: int, *, console: Console | None = None, lines: int = 20) -> None:
        self.console = console or Console(file=sys.stdout, soft_wrap=True)
        self.total_steps = total_steps
        self.line_every = max(1, total_steps // lines)
        self._progress: Progress | None = None
        self._task = None
        self._last_line_step = 0

    def __enter__(self) -> ProgressDisplay:
        if self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(), console=self.console, transient=False)
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total_steps, stats="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, progress: RunStatus) -> None:
        for event in progress.events:
            self.console.print(format_event(event), style=EVENT_STYLES.get(event.type), highlight=False)
        for evaluation in progress.evaluations:
            self.console.print(format_evaluation(evaluation), style="magenta", highlight=False)
        if not progress.history:
            return
        row = progress.history[-1]
        stats = (f"loss {row['loss']:.4f}  {row['samples_per_s']:.0f} samples/s  "
                 f"world size {row['world_size']}  {progress.state}")
        if self._progress is not None:
            self._progress.update(self._task, completed=row["step"], stats=stats)
        elif row["step"] - self._last_line_step >= self.line_every or row["step"] == self.total_steps:
            self._last_line_step = row["step"]
            self.console.print(f"step {row['step']}/{self.total_steps}  {stats}", highlight=False)


def format_event(event: Event) -> str:
    details = ", ".join(f"{k}={v}" for k, v in event.details.items() if k not in LONG_FIELDS)
    return f"[{event.time_s:7.2f}s] step {event.step}: {event.type}" + (f" ({details})" if details else "")


def format_evaluation(evaluation: dict[str, Any]) -> str:
    metrics = "  ".join(f"{k} {v:.4f}" for k, v in evaluation.items() if k not in ("step", "time_s"))
    return f"[{evaluation['time_s']:7.2f}s] step {evaluation['step']}: eval  {metrics}"
