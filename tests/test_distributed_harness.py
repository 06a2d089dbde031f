"""The multi-process test harness itself: when a rank fails, the error names the rank that caused it first, with
how it ended, and the ranks that only lost a peer after it (real processes in a real gloo group)."""

from __future__ import annotations

import ctypes
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.distributed_harness import run_distributed


def segfault_in_rank_1() -> None:
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    if dist.get_rank() == 1:
        time.sleep(0.5)  # the others are waiting in the next all-reduce
        ctypes.string_at(0)
    dist.all_reduce(tensor)


def raise_in_rank_2() -> None:
    if dist.get_rank() == 2:
        raise ValueError("the real cause")
    dist.all_reduce(torch.ones(4))


def hang_in_rank_0() -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        time.sleep(100)


def rank_blocks(report: str) -> list[str]:
    """The report's per-rank parts, in its order ("rank N ..." up to the next one)."""
    return ["rank " + block for block in report.split("\n\nrank ")[1:]]


def assert_only_lost_a_peer(blocks: list[str], ranks: set[str]) -> None:
    """``blocks`` are exactly ``ranks``'s, each one listed as having raised gloo's error for a peer that went first."""
    assert {block.split()[1] for block in blocks} == ranks
    assert all(block.startswith(f"rank {block.split()[1]} raised (only lost a peer):") for block in blocks), blocks


def test_a_crashed_rank_is_named_first_with_its_signal():
    with pytest.raises(AssertionError) as failure:
        run_distributed(segfault_in_rank_1, 3)
    blocks = rank_blocks(str(failure.value))
    assert blocks[0].startswith("rank 1 died:") and "killed by SIGSEGV" in blocks[0], str(failure.value)[:3000]
    assert "fatalSignalHandler" in blocks[0]  # the faulting thread's native stack (c10's)
    assert "string_at" in blocks[0]  # faulthandler's Python stack of the crash
    assert_only_lost_a_peer(blocks[1:], {"0", "2"})


def test_a_rank_that_raised_is_named_first_with_its_error():
    with pytest.raises(AssertionError) as failure:
        run_distributed(raise_in_rank_2, 3)
    blocks = rank_blocks(str(failure.value))
    assert blocks[0].startswith("rank 2 raised:"), str(failure.value)[:3000]
    assert "ValueError: the real cause" in blocks[0]
    assert_only_lost_a_peer(blocks[1:], {"0", "1"})


def test_a_hung_rank_is_named_as_still_running():
    with pytest.raises(TimeoutError, match=r"rank 0.*still running") as failure:
        run_distributed(hang_in_rank_0, 2, timeout_s=20)  # long enough for rank 1 to start and return
    assert "rank 1 returned" in str(failure.value)
