"""The layout of each generation under model parallelism (parallel.tp, parallel.pp): pure, from the number of
workers, the job's settings and, once the workers reported them, the model's limits and the step times measured.
``LayoutPolicy`` is the Controller's.

Two rules. ``choose_layout`` keeps the configured degrees (or their divisors, with fewer workers than tp x pp): the
first generation's, and every one's with ``parallel.degrees: fixed``. ``best_layout`` (``parallel.degrees:
preferred``, the default) takes, among every layout the model's limits allow (``candidate_layouts``), the one with
the most samples/s by the calibrated ``StepTimeModel`` (actors/controller/step_time_model.py), whose ranks hold no
more of the model than the configured layout's do.

Example::

    LayoutPolicy(parallel=ParallelConfig(pp=2), global_batch_size=8, max_workers=4).decide(3)
    # ParallelLayout(pp=2, microbatches=4): one pipeline, the third worker a spare, a step's 4 micro-batches kept
    LayoutPolicy(parallel=ParallelConfig(pp=2), global_batch_size=8, max_workers=4).decide(
        3, limits=ModelLimits(blocks=6, tp_degrees=(1,)))
    # ParallelLayout(pp=3, microbatches=4): 2 blocks on each of the three workers
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from raylastic.actors.controller.step_time_model import StepTimeModel, measured_step_s, rank_share
from raylastic.jobconfig import JobConfig
from raylastic.jobconfig.parallel import ParallelConfig
from raylastic.strategies.model_limits import ModelLimits
from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.strategies.shard_layout import effective_replicas

RESPLIT_GAIN = 0.05
"""How much faster (modelled) a layout of other pp or tp degrees than the current ones must be to be chosen: a
re-split moves the parts of the model between the ranks, keeping the degrees moves nothing or less."""


def choose_layout(num_workers: int, parallel: ParallelConfig, *, replicas: int, global_batch_size: int,
                  step_microbatches: int | None = None) -> ParallelLayout | None:
    """The layout a generation of up to ``num_workers`` ranks trains in (the workers it leaves out wait as
    spares), or None if none fits. It keeps the configured tp and pp with the largest data-parallel degree the
    batch allows (every data-parallel rank takes a sample at least, and through a pipeline the same number in
    each of its micro-batches); with fewer workers than tp x pp, the largest tp' x pp' dividing them that fits,
    pipeline stages given up before tensor splits (a layer split over fewer ranks needs more memory per rank,
    and so does a stage of more layers: keeping the product keeps the memory per rank). None also when the
    batch does not divide into the configured pipeline's micro-batches at any data-parallel degree.

    Through a pipeline, a step keeps ``step_microbatches`` micro-batches (the configured layout's: its
    data-parallel degree x ``parallel.microbatches``) wherever the data-parallel degree divides them and the
    schedule takes the count: a re-plan then leaves each micro-batch's size, so its activations' memory and its
    samples, as they were. Elsewhere each pipeline runs ``parallel.microbatches``."""
    if num_workers >= parallel.model_parallel:
        degrees = [(parallel.tp, parallel.pp)]
    else:
        degrees = sorted(((tp, pp) for tp in divisors(parallel.tp) for pp in divisors(parallel.pp)
                          if tp * pp <= num_workers and (pp == 1 or parallel.microbatch_rule(pp) is None)),
                         key=lambda d: (d[0] * d[1], d[0]), reverse=True)
    for tp, pp in degrees:
        for dp in range(num_workers // (tp * pp), 0, -1):
            microbatches = pipeline_microbatches(parallel, pp=pp, dp=dp, step_microbatches=step_microbatches)
            if pp > 1 and global_batch_size % (dp * microbatches):
                continue  # through a pipeline, every micro-batch of every data-parallel rank is the same size
            if global_batch_size >= dp:
                return _layout(parallel, tp=tp, pp=pp, dp=dp, replicas=replicas, microbatches=microbatches)
    return None


def candidate_layouts(num_workers: int, parallel: ParallelConfig, *, replicas: int, global_batch_size: int,
                      step_microbatches: int | None, limits: ModelLimits) -> list[ParallelLayout]:
    """Every layout of up to ``num_workers`` ranks the model's ``limits`` allow: tp among its degrees up to
    parallel.tp (what a higher one costs in communication is not known before it ran), pp up to as many pipeline
    ranks as its blocks give stages (with parallel.pp > 1), any data-parallel degree the batch allows, each
    pipeline's micro-batches as ``choose_layout`` sets them and the schedule takes."""
    stages_each = parallel.stages_on_each_rank
    tp_degrees = [tp for tp in limits.tp_degrees if tp <= parallel.tp]
    pp_degrees = range(1, limits.blocks // stages_each + 1) if parallel.pp > 1 else (1,)
    layouts = []
    for tp in tp_degrees:
        for pp in pp_degrees:
            for dp in range(1, min(num_workers // (tp * pp), global_batch_size) + 1):
                microbatches = pipeline_microbatches(parallel, pp=pp, dp=dp, step_microbatches=step_microbatches)
                if pp > 1 and (parallel.microbatch_rule(pp, microbatches) is not None
                               or global_batch_size % (dp * microbatches)):
                    continue
                layouts.append(_layout(parallel, tp=tp, pp=pp, dp=dp, replicas=replicas, microbatches=microbatches))
    return layouts


def memory_share(layout: ParallelLayout, blocks: int | None) -> float:
    """The largest share of the model one rank holds: its pipeline rank's blocks, over the tp ranks that split them.
    Data-parallel sharding is not counted: ZeRO gathers each layer whole for its forward, ddp and zero1 shard no
    parameter, and a rank's activations grow with the layers it runs."""
    return rank_share(layout, blocks) / layout.tp


def best_layout(candidates: list[ParallelLayout], model: StepTimeModel, *, memory_bound: float,
                current: tuple[int, int]) -> ParallelLayout | None:
    """The candidate with the most samples/s by ``model`` whose ranks hold at most ``memory_bound`` of the model
    each (``memory_share``); other (pp, tp) degrees than ``current`` only where ``RESPLIT_GAIN`` faster. None if no
    candidate fits."""
    fitting = [layout for layout in candidates if memory_share(layout, model.blocks) <= memory_bound * (1 + 1e-9)]
    if not fitting:
        return None

    def cost(layout: ParallelLayout) -> tuple[float, int, int]:
        resplit = (layout.pp, layout.tp) != current
        return model.step_s(layout) * (1 + RESPLIT_GAIN * resplit), layout.pp, layout.tp

    return min(fitting, key=cost)


def _layout(parallel: ParallelConfig, *, tp: int, pp: int, dp: int, replicas: int,
            microbatches: int) -> ParallelLayout:
    copies = effective_replicas(replicas, dp)
    stages = {"stages_per_rank": parallel.stages_on_each_rank, "v_shape": parallel.pp_schedule == "zbv",
              "microbatches": microbatches} if pp > 1 else {}
    return ParallelLayout(pp=pp, dp_replicate=copies, dp_shard=dp // copies, tp=tp, **stages)


def pipeline_microbatches(parallel: ParallelConfig, *, pp: int, dp: int, step_microbatches: int | None) -> int:
    """The micro-batches each of ``dp`` pipelines of ``pp`` ranks runs per step: its share of
    ``step_microbatches`` where ``dp`` divides them and the schedule takes that count, else the configured
    ``parallel.microbatches``."""
    if step_microbatches is not None and step_microbatches % dp == 0:
        share = step_microbatches // dp
        if parallel.microbatch_rule(pp, share) is None:
            return share
    return parallel.microbatches


@dataclass(frozen=True)
class LayoutPolicy:
    """The layout each generation trains in (``choose_layout``); none without model parallelism."""

    parallel: ParallelConfig = ParallelConfig()
    replicas: int = 1
    """The data-parallel copies the strategy keeps (HSDP's strategy.replicas; every data-parallel rank for ddp)."""
    global_batch_size: int = 1
    max_workers: int | None = None
    """scaling.max_workers: its layout's micro-batches per step are the count every layout keeps where it can;
    None: each pipeline runs ``parallel.microbatches``."""

    @classmethod
    def for_job(cls, job: JobConfig) -> LayoutPolicy:
        replicas = job.scaling.max_workers if job.strategy.name == "ddp" else job.strategy.replicas
        return cls(parallel=job.parallel, replicas=replicas, global_batch_size=job.training.global_batch_size,
                   max_workers=job.scaling.max_workers)

    @property
    def step_microbatches(self) -> int | None:
        """The micro-batches of a step at ``max_workers`` (its data-parallel degree x parallel.microbatches)."""
        if self.max_workers is None or self.parallel.pp == 1:
            return None
        return self.max_workers // self.parallel.model_parallel * self.parallel.microbatches

    def decide(self, num_workers: int, *, limits: ModelLimits | None = None,
               measured: Mapping[ParallelLayout, float] | None = None,
               current: ParallelLayout | None = None) -> ParallelLayout | None:
        """The layout of a generation of up to ``num_workers`` workers; None: every worker a data-parallel rank.
        With the model's ``limits`` (and parallel.degrees=preferred), short of the configured layout's workers:
        ``best_layout`` by the step times ``measured`` so far, preferring the ``current`` layout's degrees; else
        ``choose_layout``."""
        if self.parallel.model_parallel == 1:
            return None
        configured = self.choose(num_workers)
        assert configured is not None, (num_workers, self)  # only a pipeline's micro-batches can leave none
        if limits is None or self.parallel.degrees == "fixed" or self.max_workers is None:
            return configured
        reference = self.choose(self.max_workers)
        if configured == reference:
            return configured  # every worker of the configured layout is there
        candidates = candidate_layouts(num_workers, self.parallel, replicas=self.replicas,
                                       global_batch_size=self.global_batch_size,
                                       step_microbatches=self.step_microbatches, limits=limits)
        model = StepTimeModel.calibrated(measured or {}, global_batch_size=self.global_batch_size,
                                         blocks=limits.blocks)
        kept = current or reference
        best = best_layout(candidates, model, memory_bound=memory_share(reference, limits.blocks),
                           current=(kept.pp, kept.tp))
        return best or configured

    def choose(self, num_workers: int) -> ParallelLayout | None:
        """The configured degrees' layout (``choose_layout``) of up to ``num_workers`` workers."""
        return choose_layout(num_workers, self.parallel, replicas=self.replicas,
                             global_batch_size=self.global_batch_size, step_microbatches=self.step_microbatches)


@dataclass
class LayoutsSeen:
    """What a run learned for its re-plans: the model's limits, from its workers' join reports, and the layouts its
    generations trained in, by ``describe()`` (the history rows name them), for their measured step times."""

    limits: ModelLimits | None = None
    layouts: dict[str, ParallelLayout] = field(default_factory=dict)

    def formed(self, layout: ParallelLayout | None, reported: Iterable[ModelLimits | None]) -> None:
        if layout is not None:
            self.layouts[layout.describe()] = layout
        self.limits = self.limits or next((limits for limits in reported if limits is not None), None)

    def measured(self, history: Iterable[Mapping]) -> dict[ParallelLayout, float]:
        return measured_step_s(history, self.layouts)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
