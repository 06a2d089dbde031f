"""A model-parallel worker's CPU copy of its part of the state, and the collective that re-lays a new group's
state out from the copies the members kept (the plan is strategies/region_plan.py's).

A rank's part of an entry of the canonical flat state (strategies/base.py) is a region: the offset and shape
of its local tensor in the whole entry (a DTensor's, split over tp and sharded over dp; a plain tensor is
whole). ``keep_regions`` copies every region the rank holds when it leaves a generation. ``restore_regions``
then gives each rank of the new layout the regions its live state covers: what its own copies hold it copies
locally; the rest it receives point to point, from the rank the plan names for each old piece, and only the
intersection of that piece's region with its own. No file is read, and nothing is sent that a rank holds.

Example (TrainWorker's ``_leave`` and ``restore_regions``)::

    kept = keep_regions(strategy, state, copy=RegionCopy(3, layout, rank, step=120))   # before leaving
    ...                                                                               # join, set up anew
    moved = restore_regions([kept], plan, strategy, new_state, group=checkpoint_group) # collective
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from raylastic.strategies.base import Strategy, TrainState, init_optimizer_state
from raylastic.strategies.host_copies import HostCopier, PendingCopy, copy_now
from raylastic.strategies.plain_objects import all_gather_plain, dtype_name, dtype_of
from raylastic.strategies.region_plan import Piece, RegionCopy, RegionRestorePlan, RestoreTraffic
from raylastic.strategies.shard_copy import KEEP_TIMEOUT_S, PACK_ALIGNMENT

Region = tuple[tuple[int, ...], tuple[int, ...]]
"""(offset, shape) of a part of an entry."""


@dataclass
class KeptRegions:
    copy: RegionCopy
    parts: dict[str, tuple[Region, torch.Tensor]]
    """Every entry the rank held: its region and a CPU copy of it."""


def keep_regions(strategy: Strategy, state: TrainState, *, copy: RegionCopy, timeout_s: float = KEEP_TIMEOUT_S
                 ) -> KeptRegions | None:
    """A CPU copy of this rank's part of ``state``; None at step 0 (every rank builds that state from the seed).
    From a GPU into one pinned buffer, the copies queued together and waited for once (up to ``timeout_s``)."""
    if copy.step == 0:
        return None
    flat = strategy.state_dict(state)
    packer = RegionPacker(flat)
    copier = HostCopier.for_tensors(list(flat.values()))
    buffer = copier.pool.take(packer.size)
    packer.pack(buffer, copier=copier).wait(timeout_s)
    return KeptRegions(copy=copy, parts=unpack_regions(packer.entries, buffer))


def restore_regions(kept: list[KeptRegions], plan: RegionRestorePlan, strategy: Strategy, state: TrainState,
                    group: dist.ProcessGroup | None = None) -> RestoreTraffic:
    """Collective over ``group`` (every rank of the new group, which holds ``state`` laid out anew): load the
    plan's state into ``state`` from the members' ``kept`` copies. Returns what this rank received."""
    rank = dist.get_rank(group)
    init_optimizer_state(state.optimizer)  # its lazily built state must exist to be loaded into
    live = strategy.state_dict(state)
    mine = {k.copy.piece: k for k in kept if (k.copy.generation, k.copy.step, k.copy.layout)
            == (plan.generation, plan.step, plan.layout)}
    offered = {piece: {key: region for key, (region, _) in mine[piece].parts.items()}
               for piece, sender in plan.senders.items() if sender == rank}
    needed = {key: _local_part(value)[0] for key, value in live.items()}
    views = [_view_from_plain(view) for view in all_gather_plain(_plain_view(offered, needed, sorted(mine)),
                                                                   group=group)]
    regions = {piece: parts for offered_by, _, _ in views for piece, parts in offered_by.items()}
    transfers = _transfers(plan, regions, [(need, set(held)) for _, need, held in views])
    assembled = {key: torch.empty(region[1], dtype=live[key].dtype) for key, region in needed.items()}
    for key, piece, region in transfers[(rank, rank)]:  # what this rank holds itself
        _place(assembled[key], needed[key], region, _cut(mine[piece].parts[key], region))
    pending, received = [], []
    for (sender, receiver), items in sorted(transfers.items()):
        if sender == receiver or rank not in (sender, receiver):
            continue
        dtype_of = (lambda key, piece: mine[piece].parts[key][1].dtype) if rank == sender else (
            lambda key, piece: live[key].dtype)
        for dtype, group_items in _by_dtype(items, dtype_of):
            if rank == sender:
                buffer = torch.cat([_cut(mine[piece].parts[key], region).reshape(-1) for key, piece, region in
                                    group_items])
                pending.append(dist.isend(buffer, group=group, group_dst=receiver))
            else:
                buffer = torch.empty(sum(math.prod(region[1]) for _, _, region in group_items), dtype=dtype)
                pending.append(dist.irecv(buffer, group=group, group_src=sender))
                received.append((buffer, group_items, sender))
    for work in pending:
        work.wait()
    for buffer, group_items, _ in received:
        pieces = buffer.split([math.prod(region[1]) for _, _, region in group_items])
        for (key, _, region), piece in zip(group_items, pieces, strict=True):
            _place(assembled[key], needed[key], region, piece.view(region[1]))
    with torch.no_grad():
        for key, value in live.items():
            (value.to_local() if isinstance(value, DTensor) else value).copy_(assembled[key])
    strategy.load_state_dict(state, live)
    return RestoreTraffic(bytes_received=sum(buffer.numel() * buffer.element_size() for buffer, _, _ in received),
                          senders=tuple(sorted({sender for _, _, sender in received})))


class RegionPacker:
    """This rank's part of a flat state, packed into a byte buffer again and again (the buddy copy's, under model
    parallelism): each entry's local tensor at an aligned offset. ``entries`` (key -> region, dtype, offset) is
    what ``unpack_regions`` reads the buffer with. Valid while the live tensors are updated in place."""

    def __init__(self, flat: dict[str, torch.Tensor]) -> None:
        self.entries: dict[str, tuple[Region, torch.dtype, int]] = {}
        self._locals: list[tuple[str, torch.Tensor]] = []
        offset = 0
        for key in sorted(flat):
            region, local = _local_part(flat[key])
            self.entries[key] = (region, local.dtype, offset)
            self._locals.append((key, local.detach()))
            offset += -(-local.numel() * local.element_size() // PACK_ALIGNMENT) * PACK_ALIGNMENT
        self.size = offset

    def pack(self, out: torch.Tensor, fresh: dict[str, torch.Tensor] | None = None, copier: HostCopier | None = None,
             ordered: Collection[str] = ()) -> PendingCopy:
        """Copy every local tensor into ``out`` (``self.size`` bytes) with ``copier`` (None: a plain copy, done on
        return); ``ordered``: the keys the next step's forward may change in place (strategies/host_copies.py)."""
        pairs, first = [], []
        for key, local in self._locals:
            region, dtype, offset = self.entries[key]
            target = out[offset:offset + local.numel() * local.element_size()].view(dtype).view(region[1])
            (first if key in ordered else pairs).append((target, local))
        return copier.copy(pairs, ordered=first) if copier else copy_now([*first, *pairs])


