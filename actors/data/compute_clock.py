"""A rank's compute time per step, without the time it waits for slower peers.

A step's wall time is the same on every rank of a synchronous group: the fast ones wait for the slow
one in the gradient all-reduce. What tells them apart is when each rank's own work ends: the moment
backward has computed its last local gradient (its AccumulateGrad hook runs). So the clock runs from
the step's start to that moment; on a GPU it reads CUDA events recorded at both points, since the
host runs ahead of the device, and only once the step is read (``ComputeTime.seconds``): waiting for them at
each step would stall the host there. Under DDP (ddp, zero1, compression, hierarchical all-reduce) nothing
waits on peers before that point. FSDP2 (zero2, zero3) gathers parameters inside forward, where a
fast rank waits for the others, and its gradients land on the sharded parameters after the
reduce-scatter: there the clock reads the whole step, which is the same for every rank, and the
shares stay as they are.

Usage, by the step loop::

    clock = ComputeClock(device)
    clock.attach(state.model)            # hooks on every trained parameter (a new generation: again)
    clock.start()                        # the step begins
    ...forward, backward...
    clock.compute_s(step_s=...)          # this step's compute time (``step_s`` if no gradient was seen)
    timing = clock.measure(step_s=...)   # the same, read later: timing.seconds() (a GPU's: after a host read)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ComputeTime:
    """One step's compute time: known on the host (``host_s``), or between two CUDA events that complete with the
    step (``events``, read once the host has waited for the step)."""

    host_s: float
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def seconds(self) -> float:
        if self.events is None:
            return self.host_s
        start, gradient = self.events
        gradient.synchronize()  # at once after the step's read: the events are behind us
        return start.elapsed_time(gradient) / 1000


class ComputeClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._handles: list = []
        self._started = 0.0
        self._last_gradient: float | None = None
        self._start_event: torch.cuda.Event | None = None
        self._gradient_event: torch.cuda.Event | None = None

    def attach(self, model: torch.nn.Module) -> None:
        """Time the gradients of ``model``'s trained parameters (hooks from an earlier ``attach`` go)."""
        self.detach()
        self._handles = [p.register_post_accumulate_grad_hook(self._gradient_ready)
                         for p in model.parameters() if p.requires_grad]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def start(self) -> None:
        self._started, self._last_gradient = time.perf_counter(), None
        if self.cuda:  # new events each step: those of the steps not read yet are still to be read
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._gradient_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()

    def compute_s(self, step_s: float) -> float:
        """Seconds from ``start`` to the last gradient computed; ``step_s`` when no hook ran (FSDP2). On a GPU this
        waits for the step's gradients: ``measure`` does not."""
        return self.measure(step_s).seconds()

    def measure(self, step_s: float) -> ComputeTime:
        """``compute_s``, without waiting for the device."""
        if self._last_gradient is None:
            return ComputeTime(step_s)
        if self.cuda:
            return ComputeTime(step_s, (self._start_event, self._gradient_event))
        return ComputeTime(self._last_gradient - self._started)

    def _gradient_ready(self, parameter: torch.Tensor) -> None:
        self._last_gradient = time.perf_counter()
        if self.cuda:
            self._gradient_event.record()
