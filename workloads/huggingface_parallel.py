"""Tensor parallelism for a Hugging Face ``transformers`` model, from the plan its class declares.

transformers gives each model class that supports tensor parallelism (Llama, Mistral, Qwen and more) a plan:
the model's ``_tp_plan`` (its parameter paths with wildcards -> a style name), or its config's
``base_model_tp_plan`` under the model's ``base_model_prefix``. This module translates the style names into torch's
``parallelize_module`` styles, applies them, and keeps tied weights tied. Activations between the layers stay
whole on every rank (no sequence parallelism), so the norms and the loss run as they are.

Example (a workload's hook, for ``parallel.tp > 1``)::

    def parallelize(self, model, tp_mesh):
        parallelize_huggingface(model, tp_mesh)
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
}
"""transformers' style names -> torch's styles, each with whole (replicated) activations around it."""


def huggingface_tp_plan(model: torch.nn.Module) -> dict[str, ParallelStyle]:
    """``model``'s tensor-parallel plan as torch styles; ValueError if it has none or uses another style."""
    names = dict(getattr(model, "_tp_plan", None) or {})
    if not names:
        base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        names = {f"{prefix}.{path}" if prefix and hasattr(model, prefix) else path: style
                 for path, style in base.items()}
    if not names:
        raise ValueError(f"{type(model).__name__} declares no tensor-parallel plan (no _tp_plan and no "
                         "config.base_model_tp_plan): give the workload a parallelize(model, tp_mesh) of its own")
    unknown = sorted({style for style in names.values() if style not in STYLES})
    if unknown:
        raise ValueError(f"{type(model).__name__}'s tensor-parallel plan uses {', '.join(unknown)}; supported: "
                         f"{', '.join(STYLES)}")
    return {path: STYLES[style]() for path, style in names.items()}


def parallelize_huggingface(model: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split ``model`` in place over the ranks of ``tp_mesh`` by its own plan (``huggingface_tp_plan``)."""
    plan = huggingface_tp_plan(model)
    tied = _tied_parameters(model)
    parallelize_module(model, tp_mesh, plan)
    for first, other in tied:  # each style made a parameter of its own: tie them again
        owner, name = _owner(model, other)
        setattr(owner, name, model.get_parameter(first))


def _tied_parameters(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(the first name, another name) of every parameter known by more than one name."""
    first_names: dict[int, str] = {}
    tied = []
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first_names:
            tied.append((first_names[id(parameter)], name))
        else:
            first_names[id(parameter)] = name
    return tied


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    module_path, _, attribute = name.rpartition(".")
    return (model.get_submodule(module_path) if module_path else model), attribute
