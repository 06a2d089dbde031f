"""A workload with one bad sample: its features are NaN, so the step that trains on it has a NaN loss on
the rank that holds it (and, after the all-reduce, NaN gradients on every rank). Referenced as
"tests.support.nan_workload:PoisonedDigits" with ``workload.options={poison_index: i}``; ``poison_index_for``
finds the sample that a given step and rank train on."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from raylastic.actors.data.order import GlobalSampleOrder


class PoisonedDigits:
    def __init__(self, poison_index: int) -> None:
        from raylastic.workloads.digits import Digits

        self.digits = Digits()
        self.poison_index = poison_index

    def build_model(self) -> torch.nn.Module:
        return self.digits.build_model()

    def train_dataset(self) -> TensorDataset:
        features, labels = self.digits.train_dataset().tensors
        features = features.clone()
        features[self.poison_index] = float("nan")
        return TensorDataset(features, labels)

    def training_step(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.digits.training_step(model, batch)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        return self.digits.evaluate(model)


def poison_index_for(step: int, rank: int, world_size: int, global_batch_size: int, seed: int = 0) -> int:
    """The dataset index of the first sample rank ``rank`` trains on in step ``step`` (1-based)."""
    from raylastic.workloads.digits import Digits

    order = GlobalSampleOrder(len(Digits().train_dataset()), global_batch_size, seed)
    return int(order.rank_indices(step - 1, rank, world_size)[0])
