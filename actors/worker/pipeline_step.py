"""A step's forward and backward through a pipeline of stages (``torch.distributed.pipelining``), with the math of
``backward_over_micro_batches``: each micro-batch's mean loss weighted by its samples x dp / B, so the gradient,
once the data-parallel ranks have averaged it, is the mean over the global batch; each micro-batch seeded from
the step and its position in the global batch before every stage runs it (dropout masks follow the data order,
one stream per stage and tp rank). ``StepRunner`` runs it under ``parallel.pp``.

Example (every rank of a pipeline, once its stage is built and wrapped)::

    pipeline = Pipeline.build(stage_module, stage_index=p, num_stages=pp, group=mesh.pp.get_group(),
                              device=device, schedule="1f1b", microbatches=4, loss=workload.pipeline_loss,
                              weight=dp / B, seed=0)
    loss_sum = pipeline.step(step_index, position, inputs, targets)   # the summed loss on the last stage, else 0
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

from raylastic.actors.worker.step import seed_rng, step_seed
from raylastic.jobconfig import ParallelConfig
from raylastic.strategies.parallel_mesh import ParallelMesh

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
"""parallel.pp_schedule -> torch's schedule class (the one-stage-per-rank ones)."""


class SeededStage(PipelineStage):
    """A stage that seeds the RNG before each micro-batch's forward from ``chunk_seed(micro-batch index)`` (its
    Pipeline's)."""

    chunk_seed: Callable[[int], int]

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple, kwargs: dict | None = None,
                          save_forward_output: bool = True) -> Any:
        seed_rng(self.chunk_seed(fwd_chunk_id), self.device)
        return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)


@dataclass
class Pipeline:
    stage: SeededStage
    schedule: Any
    microbatches: int
    seed: int
    stream: int
    weight: float = 1.0
    step_index: int = 0
    position: int = 0
    samples_per_microbatch: int = 1

    @classmethod
    def build(cls, module: torch.nn.Module, *, stage_index: int, num_stages: int, group: dist.ProcessGroup,
              device: torch.device, schedule: str, microbatches: int,
              loss: Callable[[Any, Any], torch.Tensor], weight: float, seed: int, stream: int = 0) -> Pipeline:
        """This rank's stage of a pipeline of ``num_stages`` over ``group`` (the pp mesh's), run by ``schedule``
        in ``microbatches`` micro-batches; ``loss(output, target)`` is a micro-batch's mean loss, ``weight``
        dp / B."""
        def weighted_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
            return loss(output, target).float() * target.shape[0] * weight

        stage = SeededStage(module, stage_index, num_stages, device, group=group)
        runner = SCHEDULES[schedule](stage, n_microbatches=microbatches, loss_fn=weighted_loss, scale_grads=False)
        pipeline = cls(stage, runner, microbatches, seed, stream, weight)
        stage.chunk_seed = pipeline.chunk_seed
        return pipeline

    def chunk_seed(self, chunk: int) -> int:
        """The seed of micro-batch ``chunk`` of the current step: its place in the global batch, this rank's stream."""
        position = self.position + chunk * self.samples_per_microbatch
        return step_seed(self.seed, self.step_index, position, self.stream)

    @classmethod
    def for_generation(cls, model: torch.nn.Module, mesh: ParallelMesh | None, parallel: ParallelConfig, *,
                       device: torch.device, loss: Callable[[Any, Any], torch.Tensor], global_batch_size: int,
                       seed: int) -> Pipeline | None:
        """This rank's stage of a generation laid out on ``mesh``, around its (set up) ``model``; None without
        pipeline parallelism."""
        if mesh is None or mesh.pp is None:
            return None
        layout, at = mesh.layout, mesh.layout.coordinates(dist.get_rank())
        return cls.build(model, stage_index=at.pp, num_stages=layout.pp, group=mesh.pp.get_group(), device=device,
                         schedule=parallel.pp_schedule, microbatches=parallel.microbatches, loss=loss,
                         weight=layout.dp / global_batch_size, seed=seed, stream=at.pp * layout.tp + at.tp)

    @property
    def group(self) -> dist.ProcessGroup:
        """The pipeline's ranks: this rank's stage and the others that hold the same samples' other layers."""
        return self.stage.group

    def step(self, step_index: int, position: int, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this rank's share of step ``step_index`` (``position``: where it starts in the
        global batch; its samples divide into the micro-batches); the summed loss on the last stage, else 0."""
        self.step_index, self.position = step_index, position
        self.samples_per_microbatch = len(targets) // self.microbatches
        losses: list[torch.Tensor] = []  # the weighted loss of each micro-batch (the last stage's)
        arguments = (inputs,) if self.stage.is_first else ()
        self.schedule.step(*arguments, **({"target": targets, "losses": losses} if self.stage.is_last else {}))
        if not self.stage.is_last:
            return torch.zeros(())
        summed = torch.stack([_plain(loss.detach()) for loss in losses]).sum()
        return summed / self.weight


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A micro-batch's loss as a plain tensor (under tensor parallelism a DTensor replicated over the tp ranks)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
