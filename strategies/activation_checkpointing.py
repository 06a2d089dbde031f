"""Activation checkpointing: a model's repeated blocks recompute their activations in backward.

``full`` keeps only each block's input and runs the block's forward again in backward (Chen et al. 2016);
``selective`` keeps the outputs of the block's matmuls and attention and recomputes the cheap element-wise
operations between them, Korthikanti et al. 2022's trade, as torchtitan's op-level policy makes it. Each block
is wrapped with torch's non-reentrant ``checkpoint_wrapper``, which restores the RNG state for the recompute,
so dropout draws the same masks: the math is unchanged. Apply after tensor parallelism and before the
strategy wraps the model (torchtitan's order); parameter names then carry ``_checkpoint_wrapped_module``,
which ``canonical_name`` (strategies/model_parts.py) removes for checkpoints.

Example::

    checkpoint_blocks(model, "full")       # every entry of the model's ModuleLists (a GPT's layers)
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
SAVED_OPS = frozenset(op for op in (
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.linear.default,
    _aten._scaled_dot_product_efficient_attention.default, _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default, _aten._scaled_dot_product_cudnn_attention.default))
"""What selective checkpointing keeps: the outputs of matmuls and attention (the costly operations)."""


def repeated_blocks(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, str]]:
    """(container, key) of each repeated block: the entries of a ModuleList, or of a ModuleDict keyed "0", "1",
    ... (a GPT's layers, a Hugging Face model's ``layers``)."""
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList) or (
                isinstance(module, torch.nn.ModuleDict) and all(key.isdigit() for key in module)):
            keys = range(len(module)) if isinstance(module, torch.nn.ModuleList) else list(module.keys())
            for key in keys:
                yield module, key


def checkpoint_blocks(model: torch.nn.Module, mode: str) -> None:
    """Wrap every repeated block of ``model`` in place for ``mode`` ("none": nothing)."""
    if mode == "none":
        return
    options = {} if mode == "full" else {"context_fn": functools.partial(create_selective_checkpoint_contexts,
                                                                          _keep_matmuls)}
    for container, key in list(repeated_blocks(model)):
        container[key] = checkpoint_wrapper(container[key], **options)


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE
