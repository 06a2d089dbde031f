"""A worker's CPU copies of shards of the sharded state, and the collective that rebuilds the state from
the copies of a new group's ranks (the plan is strategies/peer_restore.py's).

What a rank keeps is its shard of every entry of the canonical flat state dict (strategies/base.py,
with the fp16 scaler's entries): rows ``row_bounds(rows, num_shards, shard)`` of dim 0, whether the live
entry is a DTensor sharded that way (FSDP2's parameters and optimizer state, zero1's optimizer state)
or a plain tensor every rank holds whole (zero1's parameters: a rank keeps its rows of them only).
A 0-dim entry (Adam's step, the scaler's scale) belongs to shard 0. So the copies of a layout's
shards, put side by side, are the whole state, whatever the strategy.

A copy is made when a worker leaves a generation (``keep_shards``), or after every step into one byte
buffer (``pack_shard``; strategies/buddy_copy.py sends it to the next rank, which reads it back with
``unpack_shard``): each entry's rows lie at an aligned offset, so the rows are views of the buffer.

Restoring: each shard of the old layout is broadcast by its sender over the new group (one flat
buffer per dtype), every rank assembles the whole state in CPU memory (one full copy per rank, for
the time of the restore), and takes from it what the new layout gives it, as a checkpoint load
would: the same ``Strategy.load_state_dict``, so any world size, replica count and zero stage loads.

Example (TrainWorker's ``join`` and ``restore_from_peers``)::

    kept = keep_shards(strategy, state, scaler, generation=3, step=120)      # before leaving generation 3
    ...                                                                       # join generation 4, set up
    full = gather_shards([kept], plan, group=checkpoint_group)                # collective
    load_full_state(strategy, new_state, scaler, full)
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from raylastic.strategies.base import Strategy, TrainState, init_optimizer_state, scaler_entries, set_scaler
from raylastic.strategies.host_copies import HostCopier, PendingCopy, copy_now
from raylastic.strategies.peer_restore import PeerRestorePlan, ShardCopy
from raylastic.strategies.plain_objects import broadcast_plain, dtype_name, dtype_of
from raylastic.strategies.shard_layout import ShardLayout, row_bounds

logger = logging.getLogger(__name__)

PACK_ALIGNMENT = 16
"""Bytes: where each entry of a packed shard starts (a multiple of every dtype's size)."""
KEEP_TIMEOUT_S = 120.0
"""How long a worker leaving a generation waits for its device's copy of its shard."""


@dataclass(frozen=True)
class _Entry:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class KeptShards:
    """A copy of one rank's shard of a generation's state, in CPU memory (kept by that rank or its buddy)."""

    copy: ShardCopy
    """What it is: the generation's layout, the place in it of the rank whose shard it is, the step."""
    entries: dict[str, _Entry]
    """Every entry of the whole state: its full shape and dtype."""
    rows: dict[str, torch.Tensor]
    """This shard's rows of each entry (0-dim entries in shard 0 only)."""


def keep_shards(strategy: Strategy, state: TrainState, scaler: torch.amp.GradScaler | None, *, generation: int,
                step: int, timeout_s: float = KEEP_TIMEOUT_S) -> KeptShards | None:
    """A CPU copy of this rank's shard of ``state`` (committed ``step`` steps, in ``generation``). None at step
    0 (every rank rebuilds that state from the seed; an optimizer's state is not built yet) and when the state
    is not one step's: zero1 lost a peer while gathering an update (``ShardedOptimizer.stepping``). From a GPU
    into one pinned buffer, the copies queued together and waited for once (up to ``timeout_s``)."""
    assert state.layout is not None, f"{strategy.name} keeps no shard layout"
    flat = shard_state(strategy, state, scaler, step)
    if flat is None:
        return None
    layout = state.layout
    packer = ShardPacker(flat, layout)
    copier = HostCopier.for_tensors(list(flat.values()))
    buffer = copier.pool.take(packer.size)
    packer.pack(buffer, copier=copier).wait(timeout_s)
    copy = ShardCopy(generation=generation, world_size=layout.world_size, replicas=layout.replicas,
                     rank=layout.rank, step=step)
    return KeptShards(copy=copy, entries=packer.entries, rows=unpack_shard(packer.entries, buffer, layout))


def shard_state(strategy: Strategy, state: TrainState, scaler: torch.amp.GradScaler | None, step: int
                ) -> dict[str, torch.Tensor] | None:
    """The flat state a copy is made of (the strategy's entries and the scaler's), or None when no copy can
    be made of it: at step 0, from a zero1 update cut short, or with an entry that is not a tensor."""
    if step == 0 or getattr(state.optimizer, "stepping", False):
        return None
    flat = {**strategy.state_dict(state), **scaler_entries(scaler)}
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            logger.warning("no copy of the sharded state is kept in memory: its entry %r is a %s, not a tensor "
                           "(a lost worker's shard then comes from a checkpoint)", key, type(value).__name__)
            return None
    return flat


def entries_of(flat: dict[str, torch.Tensor]) -> dict[str, _Entry]:
    """Every entry's full shape and dtype, in the order the packed shards list them."""
    return {key: _Entry(tuple(flat[key].shape), flat[key].dtype) for key in sorted(flat)}


def packed_size(entries: dict[str, _Entry], num_shards: int, shard: int) -> int:
    """Bytes of ``shard``'s rows of every entry, packed (``pack_shard``)."""
    parts = _packed_parts(entries, num_shards, shard)
    return parts[-1][1] + parts[-1][2] if parts else 0


class ShardPacker:
    """This rank's shard of a flat state, packed into a byte buffer again and again (``pack_shard``'s layout):
    the rows of every entry, as views of the live tensors, and where each goes in a buffer are worked out
    once - a DTensor's offsets and the views cost more than copying a small shard does. Valid while the live
    tensors are updated in place (an optimizer's step, FSDP's sharded parameters), not replaced."""

    def __init__(self, flat: dict[str, torch.Tensor], layout: ShardLayout) -> None:
        self.layout = layout
        self.entries = entries_of(flat)
        self.size = packed_size(self.entries, layout.num_shards, layout.shard)
        self._parts = [(key, offset, nbytes, _local_rows(flat[key], layout))
                       for key, offset, nbytes in _packed_parts(self.entries, layout.num_shards, layout.shard)]
        self._targets: dict[tuple[int, int], list[torch.Tensor]] = {}
        """(a buffer's address, size) -> the views of it that the parts are copied into."""

    def pack(self, out: torch.Tensor, fresh: dict[str, torch.Tensor] | None = None, copier: HostCopier | None = None,
             ordered: Collection[str] = ()) -> PendingCopy:
        """Copy the rows into ``out`` (``self.size`` bytes) with ``copier`` (None: a plain copy, done on return);
        entries of ``fresh`` (the loss scaler's, which are copies made anew) are taken from there; ``ordered``:
        the keys the next step's forward may change in place (strategies/host_copies.py). From a GPU, without a
        whole shard's temporary there."""
        key_of_buffer = (out.data_ptr(), out.numel())
        if key_of_buffer not in self._targets:
            if len(self._targets) > 4:  # buffers come and go: keep the views of the few in use
                self._targets.clear()
            self._targets[key_of_buffer] = [out[offset:offset + nbytes].view(rows.dtype).view(rows.shape)
                                            for _, offset, nbytes, rows in self._parts]
        pairs, first = [], []
        for (key, _, _, rows), target in zip(self._parts, self._targets[key_of_buffer], strict=True):
            source = _local_rows(fresh[key], self.layout) if fresh and key in fresh else rows
            (first if key in ordered else pairs).append((target, source))
        return copier.copy(pairs, ordered=first) if copier else copy_now([*first, *pairs])


def pack_shard(flat: dict[str, torch.Tensor], layout: ShardLayout, entries: dict[str, _Entry],
               out: torch.Tensor) -> None:
    """Copy this rank's rows of every entry of ``flat`` (``layout.shard``'s) into the byte buffer ``out``,
    entry after entry in ``entries``' order (``entries_of(flat)``)."""
    packer = ShardPacker(flat, layout)
    assert packer.entries == entries, "the entries are the flat state's"
    packer.pack(out)  # a plain copy: done on return


def local_storage(value: torch.Tensor) -> int:
    """The address of ``value``'s local data (a DTensor's local shard): the same while it is updated in place."""
    return (value.to_local() if isinstance(value, DTensor) else value).data_ptr()


def unpack_shard(entries: dict[str, _Entry], buffer: torch.Tensor, layout: ShardLayout) -> dict[str, torch.Tensor]:
    """``pack_shard``'s buffer of ``layout.shard`` as rows per entry (views of ``buffer``, no copy)."""
    rows = {}
    for key, offset, nbytes in _packed_parts(entries, layout.num_shards, layout.shard):
        entry = entries[key]
        rows[key] = buffer[offset:offset + nbytes].view(entry.dtype).view(_shard_shape(entry.shape, layout.num_shards,
                                                                                     layout.shard))
    return rows


def gather_shards(kept: list[KeptShards], plan: PeerRestorePlan, group: dist.ProcessGroup | None = None
                  ) -> dict[str, torch.Tensor]:
    """Collective over ``group`` (every rank of the new group): the whole state the plan describes, on CPU.
    Shard ``s`` comes from new rank ``plan.senders[s]``, which must hold it among its ``kept`` copies."""
    rank = dist.get_rank(group)
    mine = {shard: _copy_of_shard(kept, plan, shard, rank) for shard, sender in enumerate(plan.senders)
            if sender == rank}
    described = ({key: [list(entry.shape), dtype_name(entry.dtype)] for key, entry in
                  next(iter(mine.values())).entries.items()} if rank == plan.senders[0] else None)
    entries = {key: _Entry(tuple(shape), dtype_of(dtype))
               for key, (shape, dtype) in broadcast_plain(described, src=plan.senders[0], group=group).items()}
    full = {key: torch.empty(entry.shape, dtype=entry.dtype) for key, entry in entries.items()}
    for shard, sender in enumerate(plan.senders):
        for keys in _by_dtype(entries):  # one broadcast per shard and dtype
            parts = {key: part for key in keys if (part := _part(full[key], plan.num_shards, shard)) is not None}
            if not parts:
                continue
            sizes = [part.numel() for part in parts.values()]
            if rank == sender:
                buffer = torch.cat([mine[shard].rows[key].reshape(-1) for key in parts])
            else:
                buffer = torch.empty(sum(sizes), dtype=entries[keys[0]].dtype)
            dist.broadcast(buffer, group=group, group_src=sender)
            for part, piece in zip(parts.values(), buffer.split(sizes), strict=True):
                part.copy_(piece.view(part.shape))
    return full


def _copy_of_shard(kept: list[KeptShards], plan: PeerRestorePlan, shard: int, rank: int) -> KeptShards:
    """The copy of ``shard`` of the plan's state among ``kept`` (the plan says this rank holds one)."""
    for copy in kept:
        described = copy.copy
        if (described.generation, described.step, described.world_size, described.replicas, described.layout.shard) \
                == (plan.generation, plan.step, plan.world_size, plan.replicas, shard):
            return copy
    raise AssertionError(f"rank {rank} is to send shard {shard} of {plan}, it holds {[k.copy for k in kept]}")


def load_full_state(strategy: Strategy, state: TrainState, scaler: torch.amp.GradScaler | None,
                    full: dict[str, torch.Tensor]) -> None:
    """Load the whole state ``full`` (``gather_shards``) into this rank's part of ``state``, any layout."""
    if any(key.startswith("optim.") for key in full):
        init_optimizer_state(state.optimizer)  # its lazily built state must exist to be loaded into
    live = strategy.state_dict(state)
    model_and_optimizer = {key: value for key, value in full.items() if not key.startswith("scaler.")}
    if live.keys() != model_and_optimizer.keys():
        difference = sorted(live.keys() ^ model_and_optimizer.keys())
        raise RuntimeError(f"the state kept by the peers does not fit this {strategy.name} state: "
                           f"{difference[:5]} are in one and not the other")
    with torch.no_grad():
        for key, value in live.items():
            source = full[key]
            if isinstance(value, DTensor):
                shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh,
                                                                      value.placements)
                source = source[tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))]
                value = value.to_local()
            value.copy_(source)
    strategy.load_state_dict(state, live)
    set_scaler(scaler, full)


