"""A second copy of every rank's shard of the sharded state, in the next rank's CPU memory.

With ``strategy.replicas`` 1, a ZeRO rank's shard exists nowhere else: without this copy, losing the rank
would send the run back to its last checkpoint. Gemini (SOSP'23) keeps such in-memory checkpoints in
peers' CPU memory; so does this. After every committed step each rank packs its shard of the state
(parameters, optimizer state, loss scale; strategies/shard_copy.py ``pack_shard``) into a CPU buffer and
sends it to its buddy, rank + 1 (mod the world size), receiving the shard of rank - 1, with gloo's
isend/irecv on a group of their own. The training thread only queues the snapshot (strategies/host_copies.py:
on a GPU into pinned memory on a side stream, the next step's kernels queued meanwhile; on CPU a memcpy) and
goes on: a thread of the exchange posts the receive, waits for the snapshot to be in host memory and posts
the send, and gloo's threads move the bytes while the next step computes. The step waits for the exchange
(``finish``, bounded by the group's timeout) before its gradients are reduced, and so before its optimizer
changes what was copied; a snapshot whose copy did not complete is dropped. So no rank commits step k + 1 before
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
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from raylastic.strategies.base import Strategy, TrainState, scaler_entries
from raylastic.strategies.host_copies import BufferPool, HostCopier, PendingCopy, source_device
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

POST_SLACK_S = 5.0
"""Beyond the group's timeout (which bounds the wait for the snapshot's copy), how long ``finish`` waits for the
exchange's thread to post the send."""


@dataclass(frozen=True)
class _Packing:
    """How this state is packed, and what the left neighbour's copy holds; made again when the state changes."""

    packer: ShardPacker | RegionPacker
    signature: int | None
    """The optimizer state's size it was made for, or None: made anew each step."""
    received_size: int
    left_entries: dict[str, Any]
    ordered: frozenset[str]
    """Keys the next step's forward may change in place (``changed_by_forward``)."""
    device: torch.device
    """Where the state is (a GPU's: pinned buffers and a side stream)."""


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
    copied: PendingCopy
    """This rank's snapshot of ``step`` reaching host memory (on a GPU: the side stream's copy)."""
    posted: Future
    """The sender thread's [receive, send] works, once the snapshot is complete and the send is posted."""
    given_up: threading.Event


