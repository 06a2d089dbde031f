"""Data parallelism with torch DDP: bucketed all-reduce overlapped with backward (replicated state).

``bucket_cap_mb`` is DDP's bucket size (its first bucket is 1 MiB whatever this says). At world
size 1 the model is used as it is: the loss scaling in the step loop makes the math the same.
DDP averages gradients over the world size; the step loop scales each rank's summed loss by
``world_size / global_batch_size`` so the result is the mean over the global batch.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from raylastic.strategies.base import CommInstruments, GroupContext, ModelFactory, OptimizerFactory, TrainState
from raylastic.strategies.compression import CommHook, CompressionOptions, make_comm_hook
from raylastic.strategies.compression.accounting import NO_TRAFFIC, CommTraffic, UncompressedTraffic
from raylastic.strategies.flat_state import copy_into, model_entries, optimizer_entries
from raylastic.strategies.hierarchical import make_hierarchical_hook
from raylastic.strategies.overlap import CommTimer
from raylastic.strategies.state_transfer import broadcast_training_state


def wrap_ddp(model: torch.nn.Module, device: torch.device, bucket_cap_mb: float) -> torch.nn.Module:
    """``model`` in a DDP for the current process group; the model itself at world size 1."""
    if dist.get_world_size() == 1:
        return model
    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=bucket_cap_mb,
        init_sync=False)  # state is handed over explicitly, from the most advanced rank


def ddp_no_sync(wrapped: torch.nn.Module) -> AbstractContextManager:
    """DDP's ``no_sync``; under training.compile ``wrapped`` is the compiled DDP, whose forward still runs
    DDP's own (dynamo compiles the module inside), so the DDP it holds decides."""
    ddp = getattr(wrapped, "_orig_mod", wrapped)  # torch.compile's OptimizedModule
    if isinstance(ddp, DistributedDataParallel):
        return ddp.no_sync()
    return contextlib.nullcontext()


@dataclass(frozen=True, kw_only=True)
class DDPStrategy:
    bucket_cap_mb: float = 25.0
    compression: str = "none"
    """A kind from strategies.compression ("none": DDP's own all-reduce, counted; a hook only with comm_timing)."""
    compression_options: CompressionOptions = field(default_factory=CompressionOptions)
    hierarchical: bool = False
    comm_timing: bool = False
    """Time each bucket's communication (a Python hook); off, uncompressed DDP all-reduces in C++."""
    name: str = "ddp"
    replicated: bool = True
    averages_gradients: bool = True

    def setup(self, build_model: ModelFactory, build_optimizer: OptimizerFactory, device: torch.device,
              previous: TrainState | None, context: GroupContext | None = None) -> TrainState:
        """Keeps the previous generation's model and optimizer (survivors keep their state); the DDP
        and its communication hook are new, so error-feedback buffers start at zero on every rank."""
        if previous is None:
            model = build_model()
            optimizer = build_optimizer(model)
        else:
            model, optimizer = previous.model, previous.optimizer
        wrapped = wrap_ddp(model, device, self.bucket_cap_mb)
        comm = None
        if isinstance(wrapped, DistributedDataParallel):
            hook = self._comm_hook(context)
            if hook is None:  # DDP's own C++ all-reduce: no Python runs on the gradients' path
                comm = CommInstruments(state=UncompressedTraffic(model))
            else:
                timer = CommTimer() if self.comm_timing else None
                wrapped.register_comm_hook(hook.state, timer.wrap(hook.hook) if timer else hook.hook)
                comm = CommInstruments(state=hook.state, timer=timer)
        return TrainState(model=model, wrapped=wrapped, optimizer=optimizer, comm=comm)

    def _comm_hook(self, context: GroupContext | None) -> CommHook | None:
        """The hook this DDP needs: None for plain uncompressed all-reduce that nobody times."""
        if self.hierarchical:
            assert context is not None, "hierarchical all-reduce needs every rank's node id"
            return make_hierarchical_hook(list(context.node_ids))
        if self.compression == "none" and not self.comm_timing:
            return None
        return make_comm_hook(self.compression, options=self.compression_options,
                              completed_steps=context.completed_steps if context else 0)

    def no_sync(self, state: TrainState) -> AbstractContextManager:
        return ddp_no_sync(state.wrapped)

    def after_step(self, state: TrainState, step: int, samples: int, last: bool) -> CommTraffic:
        return NO_TRAFFIC

    def hand_over(self, state: TrainState, step: int, *, source_rank: int, device: torch.device,
                  scaler: torch.amp.GradScaler | None = None) -> int:
        """A new generation: the source's model, optimizer, step and loss scaler go to every rank."""
        return broadcast_training_state(state.model, state.optimizer, step, source_rank=source_rank, device=device,
                                        scaler=scaler)

    def state_dict(self, state: TrainState) -> dict[str, Any]:
        names = {p: n for n, p in state.model.named_parameters()}
        return {**model_entries(state.model), **optimizer_entries(state.optimizer.state, names)}

    def load_state_dict(self, state: TrainState, flat: dict[str, Any]) -> None:
        copy_into(self.state_dict(state), flat)
