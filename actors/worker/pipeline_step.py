"""A step's forward and backward through a pipeline of stages (``torch.distributed.pipelining``), with the math of
``backward_over_micro_batches``: each micro-batch's mean loss weighted by its samples x dp / B, so the gradient,
once the data-parallel ranks have averaged it, is the mean over the global batch; each micro-batch seeded from
the step and its position in the global batch before every stage runs it (dropout masks follow the data order,
one stream per stage and tp rank). A rank runs one stage (gpipe, 1f1b) or several (interleaved_1f1b, zbv: the
parts of a ``ModelParts``). ``StepRunner`` runs it under ``parallel.pp``.

Example (every rank of a pipeline, once its stages are built and wrapped)::

    pipeline = Pipeline.build({p: stage_module}, holders={0: 0, 1: 1}, group=mesh.pp.get_group(), device=device,
                              schedule="1f1b", microbatches=4, loss=workload.pipeline_loss, weight=dp / B, seed=0)
    loss_sum = pipeline.step(step_index, position, inputs, targets)   # the summed loss on the last stage, else 0
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from raylastic.actors.worker.stage_meta import PlainMetaStage
from raylastic.actors.worker.step import seed_rng, step_seed
from raylastic.jobconfig import ParallelConfig
from raylastic.strategies.model_parts import ModelParts
from raylastic.strategies.parallel_mesh import ParallelMesh

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "zbv": ScheduleZBVZeroBubble}
"""parallel.pp_schedule -> torch's schedule class."""
ONE_STAGE_SCHEDULES = ("gpipe", "1f1b")
"""The schedules that take one stage (the others a list of a rank's stages)."""


class SeededStage(PlainMetaStage):
    """A stage that seeds the RNG before each micro-batch's forward from ``chunk_seed(micro-batch index)``, after
    calling ``before_chunk`` (the step hooks')."""

    chunk_seed: Callable[[int], int]
    before_chunk: Callable[[int], Any] | None = None

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple, kwargs: dict | None = None,
                          save_forward_output: bool = True) -> Any:
        if self.before_chunk is not None:
            self.before_chunk(fwd_chunk_id)
        seed_rng(self.chunk_seed(fwd_chunk_id), self.device)
        return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)


