"""The world-size-free sample order: which samples step k consumes, and which of them rank r takes.

The sample stream is the concatenation of one seeded permutation of the data set per epoch.
Step k consumes positions [k*B, (k+1)*B) of that stream whatever the world size, so a run that
changes size mid-way still sees every sample of an epoch exactly once. The ranks take contiguous
slices of the step's samples, in rank order: by default rank r of w takes [r*B//w, (r+1)*B//w)
(sizes differ by at most one); a ``BatchSplit`` gives the ranks slices of any sizes (actors/data/balance.py
sizes them by each rank's speed). The step's gradient is the same either way: the loss is weighted
per sample (actors/worker/step.py). An empty data set is refused; one smaller than a global batch is
trained on with a warning, since each step then takes some of its samples more than once.

Example::

    order = GlobalSampleOrder(num_samples=1000, global_batch_size=64, seed=0)
    mine = order.rank_indices(step=3, rank=1, world_size=3)   # a LongTensor of dataset indices
    theirs = order.split_indices(step=3, split=BatchSplit((16, 32, 16)), rank=1)  # 32 of them
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from raylastic.actors.data.batch_split import BatchSplit

logger = logging.getLogger(__name__)


@dataclass
class GlobalSampleOrder:
    """The order of a data set of ``num_samples`` for steps of ``global_batch_size`` (both from the workload and
    ``training.global_batch_size`` at a worker's start). Raises ValueError for an empty data set; warns when it
    is smaller than one global batch."""

    num_samples: int
    global_batch_size: int
    seed: int
    _permutations: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"the workload's train_dataset() has {self.num_samples} samples: nothing to train on "
                             f"(training.global_batch_size={self.global_batch_size} samples a step)")
        if self.num_samples < self.global_batch_size:
            logger.warning(short_dataset_warning(self.num_samples, self.global_batch_size))

    def permutation(self, epoch: int) -> torch.Tensor:
        """The data set's order in ``epoch``; seeded by (seed, epoch) only, cached for two epochs."""
        if epoch not in self._permutations:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._permutations = {e: p for e, p in self._permutations.items() if e >= epoch - 1}
            self._permutations[epoch] = torch.randperm(self.num_samples, generator=generator)
        return self._permutations[epoch]

    def rank_indices(self, step: int, rank: int, world_size: int) -> torch.Tensor:
        """The contiguous part of step ``step``'s global batch that ``rank`` of ``world_size`` trains on (an even
        split)."""
        return self.split_indices(step, BatchSplit.even(self.global_batch_size, world_size), rank)

    def split_indices(self, step: int, split: BatchSplit, rank: int) -> torch.Tensor:
        """The part of step ``step``'s global batch that ``rank`` trains on under ``split``."""
        assert split.global_batch_size == self.global_batch_size, (split, self.global_batch_size)
        start, stop = split.bounds(rank)
        base = step * self.global_batch_size
        return self._stream_slice(base + start, base + stop)

    def _stream_slice(self, start: int, stop: int) -> torch.Tensor:
        parts = []
        while start < stop:
            epoch, offset = divmod(start, self.num_samples)
            take = min(stop - start, self.num_samples - offset)
            parts.append(self.permutation(epoch)[offset:offset + take])
            start += take
        return torch.cat(parts) if len(parts) != 1 else parts[0]


def short_dataset_warning(num_samples: int, global_batch_size: int) -> str:
    """What repeats when a data set is smaller than a global batch: every step spans more than one epoch."""
    return (f"the workload's train_dataset() has {num_samples} samples, fewer than training.global_batch_size="
            f"{global_batch_size}: every step's {global_batch_size} samples span consecutive epochs' orders, so at "
            f"least {global_batch_size - num_samples} of them repeat a sample already in that step; set "
            f"training.global_batch_size to at most {num_samples} for no sample to repeat within a step")


def micro_batch_count(split: BatchSplit, micro_batch_size: int | None) -> int:
    """How many micro-batches every rank runs in a step: as many as the largest share needs. It is the same on
    every rank because forward itself runs collectives (FSDP2 gathers parameters, DDP broadcasts buffers)."""
    return 1 if micro_batch_size is None else -(-max(split.sizes) // micro_batch_size)


def micro_batches(indices: torch.Tensor, count: int) -> list[torch.Tensor]:
    """A rank's slice in ``count`` contiguous micro-batches of near-equal size, in order. A slice of fewer
    than ``count`` samples is padded with copies of its last sample, which the step weights by 0."""
    if count == 1:
        return [indices]
    chunks = list(torch.tensor_split(indices, min(count, len(indices))))
    return chunks + [indices[-1:]] * (count - len(chunks))
