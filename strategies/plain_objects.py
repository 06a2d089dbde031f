"""Small values sent over a process group as JSON in tensors, never as pickles.

torch's ``broadcast_object_list`` and ``all_gather_object`` unpickle what a peer sends, so a peer can run code
in every rank. What our ranks exchange besides tensors is plain data (steps, shapes, dtype names,
checksums, node ids), so it travels as JSON: its length, then its UTF-8 bytes, as tensors (on ``device``
for an NCCL group). A value JSON cannot carry raises TypeError on the sender, naming it.

Example::

    step = broadcast_plain(step if rank == source else None, src=source, group=group)
    node_ids = all_gather_plain(node_id, group=group)      # one per rank, in rank order
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

CPU = torch.device("cpu")


def broadcast_plain(value: Any, *, src: int, group: dist.ProcessGroup | None = None, device: torch.device = CPU
                    ) -> Any:
    """``value`` of group rank ``src``, on every rank of ``group`` (the others' ``value`` is ignored)."""
    sender = dist.get_rank(group) == src
    payload = _encode(value) if sender else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(length, group=group, group_src=src)
    data = _as_tensor(payload, device) if sender else torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, group=group, group_src=src)
    return value if sender else _decode(data)


def all_gather_plain(value: Any, *, group: dist.ProcessGroup | None = None, device: torch.device = CPU) -> list[Any]:
    """Every rank's ``value``, in group rank order, on every rank of ``group``."""
    payload = _encode(value)
    size = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([len(payload)], dtype=torch.int64, device=device), group=group)
    longest = max(int(length.item()) for length in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:len(payload)] = _as_tensor(payload, device)
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    return [_decode(part[:int(length.item())]) for part, length in zip(parts, lengths, strict=True)]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; ValueError for a name that is no torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _encode(value: Any) -> bytes:
    try:
        return json.dumps(value, allow_nan=True, separators=(",", ":")).encode()
    except TypeError as error:
        raise TypeError(f"only plain values (JSON) are sent between ranks: {error}") from None


def _decode(data: torch.Tensor) -> Any:
    return json.loads(bytes(data.cpu().numpy()).decode())


def _as_tensor(payload: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
