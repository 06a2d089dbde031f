"""The model one rank of a generation trains, before its strategy wraps it: the workload's model on the rank's
device, split over the generation's tensor-parallel ranks (the workload's ``parallelize``), its blocks
checkpointed (training.activation_checkpointing), in torchtitan's order.

Example::

    model = build_rank_model(workload, torch.device("cpu"), mesh=None, activation_checkpointing="full")
"""

from __future__ import annotations

import torch

from raylastic.strategies.activation_checkpointing import checkpoint_blocks
from raylastic.strategies.parallel_mesh import ParallelMesh
from raylastic.workloads.protocol import Workload


def build_rank_model(workload: Workload, device: torch.device, *, mesh: ParallelMesh | None,
                     activation_checkpointing: str = "none") -> torch.nn.Module:
    model = workload.build_model().to(device)
    if mesh is not None and mesh.tp is not None:
        workload.parallelize(model, mesh.tp)
    checkpoint_blocks(model, activation_checkpointing)
    return model
