"""Hand the training state over from one rank to the whole group, in memory.

Used when a generation forms: the most advanced rank (highest committed step) is the source;
new workers and survivors that fell behind receive its model, optimizer state, step and (fp16)
loss-scaler state. The optimizer's structure (param groups, which state tensors exist) and the
scaler's numbers travel once as plain values (strategies/plain_objects.py: JSON, no pickle); tensors
travel as broadcasts in place.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from raylastic.strategies.plain_objects import broadcast_plain, dtype_name, dtype_of


def broadcast_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, *,
                             source_rank: int, device: torch.device,
                             scaler: torch.amp.GradScaler | None = None) -> int:
    """Make every rank's model, optimizer, step and loss scaler (fp16: a different scale would make the
    replicas skip different steps) equal to ``source_rank``'s; returns the step."""
    is_source = dist.get_rank() == source_rank
    optim_state = optimizer.state_dict() if is_source else None
    header = broadcast_plain({"step": step, "param_groups": optim_state["param_groups"],
                              "state": _describe(optim_state["state"]),
                              "scaler": scaler.state_dict() if scaler is not None else None} if is_source else None,
                             src=source_rank, device=device)

    with torch.no_grad():
        for tensor in model.state_dict().values():
            _broadcast_in_place(tensor, source_rank, device)

    received: dict[int, dict[str, torch.Tensor]] = {}
    for param_id, entries in sorted((int(param_id), entries) for param_id, entries in header["state"].items()):
        received[param_id] = {}
        for key, (shape, dtype) in sorted(entries.items()):
            tensor = (optim_state["state"][param_id][key] if is_source
                      else torch.empty(shape, dtype=dtype_of(dtype)))
            received[param_id][key] = _broadcast_in_place(tensor, source_rank, device)
    if not is_source:
        groups = [_like(own, sent) for own, sent in zip(optimizer.param_groups, header["param_groups"], strict=True)]
        optimizer.load_state_dict({"state": received, "param_groups": groups})
        if scaler is not None and header["scaler"] is not None:
            scaler.load_state_dict(header["scaler"])
    return header["step"]


def _describe(state: dict[int, dict[str, torch.Tensor]]) -> dict[str, dict[str, list]]:
    """Each state tensor's shape and dtype name, by parameter id (a JSON key: a string) and name."""
    return {str(pid): {k: [list(t.shape), dtype_name(t.dtype)] for k, t in entries.items()}
            for pid, entries in state.items()}


def _like(own: dict[str, Any], sent: dict[str, Any]) -> dict[str, Any]:
    """The param group ``sent`` (through JSON: its tuples arrive as lists) with the tuples of ``own`` again, as
    Adam's ``betas``."""
    return {key: tuple(value) if isinstance(own.get(key), tuple) and isinstance(value, list) else value
            for key, value in sent.items()}


def _broadcast_in_place(tensor: torch.Tensor, source_rank: int, device: torch.device) -> torch.Tensor:
    """Broadcast ``tensor`` (CPU or device) over the group, staging it on ``device`` for NCCL."""
    staged = tensor if tensor.device == device else tensor.to(device)
    dist.broadcast(staged, src=source_rank)
    if staged is not tensor:
        tensor.copy_(staged)
    return tensor
