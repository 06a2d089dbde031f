"""planned_batches: a rank's micro-batches, fetched in the training thread (data.num_workers=0) or by a DataLoader's
worker processes, are the same batches in the same order for every kind of dataset.

    python -m pytest tests/test_planned_batches.py -q
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from raylastic.actors.data.batch_split import BatchSplit
from raylastic.actors.data.batches import planned_batches
from raylastic.actors.data.order import GlobalSampleOrder, micro_batch_count
from raylastic.jobconfig import DataConfig

NUM_SAMPLES, GLOBAL_BATCH, STEPS = 37, 12, 7


class DictItems(Dataset):
    """A hand-written dataset of dict items (collated by torch's default_collate)."""

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.full((3,), index), "label": torch.tensor(index % 5)}


class PairItems(Dataset):
    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int) -> tuple[int, str]:
        return index, f"sample-{index}"


def collate_pairs(items: list[tuple[int, str]]) -> dict:
    """A workload's own collate: the batch as a tensor of ids and a list of texts."""
    return {"ids": torch.tensor([i for i, _ in items]), "texts": [text for _, text in items]}


DATASETS = {
    "tensors": (TensorDataset(torch.arange(NUM_SAMPLES * 2.0).reshape(NUM_SAMPLES, 2), torch.arange(NUM_SAMPLES)),
                None),
    "dict items": (DictItems(), None),
    "own collate": (PairItems(), collate_pairs),
}


def _batches(name: str, num_workers: int, rank: int, split: BatchSplit, micro_batch_size: int | None) -> list:
    dataset, collate = DATASETS[name]
    order = GlobalSampleOrder(NUM_SAMPLES, GLOBAL_BATCH, seed=5)
    batches = planned_batches(dataset, order, split=split, rank=rank, first_step=2, until_step=STEPS,
                              micro_batch_size=micro_batch_size, collate=collate,
                              data=DataConfig(num_workers=num_workers))
    return list(batches)


def _ids(name: str, batch) -> list[int]:
    """The sample indices a collated batch holds."""
    if name == "tensors":
        return batch[1].tolist()
    return batch["input_ids"][:, 0].tolist() if name == "dict items" else batch["ids"].tolist()


@pytest.mark.parametrize("name", DATASETS)
@pytest.mark.parametrize(("split", "rank", "micro_batch_size"), [
    (BatchSplit.even(GLOBAL_BATCH, 1), 0, None), (BatchSplit((3, 9)), 1, 4), (BatchSplit((3, 9)), 0, 4)])
def test_the_training_thread_fetches_what_a_loader_process_would(name, split, rank, micro_batch_size):
    in_thread = _batches(name, 0, rank, split, micro_batch_size)
    by_process = _batches(name, 1, rank, split, micro_batch_size)
    order = GlobalSampleOrder(NUM_SAMPLES, GLOBAL_BATCH, seed=5)
    count = micro_batch_count(split, micro_batch_size)
    assert len(in_thread) == len(by_process) == (STEPS - 2) * count
    expected = torch.cat([order.split_indices(step, split, rank) for step in range(2, STEPS)]).tolist()
    fetched = [i for batch in in_thread for i in _ids(name, batch)]
    assert fetched == expected
    for ours, theirs in zip(in_thread, by_process, strict=True):
        assert type(ours) is type(theirs)
        if name == "tensors":
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        else:
            assert ours.keys() == theirs.keys()
            assert all(torch.equal(ours[k], theirs[k]) if isinstance(ours[k], torch.Tensor) else ours[k] == theirs[k]
                       for k in ours)
