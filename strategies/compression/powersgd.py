"""PowerSGD (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", https://arxiv.org/abs/1905.13727): torch's hook, with byte accounting.

Each gradient, viewed as an n x m matrix M (first dim x the rest), is replaced by a rank-r
approximation from one step of power iteration, warm-started from the previous step's Q:
P = M Q (all-reduced, summed), P orthogonalized, Q = M^T P (all-reduced, averaged), M ~ P Q^T.
Error feedback adds each rank's approximation error to its next gradient. Tensors too small to
gain (``(n + m) r * min_compression_rate >= n m``: biases, norms) are all-reduced as they are.
The first ``start_iter`` iterations are a plain all-reduce (compressing too early hurts accuracy,
and torch keys its error and P/Q buffers by bucket index, which only stabilises once DDP has
rebuilt its buckets after the first iteration).

torch's hook exposes no byte count, so it is computed from the bucket's shapes with torch's own
rule (``_should_compress``): per compressed matrix (n + m) r elements (P then Q), per other
tensor its numel, times the element size; before ``start_iter`` the whole bucket.

Gloo: torch's hook starts its P and Q all-reduces from future callbacks, which on gloo run on
gloo's threads; with several buckets in flight two ranks can then issue the all-reduces of
different buckets in different orders ("Received data size doesn't match expected size", seen
here with torch 2.13). On CPU tensors this hook therefore waits for a bucket's chain before
returning, so buckets are compressed one after another (no overlap with the backward pass). On
NCCL a collective's future is complete at enqueue, the callbacks run inline, and nothing waits.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's annotations
# with dist.GradBucket and Future[Tensor] as objects and rejects strings.

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from raylastic.strategies.compression.accounting import HookState


class PowerSGDHookState(HookState):
    """torch's ``PowerSGDState`` (in ``.powersgd``) plus the accounting of this package."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, rank: int = 4, start_iter: int = 10,
                 min_compression_rate: float = 2.0, random_seed: int = 0) -> None:
        super().__init__(process_group)
        self.powersgd = torch_powersgd.PowerSGDState(  # imports numpy
            process_group=process_group, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter,
            min_compression_rate=min_compression_rate, use_error_feedback=True, warm_start=True,
            random_seed=random_seed)


def powersgd_payload_bytes(bucket: dist.GradBucket, state: torch_powersgd.PowerSGDState) -> int:
    """Bytes this rank all-reduces for ``bucket`` in torch's hook at ``state``'s current iteration."""
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        return buffer.numel() * buffer.element_size()
    elements = 0
    for gradient in bucket.gradients():
        n = gradient.shape[0]
        m = gradient.numel() // n
        rank = min(n, m, state.matrix_approximation_rank)
        compress, uncompressed, compressed = torch_powersgd._should_compress(n, m, rank, state.min_compression_rate)
        elements += compressed if compress else uncompressed
    return elements * buffer.element_size()


def powersgd_hook(state: PowerSGDHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``powerSGD_hook`` on ``state.powersgd``, counting the bytes it all-reduces.

    Example::

        state = PowerSGDHookState(rank=4, start_iter=10)
        ddp_model.register_comm_hook(state, powersgd_hook)
    """
    state.record(bucket, powersgd_payload_bytes(bucket, state.powersgd))  # before the hook advances iter
    state.end_bucket(bucket)
    future = torch_powersgd.powerSGD_hook(state.powersgd, bucket)
    if bucket.buffer().device.type == "cpu":
        future.wait()  # gloo: the chain's later all-reduces start from callbacks; finish it before the next bucket
    return future


def reference_powersgd_mean(per_rank_matrices: list[torch.Tensor], q: torch.Tensor) -> torch.Tensor:
    """Naive reference of one compressed PowerSGD step from initial ``q`` (m x r), no prior error.

    P = orth(sum_i M_i Q), Q' = mean_i M_i^T P, result P Q'^T = P P^T mean(M): the projection of
    the mean gradient onto span(mean(M) Q); any orthonormal basis of that span gives the same result.
    """
    mean = sum(per_rank_matrices) / len(per_rank_matrices)
    p, _ = torch.linalg.qr(sum(m @ q for m in per_rank_matrices))
    return p @ (mean.T @ p).T
