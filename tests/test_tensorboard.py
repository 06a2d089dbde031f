"""The TensorBoard log: scalars per step (at most every min_interval_s, and always the last), events as text."""

from __future__ import annotations

import logging
import math
import struct
from pathlib import Path

from tensorboardX.proto import event_pb2

from raylastic.cluster.tensorboard import TensorBoardLog
from tests.support.helpers import run_status


def read_events(directory: Path) -> list[event_pb2.Event]:
    """Every record of the event files in ``directory`` (TFRecord framing: length, crc, data, crc)."""
    events = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        position = 0
        while position < len(data):
            (length,) = struct.unpack("<Q", data[position:position + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[position + 12:position + 12 + length])
            events.append(event)
            position += 12 + length + 4
    return events


def row(step: int, time_s: float) -> dict:
    return {"step": step, "time_s": time_s, "loss": 1.0 / step, "samples_per_s": 100.0, "world_size": 2}


def test_steps_are_thinned_to_the_interval_and_the_last_is_kept(tmp_path: Path) -> None:
    log = TensorBoardLog(tmp_path, min_interval_s=0.125)  # 8 steps of 1/64 s (exact in binary)
    log.update(run_status([row(s, s / 64) for s in range(1, 26)],
                events=[{"type": "worker_failed", "step": 12, "time_s": 0.12, "worker": "w1"}]))
    log.update(run_status([row(s, s / 64) for s in range(26, 38)], events=[]))
    log.close()

    events = read_events(tmp_path / "tensorboard")
    loss_steps = [e.step for e in events for v in e.summary.value if v.tag == "train/loss"]
    assert loss_steps == [1, 9, 17, 25, 33, 37]
    losses = {e.step: v.simple_value for e in events for v in e.summary.value if v.tag == "train/loss"}
    assert abs(losses[37] - 1 / 37) < 1e-6
    texts = [e for e in events for v in e.summary.value if v.tag.startswith("events")]
    assert [e.step for e in texts] == [12]


def test_every_step_is_written_when_the_interval_is_zero(tmp_path: Path) -> None:
    log = TensorBoardLog(tmp_path, min_interval_s=0.0)
    log.update(run_status([row(s, 0.001 * s) for s in range(1, 6)], events=[]))
    log.close()
    steps = [e.step for e in read_events(tmp_path / "tensorboard") for v in e.summary.value
             if v.tag == "train/world_size"]
    assert steps == [1, 2, 3, 4, 5]


def test_a_skipped_steps_nonfinite_loss_and_norm_are_left_out_without_a_warning(tmp_path: Path, caplog) -> None:
    """training.on_nonfinite=skip: the step's row keeps its NaN loss and gradient norm (result.json writes null);
    TensorBoard gets the step's other scalars, and tensorboardX's "NaN or Inf found" warning is not printed."""
    skipped = row(2, 0.002) | {"loss": math.nan, "grad_norm": math.inf, "skipped": True}
    log = TensorBoardLog(tmp_path, min_interval_s=0.0)
    with caplog.at_level(logging.WARNING):
        log.update(run_status([row(1, 0.001) | {"grad_norm": 0.5}, skipped, row(3, 0.003)], events=[]))
        log.close()
    assert not [r for r in caplog.records if "NaN or Inf" in r.getMessage()]
    written = {(v.tag, e.step) for e in read_events(tmp_path / "tensorboard") for v in e.summary.value}
    assert {("train/loss", 1), ("train/loss", 3), ("train/grad_norm", 1), ("train/world_size", 2)} <= written
    assert not {("train/loss", 2), ("train/grad_norm", 2)} & written
