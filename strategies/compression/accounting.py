"""What every communication hook shares: byte accounting, step counting, error feedback, one gather.

A DDP comm hook is called once per gradient bucket per communicating backward pass (only the
last micro-batch of an accumulated step communicates: ``no_sync`` skips the hook entirely), in
bucket index order: bucket 0 (the gradients ready first, i.e. the last layers) starts an
iteration and ``bucket.is_last()`` (index == bucket count - 1, the first layers) ends it. The
states here count optimizer steps at the last bucket, as torch's
``PowerSGDState.maybe_increase_iter`` does, so every bucket of iteration t sees ``steps == t``.

Bytes are counted as the *payload* this rank contributes to collectives: the size of the
tensors it hands to all_reduce / all_gather, not what a ring or tree moves on the wire (an
all-reduce moves about 2(N-1)/N times its payload per rank, an all-gather (N-1)/N times the
payload of every rank, so it *receives* N-1 payloads). ``uncompressed_bytes`` is what plain
DDP would have contributed for the same buckets (numel x element size), so the ratio of the
two is the compression ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CommTraffic:
    """Payload bytes over some stretch of training (one step, or since the hook was built)."""

    bytes_sent: int
    """Bytes this rank contributed to the hook's collectives."""
    uncompressed_bytes: int
    """Bytes an uncompressed all-reduce of the same buckets would have contributed."""


NO_TRAFFIC = CommTraffic(bytes_sent=0, uncompressed_bytes=0)


class HookState:
    """The state every hook of this package carries: its group, byte counters and step count.

    ``bytes_sent`` and ``uncompressed_bytes`` are cumulative; ``take_bytes_sent()`` /
    ``take_traffic()`` return what was added since the previous take (the step loop calls one of
    them once per step). ``steps`` counts communicated iterations (= optimizer steps).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.bytes_sent = 0
        self.uncompressed_bytes = 0
        self.steps = 0
        self._taken = CommTraffic(0, 0)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def record(self, bucket: dist.GradBucket, payload_bytes: int) -> None:
        """Count one bucket: ``payload_bytes`` sent instead of the bucket's full size."""
        buffer = bucket.buffer()
        self.bytes_sent += int(payload_bytes)
        self.uncompressed_bytes += buffer.numel() * buffer.element_size()

    def end_bucket(self, bucket: dist.GradBucket) -> None:
        """Call once per bucket after choosing what to do with it: the last bucket ends the iteration."""
        if bucket.is_last():
            self.steps += 1

    def take_traffic(self) -> CommTraffic:
        """The traffic since the previous take (and start counting anew)."""
        taken = CommTraffic(self.bytes_sent - self._taken.bytes_sent,
                            self.uncompressed_bytes - self._taken.uncompressed_bytes)
        self._taken = CommTraffic(self.bytes_sent, self.uncompressed_bytes)
        return taken

    def take_bytes_sent(self) -> int:
        """Bytes sent since the previous take (the ``bytes_sent`` of ``take_traffic()``)."""
        return self.take_traffic().bytes_sent


class UncompressedTraffic:
    """The traffic of DDP's own all-reduce, which no hook counts: every gradient, once per step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.step_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

    def take_traffic(self) -> CommTraffic:
        """One step's traffic (the step loop takes it once per step, like a hook state's)."""
        return CommTraffic(self.step_bytes, self.step_bytes)


class ErrorFeedback:
    """Per-parameter residuals ("error memory") of a lossy compressor.

    Keyed by parameter, not by bucket index: torch 2.13 DDP puts every parameter in one bucket
    for the first iteration and rebuilds the buckets after it (and a rebuild may regroup them),
    so a residual stored by bucket index would no longer fit its bucket. A bucket's flat buffer
    is its parameters' gradients concatenated in ``bucket.parameters()`` order.
    """

    def __init__(self) -> None:
        self._residuals: dict[int, torch.Tensor] = {}  # id(parameter) -> residual of its gradient

    def compensate(self, bucket: dist.GradBucket, flat: torch.Tensor) -> torch.Tensor:
        """A new tensor: ``flat`` plus the stored residual of each of the bucket's parameters."""
        compensated = flat.clone()
        offset = 0
        for parameter in bucket.parameters():
            numel = parameter.numel()
            residual = self._residuals.get(id(parameter))
            if residual is not None:
                compensated[offset:offset + numel].add_(residual)
            offset += numel
        assert offset == flat.numel(), f"bucket {bucket.index()}: parameters hold {offset}, buffer {flat.numel()}"
        return compensated

    def store(self, bucket: dist.GradBucket, residual: torch.Tensor) -> None:
        """Remember ``residual`` (flat, the bucket's layout) for the bucket's parameters."""
        offset = 0
        for parameter in bucket.parameters():
            numel = parameter.numel()
            self._residuals[id(parameter)] = residual[offset:offset + numel]
            offset += numel

    def clear(self) -> None:
        self._residuals.clear()


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``tensor`` as a flat uint8 tensor (no conversion)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def from_bytes(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 ``raw`` (last dim) as ``dtype``; copies first so any byte offset is aligned."""
    return raw.clone().view(dtype)


def all_gather_bytes(payload: torch.Tensor,
                     process_group: dist.ProcessGroup | None) -> torch.futures.Future[torch.Tensor]:
    """All-gather one flat uint8 payload of the same length on every rank: a future of (world, length).

    One collective per bucket, issued from the calling thread: every rank issues its collectives
    in the same order, which a chain of collectives started from future callbacks can't promise.
    """
    world_size = dist.get_world_size(process_group)
    gathered = torch.empty(world_size, payload.numel(), dtype=torch.uint8, device=payload.device)
    work = dist.all_gather(list(gathered.unbind(0)), payload, group=process_group, async_op=True)
    return resolves_to(work.get_future(), gathered)


def resolves_to(future: torch.futures.Future, value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future of ``value`` once ``future`` is done, failing if it failed.

    ``future.then(lambda _: value)`` would swallow a collective's error (a peer lost mid-step) and
    hand DDP whatever the output buffer held: the survivors would step on garbage instead of
    discarding the step.
    """

    def done(finished: torch.futures.Future) -> torch.Tensor:
        finished.value()  # re-raises the collective's error
        return value

    return future.then(done)
