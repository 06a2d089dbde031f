"""How a step's samples are split over the ranks: contiguous slices in rank order, even by default or of any
sizes (actors/data/balance.py sizes them by each rank's speed). Imports no torch: the Controller sizes the splits."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSplit:
    """How many of each step's samples every rank takes, in rank order (each at least one)."""

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        assert self.sizes and all(isinstance(s, int) and s >= 1 for s in self.sizes), self.sizes

    @classmethod
    def even(cls, global_batch_size: int, world_size: int) -> BatchSplit:
        """Sizes that differ by at most one (``rank_slice``)."""
        return cls(tuple(stop - start for start, stop in (rank_slice(global_batch_size, r, world_size)
                                                          for r in range(world_size))))

    @property
    def world_size(self) -> int:
        return len(self.sizes)

    @property
    def global_batch_size(self) -> int:
        return sum(self.sizes)

    def bounds(self, rank: int) -> tuple[int, int]:
        """[start, stop) of ``rank``'s slice of the step's samples."""
        start = sum(self.sizes[:rank])
        return start, start + self.sizes[rank]


def rank_slice(global_batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous share of a global batch; shares differ by at most one."""
    assert 0 <= rank < world_size <= global_batch_size, (rank, world_size, global_batch_size)
    return rank * global_batch_size // world_size, (rank + 1) * global_batch_size // world_size
