"""Tensor parallelism for the GPT of workloads/chargpt.py: Megatron-LM's split of each block (Shoeybi et al.
2019) with sequence parallelism (Korthikanti et al. 2022), as torchtitan applies it with torch's
``parallelize_module``.

Each attention's q, k and v split by heads and the MLP's first layer by columns (``ColwiseParallel``); the
projections back into the residual stream split by rows (``RowwiseParallel``) and reduce-scatter along the
sequence, so between blocks every rank holds its ``block_size / tp`` positions of the residual stream, and the
LayerNorms and dropouts act on those alone (``SequenceParallel``). The token embedding splits by vocabulary,
the position embedding is replicated and each rank takes its positions, and the lm head splits by vocabulary
too: its logits stay sharded, and the cross-entropy runs on them under ``loss_parallel`` (the step loop enters
it). The tied head and embedding stay one parameter.

Example (every rank of a tp group, before the strategy wraps the model)::

    parallelize_gpt(model, mesh.tp)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

if TYPE_CHECKING:
    from raylastic.workloads.chargpt import GPT


def tensor_parallel_rule(model: GPT, tp: int) -> str | None:
    """Why ``model`` (the whole GPT, or a pipeline stage of it) cannot split over ``tp`` ranks (naming what to
    change), or None."""
    shape = {"workload.options.block_size": model.block_size}
    if model.blocks:
        shape["workload.options.n_head"] = next(iter(model.blocks.values())).attn.n_head
    for part in (model.wte, model.lm_head):
        if part is not None:
            shape["its vocabulary size"] = part.weight.shape[0]
    for name, value in shape.items():
        if value % tp:
            return (f"parallel.tp={tp} must divide the GPT's {name} ({value}): tensor parallelism splits the "
                    "attention heads, the sequence between the blocks and the vocabulary over the tp ranks")
    return None


def parallelize_gpt(model: GPT, tp_mesh: DeviceMesh) -> None:
    """Split ``model`` (the whole GPT, or a pipeline stage of it: the parts it holds) in place over the ranks of
    ``tp_mesh`` (every rank calls it, with the same model); a ValueError if its shape does not divide
    (``tensor_parallel_rule``)."""
    rule = tensor_parallel_rule(model, tp_mesh.size())
    if rule is not None:
        raise ValueError(rule)
    block = "blocks.*."
    gather_sequence = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {}
    if model.wte is not None:
        plan["wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        plan["wpe"] = PrepareModuleInputOutput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                               output_layouts=(Replicate(),), desired_output_layouts=(Shard(0),))
        distribute_module(model.wpe, tp_mesh)  # a replicated table: every rank looks up positions, keeps its own
    if model.blocks:
        plan |= {
            f"{block}ln_1": SequenceParallel(),
            f"{block}attn": gather_sequence,
            **{f"{block}attn.{name}": ColwiseParallel() for name in ("q", "k", "v")},
            f"{block}attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            f"{block}ln_2": SequenceParallel(),
            f"{block}mlp": gather_sequence,
            f"{block}mlp.0": ColwiseParallel(),
            f"{block}mlp.2": RowwiseParallel(output_layouts=Shard(1)),
        }
    if model.lm_head is not None:
        plan["ln_f"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    tied = model.lm_head is not None and model.wte is not None and model.lm_head.weight is model.wte.weight
    parallelize_module(model, tp_mesh, plan)
    if tied:  # each style made a parameter of its own; both hold the table's rows split alike (Shard(0))
        model.lm_head.weight = model.wte.weight
