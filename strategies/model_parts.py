"""The pipeline stages one rank holds, as one module, and the names their parameters have in the whole model.

Under the interleaved_1f1b and zbv schedules a pipeline rank holds several stages, each the whole model with the
other stages' parts removed (workloads/gpt_pipeline.py), each run through its own ``PipelineStage``. ``ModelParts``
holds them so that the strategy, the optimizer and the gradient clip see one model; each part is named
``_pipeline_stage_<index>``, which ``canonical_name`` removes, as it removes activation checkpointing's wrapper:
a parameter keeps its whole-model name in checkpoints at any layout.

Example::

    parts = ModelParts({0: stage_zero, 3: stage_three})
    [index for index, _ in parts.stages()]                      # [0, 3]
    canonical_name("_pipeline_stage_3.blocks.6.attn.q.weight")  # "blocks.6.attn.q.weight"
"""

from __future__ import annotations

import re

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

PART_PREFIX = "_pipeline_stage_"
_PART_NAME = re.compile(rf"(^|\.){PART_PREFIX}\d+\.")


class ModelParts(torch.nn.Module):
    def __init__(self, parts: dict[int, torch.nn.Module]) -> None:
        super().__init__()
        for stage, part in sorted(parts.items()):
            self.add_module(f"{PART_PREFIX}{stage}", part)

    def stages(self) -> list[tuple[int, torch.nn.Module]]:
        """(stage index, module) of each part, in stage order."""
        return [(int(name.removeprefix(PART_PREFIX)), part) for name, part in self.named_children()]

    def forward(self, *args: object, **kwargs: object) -> None:
        raise TypeError("a rank's pipeline stages run one by one, each through its PipelineStage")


def roots(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that run a forward of their own: a ModelParts' parts, else the model."""
    return [part for _, part in model.stages()] if isinstance(model, ModelParts) else [model]


def canonical_name(name: str) -> str:
    """A parameter's name as it is in the whole model without activation checkpointing (what checkpoints and
    model.pt are keyed by)."""
    return _PART_NAME.sub(r"\1", name.replace(_CHECKPOINT_PREFIX, ""))
