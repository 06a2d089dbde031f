"""The layout of each generation under model parallelism (parallel.tp, parallel.pp): pure, from the number of
workers and the job's settings (``choose_layout``); ``LayoutPolicy`` is the Controller's.

Example::

    LayoutPolicy(parallel=ParallelConfig(pp=2), global_batch_size=8, max_workers=4).decide(3)
    # ParallelLayout(pp=2, microbatches=4): one pipeline, the third worker a spare, a step's 4 micro-batches kept
"""

from __future__ import annotations

from dataclasses import dataclass

from raylastic.jobconfig import JobConfig
from raylastic.jobconfig.parallel import ParallelConfig
from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.strategies.shard_layout import effective_replicas


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
                copies = effective_replicas(replicas, dp)
                stages = {"stages_per_rank": parallel.stages_on_each_rank, "v_shape": parallel.pp_schedule == "zbv",
                          "microbatches": microbatches} if pp > 1 else {}
                return ParallelLayout(pp=pp, dp_replicate=copies, dp_shard=dp // copies, tp=tp, **stages)
    return None


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

    def decide(self, num_workers: int) -> ParallelLayout | None:
        """The layout of a generation of up to ``num_workers`` workers; None: every worker a data-parallel rank."""
        if self.parallel.model_parallel == 1:
            return None
        layout = choose_layout(num_workers, self.parallel, replicas=self.replicas,
                               global_batch_size=self.global_batch_size, step_microbatches=self.step_microbatches)
        assert layout is not None, (num_workers, self)  # only a pipeline's micro-batches can leave none
        return layout


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