def _local_rows(value: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """``layout.shard``'s rows of ``value``, a view of this rank's local part (a 0-dim entry: itself)."""
    local, first_row = value, 0
    if isinstance(value, DTensor):
        shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        local, first_row = value.to_local(), (offset[0] if offset else 0)
        assert tuple(local.shape) == tuple(shape) and tuple(shape[1:]) == tuple(value.shape[1:]), "dim-0 shards"
    if value.dim() == 0:
        return local.detach()
    start, stop = row_bounds(value.shape[0], layout.num_shards, layout.shard)
    assert start == stop or first_row <= start and stop <= first_row + local.shape[0], "it holds its shard's rows"
    return local[start - first_row:stop - first_row].detach()


def _shard_shape(shape: tuple[int, ...], num_shards: int, shard: int) -> tuple[int, ...]:
    if not shape:
        return ()
    start, stop = row_bounds(shape[0], num_shards, shard)
    return (stop - start, *shape[1:])


def _packed_parts(entries: dict[str, _Entry], num_shards: int, shard: int) -> list[tuple[str, int, int]]:
    """(key, offset, bytes) of each entry ``shard`` holds rows of, in ``entries``' order (0-dim ones in shard 0
    only); each starts at a multiple of PACK_ALIGNMENT, so that it can be viewed as its dtype."""
    parts, offset = [], 0
    for key, entry in entries.items():
        if not entry.shape and shard != 0:
            continue
        nbytes = math.prod(_shard_shape(entry.shape, num_shards, shard)) * entry.dtype.itemsize
        parts.append((key, offset, nbytes))
        offset += -(-nbytes // PACK_ALIGNMENT) * PACK_ALIGNMENT
    return parts


def _bounds(shape: tuple[int, ...], num_shards: int, shard: int) -> tuple[int, int] | None:
    """The rows of ``shape`` in ``shard`` (``(0, 0)`` for a 0-dim entry, which shard 0 holds; else None)."""
    if not shape:
        return (0, 0) if shard == 0 else None
    return row_bounds(shape[0], num_shards, shard)


def _part(tensor: torch.Tensor, num_shards: int, shard: int) -> torch.Tensor | None:
    """The view of ``tensor`` that ``shard`` holds (a 0-dim tensor itself, in shard 0), or None."""
    bounds = _bounds(tuple(tensor.shape), num_shards, shard)
    if bounds is None or tensor.dim() == 0:
        return None if bounds is None else tensor
    return tensor[bounds[0]:bounds[1]]


def _by_dtype(entries: dict[str, _Entry]) -> list[list[str]]:
    """The entries' keys grouped by dtype, in an order every rank agrees on."""
    grouped: dict[torch.dtype, list[str]] = defaultdict(list)
    for key in sorted(entries):
        grouped[entries[key].dtype].append(key)
    return [grouped[dtype] for dtype in sorted(grouped, key=str)]
