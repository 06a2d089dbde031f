"""Data parallelism with torch DDP: bucketed all-reduce overlapped with backward.

``bucket_cap_mb`` is DDP's bucket size (its first bucket is 1 MiB whatever this says). At world
size 1 the model is used as it is: the loss scaling in the step loop makes the math the same.
DDP averages gradients over the world size; the step loop scales each rank's summed loss by
``world_size / global_batch_size`` so the result is the mean over the global batch.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True, kw_only=True)
class DDPStrategy:
    bucket_cap_mb: float = 25.0

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """Wrap ``model`` for the current process group (call again after every re-formed group)."""
        if dist.get_world_size() == 1:
            return model
        return DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_cap_mb,
            init_sync=False,  # state is handed over explicitly, from the most advanced rank
        )

    def no_sync(self, wrapped: torch.nn.Module) -> ContextManager:
        """Skip gradient communication (all micro-batches but the last of an accumulated step)."""
        if isinstance(wrapped, DistributedDataParallel):
            return wrapped.no_sync()
        return contextlib.nullcontext()
