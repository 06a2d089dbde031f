"""Uncompressed and half-precision all-reduce: torch's default hooks, with byte accounting.

``none`` all-reduces the float32 bucket as DDP does without a hook (bitwise the same result;
the hook only adds the accounting). ``fp16`` / ``bf16`` cast the bucket to 16 bits, divide by
the world size *before* summing (so fp16 can't overflow) and cast back: half the bytes, with a
relative error of ~2^-11 (fp16) or ~2^-8 (bf16) per element. Mixed-precision all-reduce of
gradients as in Micikevicius et al. 2018, "Mixed Precision Training".
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's annotations
# with dist.GradBucket and Future[Tensor] as objects and rejects strings.

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from raylastic.strategies.compression.accounting import HookState


class LowPrecisionState(HookState):
    """``dtype`` None: plain all-reduce; torch.float16 / torch.bfloat16: cast for the all-reduce."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(process_group)
        if dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be None, torch.float16 or torch.bfloat16, got {dtype}")
        self.dtype = dtype


def low_precision_hook(state: LowPrecisionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the mean of the bucket, in ``state.dtype`` when it is set.

    Example::

        state = LowPrecisionState(dtype=torch.bfloat16)
        ddp_model.register_comm_hook(state, low_precision_hook)
    """
    buffer = bucket.buffer()
    state.end_bucket(bucket)
    if state.dtype is None:
        state.record(bucket, buffer.numel() * buffer.element_size())
        return default_hooks.allreduce_hook(state.process_group, bucket)
    state.record(bucket, buffer.numel() * torch.finfo(state.dtype).bits // 8)
    if state.dtype == torch.float16:
        return default_hooks.fp16_compress_hook(state.process_group, bucket)
    return default_hooks.bf16_compress_hook(state.process_group, bucket)


def reference_low_precision_mean(per_rank_grads: list[torch.Tensor], dtype: torch.dtype | None) -> torch.Tensor:
    """Naive reference: each rank's gradient cast to ``dtype`` and divided by N, summed, cast back."""
    world_size = len(per_rank_grads)
    if dtype is None:
        return sum(g / world_size for g in per_rank_grads)
    total = sum(g.to(dtype) / world_size for g in per_rank_grads)
    return total.to(per_rank_grads[0].dtype)
