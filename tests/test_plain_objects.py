"""Plain values between ranks (strategies/plain_objects.py): JSON in tensors over real gloo groups, and whole runs -
a hand-over, a peer restore from buddy copies, checkpoints - in which no rank sends a pickle."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from raylastic.cluster.job import train
from raylastic.strategies.plain_objects import all_gather_plain, broadcast_plain, dtype_name, dtype_of
from tests.support.distributed_harness import run_distributed
from tests.support.helpers import job

SENT = {"step": 7, "shape": [3, 4], "dtype": "bfloat16", "scale": 65536.0, "inf": math.inf, "none": None,
        "text": "naïve ✓", "nested": [{"a": [1.5, -2]}]}


def _exchange(value: dict) -> tuple[dict, list]:
    rank = dist.get_rank()
    received = broadcast_plain(value if rank == 1 else None, src=1)
    gathered = all_gather_plain({"rank": rank, "node": f"node-{rank}" * (rank + 1)})
    return received, gathered


def test_values_arrive_whole_on_every_rank():
    for received, gathered in run_distributed(_exchange, 3, SENT):
        assert received == SENT
        assert gathered == [{"rank": rank, "node": f"node-{rank}" * (rank + 1)} for rank in range(3)]


def _send_a_tensor(_: None) -> str:
    try:
        broadcast_plain({"t": torch.ones(1)}, src=0)
    except TypeError as error:
        return str(error)
    return "sent"


def test_a_value_json_cannot_carry_is_refused_on_the_sender_naming_it():
    (error,) = run_distributed(_send_a_tensor, 1, None)
    assert error.startswith("only plain values (JSON) are sent between ranks") and "Tensor" in error


def test_dtype_names_round_trip():
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool):
        assert dtype_of(dtype_name(dtype)) is dtype
    with pytest.raises(ValueError, match="'nn' is not a torch dtype"):
        dtype_of("nn")


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_run_with_a_kill_and_checkpoints_sends_no_pickle(tmp_path, strategy):
    """ddp: the replacement receives the state by hand-over; zero3: the lost shards come from buddy copies."""
    result = train(job("workload.name=tests.support.user_workload:PickleFreeDigits", f"strategy.name={strategy}",
                       "checkpoint.every_steps=5", "faults=[{action: kill, rank: 1, step: 8}]",
                       name=f"no-pickle-{strategy}"), run_dir=tmp_path)
    assert result.final_step == 20
    assert sum(event.type == "worker_failed" for event in result.events) == 1
    formed = [event.details for event in result.events if event.type == "generation_formed"]
    handed_over_by_a_rank = isinstance(formed[-1]["state_source"], int)  # ddp: that rank broadcast its state
    assert handed_over_by_a_rank if strategy == "ddp" else formed[-1]["state_source"] == "buddy", formed
