"""The world-size-free sample order: which samples step k consumes, and which of them rank r takes.

The sample stream is the concatenation of one seeded permutation of the data set per epoch.
Step k consumes positions [k*B, (k+1)*B) of that stream whatever the world size, so a run that
changes size mid-way still sees every sample of an epoch exactly once. Rank r of w takes the
contiguous slice [r*B//w, (r+1)*B//w) of the step's samples (sizes differ by at most one).

Example::

    order = GlobalSampleOrder(num_samples=1000, global_batch_size=64, seed=0)
    mine = order.rank_indices(step=3, rank=1, world_size=3)   # a LongTensor of dataset indices
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GlobalSampleOrder:
    num_samples: int
    global_batch_size: int
    seed: int
    _permutations: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def permutation(self, epoch: int) -> torch.Tensor:
        """The data set's order in ``epoch``; seeded by (seed, epoch) only, cached for two epochs."""
        if epoch not in self._permutations:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._permutations = {e: p for e, p in self._permutations.items() if e >= epoch - 1}
            self._permutations[epoch] = torch.randperm(self.num_samples, generator=generator)
        return self._permutations[epoch]

    def rank_indices(self, step: int, rank: int, world_size: int) -> torch.Tensor:
        """The contiguous part of step ``step``'s global batch that ``rank`` of ``world_size`` trains on."""
        start, stop = rank_slice(self.global_batch_size, rank, world_size)
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


def rank_slice(global_batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous share of a global batch; shares differ by at most one."""
    assert 0 <= rank < world_size <= global_batch_size, (rank, world_size, global_batch_size)
    return rank * global_batch_size // world_size, (rank + 1) * global_batch_size // world_size


def micro_batches(indices: torch.Tensor, micro_batch_size: int | None) -> list[torch.Tensor]:
    """Split a rank's slice into micro-batches of at most ``micro_batch_size`` samples."""
    if micro_batch_size is None or micro_batch_size >= len(indices):
        return [indices]
    return list(torch.split(indices, micro_batch_size))
