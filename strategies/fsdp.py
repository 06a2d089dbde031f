"""ZeRO stages 2 and 3 with FSDP2 (``fully_shard``): gradients and optimizer state sharded (zero2),
and parameters too between forward and backward (zero3).

Rajbhandari et al. 2020 (ZeRO stages P_os+g and P_os+g+p). FSDP2 keeps parameters sharded at
rest as DTensors; ``reshard_after_forward=False`` (zero2) keeps the gathered parameters from
forward through backward, ``True`` (zero3) frees them after each forward and gathers again for
backward. Each repeated block is its own FSDP unit (its parameters are gathered together), then
the root. FSDP2 averages gradients over ranks like DDP, so the step loop's loss scaling is the
same. On GPUs, DTensor collectives use NCCL; FSDP2's CPU offload (``offload``) keeps parameters
and optimizer state in host memory.

With ``replicas`` R > 1 it is HSDP (hybrid sharding, Zhao et al. 2023, "PyTorch FSDP"): a 2-D mesh of
R replica groups, each sharding the state over its W/R ranks (strategies/shard_layout.py). FSDP2
reduce-scatters gradients inside a replica group and all-reduces the shards across the groups, still
the mean over every rank, so the math is the one at R = 1; R copies of each shard survive in memory.

Each generation's mesh is new in two ways DTensor's caches make necessary (see ``generation_mesh``
and ``release_group_with``): it equals no earlier mesh of the process, and it
lets go of its process group when the model it was made for is freed.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

from raylastic.strategies.activation_checkpointing import repeated_blocks
from raylastic.strategies.base import GroupContext, ModelFactory, OptimizerFactory, TrainState, require_elementwise
from raylastic.strategies.compression.accounting import NO_TRAFFIC, CommTraffic
from raylastic.strategies.model_parts import canonical_name, roots
from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.strategies.parallel_mesh import parallel_mesh
from raylastic.strategies.shard_layout import ShardLayout, effective_replicas

logger = logging.getLogger(__name__)
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(frozen=True, kw_only=True)
class FSDPStrategy:
    reshard_after_forward: bool
    offload: bool = False
    name: str = "zero3"
    replicated: bool = False
    averages_gradients: bool = True
    replicas: int = 1
    """strategy.replicas: HSDP with this many copies where it divides the world size (``effective_replicas``)."""

    def setup(self, build_model: ModelFactory, build_optimizer: OptimizerFactory, device: torch.device,
              previous: TrainState | None, context: GroupContext | None = None) -> TrainState:
        """A fresh model sharded over the current group: sharded state cannot outlive its group."""
        model = build_model()
        parallel = context.mesh if context is not None else None
        if parallel is None:
            layout = ShardLayout(world_size=dist.get_world_size(), replicas=replicas_for_group(self.replicas),
                                 rank=dist.get_rank())
            mesh = root = generation_mesh(device, layout.replicas)
        else:  # the data-parallel view of the generation's mesh: FSDP2 joins it with the model's tp mesh
            grid = parallel.layout
            layout = ShardLayout(world_size=grid.dp, replicas=grid.dp_replicate, rank=grid.data_rank(dist.get_rank()))
            mesh, root = parallel.dp, parallel.root
        options: dict[str, Any] = dict(mesh=mesh, reshard_after_forward=self.reshard_after_forward,
                                       offload_policy=CPUOffloadPolicy() if self.offload else OffloadPolicy())
        for container, key in repeated_blocks(model):  # each block a unit of its own, the rest with its root
            fully_shard(container[key], **options)
        for root_module in roots(model):  # a rank's pipeline stages run forward one by one: each its own root
            fully_shard(root_module, **options)
        release_group_with(model, root)
        optimizer = build_optimizer(model)
        require_elementwise(optimizer, self.name)
        return TrainState(model=model, wrapped=model, optimizer=optimizer, layout=layout)

    def no_sync(self, state: TrainState) -> AbstractContextManager:
        return _without_gradient_sync(state.model)

    def after_step(self, state: TrainState, step: int, samples: int, last: bool) -> CommTraffic:
        return NO_TRAFFIC

    def state_dict(self, state: TrainState) -> dict[str, Any]:
        model, optimizer = get_state_dict(state.model, state.optimizer, options=_OPTIONS)
        return {**{f"model.{canonical_name(k)}": v for k, v in model.items()},
                **{f"optim.{canonical_name(k)}": v for k, v in optimizer.items() if k.startswith("state.")}}

    def load_state_dict(self, state: TrainState, flat: dict[str, Any]) -> None:
        current_model, current = get_state_dict(state.model, state.optimizer, options=_OPTIONS)
        model = {k: flat[f"model.{canonical_name(k)}"] for k in current_model}
        optimizer = {k: flat.get(f"optim.{canonical_name(k)}", v) for k, v in current.items()}  # param_groups: built
        set_state_dict(state.model, state.optimizer, model_state_dict=model, optim_state_dict=optimizer,
                       options=_OPTIONS)


def generation_mesh(device: torch.device, replicas: int = 1) -> DeviceMesh:
    """A mesh over the current group, equal to no mesh this process made before: 1-D (dim "shard-<tag>")
    with one copy, else 2-D ``(replicas, world_size // replicas)`` (dims "replicate-<tag>", "shard-<tag>"),
    the layout of strategies/shard_layout.py. ``replicas`` must divide the world size (``effective_replicas``).

    DeviceMesh equality and hash leave out this process's place in the mesh, and DTensor caches the
    output specs of its ops by mesh - ``nn.Parameter``'s ``detach`` in ``fully_shard``, a state dict's,
    Adam's ``zeros_like`` - per thread, in threads that outlive a group (a Ray actor's). Under an equal
    mesh, a rank that had another place in an earlier group of the same size would get that group's
    mesh back, so its shards would be saved and loaded at another rank's offsets (DCP: "Failed to validate global
    plan ... invalid fill").

    Example (a strategy's ``setup``, once the generation's group is joined)::

        mesh = generation_mesh(device)
        fully_shard(model, mesh=mesh)
        release_group_with(model, mesh)
    """
    world_size = dist.get_world_size()
    assert world_size % replicas == 0, (world_size, replicas)
    return parallel_mesh(device, ParallelLayout(dp_replicate=replicas, dp_shard=world_size // replicas)).root


def replicas_for_group(replicas: int) -> int:
    """The copies the current group keeps of the sharded state (``effective_replicas``), with a warning when
    that is fewer than strategy.replicas asks for."""
    world_size = dist.get_world_size()
    effective = effective_replicas(replicas, world_size)
    if effective < replicas and dist.get_rank() == 0:
        logger.warning("strategy.replicas=%d at world size %d: %d cop%s of the sharded state (the copies must "
                       "split the ranks evenly)", replicas, world_size, effective, "y" if effective == 1 else "ies")
    return effective


def release_group_with(owner: object, mesh: DeviceMesh) -> None:
    """Once ``owner`` (what holds ``mesh`` for a generation: the model) is freed, ``mesh`` no longer holds
    its process group.

    The mesh (a 2-D one's root also holds its dimensions' groups) holds it for torch.compile only
    (collectives look a group up by name), and DTensor's caches keep meshes alive long after the state
    they were made for. A destroyed gloo group that is still held keeps its connections open, so a rank
    blocked in one of its collectives - one not next to a lost peer in gloo's ring - would wait out
    failure.collective_timeout_s instead of failing when the survivors leave the group.
    """
    weakref.finalize(owner, mesh._pg_registry.clear)


@contextlib.contextmanager
def _without_gradient_sync(model: torch.nn.Module) -> Iterator[None]:
    units = roots(model)
    assert all(isinstance(unit, FSDPModule) for unit in units)
    for unit in units:
        unit.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True)
