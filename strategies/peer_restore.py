"""Which survivor sends which shard: the plan of an in-memory restore of sharded state.

When a sharded worker (zero1/zero2/zero3) joins a new generation it keeps, in CPU memory, its shard
of the old generation's state (strategies/shard_copy.py), and, with one copy of the state (replicas 1),
the copies its buddy exchange made (strategies/buddy_copy.py): its own shard at the last two steps and
its left neighbour's at the newest step received. It reports what it holds as ``ShardCopy``s.
``plan_peer_restore`` reads the reports of the new group, in new-rank order, and picks for every shard of
the old layout one new rank that holds it; ``TrainWorker.restore_from_peers`` then runs the plan on every
rank. Pure: no torch.distributed, no Ray.

With ``strategy.replicas`` R, each shard has R copies (strategies/shard_layout.py), so a loss of up
to R - 1 workers (any R - 1 ranks, or more where they hold different shards) leaves a plan; at R = 1
the buddy copies leave one unless a rank and its buddy (the next rank) are lost together. No plan
(None): the state comes from a checkpoint.

Example (the Controller, after ``form()``)::

    plan = plan_peer_restore([report.shard_copies for report in reports])
    if plan is not None:
        group.restore_from_peers(plan)   # every rank takes its shards from the copies the plan names
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from raylastic.strategies.shard_layout import ShardLayout


@dataclass(frozen=True)
class ShardCopy:
    """What one worker keeps of a generation's sharded state: its part of the layout, at a committed step."""

    generation: int
    """The generation the copy was made in."""
    world_size: int
    """That generation's world size, and its effective replica count (``effective_replicas``)."""
    replicas: int
    rank: int
    """The rank in that generation whose shard this is: shard ``rank % (world_size // replicas)``."""
    step: int
    """Committed optimizer steps in the copy."""
    holder: Literal["own", "buddy"] = "own"
    """Whose copy it is: the rank's own, or the one its buddy received from it."""

    @property
    def layout(self) -> ShardLayout:
        return ShardLayout(world_size=self.world_size, replicas=self.replicas, rank=self.rank)


@dataclass(frozen=True)
class PeerRestorePlan:
    """Every shard of one old layout, each with the new rank that sends it."""

    generation: int
    world_size: int
    replicas: int
    """The old layout: ``world_size // replicas`` shards."""
    step: int
    """The step every rank holds after the restore."""
    senders: tuple[int, ...]
    """``senders[shard]``: the new rank that sends that shard of the old layout to the whole group."""
    from_buddies: tuple[int, ...] = ()
    """The shards whose only surviving copy is a buddy's (their own rank was lost)."""

    @property
    def num_shards(self) -> int:
        return len(self.senders)


def plan_peer_restore(holdings: Sequence[Sequence[ShardCopy]]) -> PeerRestorePlan | None:
    """A plan that restores the newest complete state the new group holds, or None if it holds none.

    ``holdings[new_rank]``: the copies that rank reported (none: a new worker). Copies of one old layout
    at one step form a state; it is complete when every shard has a copy. Ranks may have ended the old
    generation one step apart (a peer lost at the end of a step), so the copies may disagree: the complete
    state of the highest step is taken (then of the newest generation), and ranks that hold another only
    receive. A shard's sender is the lowest new rank that holds its own copy of it, else the lowest that
    holds a buddy's.

    Example::

        copies = [[ShardCopy(0, 4, 2, rank, 7)] for rank in (0, 2, 3)]   # old rank 1 lost: shard 1 on rank 3
        plan_peer_restore(copies)    # PeerRestorePlan(generation=0, world_size=4, replicas=2, step=7,
                                     #                 senders=(0, 2))
        plan_peer_restore([copies[0], copies[1], []])                     # shard 1 lost: None
    """
    holders: dict[tuple[int, int, int, int], dict[int, tuple[bool, int]]] = {}
    """(step, generation, world_size, replicas) -> {shard: (is a buddy's copy, lowest new rank holding it)}"""
    owners: dict[tuple[int, int, int, str], int] = {}
    for new_rank, copies in enumerate(holdings):
        for copy in copies:
            key = (copy.generation, copy.rank, copy.step, copy.holder)
            owner = owners.setdefault(key, new_rank)
            assert owner == new_rank, f"new ranks {owner} and {new_rank} both report rank {copy.rank} of {copy}"
            state = holders.setdefault((copy.step, copy.generation, copy.world_size, copy.replicas), {})
            candidate = (copy.holder == "buddy", new_rank)
            shard = copy.layout.shard
            state[shard] = min(state.get(shard, candidate), candidate)
    complete = [(key, shards) for key, shards in holders.items() if len(shards) == key[2] // key[3]]
    if not complete:
        return None
    (step, generation, world_size, replicas), shards = max(complete, key=lambda item: item[0][:2])
    return PeerRestorePlan(generation=generation, world_size=world_size, replicas=replicas, step=step,
                           senders=tuple(shards[shard][1] for shard in range(len(shards))),
                           from_buddies=tuple(shard for shard in range(len(shards)) if shards[shard][0]))
