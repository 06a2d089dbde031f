"""Run metrics for TensorBoard, written by the driver into ``<run dir>/tensorboard``.

``tensorboard --logdir runs/NAME`` then shows loss, throughput, bytes sent, exposed
communication and world size per step, and the run's events as text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tensorboardX import SummaryWriter

SCALARS = ("loss", "samples_per_s", "world_size", "bytes_sent", "comm_s", "exposed_comm_s", "step_s")


class TensorBoardLog:
    """Feed it the Controller's ``progress()`` dicts (as the CLI's display is fed)."""

    def __init__(self, run_dir: Path) -> None:
        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def update(self, progress: dict[str, Any]) -> None:
        for row in progress["history"]:
            for name in SCALARS:
                if name in row:
                    self.writer.add_scalar(f"train/{name}", row[name], global_step=row["step"])
        for event in progress["events"]:
            details = ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("type", "step"))
            self.writer.add_text("events", f"{event['type']}: {details}", global_step=event["step"])

    def close(self) -> None:
        self.writer.close()