def region_packed_size(entries: dict[str, tuple[Region, torch.dtype, int]]) -> int:
    """Bytes of a buffer packed by a RegionPacker with these ``entries``."""
    if not entries:
        return 0
    region, dtype, offset = max(entries.values(), key=lambda entry: entry[2])
    return offset + -(-math.prod(region[1]) * dtype.itemsize // PACK_ALIGNMENT) * PACK_ALIGNMENT


def unpack_regions(entries: dict[str, tuple[Region, torch.dtype, int]], buffer: torch.Tensor
                   ) -> dict[str, tuple[Region, torch.Tensor]]:
    """A packed buffer as KeptRegions' parts (views of ``buffer``, no copy)."""
    return {key: (region, buffer[offset:offset + math.prod(region[1]) * dtype.itemsize].view(dtype).view(region[1]))
            for key, (region, dtype, offset) in entries.items()}


def plain_entries(entries: dict[str, tuple[Region, torch.dtype, int]]) -> dict[str, list]:
    """A RegionPacker's ``entries`` as JSON (strategies/plain_objects.py), to tell the other ranks."""
    return {key: [*_plain_region(region), dtype_name(dtype), offset]
            for key, (region, dtype, offset) in entries.items()}


def entries_from_plain(plain: dict[str, list]) -> dict[str, tuple[Region, torch.dtype, int]]:
    """``plain_entries``' inverse."""
    return {key: (_region_from_plain(at, shape), dtype_of(dtype), int(offset))
            for key, (at, shape, dtype, offset) in plain.items()}


def _plain_view(offered: dict[Piece, dict[str, Region]], needed: dict[str, Region], held: list[Piece]) -> dict:
    """What a rank tells the others before a restore, as JSON: the pieces it sends (their regions), the regions it
    needs, the pieces it holds."""
    return {"offered": [[list(piece), {key: _plain_region(region) for key, region in parts.items()}]
                        for piece, parts in offered.items()],
            "needed": {key: _plain_region(region) for key, region in needed.items()},
            "held": [list(piece) for piece in held]}


def _view_from_plain(view: dict) -> tuple[dict[Piece, dict[str, Region]], dict[str, Region], list[Piece]]:
    offered = {_piece(piece): {key: _region_from_plain(*region) for key, region in parts.items()}
               for piece, parts in view["offered"]}
    return (offered, {key: _region_from_plain(*region) for key, region in view["needed"].items()},
            [_piece(piece) for piece in view["held"]])


def _plain_region(region: Region) -> list[list[int]]:
    return [list(region[0]), list(region[1])]


def _region_from_plain(at: list, shape: list) -> Region:
    return tuple(int(i) for i in at), tuple(int(n) for n in shape)


def _piece(plain: list) -> Piece:
    pp, dp_shard, tp = (int(i) for i in plain)
    return pp, dp_shard, tp


def _transfers(plan: RegionRestorePlan, regions: dict[Piece, dict[str, Region]],
               ranks: list[tuple[dict[str, Region], set[Piece]]]) -> dict[tuple[int, int], list]:
    """(sender, receiver) -> [(key, piece, region)] for every rank: each region of the old pieces (one piece
    for each distinct region of an entry: tp ranks hold replicated entries whole) that intersects the region
    the receiver needs, from itself where it holds that piece, else from the piece's sender."""
    transfers: dict[tuple[int, int], list] = defaultdict(list)
    distinct: dict[str, dict[Region, Piece]] = defaultdict(dict)
    for piece in sorted(regions):
        for key, region in regions[piece].items():
            distinct[key].setdefault(region, piece)
    for receiver, (needed, held) in enumerate(ranks):
        for key, need in needed.items():
            if key not in distinct:
                raise RuntimeError(f"the state the peers kept has no {key!r}: it does not fit this model")
            covered = 0
            for region, piece in distinct[key].items():
                overlap = _intersection(region, need)
                if overlap is None:
                    continue
                covered += math.prod(overlap[1])
                same = [p for p in held if regions[p].get(key) == region]
                sender = receiver if piece in held or same else plan.senders[piece]
                transfers[(sender, receiver)].append((key, min(same) if same else piece, overlap))
            if covered != math.prod(need[1]):
                raise RuntimeError(f"the pieces the peers kept cover {covered} of the {math.prod(need[1])} "
                                   f"elements of {key!r} that rank {receiver} needs")
    return transfers


def _local_part(value: torch.Tensor) -> tuple[Region, torch.Tensor]:
    """The region of the whole entry that this rank's local tensor is, and that tensor."""
    if isinstance(value, DTensor):
        shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return (tuple(offset), tuple(shape)), value.to_local()
    return ((0,) * value.dim(), tuple(value.shape)), value


def _intersection(first: Region, second: Region) -> Region | None:
    starts = [max(a, b) for a, b in zip(first[0], second[0], strict=True)]
    stops = [min(a + n, b + m) for a, n, b, m in zip(first[0], first[1], second[0], second[1], strict=True)]
    if any(stop <= start for start, stop in zip(starts, stops, strict=True)):
        return None
    return tuple(starts), tuple(stop - start for start, stop in zip(starts, stops, strict=True))


def _slices(outer: Region, inner: Region) -> tuple[slice, ...]:
    """Where ``inner`` lies in a tensor holding ``outer``."""
    return tuple(slice(i - o, i - o + n) for o, i, n in zip(outer[0], inner[0], inner[1], strict=True))


def _cut(part: tuple[Region, torch.Tensor], region: Region) -> torch.Tensor:
    held, tensor = part
    return tensor[_slices(held, region)]


def _place(target: torch.Tensor, target_region: Region, region: Region, source: torch.Tensor) -> None:
    target[_slices(target_region, region)] = source


def _by_dtype(items: list, dtype_of: Callable[[str, Piece], torch.dtype]) -> list[tuple[torch.dtype, list]]:
    """``items`` grouped by their entry's dtype, in an order both ends agree on."""
    grouped: dict[torch.dtype, list] = defaultdict(list)
    for key, piece, region in items:
        grouped[dtype_of(key, piece)].append((key, piece, region))
    return [(dtype, grouped[dtype]) for dtype in sorted(grouped, key=str)]
