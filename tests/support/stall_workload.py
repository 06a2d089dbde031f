"""A workload whose steps stall from a chosen one on, so that a test can ask for a stop the run cannot honour
in time. Referenced as "tests.support.stall_workload:StallingDigits"."""

from __future__ import annotations

import time

import torch

from tests.support.user_workload import SlowDigits


class StallingDigits(SlowDigits):
    """The digits workload; every micro-batch from the ``stall_from``-th one of this process on sleeps ``stall_s``
    (with one worker and no accumulation, the ``stall_from``-th step stalls)."""

    def __init__(self, stall_from: int = 3, stall_s: float = 600.0) -> None:
        super().__init__(pause_s=0.0)
        self.stall_from = stall_from
        self.stall_s = stall_s
        self.calls = 0

    def training_step(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        if self.calls >= self.stall_from:
            time.sleep(self.stall_s)
        return super().training_step(model, batch)
