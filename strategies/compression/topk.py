"""Top-k sparsification with error feedback (Stich et al. 2018, "Sparsified SGD with Memory",
https://arxiv.org/abs/1809.07599; Lin et al. 2018, "Deep Gradient Compression",
https://arxiv.org/abs/1712.01887; Aji & Heafield 2017).

Per bucket and rank: c = gradient + residual; keep the k = ceil(fraction * numel) entries of c
with the largest magnitude; all-gather (values, indices) from every rank (k is the same on every
rank, the bucket being the same size); scatter-add all of them and divide by the world size;
the residual becomes c with the sent entries zeroed, so nothing is ever dropped, only delayed.
Bytes per bucket: k x (element size + 4) with int32 indices (8 for buckets of 2^31+ elements):
8 bytes per kept float32 instead of 4 per element, 50x less at 1%.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's annotations
# with dist.GradBucket and Future[Tensor] as objects and rejects strings.

import math

import torch
import torch.distributed as dist

from raylastic.strategies.compression.accounting import ErrorFeedback, HookState, all_gather_bytes, as_bytes, from_bytes


class TopKState(HookState):
    """The kept fraction and the per-parameter residuals."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, fraction: float = 0.01) -> None:
        super().__init__(process_group)
        self.fraction = fraction
        self.error_feedback = ErrorFeedback()

    def k_for(self, numel: int) -> int:
        return max(1, min(numel, math.ceil(self.fraction * numel)))


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The mean over ranks of every rank's top-k (error-compensated) entries of the bucket.

    Example::

        state = TopKState(fraction=0.01)
        ddp_model.register_comm_hook(state, topk_hook)
    """
    buffer = bucket.buffer()
    numel, world_size = buffer.numel(), state.world_size
    compensated = state.error_feedback.compensate(bucket, buffer)
    k = state.k_for(numel)
    indices = torch.topk(compensated.abs(), k, sorted=False).indices
    values = compensated[indices]
    index_dtype = torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64
    payload = torch.cat([as_bytes(values), as_bytes(indices.to(index_dtype))])
    compensated[indices] = 0  # what was not sent is carried to the next step
    state.error_feedback.store(bucket, compensated)
    state.record(bucket, payload.numel())
    state.end_bucket(bucket)
    value_bytes = k * buffer.element_size()

    def decompress(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        gathered = future.value()
        all_values = from_bytes(gathered[:, :value_bytes], buffer.dtype)
        all_indices = from_bytes(gathered[:, value_bytes:], index_dtype).long()
        buffer.zero_()
        for rank in range(world_size):  # rank order: the same float sums, bit for bit, on every rank
            buffer.index_add_(0, all_indices[rank], all_values[rank])
        return buffer.div_(world_size)

    return all_gather_bytes(payload, state.process_group).then(decompress)


def reference_topk_mean(per_rank_grads: list[torch.Tensor], residuals: list[torch.Tensor],
                        k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Naive reference: (the mean over ranks of the sparsified gradients, each rank's new residual)."""
    world_size = len(per_rank_grads)
    total = torch.zeros_like(per_rank_grads[0])
    new_residuals = []
    for grad, residual in zip(per_rank_grads, residuals, strict=True):
        compensated = grad + residual
        order = sorted(range(compensated.numel()), key=lambda i: -abs(compensated[i].item()))
        kept = torch.zeros_like(compensated)
        kept[order[:k]] = compensated[order[:k]]
        total += kept
        new_residuals.append(compensated - kept)
    return total / world_size, new_residuals
