"""A second copy of every rank's shard of the sharded state, in the next rank's CPU memory.

With ``strategy.replicas`` 1, a ZeRO rank's shard exists nowhere else: without this copy, losing the rank
would send the run back to its last checkpoint. Gemini (SOSP'23) keeps such in-memory checkpoints in
peers' CPU memory; so does this. After every committed step each rank packs its shard of the state
(parameters, optimizer state, loss scale; strategies/shard_copy.py ``pack_shard``) into a CPU buffer and
sends it to its buddy, rank + 1 (mod the world size), receiving the shard of rank - 1, with gloo's
isend/irecv on a group of their own. The transfer runs on gloo's threads while the next step computes;
the step waits for it (``finish``) before its gradients are reduced. So no rank commits step k + 1 before
every rank holds its left neighbour's copy of step k, and when a rank is lost, its buddy holds its shard
of step k while the survivors hold step k or k + 1: at most one committed step is lost.

What a rank holds, in host memory: its own shard at the last two steps committed (the older one goes
once the next step commits, when every rank is known to hold step k's copies), its left neighbour's
newest complete copy, and the one being received: up to four buffers the size of its shard, reused
from step to step.

Example (the step loop: ``start`` after every commit, ``finish`` before every step's gradient reduction)::

    copies = BuddyCopies(group=buddy_group, layout=state.layout, generation=4, timeout_s=30)
    copies.start(strategy, state, scaler, step=120)  # snapshot this rank's shard; the exchange posted
    ...                                              # step 121's forward
    copies.finish()                                  # step 120's exchange done (raises if a neighbour is lost)
    copies.kept()                                    # [KeptShards, ...]: what this rank reports when it leaves
    copies.close()                                   # before the group goes
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from raylastic.strategies.base import Strategy, TrainState, scaler_entries
from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.strategies.peer_restore import ShardCopy
from raylastic.strategies.plain_objects import all_gather_plain
from raylastic.strategies.region_copy import (
    KeptRegions,
    RegionPacker,
    entries_from_plain,
    plain_entries,
    region_packed_size,
    unpack_regions,
)
from raylastic.strategies.region_plan import RegionCopy
from raylastic.strategies.shard_copy import (
    KeptShards,
    ShardPacker,
    local_storage,
    packed_size,
    shard_state,
    unpack_shard,
)
from raylastic.strategies.shard_layout import ShardLayout

logger = logging.getLogger(__name__)


@dataclass
class _Snapshot:
    """One rank's packed shard at a committed step."""

    step: int
    entries: dict[str, Any]
    buffer: torch.Tensor


@dataclass
class _Exchange:
    step: int
    entries: dict[str, Any]
    receiving: torch.Tensor
    works: list[Any]


