"""1-bit (sign) compression with error feedback after a full-precision warm-up.

1-bit SGD: Seide et al. 2014, "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs"; the warm-up then 1-bit stage: Tang et al.
2021, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed"
(https://arxiv.org/abs/2102.02888); the scaled sign with error feedback: Karimireddy et al. 2019,
"Error Feedback Fixes SignSGD and other Gradient Compression Schemes".

The first ``warmup_steps`` optimizer steps are a plain all-reduce of the mean. After that, per
bucket and rank: c = gradient + residual, scale = mean(|c|) (the L2-optimal scale for sign(c)),
the signs of c packed 8 to a byte; signs and scale are all-gathered and every rank reconstructs
sum_r scale_r sign_r / N; the residual becomes c - scale sign(c). Zero counts as positive.
Bytes per bucket: ceil(numel / 8) + 4, ~32x less than float32.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's annotations
# with dist.GradBucket and Future[Tensor] as objects and rejects strings.

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from raylastic.strategies.compression.accounting import ErrorFeedback, HookState, all_gather_bytes, as_bytes, from_bytes


class OneBitState(HookState):
    """The warm-up length, the step counts and the residuals."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, warmup_steps: int = 50,
                 completed_steps: int = 0) -> None:
        super().__init__(process_group)
        self.warmup_steps = warmup_steps
        self.completed_steps = completed_steps
        """Run steps committed before this state was built (the warm-up counts run steps)."""
        self.error_feedback = ErrorFeedback()

    @property
    def compressing(self) -> bool:
        return self.completed_steps + self.steps >= self.warmup_steps


def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=device)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """One bit per element (1: >= 0), 8 to a uint8, most significant bit first; padded with 0s."""
    bits = (values >= 0).to(torch.uint8)
    padding = (-bits.numel()) % 8
    if padding:
        bits = torch.cat([bits, bits.new_zeros(padding)])
    return (bits.view(-1, 8) * _bit_weights(values.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The +1/-1 signs of ``pack_signs`` (``numel`` of them) as ``dtype``."""
    bits = (packed.unsqueeze(-1) & _bit_weights(packed.device)) != 0
    signs = bits.reshape(-1)[:numel].to(dtype)
    return signs.mul_(2).sub_(1)


def onebit_hook(state: OneBitState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The mean over ranks: exact during the warm-up, of scaled signs with error feedback after it.

    Example::

        state = OneBitState(warmup_steps=50)
        ddp_model.register_comm_hook(state, onebit_hook)
    """
    buffer = bucket.buffer()
    numel, world_size = buffer.numel(), state.world_size
    if not state.compressing:
        state.record(bucket, numel * buffer.element_size())
        state.end_bucket(bucket)
        return default_hooks.allreduce_hook(state.process_group, bucket)

    compensated = state.error_feedback.compensate(bucket, buffer)
    scale = compensated.abs().mean(dtype=torch.float32).reshape(1)
    packed = pack_signs(compensated)
    sent = unpack_signs(packed, numel, compensated.dtype).mul_(scale.to(compensated.dtype))
    state.error_feedback.store(bucket, compensated.sub_(sent))
    payload = torch.cat([packed, as_bytes(scale)])
    state.record(bucket, payload.numel())
    state.end_bucket(bucket)
    sign_bytes = packed.numel()

    def decompress(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        gathered = future.value()
        scales = from_bytes(gathered[:, sign_bytes:], torch.float32).to(buffer.dtype)
        buffer.zero_()
        for rank in range(world_size):  # rank order: the same float sums, bit for bit, on every rank
            buffer.add_(unpack_signs(gathered[rank, :sign_bytes], numel, buffer.dtype).mul_(scales[rank]))
        return buffer.div_(world_size)

    return all_gather_bytes(payload, state.process_group).then(decompress)


def reference_onebit_mean(per_rank_grads: list[torch.Tensor],
                          residuals: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Naive reference of one compressed step: (mean of scaled signs, each rank's new residual)."""
    sent = []
    new_residuals = []
    for grad, residual in zip(per_rank_grads, residuals, strict=True):
        compensated = grad + residual
        signs = torch.where(compensated >= 0, 1.0, -1.0).to(grad.dtype)
        scaled = compensated.abs().mean() * signs
        sent.append(scaled)
        new_residuals.append(compensated - scaled)
    total = torch.zeros_like(per_rank_grads[0])
    for scaled in sent:
        total += scaled
    return total / len(sent), new_residuals
