"""The model one rank of a generation trains, before its strategy wraps it: the workload's model on the rank's
device, cut down to the rank's pipeline stage (the workload's ``pipeline_split``; several stages in a
``ModelParts`` under the interleaved_1f1b and zbv schedules), split over the generation's
tensor-parallel ranks (its ``parallelize``), its blocks checkpointed (training.activation_checkpointing), in
torchtitan's order. Also how far the model splits (``model_limits``), for the Controller's re-plans.

Example::

    model = build_rank_model(workload, torch.device("cpu"), mesh=None, activation_checkpointing="full")
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from raylastic.jobconfig import WorkloadConfig
from raylastic.strategies.activation_checkpointing import checkpoint_blocks
from raylastic.strategies.model_limits import ModelLimits
from raylastic.strategies.model_parts import ModelParts, roots
from raylastic.strategies.parallel_mesh import ParallelMesh
from raylastic.workloads.protocol import Workload


def build_rank_model(workload: Workload, device: torch.device, *, mesh: ParallelMesh | None,
                     activation_checkpointing: str = "none") -> torch.nn.Module:
    model = workload.build_model().to(device)
    if mesh is not None and mesh.pp is not None:  # this rank's pipeline stages
        layout = mesh.layout
        stages = layout.stages(layout.coordinates(dist.get_rank()).pp)
        if len(stages) == 1:
            model = workload.pipeline_split(model, stages[0], layout.num_stages)
        else:
            model = ModelParts({stage: workload.pipeline_split(copy.deepcopy(model), stage, layout.num_stages)
                                for stage in stages})
    if mesh is not None and mesh.tp is not None:
        for part in roots(model):
            workload.parallelize(part, mesh.tp)
    checkpoint_blocks(model, activation_checkpointing)
    return model


def model_limits(workload: Workload, config: WorkloadConfig) -> ModelLimits | None:
    """The workload's ``model_limits`` hook's answer for its model built on the meta device (no memory taken, no
    random number drawn); None for a workload without the hook."""
    hook = getattr(workload, "model_limits", None)
    if hook is None:
        return None
    with torch.device("meta"):
        model = workload.build_model()
    return ModelLimits.reported(hook(model), workload=config.name)
