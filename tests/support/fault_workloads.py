"""User workloads that misbehave the way real jobs do: a bug at some step, a hang, a slow start.

Each is the digits workload plus one defect; "once" defects leave a marker file behind so that the
replacement worker of a recovered run behaves.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from raylastic.workloads.digits import Digits


class _DigitsBase:
    def __init__(self) -> None:
        self.digits = Digits()
        self.calls = 0

    def build_model(self) -> torch.nn.Module:
        return self.digits.build_model()

    def train_dataset(self) -> TensorDataset:
        return self.digits.train_dataset()

    def training_step(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        return self.digits.training_step(model, batch)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        return self.digits.evaluate(model)


def _claim(marker: str) -> bool:
    """True for the first process to ask (the marker did not exist yet)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


class BuggyDigits(_DigitsBase):
    """A bug in the user's code: ``training_step`` raises on rank ``rank`` at its ``step``-th call."""

    def __init__(self, step: int, rank: int = 1) -> None:
        super().__init__()
        self.step, self.rank = step, rank

    def training_step(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.calls + 1 == self.step and dist.get_rank() == self.rank:
            raise ValueError(f"shapes do not match in the user's loss (step {self.step})")
        return super().training_step(model, batch)


class MismatchedCollectiveDigits(_DigitsBase):
    """A collective the ranks call with arguments that differ between them: at its ``step``-th step every rank
    reduces to itself as the root, so every rank waits for the others and none sends; each rank's collective
    fails when failure.collective_timeout_s ends, and no worker is lost. (A size mismatch on gloo aborts the
    receiving process instead, which looks like any other lost worker.) Every step from then on does the same."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def training_step(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.calls + 1 >= self.step:
            dist.reduce(torch.ones(4), dst=dist.get_rank())
        return super().training_step(model, batch)


class HangingDigits(_DigitsBase):
    """A deadlock in the user's code, once per run: the first worker of rank ``rank`` to reach its
    ``step``-th step never returns from it (its process still answers the Controller)."""

    def __init__(self, step: int, marker: str, rank: int = 1) -> None:
        super().__init__()
        self.step, self.marker, self.rank = step, marker, rank

    def training_step(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.calls + 1 == self.step and dist.get_rank() == self.rank and _claim(self.marker):
            threading.Event().wait()
        return super().training_step(model, batch)


class SlowStartDigits(_DigitsBase):
    """One worker of the run (the first to start) takes ``delay_s`` to build its workload, as a slow node's
    worker loading a large dataset does."""

    def __init__(self, delay_s: float, marker: str) -> None:
        super().__init__()
        if _claim(marker):
            time.sleep(delay_s)


class SlowBuildDigits(_DigitsBase):
    """Building the model takes ``delay_s`` (a sharded strategy builds it at every generation)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def build_model(self) -> torch.nn.Module:
        time.sleep(self.delay_s)
        return super().build_model()


def marker_path(directory: Path, name: str) -> str:
    return str(directory / f"{name}.marker")


class FailingEvaluationDigits(_DigitsBase):
    """A bug in the user's evaluation: ``evaluate`` raises (the first time it runs, at the run's end)."""

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        raise ValueError("the evaluation set is empty")


class MissingDataOnNewNodes(_DigitsBase):
    """Its data is on the first ``healthy`` workers' nodes only: every worker started after them fails to build
    the workload, as one placed on a node without ``data_dir`` does."""

    def __init__(self, marker: str, healthy: int = 2) -> None:
        super().__init__()
        if not any(_claim(f"{marker}.{index}") for index in range(healthy)):
            raise FileNotFoundError(f"data_dir /data/digits does not exist on {os.uname().nodename}")
