"""Hand the training state over from one rank to the whole group, in memory.

Used when a generation forms: the most advanced rank (highest committed step) is the source;
new workers and survivors that fell behind receive its model, optimizer state, step and (fp16)
loss-scaler state. The optimizer's structure (param groups, which state tensors exist) and the
scaler's two numbers travel once as a small object; tensors travel as broadcasts in place, so no
full copy is pickled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def broadcast_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, *,
                             source_rank: int, device: torch.device,
                             scaler: torch.amp.GradScaler | None = None) -> int:
    """Make every rank's model, optimizer, step and loss scaler (fp16: a different scale would make the
    replicas skip different steps) equal to ``source_rank``'s; returns the step."""
    is_source = dist.get_rank() == source_rank
    optim_state = optimizer.state_dict() if is_source else None
    header = [{"step": step, "param_groups": optim_state["param_groups"], "state": _describe(optim_state["state"]),
               "scaler": scaler.state_dict() if scaler is not None else None} if is_source else None]
    dist.broadcast_object_list(header, src=source_rank, device=device if device.type == "cuda" else None)
    header = header[0]

    with torch.no_grad():
        for tensor in model.state_dict().values():
            _broadcast_in_place(tensor, source_rank, device)

    received: dict[int, dict[str, torch.Tensor]] = {}
    for param_id, entries in sorted(header["state"].items()):
        received[param_id] = {}
        for key, spec in sorted(entries.items()):
            tensor = (optim_state["state"][param_id][key] if is_source
                      else torch.empty(spec.shape, dtype=spec.dtype))
            received[param_id][key] = _broadcast_in_place(tensor, source_rank, device)
    if not is_source:
        optimizer.load_state_dict({"state": received, "param_groups": header["param_groups"]})
        if scaler is not None and header["scaler"] is not None:
            scaler.load_state_dict(header["scaler"])
    return header["step"]


def _describe(state: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, _TensorSpec]]:
    return {pid: {k: _TensorSpec(tuple(t.shape), t.dtype) for k, t in entries.items()}
            for pid, entries in state.items()}


def _broadcast_in_place(tensor: torch.Tensor, source_rank: int, device: torch.device) -> torch.Tensor:
    """Broadcast ``tensor`` (CPU or device) over the group, staging it on ``device`` for NCCL."""
    staged = tensor if tensor.device == device else tensor.to(device)
    dist.broadcast(staged, src=source_rank)
    if staged is not tensor:
        tensor.copy_(staged)
    return tensor