@dataclass
class Pipeline:
    stages: list[SeededStage]
    schedule: Any
    holders: dict[int, int]
    """Stage index -> the rank of the pipeline's group that holds it."""
    loss: Callable[[Any, Any], torch.Tensor]
    microbatches: int
    seed: int
    weight: float = 1.0
    step_index: int = 0
    position: int = 0
    samples_per_microbatch: int = 1
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None
    """fp16's loss scaling (the scaler's ``scale``), applied to the loss the schedule's backward starts from."""

    @classmethod
    def build(cls, modules: dict[int, torch.nn.Module], *, holders: dict[int, int], group: dist.ProcessGroup,
              device: torch.device, schedule: str, microbatches: int,
              loss: Callable[[Any, Any], torch.Tensor], weight: float, seed: int,
              streams: Callable[[int], int] = lambda stage: stage,
              scale: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Pipeline:
        """This rank's stages (``modules``: stage index -> module) of a pipeline over ``group`` (the pp mesh's;
        ``holders``: every stage's rank in it), run by ``schedule`` in ``microbatches`` micro-batches;
        ``loss(output, target)`` is a micro-batch's mean loss, ``weight`` dp / B; ``streams(stage)``: the random
        stream the stage draws from; ``scale``: fp16's loss scaling (the scaler's ``scale``), applied to what the
        schedule's backward starts from."""
        def weighted_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
            weighted = loss(output, target).float() * target.shape[0] * weight
            return scale(weighted) if scale is not None else weighted

        stages = [SeededStage(module, index, len(holders), device, group=group)
                  for index, module in sorted(modules.items())]
        runner = SCHEDULES[schedule](stages[0] if schedule in ONE_STAGE_SCHEDULES else stages,
                                     n_microbatches=microbatches, loss_fn=weighted_loss, scale_grads=False)
        pipeline = cls(stages, runner, holders, loss, microbatches, seed, weight, scale=scale)
        for stage in stages:
            stage.chunk_seed = functools.partial(pipeline.chunk_seed, stream=streams(stage.stage_index))
        return pipeline

    def chunk_seed(self, chunk: int, stream: int) -> int:
        """The seed of micro-batch ``chunk`` of the current step: its place in the global batch, the stage's
        ``stream``."""
        position = self.position + chunk * self.samples_per_microbatch
        return step_seed(self.seed, self.step_index, position, stream)

    @classmethod
    def for_generation(cls, model: torch.nn.Module, mesh: ParallelMesh | None, parallel: ParallelConfig, *,
                       device: torch.device, loss: Callable[[Any, Any], torch.Tensor], global_batch_size: int,
                       seed: int, scale: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Pipeline | None:
        """This rank's stages of a generation laid out on ``mesh``, around its (set up) ``model`` (a ModelParts
        with several stages); None without pipeline parallelism. ``scale``: fp16's loss scaling (``build``)."""
        if mesh is None or mesh.pp is None:
            return None
        layout, at = mesh.layout, mesh.layout.coordinates(dist.get_rank())
        stages = layout.stages(at.pp)
        modules = dict(model.stages()) if isinstance(model, ModelParts) else {stages[0]: model}
        holders = {stage: pp_rank for pp_rank in range(layout.pp) for stage in layout.stages(pp_rank)}
        return cls.build(modules, holders=holders, group=mesh.pp.get_group(), device=device,
                         schedule=parallel.pp_schedule, microbatches=layout.microbatches or parallel.microbatches,
                         loss=loss, weight=layout.dp / global_batch_size, seed=seed,
                         streams=lambda stage: stage * layout.tp + at.tp, scale=scale)

    @property
    def group(self) -> dist.ProcessGroup:
        """The pipeline's ranks: this rank's stages and the others that hold the same samples' other layers."""
        return self.stages[0].group

    @property
    def holds_loss(self) -> bool:
        """Whether this rank holds the last stage, where the loss is computed."""
        return any(stage.is_last for stage in self.stages)

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[float]:
        """Forward only (no schedule: stage by stage, the activations sent on to the next stage's rank): each
        sample's loss where the last stage is, else []. Every rank of the pipeline calls it with the same batch."""
        here = {stage.stage_index: stage.submod for stage in self.stages}
        me, last = dist.get_rank(self.group), len(self.holders) - 1
        activations = inputs
        for index in sorted(here):
            if index > 0 and self.holders[index - 1] != me:
                activations = _receive(self.holders[index - 1], self.group, inputs.device)
            activations = here[index](activations)
            if index < last and self.holders[index + 1] != me:
                _send(activations, self.holders[index + 1], self.group)
        if not self.holds_loss:
            return []
        return [_plain(self.loss(activations[i:i + 1], targets[i:i + 1])).item() for i in range(len(targets))]

    def step(self, step_index: int, position: int, inputs: torch.Tensor, targets: torch.Tensor,
             before_microbatch: Callable[[int], Any] | None = None) -> torch.Tensor:
        """Forward and backward of this rank's share of step ``step_index`` (``position``: where it starts in the
        global batch; its samples divide into the micro-batches); the summed loss where the last stage is, else 0.
        ``before_microbatch(index)`` is called before each of this rank's micro-batch forwards."""
        self.step_index, self.position = step_index, position
        for stage in self.stages:
            stage.before_chunk = before_microbatch
        self.samples_per_microbatch = len(targets) // self.microbatches
        losses: list[torch.Tensor] = []  # the weighted (fp16: and scaled) loss of each micro-batch (the last stage's)
        first = any(stage.is_first for stage in self.stages)
        self.schedule.step(*((inputs,) if first else ()),
                           **({"target": targets, "losses": losses} if self.holds_loss else {}))
        if not self.holds_loss:
            return torch.zeros(())
        summed = torch.stack([_plain(loss.detach()) for loss in losses]).sum()
        if self.scale is not None:  # a power of two: the division is exact, and stays on the device
            summed = summed / self.scale(torch.ones((), device=summed.device))
        return summed / self.weight


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _send(tensor: torch.Tensor, to: int, group: dist.ProcessGroup) -> None:
    """``tensor`` to rank ``to`` of ``group``: its dtype and shape, then its data (``_receive``'s other end)."""
    header = torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape], dtype=torch.int64)
    dist.send(torch.nn.functional.pad(header, (0, 10 - len(header))).to(tensor.device), group=group, group_dst=to)
    dist.send(tensor.contiguous(), group=group, group_dst=to)


def _receive(source: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    header = torch.empty(10, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=source)
    dtype, dims, *shape = header.tolist()
    tensor = torch.empty(shape[:dims], dtype=_DTYPES[dtype], device=device)
    dist.recv(tensor, group=group, group_src=source)
    return tensor


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A micro-batch's loss as a plain tensor (under tensor parallelism a DTensor replicated over the tp ranks)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
