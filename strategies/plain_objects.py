"""Small values sent over a process group as JSON in tensors, never as pickles.

torch's ``broadcast_object_list`` and ``all_gather_object`` unpickle what a peer sends, so a peer can run code
in every rank. What our ranks exchange besides tensors is plain data (steps, shapes, dtype names,
checksums, node ids), so it travels as JSON: its length, then its UTF-8 bytes, as tensors (on ``device``
for an NCCL group). A value JSON cannot carry raises TypeError on the sender, naming it. A length over
``max_bytes`` (a peer's announcement, or this rank's own value) raises PlainValueTooLong on every rank that
read it, before anything of that size is allocated. Tensors go with ``all_gather_tensors``: their names,
shapes and dtypes as JSON, then the tensors themselves.

Example::

    step = broadcast_plain(step if rank == source else None, src=source, group=group)
    node_ids = all_gather_plain(node_id, group=group)      # one per rank, in rank order
    send_plain(shapes, dst=1, group=group)                 # on group rank 1: shapes = recv_plain(src=0, ...)
    stages = all_gather_tensors(stage_state, group=pipeline_group)  # every rank's dict of tensors, in rank order
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

CPU = torch.device("cpu")
MAX_BYTES = 64 * 2**20
"""The longest value sent by default: far above what our ranks exchange (a large model's names, shapes and
offsets take a few MB), far below what would exhaust a host's memory."""


class PlainValueTooLong(ValueError):
    """A rank announced a value longer than ``max_bytes`` (or a negative length): refused, nothing allocated."""


def broadcast_plain(value: Any, *, src: int, group: dist.ProcessGroup | None = None, device: torch.device = CPU,
                    max_bytes: int = MAX_BYTES) -> Any:
    """``value`` of group rank ``src``, on every rank of ``group`` (the others' ``value`` is ignored)."""
    sender = dist.get_rank(group) == src
    payload = _encode(value) if sender else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(length, group=group, group_src=src)
    size = _checked_length(length, src, max_bytes)  # the sender too: every rank raises, none waits for the bytes
    data = _as_tensor(payload, device) if sender else torch.empty(size, dtype=torch.uint8, device=device)
    dist.broadcast(data, group=group, group_src=src)
    return value if sender else _decode(data)


def all_gather_plain(value: Any, *, group: dist.ProcessGroup | None = None, device: torch.device = CPU,
                     max_bytes: int = MAX_BYTES) -> list[Any]:
    """Every rank's ``value``, in group rank order, on every rank of ``group``."""
    payload = _encode(value)
    size = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([len(payload)], dtype=torch.int64, device=device), group=group)
    longest = max(_checked_length(length, rank, max_bytes) for rank, length in enumerate(lengths))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:len(payload)] = _as_tensor(payload, device)
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    return [_decode(part[:int(length.item())]) for part, length in zip(parts, lengths, strict=True)]


def send_plain(value: Any, *, dst: int, group: dist.ProcessGroup | None = None, device: torch.device = CPU,
               max_bytes: int = MAX_BYTES) -> None:
    """Send ``value`` to group rank ``dst``, which calls ``recv_plain``."""
    payload = _encode(value)
    dist.send(torch.tensor([len(payload)], dtype=torch.int64, device=device), group=group, group_dst=dst)
    _checked_length(torch.tensor([len(payload)]), dist.get_rank(group), max_bytes)  # as the receiver will
    dist.send(_as_tensor(payload, device), group=group, group_dst=dst)


def recv_plain(*, src: int, group: dist.ProcessGroup | None = None, device: torch.device = CPU,
               max_bytes: int = MAX_BYTES) -> Any:
    """The value group rank ``src`` sent with ``send_plain``."""
    length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(length, group=group, group_src=src)
    data = torch.empty(_checked_length(length, src, max_bytes), dtype=torch.uint8, device=device)
    dist.recv(data, group=group, group_src=src)
    return _decode(data)


def all_gather_tensors(tensors: dict[str, torch.Tensor], *, group: dist.ProcessGroup | None = None,
                       device: torch.device = CPU, max_bytes: int = MAX_BYTES) -> list[dict[str, torch.Tensor]]:
    """Every rank's dict of (CPU) tensors, in group rank order, on every rank of ``group`` (on CPU): each rank's
    names, shapes and dtypes as JSON, then each tensor broadcast by its rank (staged on ``device``)."""
    described = {name: [list(tensor.shape), dtype_name(tensor.dtype)] for name, tensor in tensors.items()}
    listings = all_gather_plain(described, group=group, device=device, max_bytes=max_bytes)
    mine = dist.get_rank(group)
    gathered: list[dict[str, torch.Tensor]] = []
    for rank, listing in enumerate(listings):
        received = {}
        for name, (shape, dtype) in listing.items():
            staged = (tensors[name].to(device) if rank == mine
                      else torch.empty(shape, dtype=dtype_of(dtype), device=device))
            dist.broadcast(staged, group=group, group_src=rank)
            received[name] = tensors[name] if rank == mine else staged.cpu()
        gathered.append(received)
    return gathered


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; ValueError for a name that is no torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _checked_length(length: torch.Tensor, rank: int, max_bytes: int) -> int:
    announced = int(length.item())
    if not 0 <= announced <= max_bytes:
        raise PlainValueTooLong(f"group rank {rank} announced a plain value of {announced} bytes; at most "
                                f"{max_bytes} are accepted (max_bytes), so it was refused unread")
    return announced


def _encode(value: Any) -> bytes:
    try:
        return json.dumps(value, allow_nan=True, separators=(",", ":")).encode()
    except TypeError as error:
        raise TypeError(f"only plain values (JSON) are sent between ranks: {error}") from None


def _decode(data: torch.Tensor) -> Any:
    return json.loads(bytes(data.cpu().numpy()).decode())


def _as_tensor(payload: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
