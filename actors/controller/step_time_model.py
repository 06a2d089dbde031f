"""A layout's seconds per step as the layout policy models them, calibrated from the step times this run measured.
Pure, no torch.

The model is compute-bound. A step takes ``c`` times the work of its slowest rank: the samples of its pipeline's
share of the batch (B / dp), times the largest share of the model's blocks that a pipeline rank holds, over the
tp ranks that split it, stretched by the schedule's bubble ((m + (pp - 1) / v) / m for m micro-batches and v stages
on each rank) and by tensor parallelism's communication (1 + a x (tp - 1)). ``c`` and ``a`` are fitted to the
median step times of the layouts this run trained in: ``c`` alone while they share one tp degree (``a`` = 0), both
by least squares once two tp degrees ran. A layout the run trained in is scored by its own median.

Example::

    model = StepTimeModel.calibrated({ParallelLayout(pp=2, dp_replicate=2): 0.2}, global_batch_size=8, blocks=6)
    model.step_s(ParallelLayout(pp=3, microbatches=4))   # 0.32: pp3 on 6 blocks, 4 micro-batches, one pipeline
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from raylastic.strategies.parallel_layout import ParallelLayout


@dataclass(frozen=True)
class StepTimeModel:
    global_batch_size: int
    blocks: int | None = None
    """The model's blocks (strategies/model_limits.py); None: every stage taken as 1 / pp of the model."""
    seconds_per_work: float = 1.0
    tp_overhead: float = 0.0
    measured: tuple[tuple[ParallelLayout, float], ...] = ()

    @classmethod
    def calibrated(cls, measured: Mapping[ParallelLayout, float], *, global_batch_size: int,
                   blocks: int | None) -> StepTimeModel:
        model = cls(global_batch_size, blocks, measured=tuple(measured.items()))
        if not measured:
            return model
        tp_minus_one = [float(layout.tp - 1) for layout in measured]
        per_work = [seconds / model.work(layout) for layout, seconds in measured.items()]
        if len(set(tp_minus_one)) > 1:
            slope, intercept = statistics.linear_regression(tp_minus_one, per_work)
            if intercept > 0:
                return replace(model, seconds_per_work=intercept, tp_overhead=max(0.0, slope / intercept))
        return replace(model, seconds_per_work=statistics.median(per_work))

    def step_s(self, layout: ParallelLayout) -> float:
        for seen, seconds in self.measured:
            if seen == layout:
                return seconds
        return self.seconds_per_work * self.work(layout) * (1 + self.tp_overhead * (layout.tp - 1))

    def work(self, layout: ParallelLayout) -> float:
        """The slowest rank's samples x model share x bubble, before tensor parallelism's communication."""
        return self.global_batch_size / layout.dp * rank_share(layout, self.blocks) / layout.tp * bubble(layout)


def rank_share(layout: ParallelLayout, blocks: int | None) -> float:
    """The largest share of the model's blocks one pipeline rank holds (its stages' blocks, split as evenly as they
    go, the first stages one more); 1 without a pipeline."""
    if layout.pp == 1:
        return 1.0
    if blocks is None:
        return 1.0 / layout.pp
    size, extra = divmod(blocks, layout.num_stages)
    held = [sum(size + (stage < extra) for stage in layout.stages(rank)) for rank in range(layout.pp)]
    return max(held) / blocks


def bubble(layout: ParallelLayout) -> float:
    """How much longer the schedule takes than its ranks' work: (m + (pp - 1) / v) / m (m: the layout's
    micro-batches, by default as many as its stages)."""
    if layout.pp == 1:
        return 1.0
    microbatches = layout.microbatches or layout.num_stages
    return (microbatches + (layout.pp - 1) / layout.stages_per_rank) / microbatches


def measured_step_s(history: Iterable[Mapping], layouts: Mapping[str, ParallelLayout]) -> dict[ParallelLayout, float]:
    """The median step time of each layout in ``layouts`` (by its ``describe()``) over the history rows that name it
    (steps skipped for a non-finite loss left out)."""
    times: dict[str, list[float]] = {}
    for row in history:
        if row.get("layout") in layouts and not row.get("skipped"):
            times.setdefault(row["layout"], []).append(row["step_s"])
    return {layouts[name]: statistics.median(seconds) for name, seconds in times.items()}
