"""A leased step's batches from DataLoader worker processes (actors/data/leased_batches.py): the batches of the
index lists asked for, in order, fetched in other processes; a fetch not taken whole does not shift the next."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import psutil
import pytest
import torch
from torch.utils.data import Dataset

from raylastic.actors.data.leased_batches import PARENT_CHECK_S, LeasedBatches
from raylastic.jobconfig import DataConfig

pytestmark = pytest.mark.processes


class IndexAndProcess(Dataset):
    """Item i: a dict batch, as Hugging Face datasets give, saying i and the process that fetched it."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"index": torch.tensor(index), "pid": torch.tensor(os.getpid())}


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_leased_batches_are_the_asked_indices_in_order(num_workers):
    batches = LeasedBatches(IndexAndProcess(), collate=None, data=DataConfig(num_workers=num_workers))
    steps = [[[4, 9, 1], [7, 2]], [[0], [5, 6], [8, 3, 11], [12]], [[40, 41]]]
    fetched_by = set()
    for chunks in steps:
        got = list(batches.fetch(chunks))
        assert [batch["index"].tolist() for batch in got] == chunks
        fetched_by.update(pid for batch in got for pid in batch["pid"].tolist())
    assert fetched_by == ({os.getpid()} if num_workers == 0 else fetched_by - {os.getpid()})
    assert len(fetched_by) == max(num_workers, 1)
    batches.close()


def test_a_fetch_not_taken_whole_leaves_the_next_one_its_own_batches():
    batches = LeasedBatches(IndexAndProcess(), collate=None, data=DataConfig(num_workers=2))
    first = batches.fetch([[1], [2], [3]])
    next(first)  # the step failed after its first micro-batch
    assert [batch["index"].tolist() for batch in batches.fetch([[20, 21], [22]])] == [[20, 21], [22]]
    batches.close()


def _hold_a_loader(pids) -> None:
    batches = LeasedBatches(IndexAndProcess(), collate=None, data=DataConfig(num_workers=2))
    list(batches.fetch([[1], [2]]))
    pids.put([child.pid for child in psutil.Process().children()])
    threading.Event().wait()  # until killed


def test_the_loader_processes_of_a_killed_worker_do_not_outlive_it():
    """A worker SIGKILLed (ray.kill, a lost node) cannot close its loader: its processes, left waiting for
    indices, notice their parent is gone within PARENT_CHECK_S and exit."""
    context = multiprocessing.get_context("spawn")
    pids = context.Queue()
    holder = context.Process(target=_hold_a_loader, args=(pids,))  # not daemonic: it starts processes
    holder.start()
    try:
        children = pids.get(timeout=60)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(timeout=10)
    assert len(children) == 2
    deadline = time.monotonic() + 10 * PARENT_CHECK_S
    while (alive := [pid for pid in children if psutil.pid_exists(pid)
                     and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]):
        assert time.monotonic() < deadline, f"loader processes {alive} outlived their worker"
        time.sleep(0.1)
