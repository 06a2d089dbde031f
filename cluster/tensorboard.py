"""Run metrics for TensorBoard, written by the driver into ``<run dir>/tensorboard``.

``tensorboard --logdir runs/NAME`` then shows loss, learning rate, gradient norm, throughput, bytes
sent, exposed communication and world size per step, the periodic evaluations, and the run's events
as text.

Steps are written at most every ``min_interval_s`` of run time (default 0.1 s: ten points a
second, plus the last step): a small model commits hundreds of steps a second, and writing each
would cost the driver a good part of a core that the workers beside it need. result.json keeps
every step.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tensorboardX import SummaryWriter

from raylastic.actors.status.run import RunStatus

SCALARS = ("loss", "lr", "grad_norm", "samples_per_s", "world_size", "bytes_sent", "comm_s", "exposed_comm_s", "step_s")


class TensorBoardLog:
    """Feed it the Controller's ``progress()`` dicts (as the CLI's display is fed)."""

    def __init__(self, run_dir: Path, min_interval_s: float = 0.1) -> None:
        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.min_interval_s = min_interval_s
        self._last_written_s: float | None = None
        self._unwritten: dict[str, Any] | None = None

    def update(self, progress: RunStatus) -> None:
        for row in progress.history:
            if self._last_written_s is None or row["time_s"] - self._last_written_s >= self.min_interval_s:
                self._write_step(row)
            else:
                self._unwritten = row
        for evaluation in progress.evaluations:
            for name, value in evaluation.items():
                if name not in ("step", "time_s"):
                    self.writer.add_scalar(f"eval/{name}", value, global_step=evaluation["step"])
        for event in progress.events:
            details = ", ".join(f"{k}={v}" for k, v in {"time_s": event.time_s, **event.details}.items())
            self.writer.add_text("events", f"{event.type}: {details}", global_step=event.step)

    def _write_step(self, row: dict[str, Any]) -> None:
        for name in SCALARS:
            if row.get(name) is not None and math.isfinite(row[name]):  # a skipped step's NaN loss draws nothing
                self.writer.add_scalar(f"train/{name}", row[name], global_step=row["step"])
        self._last_written_s, self._unwritten = row["time_s"], None

    def close(self) -> None:
        if self._unwritten is not None:
            self._write_step(self._unwritten)
        self.writer.close()
