"""A worker's CPU copy of its shard of the sharded state, and the collective that rebuilds the state from
the copies of a new group's ranks (issue 18; the plan is strategies/peer_restore.py's).

What a rank keeps is its shard of every entry of the canonical flat state dict (strategies/base.py,
with the fp16 scaler's entries): rows ``row_bounds(rows, num_shards, shard)`` of dim 0, whether the live
entry is a DTensor sharded that way (FSDP2's parameters and optimizer state, zero1's optimizer state)
or a plain tensor every rank holds whole (zero1's parameters: a rank keeps its rows of them only).
A 0-dim entry (Adam's step, the scaler's scale) belongs to shard 0. So the copies of a layout's
shards, put side by side, are the whole state, whatever the strategy.

Restoring: each shard of the old layout is broadcast by its sender over the new group (one flat
buffer per dtype), every rank assembles the whole state in CPU memory (one full copy per rank, for
the time of the restore), and takes from it what the new layout gives it, as a checkpoint load
would: the same ``Strategy.load_state_dict``, so any world size, replica count and zero stage loads.

Example (TrainWorker's ``join`` and ``restore_from_peers``)::

    kept = keep_shards(strategy, state, scaler, generation=3, step=120)      # before leaving generation 3
    ...                                                                       # join generation 4, set up
    full = gather_shards(kept, plan, group=checkpoint_group)                  # collective
    load_full_state(strategy, new_state, scaler, full)
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from strategies.base import Strategy, TrainState, init_optimizer_state, scaler_entries, set_scaler
from strategies.peer_restore import PeerRestorePlan, ShardCopy
from strategies.shard_layout import ShardLayout, row_bounds

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Entry:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class KeptShards:
    """One rank's copy of its shard of a generation's state, in CPU memory."""

    copy: ShardCopy
    """What it is: the generation's layout, this rank's place in it, the step."""
    entries: dict[str, _Entry]
    """Every entry of the whole state: its full shape and dtype."""
    rows: dict[str, torch.Tensor]
    """This shard's rows of each entry (0-dim entries in shard 0 only)."""


def keep_shards(strategy: Strategy, state: TrainState, scaler: torch.amp.GradScaler | None, *, generation: int,
                step: int) -> KeptShards | None:
    """A CPU copy of this rank's shard of ``state`` (committed ``step`` steps, in ``generation``). None at step
    0 (every rank rebuilds that state from the seed; an optimizer's state is not built yet) and when the state
    is not one step's: zero1 lost a peer while gathering an update (``ShardedOptimizer.stepping``)."""
    assert state.layout is not None, f"{strategy.name} keeps no shard layout"
    if step == 0 or getattr(state.optimizer, "stepping", False):
        return None
    layout = state.layout
    flat = {**strategy.state_dict(state), **scaler_entries(scaler)}
    entries, rows = {}, {}
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            logger.warning("no copy of the sharded state is kept in memory: its entry %r is a %s, not a tensor "
                           "(a lost worker's shard then comes from a checkpoint)", key, type(value).__name__)
            return None
        entries[key] = _Entry(tuple(value.shape), value.dtype)
        mine = _rows_of_shard(value, layout)
        if mine is not None:
            rows[key] = mine
    copy = ShardCopy(generation=generation, world_size=layout.world_size, replicas=layout.replicas,
                     rank=layout.rank, step=step)
    return KeptShards(copy=copy, entries=entries, rows=rows)


def gather_shards(kept: KeptShards | None, plan: PeerRestorePlan, group: dist.ProcessGroup | None = None
                  ) -> dict[str, torch.Tensor]:
    """Collective over ``group`` (every rank of the new group): the whole state the plan describes, on CPU.
    Shard ``s`` comes from new rank ``plan.senders[s]`` (``kept`` must hold it there)."""
    rank = dist.get_rank(group)
    if rank in plan.senders:
        shard = plan.senders.index(rank)
        assert kept is not None and (kept.copy.generation, kept.copy.step) == (plan.generation, plan.step) \
            and kept.copy.layout.shard == shard, f"rank {rank} is to send shard {shard} of {plan}, it holds {kept}"
    header = [kept.entries if rank == plan.senders[0] else None]
    dist.broadcast_object_list(header, group=group, group_src=plan.senders[0])
    entries: dict[str, _Entry] = header[0]
    full = {key: torch.empty(entry.shape, dtype=entry.dtype) for key, entry in entries.items()}
    for shard, sender in enumerate(plan.senders):
        for keys in _by_dtype(entries):  # one broadcast per shard and dtype
            parts = {key: part for key in keys if (part := _part(full[key], plan.num_shards, shard)) is not None}
            if not parts:
                continue
            sizes = [part.numel() for part in parts.values()]
            if rank == sender:
                buffer = torch.cat([kept.rows[key].reshape(-1) for key in parts])
            else:
                buffer = torch.empty(sum(sizes), dtype=entries[keys[0]].dtype)
            dist.broadcast(buffer, group=group, group_src=sender)
            for part, piece in zip(parts.values(), buffer.split(sizes), strict=True):
                part.copy_(piece.view(part.shape))
    return full


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


def _rows_of_shard(value: torch.Tensor, layout: ShardLayout) -> torch.Tensor | None:
    """``layout.shard``'s rows of ``value`` (of its local part, for a DTensor) as a CPU copy; None for a 0-dim
    entry outside shard 0."""
    local, first_row = value, 0
    if isinstance(value, DTensor):
        shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        local, first_row = value.to_local(), (offset[0] if offset else 0)
        assert tuple(local.shape) == tuple(shape) and tuple(shape[1:]) == tuple(value.shape[1:]), "dim-0 shards"
    if value.dim() == 0:
        return local.detach().to("cpu", copy=True) if layout.shard == 0 else None
    start, stop = row_bounds(value.shape[0], layout.num_shards, layout.shard)
    assert start == stop or first_row <= start and stop <= first_row + local.shape[0], "it holds its shard's rows"
    return local[start - first_row:stop - first_row].detach().to("cpu", copy=True)


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
