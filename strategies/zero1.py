"""ZeRO stage 1: parameters and gradients replicated (DDP), optimizer state sharded over ranks.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", stage P_os. Each parameter's optimizer state is split on dim 0 into world-size chunks
(torch.chunk, as FSDP2 shards); rank r keeps chunk r. After DDP's all-reduce every rank has the
full averaged gradient, so each updates only its chunk of each parameter - the optimizer runs
on DTensor "shard" views whose local tensors alias the model's own storage - and the updated
chunks are all-gathered back into the full parameters.

With ``replicas`` R > 1 the ranks form R replica groups (strategies/shard_layout.py): the state is
split into W/R chunks, each kept by R ranks, and the all-gather runs inside a replica group. The R
groups apply the same update to the same averaged gradient, so the math is the one at R = 1.

The optimizer state is a DTensor sharded like FSDP2's, so its checkpoints load into zero2/zero3
(and ddp) at any world size.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from raylastic.strategies.base import GroupContext, ModelFactory, OptimizerFactory, TrainState, require_elementwise
from raylastic.strategies.compression.accounting import NO_TRAFFIC, CommTraffic
from raylastic.strategies.ddp import ddp_no_sync, wrap_ddp
from raylastic.strategies.flat_state import copy_into, model_entries, optimizer_entries
from raylastic.strategies.fsdp import generation_mesh, release_group_with, replicas_for_group
from raylastic.strategies.shard_layout import ShardLayout, row_bounds


class ShardedOptimizer(torch.optim.Optimizer):
    """Runs ``inner`` on this rank's dim-0 chunk of every parameter, then all-gathers the chunks.

    ``inner`` is the optimizer ``build_optimizer`` makes for the full model, its param groups (and
    their settings) kept, each parameter replaced by its shard before any state exists.
    """

    def __init__(self, model: torch.nn.Module, build_optimizer: OptimizerFactory, device: torch.device,
                 replicas: int = 1) -> None:
        self.full = [p for p in model.parameters() if p.requires_grad]
        self.mesh = generation_mesh(device, replicas)  # see strategies/fsdp.py: DTensor's caches outlive a group
        release_group_with(self, self.mesh)
        self.layout = ShardLayout(world_size=dist.get_world_size(), replicas=replicas, rank=dist.get_rank())
        self.shard, self.num_shards = self.layout.shard, self.layout.num_shards
        self.group = self.mesh.get_group(self.mesh.ndim - 1)
        """The ranks of this replica group: the chunks of one copy of the state."""
        self.sharded = [Replicate()] * (self.mesh.ndim - 1) + [Shard(0)]
        self.stepping = False
        """True from the update of this rank's chunks until every chunk is gathered back: the parameters are
        then a mix of two steps (a peer lost in the all-gather leaves them so)."""
        shard_of = {full: torch.nn.Parameter(self._shard_of(full.data)) for full in self.full}
        self.shards = list(shard_of.values())
        self.inner = build_optimizer(model)
        require_elementwise(self.inner, "zero1")
        for group in self.inner.param_groups:
            if any(p not in shard_of for p in group["params"]):
                raise ValueError("workload.configure_optimizer: under strategy.name=zero1 every parameter it "
                                 "optimizes must be one of the model's trainable parameters")
            group["params"] = [shard_of[p] for p in group["params"]]
        self.defaults = self.inner.defaults

    @property
    def state(self) -> dict:  # type: ignore[override]
        return self.inner.state

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for parameter in self.full:
            parameter.grad = None
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for full, shard in zip(self.full, self.shards, strict=True):
            shard.grad = self._shard_of(full.grad) if full.grad is not None else None
        self.stepping = True
        self.inner.step()
        for full, shard in zip(self.full, self.shards, strict=True):
            self._all_gather_into(full.data, shard.to_local())
        self.stepping = False

    def _shard_of(self, tensor: torch.Tensor) -> DTensor:
        if tensor.dim() == 0:  # a scalar cannot be split: every rank holds and updates it
            return DTensor.from_local(tensor, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        start, stop = row_bounds(tensor.shape[0], self.num_shards, self.shard)
        return DTensor.from_local(tensor[start:stop], self.mesh, self.sharded, run_check=False, shape=tensor.shape,
                                  stride=tensor.stride())

    def _all_gather_into(self, full: torch.Tensor, local: torch.Tensor) -> None:
        if full.dim() == 0:
            return
        width = -(-full.shape[0] // self.num_shards)
        padded = local.new_zeros((width, *full.shape[1:]))
        padded[: local.shape[0]] = local
        gathered = [torch.empty_like(padded) for _ in range(self.num_shards)]
        dist.all_gather(gathered, padded, group=self.group)
        full.copy_(torch.cat(gathered)[: full.shape[0]])


@dataclass(frozen=True, kw_only=True)
class Zero1Strategy:
    bucket_cap_mb: float = 25.0
    name: str = "zero1"
    replicated: bool = False
    averages_gradients: bool = True
    replicas: int = 1
    """strategy.replicas: copies of the optimizer state where it divides the world size (``effective_replicas``)."""

    def setup(self, build_model: ModelFactory, build_optimizer: OptimizerFactory, device: torch.device,
              previous: TrainState | None, context: GroupContext | None = None) -> TrainState:
        """Keeps the model (replicated); the optimizer's shards depend on the group, so it is rebuilt."""
        model = previous.model if previous is not None else build_model()
        optimizer = ShardedOptimizer(model, build_optimizer, device, replicas_for_group(self.replicas))
        return TrainState(model=model, wrapped=wrap_ddp(model, device, self.bucket_cap_mb), optimizer=optimizer,
                          layout=optimizer.layout)

    def no_sync(self, state: TrainState) -> AbstractContextManager:
        return ddp_no_sync(state.wrapped)

    def after_step(self, state: TrainState, step: int, samples: int, last: bool) -> CommTraffic:
        return NO_TRAFFIC

    def state_dict(self, state: TrainState) -> dict[str, Any]:
        optimizer: ShardedOptimizer = state.optimizer  # type: ignore[assignment]
        full_names = {p: n for n, p in state.model.named_parameters()}
        names = {shard: full_names[full] for full, shard in zip(optimizer.full, optimizer.shards, strict=True)}
        return {**model_entries(state.model), **optimizer_entries(optimizer.state, names)}

    def load_state_dict(self, state: TrainState, flat: dict[str, Any]) -> None:
        copy_into(self.state_dict(state), flat)
        optimizer: ShardedOptimizer = state.optimizer  # type: ignore[assignment]
        with torch.no_grad():  # the shards alias the parameters: refresh them after a load
            for full, shard in zip(optimizer.full, optimizer.shards, strict=True):
                shard.to_local().copy_(optimizer._shard_of(full.data).to_local())
