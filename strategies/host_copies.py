"""Copies of device tensors into host memory that the training thread does not wait for.

On CUDA a copy goes into a page-locked (pinned) host buffer with ``non_blocking=True`` on a side stream: the
side stream first waits for the current stream (whose kernels wrote the sources), the copies are queued on
it, and an event marks their end. Nothing waits for that event until the bytes are needed (before they are
sent, or before the buffer is written again), so the next step's kernels are queued meanwhile and run beside
the copy. The sources are recorded on the side stream (``Tensor.record_stream``): the caching allocator does
not give their memory to another tensor before the copy has read it. Sources that the next step's forward
may change in place (``ordered``: BatchNorm's running statistics, the loss scaler's entries) are copied first,
and the current stream waits for those alone, on the device: the copy is exactly the state it was made of.

On CPU the copy is a plain memcpy on the calling thread, done when ``copy`` returns: it is the snapshot of
the state between two steps (the next step's optimizer changes the sources in place), so it cannot be left
to run beside the step, and there is no device to overlap with.

Example (strategies/buddy_copy.py packs a shard this way)::

    copier = HostCopier(torch.device("cuda", 0))
    buffer = copier.pool.take(nbytes)                      # pinned; reused once given back
    pending = copier.copy([(view_of_buffer, source), ...]) # queued on the side stream; returns at once
    ...                                                    # the next step's forward is queued meanwhile
    pending.wait(timeout_s=30)                             # the bytes are in host memory now
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

CopyPath = Literal["side_stream", "inline"]
"""``side_stream``: pinned buffers, non-blocking copies on a side stream, an event; ``inline``: a plain copy."""
POLL_S = (0.0001, 0.002)
"""The bounded wait for a copy's event polls from the first interval up to the second, doubling."""


def copy_path(device: torch.device, cuda_available: bool) -> CopyPath:
    """How copies from ``device`` to host memory are made."""
    if device.type != "cuda":
        return "inline"
    if not cuda_available:
        raise ValueError(f"device: {device} needs CUDA, and torch sees none; allowed: a cuda device where CUDA "
                         "is available, or cpu")
    return "side_stream"


def reusable_index(free: Sequence[tuple[int, torch.dtype]], numel: int, dtype: torch.dtype) -> int | None:
    """Which free buffer (its numel and dtype) a request for ``numel`` elements of ``dtype`` takes: the first of
    exactly that size and dtype (a packed shard's views are laid out for its size), or None."""
    for index, (size, kind) in enumerate(free):
        if size == numel and kind == dtype:
            return index
    return None


def source_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    """The device copies of ``tensors`` come from: the first CUDA tensor's, else the CPU."""
    return next((t.device for t in tensors if t.device.type == "cuda"), torch.device("cpu"))


@dataclass
class BufferPool:
    """Host buffers given back for reuse (pinned ones are costly to allocate and to free)."""

    pinned: bool
    free: list[torch.Tensor] = field(default_factory=list)

    def take(self, numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A buffer of ``numel`` elements: a free one that fits, or a new one. Free buffers that do not fit are
        dropped when a new one is made: the state's size changed (an optimizer's state built late)."""
        index = reusable_index([(buffer.numel(), buffer.dtype) for buffer in self.free], numel, dtype)
        if index is not None:
            return self.free.pop(index)
        self.free.clear()
        return torch.empty(numel, dtype=dtype, pin_memory=self.pinned)

    def give_back(self, buffer: torch.Tensor) -> None:
        """``buffer`` may be taken again: nothing reads it or copies into it any more."""
        self.free.append(buffer)

    def nbytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.free)


@dataclass
class PendingCopy:
    """Copies queued by ``HostCopier.copy``; ``event`` marks their end on the side stream (None: done)."""

    event: torch.cuda.Event | None = None

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self, timeout_s: float) -> None:
        """Until the bytes are in host memory; after ``timeout_s`` a DistNetworkError, which the run takes for a
        lost peer: a device that no longer runs what it was given is stuck in a collective with one (and the
        copy is not to be trusted)."""
        if self.event is None:
            return
        deadline, interval = time.monotonic() + timeout_s, POLL_S[0]
        while not self.event.query():
            if time.monotonic() > deadline:
                raise dist.DistNetworkError(f"a copy to host memory did not complete within {timeout_s:g}s: "
                                            "the device is stuck (in a collective with a lost peer)")
            time.sleep(interval)
            interval = min(2 * interval, POLL_S[1])
        self.event = None


def copy_now(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> PendingCopy:
    """Copy each (host target, source) pair in one call (a shard has hundreds of small entries); done on return,
    from a GPU too (a blocking copy)."""
    if pairs:
        torch._foreach_copy_([target for target, _ in pairs], [source for _, source in pairs])
    return PendingCopy()


class HostCopier:
    """Copies from one device into host buffers (``copy_path``'s way for that device), with a pool of them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.path = copy_path(device, device.type == "cuda" and torch.cuda.is_available())  # CPU: CUDA untouched
        self.pool = BufferPool(pinned=self.path == "side_stream")
        self._stream = torch.cuda.Stream(device=device) if self.path == "side_stream" else None

    @classmethod
    def for_tensors(cls, tensors: Sequence[torch.Tensor]) -> HostCopier:
        """A copier for sources on ``source_device(tensors)``."""
        return cls(source_device(tensors))

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
             ordered: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> PendingCopy:
        """Copy each (host target, source) pair; ``ordered``: pairs whose sources the next kernels of the current
        stream may change in place (they wait for these copies, on the device). CPU: done on return."""
        pairs = [*ordered, *pairs]
        if not pairs:
            return PendingCopy()
        if self._stream is None:
            return copy_now(pairs)
        sources = [source for _, source in pairs]
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)  # the sources hold what the kernels queued so far wrote
        with torch.cuda.stream(self._stream):
            for index, (target, source) in enumerate(pairs):
                target.copy_(source, non_blocking=True)
                if index == len(ordered) - 1:
                    first = torch.cuda.Event()
                    first.record(self._stream)
                    current.wait_event(first)  # on the device: the next step's forward changes these in place
        for source in sources:
            if source.is_cuda:
                source.record_stream(self._stream)
        event = torch.cuda.Event()
        event.record(self._stream)
        return PendingCopy(event)
