"""A leased step's micro-batches, fetched and collated by ``data.num_workers`` DataLoader worker processes.

An async_ps worker learns which step it computes only when it leases it, so no sampler can plan its
batches ahead as ``batches.py`` does for a synchronous rank. Instead each DataLoader worker process
reads index lists from a queue of its own: a DataLoader takes its items from its processes in
rotation, so putting the i-th index list on queue ``i % num_workers`` makes it the i-th batch that
comes out. With ``num_workers`` 0 the batches are fetched on the calling thread.

Example::

    batches = LeasedBatches(dataset, collate=None, data=DataConfig(num_workers=2))
    first, second = batches.fetch([[4, 9, 1], [7, 2, 3]])   # collated, in order
    batches.close()
"""

from __future__ import annotations

import multiprocessing
import os
import queue
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from raylastic.actors.data.batches import Collate, fetch_batch, loader_inputs
from raylastic.jobconfig import DataConfig

PARENT_CHECK_S = 1.0
"""How often a loader process waiting for indices checks that the worker that started it still lives."""


class _QueuedIndices(IterableDataset):
    """In each DataLoader worker process: the collated batch of every index list put on that process's queue."""

    def __init__(self, source: Dataset, collate: Collate, queues: list[Any], parent_pid: int) -> None:
        self.source, self.collate, self.queues, self.parent_pid = source, collate, queues, parent_pid

    def __iter__(self) -> Iterator[Any]:
        indices_queue = self.queues[get_worker_info().id]
        while True:
            try:
                indices = indices_queue.get(timeout=PARENT_CHECK_S)
            except queue.Empty:
                if os.getppid() != self.parent_pid:  # the worker was killed: nothing will come
                    return
                continue
            if indices is None:  # closed
                return
            yield fetch_batch(self.source, self.collate, indices)


def _as_collated(batch: Any) -> Any:
    return batch


class LeasedBatches:
    def __init__(self, dataset: Dataset, *, collate: Collate | None, data: DataConfig,
                 pin_memory: bool = False) -> None:
        self.source, self.collate = loader_inputs(dataset, collate)
        self.queues: list[Any] = []
        self.sent = self.received = 0
        if data.num_workers:
            context = multiprocessing.get_context()
            self.queues = [context.Queue() for _ in range(data.num_workers)]
            feed = _QueuedIndices(self.source, self.collate, self.queues, os.getpid())
            self.loader = iter(DataLoader(feed, batch_size=None, collate_fn=_as_collated, num_workers=data.num_workers,
                                          prefetch_factor=data.prefetch_factor, pin_memory=pin_memory,
                                          multiprocessing_context=context))

    def fetch(self, chunks: list[list[int]]) -> Iterator[Any]:
        """The collated batches of ``chunks`` (lists of dataset indices), in order: all of them are handed to the
        loader processes at once, and come back as they are taken."""
        if not self.queues:
            return (fetch_batch(self.source, self.collate, chunk) for chunk in chunks)
        while self.received < self.sent:  # batches of an earlier fetch that were not all taken
            self._take()
        for chunk in chunks:
            self.queues[self.sent % len(self.queues)].put(chunk)
            self.sent += 1
        return (self._take() for _ in chunks)

    def close(self) -> None:
        """End the loader processes (they would otherwise be waited for, then terminated, as the loader goes)."""
        for indices_queue in self.queues:
            indices_queue.put(None)
        if self.queues:
            del self.loader
            self.queues = []

    def _take(self) -> Any:
        batch = next(self.loader)
        self.received += 1
        return batch