class BuddyCopies:
    def __init__(self, *, group: dist.ProcessGroup, layout: ShardLayout, generation: int, timeout_s: float,
                 pin_memory: bool = False) -> None:
        """``group``: a gloo group of this generation used for nothing else; ``pin_memory``: page-locked
        buffers, for copies from a GPU that overlap with its work."""
        assert layout.replicas == 1 and layout.world_size > 1, f"a buddy copy is for one copy of the state: {layout}"
        self.group = group
        self.layout = layout
        self.generation = generation
        self.timeout = timedelta(seconds=timeout_s)
        self.pin_memory = pin_memory
        world_size = layout.world_size
        self.right = (layout.rank + 1) % world_size
        self.left = ShardLayout(world_size=world_size, replicas=1, rank=(layout.rank - 1) % world_size)
        self.inherited: list[KeptShards] = []
        """Copies of an earlier generation, kept until this one's first exchange has completed."""
        self._own: list[_Snapshot] = []
        """This rank's packed shard at its last two committed steps, newest last."""
        self._received: _Snapshot | None = None
        """The left neighbour's newest complete copy."""
        self._in_flight: _Exchange | None = None
        self._packed_by: tuple[int | None, ShardPacker] | None = None
        """(the optimizer state's size it was made for, or None: made anew each step; the packer)."""
        self._free_own: list[torch.Tensor] = []
        self._free_received: list[torch.Tensor] = []

    def start(self, strategy: Strategy, state: TrainState, scaler: torch.amp.GradScaler | None, step: int) -> None:
        """After step ``step`` was committed (or the generation's state set up at it): snapshot this rank's shard
        and post its exchange; nothing at step 0, which every rank rebuilds from the seed."""
        self.finish()
        if step == 0 or getattr(state.optimizer, "stepping", False):
            return
        packer = self._packer(strategy, state, scaler, step)
        if packer is None:
            return
        for older in self._own[:-1]:  # step k committed: every rank holds its neighbour's copy of step k - 1
            self._free_own.append(older.buffer)
        self._own = self._own[-1:]
        own = self._buffer(self._free_own, packer.size)
        packer.pack(own, fresh=scaler_entries(scaler))
        self._own.append(_Snapshot(step, packer.entries, own))
        receiving = self._buffer(self._free_received, self._received_size(packer))
        works = [dist.isend(own, group=self.group, group_dst=self.right),
                 dist.irecv(receiving, group=self.group, group_src=self.left.rank)]
        self._in_flight = _Exchange(step, self._left_entries(packer), receiving, works)

    def _packer(self, strategy: Strategy, state: TrainState, scaler: torch.amp.GradScaler | None, step: int
                ) -> ShardPacker | None:
        """The packer of this state: made again only when the optimizer's state grew (built late for a parameter
        that had no gradient before), or every step where the strategy's state dict holds copies, not the live
        tensors (then the views would not follow the training)."""
        optimizer = getattr(state.optimizer, "inner", state.optimizer)
        signature = sum(len(per_parameter) for per_parameter in optimizer.state.values())
        if self._packed_by is None or self._packed_by[0] != signature:
            flat = shard_state(strategy, state, scaler, step)
            if flat is None:
                return None
            again = strategy.state_dict(state)
            live = all(local_storage(value) == local_storage(flat[key]) for key, value in again.items())
            self._packed_by = (signature if live else None, self._new_packer(flat))
        return self._packed_by[1]

    def _new_packer(self, flat: dict[str, torch.Tensor]) -> ShardPacker:
        return ShardPacker(flat, self.layout)

    def _received_size(self, packer: ShardPacker) -> int:
        """Bytes of the left neighbour's packed copy."""
        return packed_size(packer.entries, self.layout.world_size, self.left.rank)

    def _left_entries(self, packer: ShardPacker) -> dict[str, Any]:
        """What the left neighbour's packed copy holds (every rank packs the same entries' rows)."""
        return packer.entries

    def finish(self) -> None:
        """Wait for the exchange in flight (up to the group's timeout); raises when a neighbour is lost."""
        exchange, self._in_flight = self._in_flight, None
        if exchange is None:
            return
        for work in exchange.works:  # on an error the buffer being received goes with the exchange
            work.wait(self.timeout)
        if self._received is not None:
            self._free_received.append(self._received.buffer)
        self._received = _Snapshot(exchange.step, exchange.entries, exchange.receiving)
        self.inherited = []

    def close(self) -> None:
        """Before the group goes: let an exchange in flight end; one that fails leaves the copies made before."""
        try:
            self.finish()
        except Exception as error:  # noqa: BLE001 - a neighbour lost: the run recovers from what is held
            logger.info("the last shard exchange did not complete: %s", error)

    def kept(self) -> list[KeptShards]:
        """Every copy this rank holds: its own shard at its last two steps, its left neighbour's newest, and an
        earlier generation's copies while this one has completed no exchange."""
        own = [self._kept(snapshot, "own") for snapshot in self._own]
        received = [self._kept(self._received, "buddy")] if self._received is not None else []
        return own + received + self.inherited

    def host_bytes(self) -> int:
        """Host memory the copies hold now (buffers kept for reuse included)."""
        buffers = [s.buffer for s in self._own] + self._free_own + self._free_received
        buffers += [self._received.buffer] if self._received is not None else []
        buffers += [self._in_flight.receiving] if self._in_flight is not None else []
        return sum(buffer.numel() for buffer in buffers)

    def _kept(self, snapshot: _Snapshot, holder: str) -> KeptShards:
        layout = self.layout if holder == "own" else self.left
        copy = ShardCopy(generation=self.generation, world_size=layout.world_size, replicas=1, rank=layout.rank,
                         step=snapshot.step, holder=holder)
        return KeptShards(copy=copy, entries=snapshot.entries, rows=unpack_shard(snapshot.entries, snapshot.buffer,
                                                                                 layout))

    def _buffer(self, free: list[torch.Tensor], size: int) -> torch.Tensor:
        """A byte buffer of ``size`` bytes: a free one of that size, or a new one."""
        for index, buffer in enumerate(free):
            if buffer.numel() == size:
                return free.pop(index)
        free.clear()  # the state's shape changed (an optimizer's state built late): the old sizes are no use
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)


class RegionBuddyCopies(BuddyCopies):
    """Under model parallelism: the copy is the rank's part of the state (each entry's region it holds:
    strategies/region_copy.py), which only it knows; the ranks tell each other what their parts hold when they
    build their packers (at the generation's first copy, and again where a rank's optimizer state grew: every
    rank at the same step, as a step's optimizer state grows on all of them). ``layout``: the generation's."""

    def __init__(self, *, group: dist.ProcessGroup, layout: ParallelLayout, rank: int, generation: int,
                 timeout_s: float, pin_memory: bool = False) -> None:
        super().__init__(group=group, layout=ShardLayout(world_size=layout.world_size, replicas=1, rank=rank),
                         generation=generation, timeout_s=timeout_s, pin_memory=pin_memory)
        self.parallel = layout
        self._left: dict[str, Any] = {}

    def _new_packer(self, flat: dict[str, torch.Tensor]) -> RegionPacker:
        packer = RegionPacker(flat)
        everyone = all_gather_plain(plain_entries(packer.entries), group=self.group)
        self._left = entries_from_plain(everyone[self.left.rank])
        return packer

    def _received_size(self, packer: RegionPacker) -> int:
        return region_packed_size(self._left)

    def _left_entries(self, packer: RegionPacker) -> dict[str, Any]:
        return self._left

    def _kept(self, snapshot: _Snapshot, holder: str) -> KeptRegions:
        rank = self.layout.rank if holder == "own" else self.left.rank
        copy = RegionCopy(generation=self.generation, layout=self.parallel, rank=rank, step=snapshot.step,
                          holder=holder)
        return KeptRegions(copy=copy, parts=unpack_regions(snapshot.entries, snapshot.buffer))
