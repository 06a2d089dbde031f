"""fp16's dynamic loss scaler for each strategy and layout: the one whose overflow check every rank agrees on.

A step skipped for an overflow must be skipped by every rank, or the ranks' parameters (and scales) part.
Which scaler gives that depends on where each rank's gradients are whole:

=====================================  ================================  ==========================================
strategy (layout)                      gradients the scaler checks       scaler
=====================================  ================================  ==========================================
ddp, diloco (no model parallelism)     whole, the same on every rank     torch ``GradScaler``: no collective of its
                                       (diloco: each rank's own step)    own (diloco's inner steps stay local)
zero1 (no model parallelism)           whole after DDP's all-reduce;     ``WholeGradientScaler``: the full
                                       the optimizer steps on row shards  parameters' gradients, no collective
zero2, zero3; any strategy under       each rank's shard (FSDP2's        ``GroupGradScaler``: torch's
parallel.tp or parallel.pp > 1         DTensors), each stage's layers    ``ShardedGradScaler``, its found-inf
                                                                         all-reduced over the generation's group
=====================================  ================================  ==========================================

``ShardedGradScaler`` (torch/distributed/fsdp/sharded_grad_scaler.py, ``unscale_``) all-reduces the found-inf
flag over its process group; ``GroupGradScaler`` gives it ``None``, the default group when the call is made: the
current generation's, whatever the layout (dp x tp x pp) after a re-plan. The reduction is queued on the device
(``work.wait()`` orders streams on NCCL, the host does not wait), and with a fused optimizer (torch's
``_step_supports_amp_scaling``) ``GradScaler.step`` hands the flag to the optimizer without reading it.

Example (TrainWorker, once per process; the scaler lives across generations)::

    scaler = loss_scaler_for("zero3", model_parallel=1, device_type="cuda")   # GroupGradScaler
    runner = StepRunner(..., precision="fp16", scaler=scaler)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

WHOLE_GRADIENT_STRATEGIES = ("ddp", "diloco")
"""Strategies whose optimizer steps on whole gradients, the same on every rank that compares them."""


def loss_scaler_for(strategy_name: str, *, model_parallel: int, device_type: str) -> torch.amp.GradScaler:
    """fp16's loss scaler for ``strategy_name`` (strategy.name) at ``model_parallel`` ranks per model copy
    (parallel.tp x parallel.pp), on ``device_type`` ("cuda" or "cpu"); see the module's table."""
    if model_parallel == 1 and strategy_name in WHOLE_GRADIENT_STRATEGIES:
        return torch.amp.GradScaler(device_type)
    if model_parallel == 1 and strategy_name == "zero1":
        return WholeGradientScaler(device_type)
    return GroupGradScaler(device_type)


class GroupGradScaler(ShardedGradScaler):
    """``ShardedGradScaler`` over the default group at each step (the current generation's), its scale update
    on CPU as on GPU: torch's ``_amp_update_scale_`` kernel (ShardedGradScaler's CPU path reads the flag with
    ``.item()``; the kernel takes CPU tensors since GradScaler("cpu") exists)."""

    def __init__(self, device_type: str) -> None:
        super().__init__(device_type, process_group=None)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self._enabled and self._scale is None:  # a pipeline's first stages never scale a loss themselves
            self._lazy_init_scale_growth_tracker(torch.device(self._device))
        super().unscale_(optimizer)
        # The flag as GradScaler's own is, 0-dim and 0 or 1, for a fused optimizer (torch/optim/adam.py
        # ``_fused_adam``): it skips only where the flag is 1 and subtracts the flag from its 0-dim step counts in
        # place. ShardedGradScaler's is of shape (1,) and summed over the ranks (2 where two ranks overflow).
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = {device: flag.reshape(()).clamp(max=1.0) for device, flag in
                                         state["found_inf_per_device"].items()}

    def _amp_update_scale_cpu_(self, found_inf: torch.Tensor) -> None:
        assert self._scale is not None and self._growth_tracker is not None
        torch._amp_update_scale_(self._scale, self._growth_tracker, found_inf, self._growth_factor,
                                 self._backoff_factor, self._growth_interval)


@dataclass
class _StepGradients:
    """What ``GradScaler._unscale_grads_`` reads of an optimizer (its param groups), over other parameters."""

    param_groups: list[dict]


class WholeGradientScaler(torch.amp.GradScaler):
    """``GradScaler`` over the gradients an optimizer wrapper steps on, where it names them (``full``: zero1's
    ``ShardedOptimizer``, whose own parameters are row shards that get their gradients only inside its step).
    The full gradients are the same on every rank after DDP's all-reduce, so the ranks agree without a
    collective, and the clipping that follows the unscale sees them all unscaled."""

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        full = getattr(optimizer, "full", None)
        stepped_on = _StepGradients([{"params": full}]) if full is not None else optimizer
        return super()._unscale_grads_(stepped_on, inv_scale, found_inf, allow_fp16)  # type: ignore[arg-type]
