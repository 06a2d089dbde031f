"""Evaluation on every rank: the workload's ``evaluate`` and its ``eval_dataset`` spread over the group.

``eval_step(model, batch)`` returns sums over the batch's samples; each rank evaluates a contiguous
share of ``eval_dataset`` and the sums are all-reduced, so every rank ends with the same metrics
(each sum divided by the samples evaluated). Every rank runs the same number of forward passes (a
rank whose share is shorter repeats a batch and discards it): under zero3 each forward gathers
parameters collectively, so no rank may skip one. Under tensor parallelism the shares are the data-parallel
ranks' (actors/worker/data_place.py): the ranks of a tp group evaluate the same batches together, and one
of them counts them.

Example::

    evaluator = Evaluator(workload, batch_size=64, device=torch.device("cpu"))
    metrics = evaluator.run(model)     # e.g. {"eval_loss": 1.93}; collective: call on every rank
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from raylastic.actors.data.batch_split import rank_slice
from raylastic.actors.data.batches import fetch_batch, loader_inputs, to_device
from raylastic.actors.worker.data_place import DataPlace
from raylastic.actors.worker.pipeline_step import Pipeline
from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.workloads.protocol import Workload

logger = logging.getLogger(__name__)


class Evaluator:
    def __init__(self, workload: Workload, *, batch_size: int, device: torch.device,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
        self.workload, self.batch_size, self.device, self.autocast = workload, batch_size, device, autocast
        self.layout: ParallelLayout | None = None
        """The current group's model-parallel layout (None: every rank a data-parallel one)."""
        self.pipeline: Pipeline | None = None
        """The current group's pipeline (parallel.pp > 1), which evaluation runs through."""
        self._warned = False
        self.dataset = workload.eval_dataset() if hasattr(workload, "eval_dataset") else None
        if self.dataset is not None:
            self.source, self.collate = loader_inputs(self.dataset, getattr(workload, "collate", None))

    def run(self, model: torch.nn.Module) -> dict[str, float]:
        """The workload's ``evaluate(model)`` and the distributed ``eval_step`` metrics, in eval mode; through a
        pipeline, ``eval_loss`` (``_through_pipeline``)."""
        was_training = model.training
        model.eval()
        place = DataPlace.in_group(self.layout) if dist.is_initialized() else DataPlace(rank=0, ranks=1)
        try:
            with torch.no_grad(), self.autocast(), place.loss_context():
                if self.pipeline is not None:
                    return self._through_pipeline(place)
                metrics = self._evaluated(model) if hasattr(self.workload, "evaluate") else {}
                if self.dataset is not None:
                    metrics.update(self._distributed(functools.partial(self.workload.eval_step, model), place))
        finally:
            model.train(was_training)
        return metrics

    def _evaluated(self, model: torch.nn.Module) -> dict[str, float]:
        """The workload's ``evaluate(model)``, each metric a float (a 0-d tensor is what users often return)."""
        metrics = {}
        for name, value in self.workload.evaluate(model).items():
            try:
                metrics[name] = _number(value)
            except (TypeError, ValueError, RuntimeError):
                raise ValueError(f"the workload's evaluate() returned {name}={value!r}: a metric is a number or a "
                                 "one-element tensor") from None
        return metrics

    def _through_pipeline(self, place: DataPlace) -> dict[str, float]:
        """No rank holds the whole model for the workload's ``evaluate`` or ``eval_step``: ``eval_loss``, the mean of
        the samples' ``pipeline_loss`` over ``eval_dataset`` (none without one; check_workload refuses a periodic
        evaluation then)."""
        if not self._warned:
            self._warned = True
            logger.warning("evaluation through a pipeline (parallel.pp > 1) is eval_loss, the mean of the workload's "
                           "pipeline_loss over its eval_dataset%s; evaluate() and eval_step() need the whole model and "
                           "are not run", "" if self.dataset is not None else " (it has none: no metrics)")
        return self._distributed(self._pipeline_step, place) if self.dataset is not None else {}

    def _pipeline_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
        """The sum of the batch's samples' ``pipeline_loss``."""
        return {"eval_loss": sum(self.pipeline.evaluate(*batch))}

    def _distributed(self, eval_step: Callable[[Any], dict[str, torch.Tensor | float]],
                     place: DataPlace) -> dict[str, float]:
        rank, world_size = place.rank, place.ranks
        total = len(self.dataset)
        if total >= world_size:
            start, stop = rank_slice(total, rank, world_size)
            longest_share = math.ceil(total / world_size)
        else:  # fewer samples than ranks: rank 0 takes them all
            start, stop, longest_share = 0, total if rank == 0 else 0, total
        rounds = math.ceil(longest_share / self.batch_size)
        names: list[str] | None = None
        sums: torch.Tensor | None = None
        for number in range(rounds):
            indices = list(range(start + number * self.batch_size, min(stop, start + (number + 1) * self.batch_size)))
            counted = bool(indices) and place.reports
            batch = fetch_batch(self.source, self.collate, indices or [0])
            result = eval_step(to_device(batch, self.device))
            names = names or sorted(result)
            values = torch.tensor([_number(result[name]) for name in names] + [len(indices)], dtype=torch.float64)
            sums = (values if counted else torch.zeros_like(values)) + (0 if sums is None else sums)
        if sums is None:
            raise ValueError("workload.eval_dataset() is empty")
        sums = self._summed(sums)
        count = sums[-1].item()
        return {name: sums[i].item() / count for i, name in enumerate(names)}

    def _summed(self, sums: torch.Tensor) -> torch.Tensor:
        """``sums`` added up over the group's ranks (collective)."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            reduced = sums.to(self.device)
            dist.all_reduce(reduced)
            return reduced.cpu()
        return sums


def _number(value: torch.Tensor | float) -> float:
    """A metric's value (a DTensor's under tensor parallelism, replicated over the tp ranks) as a float."""
    return float(value.full_tensor() if isinstance(value, DTensor) else value)
