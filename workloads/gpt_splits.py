"""The model-parallel hooks of the built-in GPT workloads (``chargpt``, ``gpt``; see workloads/protocol.py): the
tensor-parallel plan of workloads/gpt_parallel.py, the stages of workloads/gpt_pipeline.py, and the last stage's
loss, the workloads' own next-token cross-entropy, and how far the model splits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from raylastic.workloads.gpt_parallel import parallelize_gpt, tensor_parallel_rule
from raylastic.workloads.gpt_pipeline import split_gpt


class GPTSplits:
    def parallelize(self, model: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
        """Tensor parallelism (parallel.tp > 1): Megatron's split of every block (workloads/gpt_parallel.py)."""
        parallelize_gpt(model, tp_mesh)

    def pipeline_split(self, model: torch.nn.Module, stage: int, num_stages: int) -> torch.nn.Module:
        """Pipeline parallelism (parallel.pp > 1): ``model`` cut down to ``stage`` (workloads/gpt_pipeline.py)."""
        return split_gpt(model, stage, num_stages)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of the logits ``output`` over the batch's tokens."""
        return F.cross_entropy(output.flatten(0, 1).float(), target.flatten())

    def model_limits(self, model: torch.nn.Module) -> dict:
        """A stage per block at most, and the tp degrees that divide the heads, the sequence and the vocabulary
        (``tensor_parallel_rule``): what a re-plan may choose from (parallel.degrees=preferred)."""
        heads = next(iter(model.blocks.values())).attn.n_head
        return {"blocks": len(model.blocks),
                "tp_degrees": [tp for tp in range(1, heads + 1) if tensor_parallel_rule(model, tp) is None]}