class BuddyCopies:
    def __init__(self, *, group: dist.ProcessGroup, layout: ShardLayout, generation: int, timeout_s: float) -> None:
        """``group``: a gloo group of this generation used for nothing else. Host buffers are pinned, and copied
        into on a side stream, where the state is on a GPU (strategies/host_copies.py)."""
        assert layout.replicas == 1 and layout.world_size > 1, f"a buddy copy is for one copy of the state: {layout}"
        self.group = group
        self.layout = layout
        self.generation = generation
        self.timeout = timedelta(seconds=timeout_s)
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
        self._packed_by: _Packing | None = None
        self._copier: HostCopier | None = None
        """Made for the device the state is on, at the first copy."""
        self._received_pool: BufferPool | None = None
        self._exchanging = ThreadPoolExecutor(max_workers=1, thread_name_prefix="buddy-copy-exchange")
        """The thread that posts each exchange (one thread kept: starting one costs the step a wait)."""

    def start(self, strategy: Strategy, state: TrainState, scaler: torch.amp.GradScaler | None, step: int) -> None:
        """After step ``step`` was committed (or the generation's state set up at it): snapshot this rank's shard
        and post its exchange; nothing at step 0, which every rank rebuilds from the seed. The training thread
        only queues the snapshot (on CPU: copies it, as a memcpy) and goes on with the next step: a thread of
        the exchange posts the send once the snapshot is in host memory."""
        self.finish()
        if step == 0 or getattr(state.optimizer, "stepping", False):
            return
        packing = self._packer(strategy, state, scaler, step)
        if packing is None:
            return
        copier = self._copier_for(packing)
        for older in self._own[:-1]:  # step k committed: every rank holds its neighbour's copy of step k - 1
            copier.pool.give_back(older.buffer)
        self._own = self._own[-1:]
        own = copier.pool.take(packing.packer.size)
        copied = packing.packer.pack(own, fresh=scaler_sources(scaler), copier=copier, ordered=packing.ordered)
        self._own.append(_Snapshot(step, packing.packer.entries, own))
        receiving = self._received_pool.take(packing.received_size)
        given_up = threading.Event()
        posted = self._exchanging.submit(self._post, own, receiving, copied, given_up)
        self._in_flight = _Exchange(step, packing.left_entries, receiving, copied, posted, given_up)

    def _post(self, own: torch.Tensor, receiving: torch.Tensor, copied: PendingCopy, given_up: threading.Event
              ) -> list[Any]:
        """On the exchange's thread: the receive at once, the send when the snapshot is complete."""
        works = [dist.irecv(receiving, group=self.group, group_src=self.left.rank)]
        copied.wait(self.timeout.total_seconds())
        if not given_up.is_set():  # finish gave up on this exchange: its group may be gone
            works.append(dist.isend(own, group=self.group, group_dst=self.right))
        return works

    def _copier_for(self, packing: _Packing) -> HostCopier:
        if self._copier is None:
            self._copier = HostCopier(packing.device)
            self._received_pool = BufferPool(pinned=False)  # gloo writes it; no device reads it
        return self._copier

    def _packer(self, strategy: Strategy, state: TrainState, scaler: torch.amp.GradScaler | None, step: int
                ) -> _Packing | None:
        """The packer of this state: made again only when the optimizer's state grew (built late for a parameter
        that had no gradient before), or every step where the strategy's state dict holds copies, not the live
        tensors (then the views would not follow the training)."""
        optimizer = getattr(state.optimizer, "inner", state.optimizer)
        signature = sum(len(per_parameter) for per_parameter in optimizer.state.values())
        if self._packed_by is None or self._packed_by.signature != signature:
            flat = shard_state(strategy, state, scaler, step)
            if flat is None:
                return None
            again = strategy.state_dict(state)
            live = all(local_storage(value) == local_storage(flat[key]) for key, value in again.items())
            packer = self._new_packer(flat)
            self._packed_by = _Packing(packer=packer, signature=signature if live else None,
                                       received_size=self._received_size(packer),
                                       left_entries=self._left_entries(packer),
                                       ordered=changed_by_forward(flat, state.model),
                                       device=source_device(list(flat.values())))
        return self._packed_by

    def _new_packer(self, flat: dict[str, torch.Tensor]) -> ShardPacker:
        return ShardPacker(flat, self.layout)

    def _received_size(self, packer: ShardPacker) -> int:
        """Bytes of the left neighbour's packed copy."""
        return packed_size(packer.entries, self.layout.world_size, self.left.rank)

    def _left_entries(self, packer: ShardPacker) -> dict[str, Any]:
        """What the left neighbour's packed copy holds (every rank packs the same entries' rows)."""
        return packer.entries

    def finish(self) -> None:
        """Wait for the exchange in flight: this rank's snapshot in host memory and its send posted, then the
        send and the receive done (each up to the group's timeout); raises when a neighbour is lost. A snapshot
        whose copy did not complete is dropped: only complete copies are kept."""
        exchange, self._in_flight = self._in_flight, None
        if exchange is None:
            return
        try:
            works = exchange.posted.result(timeout=self.timeout.total_seconds() + POST_SLACK_S)
        except BaseException:
            exchange.given_up.set()
            if not exchange.copied.done():
                self._own = [snapshot for snapshot in self._own if snapshot.step != exchange.step]
            raise
        for work in works:  # on an error the buffer being received goes with the exchange
            work.wait(self.timeout)
        if self._received is not None:
            self._received_pool.give_back(self._received.buffer)
        self._received = _Snapshot(exchange.step, exchange.entries, exchange.receiving)
        self.inherited = []

    def close(self) -> None:
        """Before the group goes: let an exchange in flight end; one that fails leaves the copies made before."""
        try:
            self.finish()
        except Exception as error:  # noqa: BLE001 - a neighbour lost: the run recovers from what is held
            logger.info("the last shard exchange did not complete: %s", error)
        self._exchanging.shutdown(wait=False)

    def kept(self) -> list[KeptShards]:
        """Every copy this rank holds: its own shard at its last two steps, its left neighbour's newest, and an
        earlier generation's copies while this one has completed no exchange (``close`` first: a snapshot
        still being copied is left out)."""
        exchange = self._in_flight
        complete = [s for s in self._own if exchange is None or exchange.copied.done() or s.step != exchange.step]
        own = [self._kept(snapshot, "own") for snapshot in complete]
        received = [self._kept(self._received, "buddy")] if self._received is not None else []
        return own + received + self.inherited

    def host_bytes(self) -> int:
        """Host memory the copies hold now (buffers kept for reuse included)."""
        buffers = [s.buffer for s in self._own]
        buffers += [self._received.buffer] if self._received is not None else []
        buffers += [self._in_flight.receiving] if self._in_flight is not None else []
        pools = [self._copier.pool, self._received_pool] if self._copier is not None else []
        return sum(buffer.numel() for buffer in buffers) + sum(pool.nbytes() for pool in pools)

    def _kept(self, snapshot: _Snapshot, holder: str) -> KeptShards:
        layout = self.layout if holder == "own" else self.left
        copy = ShardCopy(generation=self.generation, world_size=layout.world_size, replicas=1, rank=layout.rank,
                         step=snapshot.step, holder=holder)
        return KeptShards(copy=copy, entries=snapshot.entries, rows=unpack_shard(snapshot.entries, snapshot.buffer,
                                                                                 layout))


