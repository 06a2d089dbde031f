"""Model parallelism: how many ranks split each layer (tensor parallel) and the layers (pipeline parallel).

The data-parallel degree is what is left of a generation: ``world_size / (tp * pp)``; ``strategy`` applies
over it. The schedules are torch.distributed.pipelining's: ``gpipe`` (ScheduleGPipe), ``1f1b``
(Schedule1F1B), ``interleaved_1f1b`` (ScheduleInterleaved1F1B) and ``zbv`` (ScheduleZBVZeroBubble); the
checks below are the ones those classes make when a step starts, made before any actor does.

Example::

    ParallelConfig(tp=2, pp=2, pp_schedule="1f1b", pp_microbatches=4)
    ParallelConfig(pp=2, pp_schedule="interleaved_1f1b").stages_on_each_rank   # 2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from raylastic.jobconfig.checks import is_positive_int, one_of, require

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv"]
PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
LayoutDegrees = Literal["preferred", "fixed"]
LAYOUT_DEGREES: tuple[str, ...] = get_args(LayoutDegrees)
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zbv")
"""Schedules that run several stages on each rank (the others run one)."""


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree: the ranks that split each layer's weights (Megatron-style); 1: none."""
    pp: int = 1
    """Pipeline ranks: the model's layers cut into stages over this many ranks; 1: none."""
    pp_schedule: PipelineSchedule = "1f1b"
    """The order in which micro-batches go forward and backward through the stages."""
    pp_microbatches: int | None = None
    """Micro-batches a data-parallel rank's share of a step is cut into for the pipeline at scaling.max_workers;
    None: as many as the schedule's stages (pp x stages_on_each_rank). A layout with fewer data-parallel ranks
    keeps a step's count where it can (each pipeline runs its share: ``choose_layout``)."""
    stages_per_rank: int | None = None
    """Stages on each pipeline rank; None: 1 for gpipe and 1f1b, 2 for interleaved_1f1b and zbv."""
    degrees: LayoutDegrees = "preferred"
    """"preferred": tp and pp are the first generation's; a re-plan may take any others the model allows (the
    workload's ``model_limits``) that its throughput model finds faster, holding no more of the model on a rank.
    "fixed": only tp, pp and (with fewer workers than tp x pp) their divisors."""

    def __post_init__(self) -> None:
        require(is_positive_int(self.tp), "parallel.tp", "a positive integer", self.tp)
        require(is_positive_int(self.pp), "parallel.pp", "a positive integer", self.pp)
        require(self.pp_schedule in PIPELINE_SCHEDULES, "parallel.pp_schedule", one_of(PIPELINE_SCHEDULES),
                self.pp_schedule)
        require(self.degrees in LAYOUT_DEGREES, "parallel.degrees", one_of(LAYOUT_DEGREES), self.degrees)
        require(self.pp > 1 or self.pp_schedule == "1f1b", "parallel.pp_schedule",
                "left at its default (1f1b) unless parallel.pp > 1", self.pp_schedule)
        for name in ("pp_microbatches", "stages_per_rank"):
            value = getattr(self, name)
            require(value is None or is_positive_int(value), f"parallel.{name}", "a positive integer or null",
                    value)
            require(value is None or self.pp > 1, f"parallel.{name}", "left unset unless parallel.pp > 1", value)
        stages = self.stages_on_each_rank
        if self.pp_schedule == "zbv":
            require(stages == 2, "parallel.stages_per_rank", "2 with parallel.pp_schedule=zbv (its V shape)",
                    stages)
        elif self.pp_schedule == "interleaved_1f1b":
            require(stages >= 2, "parallel.stages_per_rank", "at least 2 with parallel.pp_schedule=interleaved_1f1b",
                    stages)
        else:
            require(stages == 1, "parallel.stages_per_rank", f"1 with parallel.pp_schedule={self.pp_schedule} (one "
                    "stage per rank; interleaved_1f1b and zbv run several)", stages)
        rule = self.microbatch_rule(self.pp)
        require(rule is None, "parallel.pp_microbatches", rule, self.microbatches)

    def microbatch_rule(self, pp: int, microbatches: int | None = None) -> str | None:
        """What the schedule asks of the micro-batch count (``microbatches``, else the configured one) that ``pp``
        pipeline ranks cannot have, or None."""
        microbatches = self.microbatches if microbatches is None else microbatches
        if self.pp_schedule == "1f1b" and microbatches < pp:
            return f"at least parallel.pp ({pp}) with the 1f1b schedule"
        rounds = max(1, microbatches // pp)
        if self.pp_schedule == "interleaved_1f1b" and microbatches % rounds:
            return f"a multiple of its rounds with interleaved_1f1b (pp_microbatches // pp = {rounds})"
        return None

    @property
    def stages_on_each_rank(self) -> int:
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if self.pp_schedule in MULTI_STAGE_SCHEDULES else 1

    @property
    def microbatches(self) -> int:
        """Micro-batches per data-parallel rank per step through the pipeline."""
        if self.pp_microbatches is not None:
            return self.pp_microbatches
        return self.pp * self.stages_on_each_rank

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one copy of the model between them: tp x pp."""
        return self.tp * self.pp
