"""What a workload is: a model, its training data, a summed loss and held-out metrics.

A workload is a class referenced by import path, ``"pkg.module:ClassName"`` (or a built-in
short name such as ``"digits"``); Raylastic constructs it as ``ClassName(**options)`` with
``workload.options`` from the job config, once in every worker process.

Example (a user's own workload, run with ``--set workload.name=mypkg.model:Tiny``)::

    class Tiny:
        def __init__(self, hidden: int = 32):
            self.hidden = hidden

        def build_model(self) -> torch.nn.Module:
            return torch.nn.Sequential(torch.nn.Linear(4, self.hidden), torch.nn.Linear(self.hidden, 2))

        def train_dataset(self) -> torch.utils.data.Dataset:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(256, 4, generator=g)
            return torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())

        def loss_sum(self, outputs, targets) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(outputs, targets, reduction="sum")

        def evaluate(self, model) -> dict[str, float]:
            return {}

Rules the training loop relies on:
- ``build_model`` is deterministic given the process's torch seed (the worker seeds it), and
  the model has no randomness in ``forward`` (no dropout), so the result does not depend on
  how the global batch is split across workers.
- ``train_dataset`` returns a map-style dataset whose items are ``(input, target)``; a
  ``TensorDataset`` is indexed in one gather per micro-batch, anything else goes through
  ``default_collate``.
- ``loss_sum`` returns the loss *summed* over the samples of the batch (a per-sample mean
  over tokens is fine); the loop divides by the global batch size.
- ``evaluate`` returns held-out metrics; a classifier returns ``"accuracy"``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch.utils.data import Dataset


@runtime_checkable
class Workload(Protocol):
    def build_model(self) -> torch.nn.Module: ...

    def train_dataset(self) -> Dataset: ...

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]: ...
