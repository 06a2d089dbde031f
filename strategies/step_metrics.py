"""Summing a step's metrics and control values ([loss_sum, samples, stop_vote]) over the ranks.

Every step needs them summed before its optimizer step (they are the loss the run reports and
the channel that stops every rank at the same step boundary). Two ways, the same result:

- ``SeparateAllReduce``: an all-reduce of its own, started after the last forward so that it
  travels while the last backward runs. Any strategy can use it.
- ``BucketPiggyback``: the values ride in the plain float32 all-reduce of DDP's first gradient
  bucket, so the step makes no extra collective. A tiny all-reduce costs a round trip of its
  own (~0.5 ms with gloo on a busy CPU: a quarter of a small model's step); carried along it
  costs nothing measurable, as long as the carrying stays lean: bucket 0's mean and the values
  go into one buffer kept from step to step, and DDP copies the mean from it into the gradients
  (a first version that allocated, concatenated and copied back cost ~0.13 ms a step on the
  digits MLP). It wraps the uncompressed hook only: lossy compression must never touch the
  metrics.

Usage in a step (``reduction`` is either)::

    reduction.start(values)      # after the last micro-batch's forward, before its backward
    loss.backward()              # DDP reduces its buckets (carrying the values in bucket 0)
    totals = reduction.finish()  # the values summed over ranks; raises if a peer was lost

No ``from __future__ import annotations`` here: DDP rejects hooks whose annotations are strings.
"""

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist


class MetricsReduction(Protocol):
    def start(self, values: torch.Tensor) -> None:
        """Hand over this rank's values (a 1-D float64 tensor); call before the last backward."""
        ...

    def finish(self) -> torch.Tensor:
        """The values summed over every rank (float64), once the last backward has returned."""
        ...


class SeparateAllReduce:
    """An all-reduce of the values alone, overlapping the last backward (none at world size 1:
    the values are already the sums)."""

    def __init__(self) -> None:
        self._values: torch.Tensor | None = None
        self._work: dist.Work | None = None

    def start(self, values: torch.Tensor) -> None:
        self._values = values
        self._work = dist.all_reduce(values, async_op=True) if dist.get_world_size() > 1 else None

    def finish(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        values, self._values, self._work = self._values, None, None
        return values


class BucketPiggyback:
    """Carries the values in the all-reduce of DDP's bucket 0 (the uncompressed hook's).

    DDP reduces every bucket in every synchronising backward, on every rank, so bucket 0 carries
    the values everywhere or (should a backward skip it) nowhere; ``finish`` then all-reduces
    them separately, the same on every rank.
    """

    def __init__(self) -> None:
        self._outgoing: torch.Tensor | None = None
        self._incoming: torch.Tensor | None = None
        self._combined: torch.Tensor | None = None
        """Bucket 0's mean and the values, all-reduced together; kept from step to step (no allocation)."""
        self.carried = 0
        """Steps whose values bucket 0 carried (the rest needed an all-reduce of their own)."""

    def start(self, values: torch.Tensor) -> None:
        self._outgoing, self._incoming = values, None

    def finish(self) -> torch.Tensor:
        if self._outgoing is not None:  # no bucket carried them
            values, self._outgoing = self._outgoing, None
            dist.all_reduce(values)
            return values
        values, self._incoming = self._incoming, None  # summed: backward waited for bucket 0's all-reduce
        return values.to(torch.float64)

    def wrap(self, uncompressed_hook: Callable) -> Callable:
        """``uncompressed_hook`` (a hook state with ``record``/``end_bucket`` and a mean all-reduce)
        with bucket 0 carrying the values."""
        carrier = self

        def carrying_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            buffer = bucket.buffer()
            if bucket.index() != 0 or carrier._outgoing is None or not buffer.is_floating_point() \
                    or buffer.element_size() < 4:
                return uncompressed_hook(state, bucket)
            values, carrier._outgoing = carrier._outgoing, None
            carrier.carried += 1
            state.end_bucket(bucket)
            state.record(bucket, buffer.numel() * buffer.element_size())
            size = buffer.numel()
            combined = carrier._combined_buffer(size + len(values), buffer)
            torch.div(buffer, state.world_size, out=combined[:size])
            combined[size:].copy_(values)
            carrier._incoming = combined[size:]
            # DDP copies the returned mean into the gradients (it need not be the bucket's own buffer)
            return dist.all_reduce(combined, group=state.process_group, async_op=True).get_future().then(
                lambda future: future.value()[0][:size])

        carrying_hook.__name__ = f"piggyback_{getattr(uncompressed_hook, '__name__', 'hook')}"
        return carrying_hook

    def _combined_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        if self._combined is None or self._combined.numel() != numel or self._combined.dtype != like.dtype \
                or self._combined.device != like.device:
            self._combined = torch.empty(numel, dtype=like.dtype, device=like.device)
        return self._combined