def changed_by_forward(flat: dict[str, torch.Tensor], model: torch.nn.Module) -> frozenset[str]:
    """The entries of ``flat`` that a forward may change in place: the model's that are not its parameters
    (BatchNorm's running statistics); parameters and optimizer state change only in the optimizer's step."""
    parameters = {local_storage(parameter) for parameter in model.parameters()}
    return frozenset(key for key, value in flat.items()
                     if not key.startswith("optim.") and local_storage(value) not in parameters)


def scaler_sources(scaler: torch.amp.GradScaler | None) -> dict[str, torch.Tensor]:
    """The loss scaler's entries (``scaler_entries``' keys and dtypes) made on its device: its ``state_dict``
    reads them back to the host, which would wait for the device to finish the step's kernels."""
    scale, tracker = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
    if scaler is None or not isinstance(scale, torch.Tensor) or not isinstance(tracker, torch.Tensor):
        return scaler_entries(scaler)  # none, or a scaler that has not scaled yet: its state_dict reads nothing
    return {"scaler.scale": scale.detach().reshape(()).to(torch.float64),
            "scaler.growth_tracker": tracker.detach().reshape(()).to(torch.int64)}


class RegionBuddyCopies(BuddyCopies):
    """Under model parallelism: the copy is the rank's part of the state (each entry's region it holds:
    strategies/region_copy.py), which only it knows; the ranks tell each other what their parts hold when they
    build their packers (at the generation's first copy, and again where a rank's optimizer state grew: every
    rank at the same step, as a step's optimizer state grows on all of them). ``layout``: the generation's."""

    def __init__(self, *, group: dist.ProcessGroup, layout: ParallelLayout, rank: int, generation: int,
                 timeout_s: float) -> None:
        super().__init__(group=group, layout=ShardLayout(world_size=layout.world_size, replicas=1, rank=rank),
                         generation=generation, timeout_s=timeout_s)
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
