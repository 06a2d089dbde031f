"""Canonical flat state dicts for modules whose parameters are plain tensors (ddp, zero1).

See strategies/base.py for the layout. The tensors returned are the live ones, so a
torch.distributed.checkpoint load into the dict updates the model and optimizer in place.
"""

from __future__ import annotations

from typing import Any

import torch

from raylastic.strategies.model_parts import canonical_name


def model_entries(model: torch.nn.Module) -> dict[str, Any]:
    return {f"model.{name}": tensor for name, tensor in model.state_dict(keep_vars=True).items()}


def optimizer_entries(optimizer_state: dict[torch.Tensor, dict[str, Any]],
                      names: dict[torch.Tensor, str]) -> dict[str, Any]:
    """``optim.state.<fqn>.<name>`` for every state entry of every parameter named in ``names``."""
    flat = {}
    for parameter, entries in optimizer_state.items():
        for key, value in entries.items():
            flat[f"optim.state.{canonical_name(names[parameter])}.{key}"] = value
    return flat


def copy_into(live: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Copy ``loaded`` into the live tensors of ``live`` where they are not the same objects already."""
    with torch.no_grad():
        for key, tensor in live.items():
            source = loaded[key]
            if source is not tensor:
                tensor.copy_(source)
