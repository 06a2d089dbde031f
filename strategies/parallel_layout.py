"""A generation's layout over its ranks: pipeline stages, data-parallel copies and shards, tensor-parallel splits.

Pure, no torch. The ranks of a generation form the 4-D grid ``(pp, dp_replicate, dp_shard, tp)``, the
order torchtitan's meshes use: rank ``((p * R + r) * S + s) * T + t``. The tensor-parallel dimension is
innermost, so a tp group is consecutive ranks (one node's, once ``rank_order`` has placed the members),
and the pipeline dimension outermost, so a stage's ranks are together and neighbouring stages follow
each other. ``dp_replicate`` x ``dp_shard`` is the data-parallel degree that ``strategy`` applies over,
with ``strategy.replicas`` copies (HSDP) as ``dp_replicate``. A pipeline rank may hold several of the model's
stages (``stages_per_rank``): looped, ``p, p + pp, ...`` (interleaved 1F1B), or in a V, ``p`` and ``2 pp - 1 - p``
(zero-bubble ZBV), as torchtitan places them.

Example::

    layout = ParallelLayout(pp=2, dp_replicate=1, dp_shard=2, tp=2)
    layout.world_size, layout.dp          # (8, 2)
    layout.coordinates(5)                 # Coordinates(pp=1, dp_replicate=0, dp_shard=0, tp=1)
    ParallelLayout(pp=2, stages_per_rank=2, v_shape=True).stages(0)   # (0, 3): the first and the last
    rank_order(["a", "b", "a", "b"], tp=2)  # [0, 2, 1, 3]: each tp pair on one node
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Coordinates:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int


@dataclass(frozen=True)
class ParallelLayout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    stages_per_rank: int = 1
    v_shape: bool = False
    """Whether each pipeline rank's two stages mirror each other (``stages``), else they loop."""
    microbatches: int | None = None
    """The micro-batches each pipeline runs per step (the Controller keeps a step's count, and so their size,
    across re-plans); None: ``parallel.pp_microbatches``."""

    def __post_init__(self) -> None:
        if min(self.pp, self.dp_replicate, self.dp_shard, self.tp, self.stages_per_rank) < 1:
            raise ValueError(f"every degree of a layout must be positive, got {self}")
        if self.v_shape and self.stages_per_rank != 2:
            raise ValueError(f"a V places 2 stages on each pipeline rank, got {self}")

    @property
    def num_stages(self) -> int:
        """The stages the model is cut into."""
        return self.pp * self.stages_per_rank

    def stages(self, pp_rank: int) -> tuple[int, ...]:
        """The stages pipeline rank ``pp_rank`` holds, in order."""
        if self.v_shape:
            return pp_rank, 2 * self.pp - 1 - pp_rank
        return tuple(pp_rank + index * self.pp for index in range(self.stages_per_rank))

    @property
    def dp(self) -> int:
        """The data-parallel degree: the copies of the model that take different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coordinates(self, rank: int) -> Coordinates:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a layout of {self.world_size} ranks ({self})")
        rest, tp = divmod(rank, self.tp)
        rest, dp_shard = divmod(rest, self.dp_shard)
        pp, dp_replicate = divmod(rest, self.dp_replicate)
        return Coordinates(pp, dp_replicate, dp_shard, tp)

    def rank(self, at: Coordinates) -> int:
        return ((at.pp * self.dp_replicate + at.dp_replicate) * self.dp_shard + at.dp_shard) * self.tp + at.tp

    def data_rank(self, rank: int) -> int:
        """Which of the ``dp`` data-parallel ranks ``rank`` is: the share of each step's samples it takes, with the
        other ranks of its tp group (and pipeline)."""
        at = self.coordinates(rank)
        return at.dp_replicate * self.dp_shard + at.dp_shard

    def reports(self, rank: int) -> bool:
        """Whether ``rank`` reports its data-parallel rank's loss and samples: one rank of each tp group, the one
        holding the last pipeline stage (where the loss is)."""
        at = self.coordinates(rank)
        return at.tp == 0 and self.num_stages - 1 in self.stages(at.pp)

    def describe(self) -> str:
        """``pp2 x dp2 x tp2`` (``dp2 (2 copies)`` with HSDP's copies, ``pp2 (2 stages each)`` with several stages
        on each pipeline rank); the degrees of 1 left out."""
        copies = f" ({self.dp_replicate} copies)" if self.dp_replicate > 1 else ""
        shape = ", V" if self.v_shape else ""
        stages = f" ({self.stages_per_rank} stages each{shape})" if self.stages_per_rank > 1 else ""
        parts = [f"pp{self.pp}{stages}" if self.pp > 1 else "", f"dp{self.dp}{copies}" if self.dp > 1 else "",
                 f"tp{self.tp}" if self.tp > 1 else ""]
        return " x ".join(part for part in parts if part) or "dp1"

    def details(self) -> dict:
        """What an event says of the layout: ``describe()``, and through a pipeline its micro-batches per step."""
        return {"layout": self.describe(), **({"microbatches": self.microbatches} if self.pp > 1 else {})}


def rank_order(node_ids: Sequence[str], tp: int) -> list[int]:
    """The members (by their index in ``node_ids``, the node each runs on) in rank order, so that each tp group
    (``tp`` consecutive ranks) shares a node wherever the nodes' counts allow: every node's whole tp groups
    first, node after node in the order the nodes first appear, then the members left over."""
    if tp < 1:
        raise ValueError(f"tp must be positive, got {tp}")
    by_node: dict[str, list[int]] = {}
    for index, node in enumerate(node_ids):
        by_node.setdefault(node, []).append(index)
    whole, left_over = [], []
    for members in by_node.values():
        cut = len(members) - len(members) % tp
        whole += members[:cut]
        left_over += members[cut:]
    return whole + left_over


def in_place_order(previous: ParallelLayout | None, previous_ranks: Sequence[int | None], new: ParallelLayout,
                   node_ids: Sequence[str]) -> list[int]:
    """The members (by index; ``previous_ranks[i]``: member i's rank in the ``previous`` generation, None for one
    that was not in it) in rank order for ``new``, so that what each holds stays where it is: where the pipeline
    and tensor-parallel degrees stay, every whole old tp group takes a place of its own stage in ``new``, each
    member its old tp rank (its tp shard of its stage stays on it; the group shares a node as before). The other
    places go to the other members in ``rank_order``; the members left over are spares."""
    default = rank_order(node_ids, new.tp)
    if previous is None or (previous.pp, previous.tp, previous.stages_per_rank, previous.v_shape) != (
            new.pp, new.tp, new.stages_per_rank, new.v_shape):
        return default
    groups: dict[tuple[int, int], dict[int, int]] = {}
    for member, rank in enumerate(previous_ranks):
        if rank is not None and rank < previous.world_size:
            at = previous.coordinates(rank)
            groups.setdefault((at.pp, previous.data_rank(rank)), {})[at.tp] = member
    whole = {place: members for place, members in groups.items() if len(members) == new.tp}
    placed: dict[int, int] = {}  # new rank -> member
    for stage in range(new.pp):
        # the same data-parallel place where it exists (a zero2/3 shard stays), else a free one
        kept = sorted(place for place in whole if place[0] == stage)
        stays = [place for place in kept if place[1] < new.dp]
        free = [dp for dp in range(new.dp) if dp not in {place[1] for place in stays}]
        moves = [place for place in kept if place[1] >= new.dp]
        for dp, place in [(place[1], place) for place in stays] + list(zip(free, moves, strict=False)):
            first = new.rank(Coordinates(stage, dp // new.dp_shard, dp % new.dp_shard, 0))
            placed.update({first + tp: whole[place][tp] for tp in range(new.tp)})
    rest = iter(member for member in default if member not in placed.values())
    order = [placed[rank] if rank in placed else next(rest) for rank in range(new.world_size)]
    return order + list(rest)
