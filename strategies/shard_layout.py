"""Where each rank's part of the sharded state lies, with ``strategy.replicas`` copies of it (HSDP).

Pure functions, no torch.distributed. A generation of ``world_size`` ranks with ``replicas`` copies
forms the 2-D mesh ``(replicas, num_shards)``: rank ``r`` is in replica group ``r // num_shards`` and
holds shard ``r % num_shards``, so the ranks of one replica group are contiguous (one node's, where the
Controller places ranks node by node) and the copies of a shard lie ``num_shards`` ranks apart. Shard
``s`` of a tensor is rows ``row_bounds(rows, num_shards, s)`` of its dim 0: torch.chunk's split, the one
FSDP2 and ``ShardedOptimizer`` use (the last shards may be short, or empty).

Example::

    layout = ShardLayout(world_size=4, replicas=2, rank=3)
    layout.num_shards, layout.shard       # (2, 1): rank 3 holds the second half, as rank 1 does
    effective_replicas(2, world_size=3)   # 1: two copies cannot split three ranks evenly
"""

from __future__ import annotations

from dataclasses import dataclass


def effective_replicas(replicas: int, world_size: int) -> int:
    """The copies a generation of ``world_size`` ranks keeps: the largest divisor of ``world_size`` that is at
    most ``replicas`` (every replica group must have as many ranks). It never costs more memory per rank than
    ``replicas`` would, and keeps as many copies as the group allows: ``(2, 4) -> 2``, ``(2, 3) -> 1``,
    ``(3, 4) -> 2``, ``(4, 2) -> 2`` (each rank then holds the whole state)."""
    if replicas < 1 or world_size < 1:
        raise ValueError(f"replicas and world_size must be positive, got {replicas} and {world_size}")
    return max(d for d in range(1, min(replicas, world_size) + 1) if world_size % d == 0)


@dataclass(frozen=True)
class ShardLayout:
    """One rank's place in a generation's (replicas, num_shards) mesh."""

    world_size: int
    replicas: int
    """Copies of every shard (already effective: it divides ``world_size``)."""
    rank: int

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.world_size and self.world_size % self.replicas == 0, self

    @property
    def num_shards(self) -> int:
        return self.world_size // self.replicas

    @property
    def shard(self) -> int:
        """The shard this rank holds (the same as the ranks ``num_shards`` apart)."""
        return self.rank % self.num_shards

    @property
    def replica(self) -> int:
        return self.rank // self.num_shards


def row_bounds(rows: int, num_shards: int, shard: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of dim 0 that shard ``shard`` of ``num_shards`` holds (torch.chunk's split)."""
    width = -(-rows // num_shards)
    return min(shard * width, rows), min((shard + 1) * width, rows)
