"""This rank's micro-batches for the coming steps, fetched by a torch DataLoader.

A generation trains steps [first_step, until_step); this rank's part of each is known in advance
(actors/data/order.py), so a DataLoader driven by a batch sampler of exactly those indices can
fetch and collate them ahead, in worker processes when ``data.num_workers`` > 0, while the
training thread computes. Without worker processes the training thread fetches each batch itself, as such a
DataLoader would, less the loader's per-batch overhead (~0.1 ms: a twentieth of a small model's step). The loader
is rebuilt at every generation (rank and world size change) and whenever the batch split changes; the data order
does not.

Example::

    batches = planned_batches(dataset, order, split=BatchSplit.even(64, 2), rank=0, first_step=0, until_step=100,
                              micro_batch_size=8, collate=None, data=DataConfig(num_workers=2))
    first = next(batches)          # step 0's first micro-batch, collated
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset, default_collate

from raylastic.actors.data.batch_split import BatchSplit
from raylastic.actors.data.order import GlobalSampleOrder, micro_batch_count, micro_batches
from raylastic.jobconfig import DataConfig

Collate = Callable[[list[Any]], Any]


class PlannedIndices(Sampler[list[int]]):
    """The dataset indices of this rank's micro-batches, step after step, in training order."""

    def __init__(self, order: GlobalSampleOrder, *, split: BatchSplit, rank: int, first_step: int, until_step: int,
                 micro_batch_size: int | None) -> None:
        self.order, self.split, self.rank = order, split, rank
        self.first_step, self.until_step, self.micro_batch_size = first_step, until_step, micro_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        return (chunk.tolist() for chunk in self.chunks())

    def chunks(self) -> Iterator[torch.Tensor]:
        """The same micro-batches' indices as tensors."""
        count = micro_batch_count(self.split, self.micro_batch_size)
        for step in range(self.first_step, self.until_step):
            yield from micro_batches(self.order.split_indices(step, self.split, self.rank), count)

    def __len__(self) -> int:
        return (self.until_step - self.first_step) * micro_batch_count(self.split, self.micro_batch_size)


class TensorRows(Dataset):
    """A TensorDataset whose batches are gathered in one indexing per tensor (no per-item collate)."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.tensors = dataset.tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[index] for t in self.tensors)

    def __getitems__(self, indices: list[int] | torch.Tensor) -> tuple[torch.Tensor, ...]:
        chosen = torch.as_tensor(indices)
        return tuple(t[chosen] for t in self.tensors)


def _already_batched(batch: Any) -> Any:
    return batch


def loader_inputs(dataset: Dataset, collate: Collate | None) -> tuple[Dataset, Collate]:
    """The dataset and collate function a DataLoader uses for ``dataset`` (a fast path for tensors)."""
    if collate is None and isinstance(dataset, TensorDataset):
        return TensorRows(dataset), _already_batched
    return dataset, collate or default_collate


def fetch_batch(source: Dataset, collate: Collate, indices: list[int] | torch.Tensor) -> Any:
    """``source``'s items at ``indices``, collated: in one call where the dataset fetches many at once
    (``__getitems__``: TensorRows, Hugging Face datasets), item by item otherwise (what a DataLoader does).
    ``indices`` may be a tensor only for TensorRows."""
    items = source.__getitems__(indices) if hasattr(source, "__getitems__") else [source[i] for i in indices]
    return collate(items)


def planned_batches(dataset: Dataset, order: GlobalSampleOrder, *, split: BatchSplit, rank: int, first_step: int,
                    until_step: int, micro_batch_size: int | None, collate: Collate | None, data: DataConfig,
                    pin_memory: bool = False) -> Iterator[Any]:
    """An iterator over this rank's collated micro-batches of steps [first_step, until_step) under ``split``."""
    sampler = PlannedIndices(order, split=split, rank=rank, first_step=first_step, until_step=until_step,
                             micro_batch_size=micro_batch_size)
    source, collate_fn = loader_inputs(dataset, collate)
    workers = data.num_workers
    if not workers and not pin_memory:
        planned = sampler.chunks() if isinstance(source, TensorRows) else iter(sampler)
        return (fetch_batch(source, collate_fn, indices) for indices in planned)
    loader = DataLoader(source, batch_sampler=sampler, collate_fn=collate_fn, num_workers=workers,
                        prefetch_factor=data.prefetch_factor if workers else None, pin_memory=pin_memory)
    return iter(loader)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (nested tuples, lists, mappings) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):  # a dict, or a Hugging Face BatchEncoding (a UserDict)
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(value, device) for value in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)  # a namedtuple's fields
    return batch
