"""Which survivor sends which piece of a model-parallel state: the plan of an in-memory restore across layouts.

Under tensor and pipeline parallelism a rank's part of the state is a region of each entry it holds (its stage's
entries, its tp and data-parallel shard of each). Before leaving a generation each worker keeps a CPU copy of
its part (strategies/region_copy.py) and reports it as a ``RegionCopy``. The ranks that differ only in their
``dp_replicate`` coordinate (ddp's copies and HSDP's) hold the same part, so the state is whole when one copy
of every ``(pp, dp_shard, tp)`` piece of the old layout survives. ``plan_region_restore`` picks, for every
piece, the new rank that sends it; each new rank then receives, of the pieces it lacks, only the regions its
place in the new layout covers. Pure: no torch, no Ray.

Example (the Controller, after ``form()``; a (pp2, dp2) generation lost old rank 1, piece (0, 0, 0) survives
on old rank 0, which is new rank 0)::

    layout = ParallelLayout(pp=2, dp_replicate=2)
    plan = plan_region_restore([[RegionCopy(3, layout, old, 40)] for old in (0, 2, 3)])
    plan.senders        # {(0, 0, 0): 0, (1, 0, 0): 1}: pieces by (pp, dp_shard, tp) -> new rank
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from raylastic.strategies.parallel_layout import ParallelLayout

Piece = tuple[int, int, int]
"""A part of a layout's state: the (pp, dp_shard, tp) coordinates of the ranks that hold it."""


@dataclass(frozen=True)
class RegionCopy:
    """What one worker keeps of a model-parallel generation's state: its part, at a committed step."""

    generation: int
    layout: ParallelLayout
    rank: int
    """The rank in that generation whose part this is."""
    step: int
    holder: Literal["own", "buddy"] = "own"
    """Whose copy it is: the rank's own, or the one its buddy received from it (strategies/buddy_copy.py)."""

    @property
    def piece(self) -> Piece:
        at = self.layout.coordinates(self.rank)
        return at.pp, at.dp_shard, at.tp


@dataclass(frozen=True)
class RegionRestorePlan:
    """Every piece of one old layout's state, each with the new rank that sends it."""

    generation: int
    layout: ParallelLayout
    step: int
    """The step every rank holds after the restore."""
    senders: dict[Piece, int]
    from_buddies: tuple[Piece, ...] = ()
    """The pieces whose only surviving copy is a buddy's."""
    deliveries: dict[int, tuple[tuple[int, RegionCopy], ...]] = field(default_factory=dict)
    """New rank -> the copies it is handed before the restore (by the worker ``holdings[index]`` lists, one the
    layout set aside as a spare), of the pieces no member holds; it sends them on."""


@dataclass(frozen=True)
class RestoreTraffic:
    """What one rank received in a restore."""

    bytes_received: int
    senders: tuple[int, ...]
    """The new ranks it received from."""


def pieces_of(layout: ParallelLayout) -> list[Piece]:
    return [(pp, shard, tp) for pp in range(layout.pp) for shard in range(layout.dp_shard) for tp in range(layout.tp)]


def plan_region_restore(holdings: Sequence[Sequence[RegionCopy]], members: int | None = None
                        ) -> RegionRestorePlan | None:
    """The plan that restores the newest complete state the workers hold (the highest step, then the newest
    generation), or None if no state has a copy of every piece. ``holdings[index]``: the copies that worker
    reported (none: a new worker); the first ``members`` (all, if None) are the new group's ranks, the others
    spares the new layout left out. A piece's holder is the lowest index holding its own copy of it, else the
    lowest holding a buddy's; a piece only spares hold is handed to a member (in turn), which sends it."""
    members = len(holdings) if members is None else members
    states: dict[tuple[int, int, ParallelLayout], dict[Piece, tuple[bool, int, RegionCopy]]] = {}
    for index, copies in enumerate(holdings):
        for copy in copies:
            holders = states.setdefault((copy.step, copy.generation, copy.layout), {})
            candidate = (copy.holder == "buddy", index, copy)
            holders[copy.piece] = min(holders.get(copy.piece, candidate), candidate, key=lambda c: c[:2])
    complete = [(key, holders) for key, holders in states.items() if len(holders) == len(pieces_of(key[2]))]
    if not complete or members == 0:
        return None
    (step, generation, layout), holders = max(complete, key=lambda item: item[0][:2])
    pieces = pieces_of(layout)
    senders, deliveries = {}, {}
    for piece in pieces:
        _, index, copy = holders[piece]
        if index >= members:
            receiver = sum(len(handed) for handed in deliveries.values()) % members
            deliveries[receiver] = (*deliveries.get(receiver, ()), (index, copy))
            index = receiver
        senders[piece] = index
    return RegionRestorePlan(generation=generation, layout=layout, step=step, senders=senders,
                             from_buddies=tuple(piece for piece in pieces if holders[piece][0]), deliveries=deliveries)
