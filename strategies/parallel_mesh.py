"""A generation's DeviceMesh for its ParallelLayout (strategies/parallel_layout.py), with its views.

One root mesh per generation: FSDP2 joins its data-parallel mesh with a tensor-parallel one only when
both come from the same root. The dimensions of size 1 are left out (each dimension's groups cost every
rank a rendezvous when the mesh is made), except the data-parallel shard dimension, which the
strategies always shard over. Dimension names carry a tag of this mesh alone, for the reason
``generation_mesh`` gives (strategies/fsdp.py). The dimensions' groups are made here, with the current group's
timeout (strategies/sub_groups.py): ``init_device_mesh`` would give them torch's default, and a pipeline send or a
tensor-parallel all-reduce to a stopped peer would wait it out.

Example (every rank of a generation of 8, once its group is joined)::

    mesh = parallel_mesh(torch.device("cpu"), ParallelLayout(pp=2, dp_shard=2, tp=2))
    mesh.dp        # the 1-D mesh of this rank's data-parallel peers (the 2-D one with HSDP's copies)
    mesh.tp        # the 1-D mesh of this rank's tensor-parallel group; None without one
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.strategies.sub_groups import sub_group

DIMENSIONS = ("pp", "replicate", "shard", "tp")
"""The logical dimensions, outermost first (ParallelLayout's rank order); "replicate" and "shard" are the
data-parallel ones."""


@dataclass(frozen=True)
class ParallelMesh:
    root: DeviceMesh
    layout: ParallelLayout
    names: dict[str, str]
    """Logical dimension -> its name in ``root``, for the dimensions ``root`` has."""

    @property
    def dp(self) -> DeviceMesh:
        """The data-parallel mesh: ``(replicate, shard)`` with HSDP's copies, else ``(shard,)``."""
        return self._view("replicate", "shard")

    @property
    def tp(self) -> DeviceMesh | None:
        return self._view("tp") if "tp" in self.names else None

    @property
    def pp(self) -> DeviceMesh | None:
        return self._view("pp") if "pp" in self.names else None

    def _view(self, *dimensions: str) -> DeviceMesh:
        names = tuple(self.names[d] for d in dimensions if d in self.names)
        return self.root if names == self.root.mesh_dim_names else self.root[names]


def parallel_mesh(device: torch.device, layout: ParallelLayout) -> ParallelMesh:
    """The mesh of ``layout`` over the current group (whose size must be the layout's)."""
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"a layout of {layout.world_size} ranks ({layout.describe()}) for a group of "
                         f"{dist.get_world_size()}")
    sizes = dict(zip(DIMENSIONS, (layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp), strict=True))
    kept = [d for d in DIMENSIONS if sizes[d] > 1 or d == "shard"]
    tag = uuid.uuid4().hex[:8]  # differs between ranks too, which nothing compares
    names = {d: f"{d}-{tag}" for d in kept}
    grid = torch.arange(layout.world_size, dtype=torch.int).reshape(tuple(sizes[d] for d in kept))
    root = DeviceMesh.from_group(_dimension_groups(grid), device.type, mesh=grid, mesh_dim_names=tuple(names.values()))
    return ParallelMesh(root=root, layout=layout, names=names)


def _dimension_groups(grid: torch.Tensor) -> list[dist.ProcessGroup]:
    """This rank's group along each dimension of ``grid`` (the global ranks in the mesh's shape). A dimension
    over every rank is the current group itself, as ``init_device_mesh`` makes it; the others' groups are made on
    every rank, in the same order."""
    rank, mine = dist.get_rank(), []
    for dimension in range(grid.ndim):
        if grid.shape[dimension] == grid.numel():
            mine.append(dist.group.WORLD)
            continue
        lines = grid.movedim(dimension, -1).reshape(-1, grid.shape[dimension]).tolist()
        groups = [sub_group(line) for line in lines]
        mine.append(next(group for group, line in zip(groups, lines, strict=True) if rank in line))
    return mine
