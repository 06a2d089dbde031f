"""The model one rank of a generation trains, before its strategy wraps it: the workload's model on the rank's
device, cut down to the rank's pipeline stage (the workload's ``pipeline_split``), split over the generation's
tensor-parallel ranks (its ``parallelize``), its blocks checkpointed (training.activation_checkpointing), in
torchtitan's order.

Example::

    model = build_rank_model(workload, torch.device("cpu"), mesh=None, activation_checkpointing="full")
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from raylastic.strategies.activation_checkpointing import checkpoint_blocks
from raylastic.strategies.parallel_mesh import ParallelMesh
from raylastic.workloads.protocol import Workload


def build_rank_model(workload: Workload, device: torch.device, *, mesh: ParallelMesh | None,
                     activation_checkpointing: str = "none") -> torch.nn.Module:
    model = workload.build_model().to(device)
    if mesh is not None and mesh.pp is not None:  # this rank's pipeline stage
        model = workload.pipeline_split(model, mesh.layout.coordinates(dist.get_rank()).pp, mesh.layout.pp)
    if mesh is not None and mesh.tp is not None:
        workload.parallelize(model, mesh.tp)
    checkpoint_blocks(model, activation_checkpointing)
    return model
