"""Plain values between ranks (strategies/plain_objects.py): JSON in tensors over real gloo groups, and whole runs -
a hand-over, a peer restore from buddy copies, a re-plan of model-parallel parts, checkpoints, the final model of a
pipeline - in which no rank sends a pickle, over every layout."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from raylastic.cluster.job import train
from raylastic.strategies.plain_objects import (
    PlainValueTooLong,
    all_gather_plain,
    all_gather_tensors,
    broadcast_plain,
    dtype_name,
    dtype_of,
)
from raylastic.workloads import load_workload
from tests.support.distributed_harness import run_distributed
from tests.support.helpers import job, load_model
from tests.support.strategy_runs import TINY_GPT_OPTIONS

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


STEPS = 12
"""Checkpoints at steps 5 and 10 and the end's: one before the kill at step 8, two after the recovery."""
RUNS = {  # a run per layout, each losing rank 1 at step 8 and taking the state back from the survivor's memory
    "ddp": ("tests.support.user_workload:PickleFreeDigits", "strategy.name=ddp"),
    "zero1": ("tests.support.user_workload:PickleFreeDigits", "strategy.name=zero1"),
    "zero2": ("tests.support.user_workload:PickleFreeDigits", "strategy.name=zero2"),
    "zero3": ("tests.support.user_workload:PickleFreeDigits", "strategy.name=zero3"),
    "tp": ("tests.support.user_workload:PickleFreeCharGPT", TINY_GPT_OPTIONS, "parallel.tp=2", "strategy.name=zero3"),
    "pp": ("tests.support.user_workload:PickleFreeCharGPT", TINY_GPT_OPTIONS, "parallel.pp=2", "strategy.name=ddp"),
}


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("layout", RUNS)
def test_a_run_with_a_kill_and_checkpoints_sends_no_pickle(tmp_path, layout):
    """ddp: the replacement receives the state by hand-over; zero1-3: the lost shards come from buddy copies; tp, pp:
    every generation tells its buddies what its parts hold, the re-formed one is re-planned from the parts the
    survivor kept and its buddy copy (strategies/region_copy.py), and under pp the final model.pt is gathered from
    the stages."""
    workload, *overrides = RUNS[layout]
    disturbed = job(f"workload.name={workload}", *overrides, f"training.steps={STEPS}", "checkpoint.every_steps=5",
                    "scaling.min_workers=2",
                    "faults=[{action: kill, rank: 1, step: 8}]", name=f"no-pickle-{layout}")
    result = train(disturbed, run_dir=tmp_path)
    assert result.final_step == STEPS
    assert sum(event.type == "worker_failed" for event in result.events) == 1
    formed = [event.details for event in result.events if event.type == "generation_formed"]
    assert len(formed) == 2, formed
    if layout == "ddp":
        assert isinstance(formed[-1]["state_source"], int), formed  # that rank broadcast its state
    else:
        assert formed[-1]["state_source"] in {"buddy", "peers"}, formed
    if layout == "pp":
        assert formed[-1]["layout"] == "pp2", formed
        whole = load_workload("chargpt", disturbed.workload.options).build_model().state_dict()
        assert load_model(tmp_path).keys() == whole.keys()  # both stages' parts, gathered as tensors


def _announce_too_much(operation: str) -> str:
    """Rank 1 announces a value longer than the bound: every rank refuses it before the bytes travel."""
    rank = dist.get_rank()
    try:
        if operation == "broadcast":
            broadcast_plain("x" * 100 if rank == 1 else None, src=1, max_bytes=64)
        else:
            all_gather_plain("x" * 100 if rank == 1 else "", max_bytes=64)
    except PlainValueTooLong as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize("operation", ["broadcast", "all_gather"])
def test_a_value_longer_than_the_bound_is_refused_on_every_rank_unallocated(operation):
    for error in run_distributed(_announce_too_much, 2, operation):
        assert error == "group rank 1 announced a plain value of 102 bytes; at most 64 are accepted (max_bytes), " \
                        "so it was refused unread"


def _gather_stages(_: None) -> list[dict[str, torch.Tensor]]:
    rank = dist.get_rank()
    return all_gather_tensors({f"stage{rank}.w": torch.full((rank + 1, 2), float(rank)),
                               f"stage{rank}.n": torch.tensor([rank], dtype=torch.int64)})


def test_tensors_gathered_by_name_arrive_whole_with_their_dtypes():
    for gathered in run_distributed(_gather_stages, 2, None):
        for rank, stage in enumerate(gathered):
            assert stage.keys() == {f"stage{rank}.w", f"stage{rank}.n"}
            assert torch.equal(stage[f"stage{rank}.w"], torch.full((rank + 1, 2), float(rank)))
            assert torch.equal(stage[f"stage{rank}.n"], torch.tensor([rank], dtype=torch.int64))
