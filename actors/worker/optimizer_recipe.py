"""The optimizer side of a step: which optimizer, the learning rate of step k, gradient clipping.

Everything here is a function of the committed step and the config, so a recovered or resumed run
continues the same recipe: the lr of step k is recomputed, not restored. Warm-up is linear from
``lr / warmup_steps``; after it ``linear`` and ``cosine`` decay towards ``min_lr``, which they reach at
step ``training.steps`` (the step after the last; Loshchilov & Hutter 2017 for cosine, as nanoGPT
schedules it).

Example::

    lr = learning_rate(step=10, optim=OptimConfig(lr=1e-3, warmup_steps=100), total_steps=1000)  # 1.1e-4
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from raylastic.jobconfig import OptimConfig

OptimizerFactory = Callable[[torch.nn.Module], torch.optim.Optimizer]


def optimizer_factory(config: OptimConfig, configure: Callable[[torch.nn.Module], object] | None = None, *,
                      skips_on_device: bool = False) -> OptimizerFactory:
    """Builds the optimizer for a model: the workload's ``configure_optimizer`` when it has one, else
    ``config.name`` over every parameter. Every param group gets ``lr_scale`` (default 1).

    ``skips_on_device`` (training.on_nonfinite=skip, fp16): adamw is torch's fused AdamW, which takes a found-inf
    flag on the device and skips its update there (``supports_device_skip``), so the step need not read the
    gradient norm on the host to decide. sgd stays unfused: fused SGD, skipping its first step, leaves its
    momentum buffers uninitialised (torch 2.13 ``_fused_sgd``), so an sgd step reads the flag on the host."""

    def build(model: torch.nn.Module) -> torch.optim.Optimizer:
        if configure is None:
            parameters = list(model.parameters())
            if config.name == "adamw":
                optimizer = torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay,
                                              fused=skips_on_device or None)
            else:
                optimizer = torch.optim.SGD(parameters, lr=config.lr, momentum=config.momentum,
                                            weight_decay=config.weight_decay)
        else:
            optimizer = configure(model)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"workload.configure_optimizer must return a torch.optim.Optimizer, got "
                                f"{type(optimizer).__name__}")
        for group in optimizer.param_groups:
            group.setdefault("lr_scale", 1.0)
        return optimizer

    return build


def supports_device_skip(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` takes ``found_inf``/``grad_scale`` tensors and skips its update on the device when
    found_inf is 1 (and leaves its step count as it was): torch's fused optimizers, as GradScaler feeds them
    (torch/amp/grad_scaler.py ``step``, torch/optim/adam.py ``_fused_adam``)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_unless_found_inf(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """Step ``optimizer`` (``supports_device_skip``), which leaves the parameters and its state as they were where
    ``found_inf`` (a float32 scalar on the device) is 1; nothing is read on the host."""
    optimizer.grad_scale, optimizer.found_inf = None, found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


def learning_rate(step: int, optim: OptimConfig, total_steps: int) -> float:
    """The learning rate of step ``step`` (0-based) of a run of ``total_steps`` steps."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    progress = min(1.0, (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps))
    if optim.schedule == "linear":
        return optim.lr - (optim.lr - optim.min_lr) * progress
    return optim.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (optim.lr - optim.min_lr)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every param group's lr is ``lr`` times the group's ``lr_scale``."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def clip_gradients(parameters: Iterable[torch.nn.Parameter], max_norm: float,
                   across: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The global L2 norm of the gradients (over every rank's shards under ZeRO-2/3 and tensor parallelism, and
    over the ranks of ``across``, which hold other parameters: a pipeline's stages), clipped to ``max_norm`` when
    it is positive. Call after the gradients are reduced, before the optimizer steps. The norm stays on the device, a
    scalar tensor: nothing here waits for the device (the clip coefficient is computed there too)."""
    with_grad = [p for p in parameters if p.grad is not None]
    if not with_grad and across is None:
        return torch.zeros(())
    by_mesh: dict[object, list[torch.nn.Parameter]] = {}
    for parameter in with_grad:  # a DTensor norm reduces over its own mesh: one group per mesh, plain ones apart
        mesh = parameter.grad.device_mesh if isinstance(parameter.grad, DTensor) else None
        by_mesh.setdefault(mesh, []).append(parameter)
    if len(by_mesh) == 1 and across is None:
        norm = _norm([p.grad for p in with_grad])
    else:
        norms = [_norm([p.grad for p in group]) for group in by_mesh.values()]
        squared = torch.stack(norms).square().sum() if norms else torch.zeros(())
        if across is not None:
            dist.all_reduce(squared, group=across)
        norm = squared.sqrt()
    if max_norm > 0:
        _scale_in_place([p.grad for p in with_grad], torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


@torch.no_grad()
def _scale_in_place(grads: list[torch.Tensor], coefficient: torch.Tensor) -> None:
    """``clip_grads_with_norm_``'s scaling, on each DTensor's local shard: a scale is the same on any placement, and
    a list of DTensors would have DTensor find a sharding for the whole ``_foreach_mul_`` (0.6 s the first time on
    each mesh: a re-planned generation's first step waited on it)."""
    by_place: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        by_place.setdefault((local.device, local.dtype), []).append(local)
    for (device, _), group in by_place.items():
        torch._foreach_mul_(group, coefficient.to(device))


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of ``grads``, all plain or all DTensors of one mesh, as a plain tensor."""
    if isinstance(grads[0], DTensor):  # sharded (FSDP2, tensor parallel): the per-shard norms reduce over ranks
        return torch.nn.utils.get_total_norm(grads).full_tensor()
    if len({(g.device, g.dtype) for g in grads}) == 1:  # get_total_norm without its grouping (~35 us a step)
        with torch.no_grad():
            return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    return torch.nn.utils.get_total_norm(grads)
