"""The layout policy's re-plans within the model's limits (parallel.degrees=preferred): against brute force over small
worlds and models, the cases that motivate it, its calibration from measured step times, and the limits a workload
reports."""

from __future__ import annotations

import itertools

import pytest
import torch

from raylastic.actors.controller.layout_policy import (
    RESPLIT_GAIN,
    LayoutPolicy,
    LayoutsSeen,
    memory_share,
    pipeline_microbatches,
)
from raylastic.actors.controller.step_time_model import StepTimeModel, measured_step_s
from raylastic.actors.worker.model_build import model_limits
from raylastic.jobconfig import ParallelConfig, WorkloadConfig
from raylastic.strategies.model_limits import ModelLimits
from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.strategies.shard_layout import effective_replicas
from raylastic.workloads.chargpt import CharGPT

SIX_BLOCKS = ModelLimits(blocks=6, tp_degrees=(1, 2, 4))


def every_layout(num_workers: int, parallel: ParallelConfig, *, replicas: int, batch: int, limits: ModelLimits,
                 step_microbatches: int | None) -> list[ParallelLayout]:
    """Every grid of up to ``num_workers`` ranks, kept where it is valid: checked one condition at a time."""
    stages_each = parallel.stages_on_each_rank
    valid = []
    for pp, tp, dp in itertools.product(range(1, num_workers + 1), repeat=3):
        if pp * tp * dp > num_workers or dp > batch:
            continue
        if (pp > 1 and parallel.pp == 1) or tp > parallel.tp:
            continue  # a pipeline only if configured; tp no higher than configured
        if tp not in limits.tp_degrees or pp * stages_each > limits.blocks:
            continue
        microbatches = pipeline_microbatches(parallel, pp=pp, dp=dp, step_microbatches=step_microbatches)
        if pp > 1 and (parallel.microbatch_rule(pp, microbatches) is not None or batch % (dp * microbatches)):
            continue
        copies = effective_replicas(replicas, dp)
        stages = {"stages_per_rank": stages_each, "v_shape": parallel.pp_schedule == "zbv",
                  "microbatches": microbatches} if pp > 1 else {}
        valid.append(ParallelLayout(pp=pp, dp_replicate=copies, dp_shard=dp // copies, tp=tp, **stages))
    return valid


SMALL_JOBS = [
    (ParallelConfig(pp=2), 4, 1, ModelLimits(blocks=b, tp_degrees=(1,))) for b in (2, 3, 4, 6)
] + [
    (ParallelConfig(tp=2), 4, 4, ModelLimits(blocks=4, tp_degrees=(1, 2, 4))),
    (ParallelConfig(tp=2, pp=2), 8, 1, ModelLimits(blocks=6, tp_degrees=(1, 2))),
    (ParallelConfig(tp=2, pp=2), 8, 2, ModelLimits(blocks=5, tp_degrees=(1, 2, 4))),
    (ParallelConfig(pp=2, pp_schedule="interleaved_1f1b"), 4, 1, ModelLimits(blocks=8, tp_degrees=(1,))),
    (ParallelConfig(pp=3, pp_schedule="gpipe"), 6, 1, ModelLimits(blocks=7, tp_degrees=(1,))),
]


@pytest.mark.parametrize(("parallel", "max_workers", "replicas", "limits"), SMALL_JOBS)
@pytest.mark.parametrize("batch", [24, 48])
def test_the_policy_chooses_the_fastest_fitting_layout_that_brute_force_finds(parallel, max_workers, replicas,
                                                                              limits, batch):
    policy = LayoutPolicy(parallel=parallel, replicas=replicas, global_batch_size=batch, max_workers=max_workers)
    reference = policy.choose(max_workers)
    bound = memory_share(reference, limits.blocks)
    model = StepTimeModel(batch, limits.blocks)
    for workers in range(1, max_workers + 1):
        chosen = policy.decide(workers, limits=limits, current=reference)
        if policy.choose(workers) == reference:
            assert chosen == reference  # the configured layout's workers are all there
            continue
        fitting = [layout for layout in every_layout(workers, parallel, replicas=replicas, batch=batch,
                                                     limits=limits, step_microbatches=policy.step_microbatches)
                   if memory_share(layout, limits.blocks) <= bound]
        if not fitting:
            assert chosen == policy.choose(workers), workers  # the configured degrees' rule, as before
            continue
        assert chosen in fitting, workers

        def cost(layout: ParallelLayout) -> float:
            return model.step_s(layout) * (1 + RESPLIT_GAIN * ((layout.pp, layout.tp) != (reference.pp, reference.tp)))

        assert cost(chosen) == min(cost(layout) for layout in fitting), (workers, chosen)


def test_three_survivors_of_dp2_pp2_form_pp3_when_the_blocks_divide_and_keep_pp2_when_not():
    policy = LayoutPolicy(parallel=ParallelConfig(pp=2), global_batch_size=8, max_workers=4)
    full = policy.decide(4, limits=SIX_BLOCKS)
    assert full == ParallelLayout(pp=2, dp_shard=2, microbatches=2)  # the configured layout is the fastest
    assert policy.decide(3, limits=SIX_BLOCKS, current=full) == ParallelLayout(pp=3, microbatches=4)
    # four blocks over three stages leave one of two blocks: no faster than pp2, whose spare waits
    four = ModelLimits(blocks=4, tp_degrees=(1,))
    assert policy.decide(3, limits=four, current=full) == ParallelLayout(pp=2, microbatches=4)
    assert policy.decide(3, current=full) == ParallelLayout(pp=2, microbatches=4)  # no limits reported
    fixed = LayoutPolicy(parallel=ParallelConfig(pp=2, degrees="fixed"), global_batch_size=8, max_workers=4)
    assert fixed.decide(3, limits=SIX_BLOCKS, current=full) == ParallelLayout(pp=2, microbatches=4)


def test_a_layout_holding_more_of_the_model_on_a_rank_than_the_configured_one_is_not_chosen():
    """pp2 x tp2 with 3 workers: every layout of 3 holds half the model on a rank or more, the configured layout a
    quarter; the configured degrees' rule decides (tp2, one worker a spare)."""
    policy = LayoutPolicy(parallel=ParallelConfig(pp=2, tp=2), replicas=1, global_batch_size=8, max_workers=4)
    assert policy.decide(3, limits=ModelLimits(blocks=2, tp_degrees=(1, 2))) == ParallelLayout(tp=2)


def test_the_model_is_calibrated_from_the_measured_step_times():
    pp2_dp2, pp3 = ParallelLayout(pp=2, dp_shard=2, microbatches=2), ParallelLayout(pp=3, microbatches=4)
    model = StepTimeModel.calibrated({pp2_dp2: 0.3}, global_batch_size=8, blocks=6)
    assert model.step_s(pp2_dp2) == 0.3  # a layout that ran is scored by its measurement
    assert model.step_s(pp3) == pytest.approx(0.3 * model.work(pp3) / model.work(pp2_dp2))
    # tensor parallelism's communication: fitted once two tp degrees ran (here 20% more per extra tp rank)
    tp1, tp2, tp4 = (ParallelLayout(dp_shard=4 // tp, tp=tp) for tp in (1, 2, 4))
    truth = StepTimeModel(8, 6, seconds_per_work=0.01, tp_overhead=0.2)
    model = StepTimeModel.calibrated({tp1: truth.step_s(tp1), tp2: truth.step_s(tp2)}, global_batch_size=8, blocks=6)
    assert (model.seconds_per_work, model.tp_overhead) == (pytest.approx(0.01), pytest.approx(0.2))
    assert model.step_s(tp4) == pytest.approx(truth.step_s(tp4))


def test_measured_step_times_are_each_layouts_median_over_the_history():
    pp2, pp3 = ParallelLayout(pp=2, microbatches=4), ParallelLayout(pp=3, microbatches=4)
    seen = LayoutsSeen()
    seen.formed(pp2, [None, ModelLimits(blocks=6, tp_degrees=(1,))])
    seen.formed(pp3, [None])
    rows = [{"layout": "pp2", "step_s": s} for s in (0.9, 0.2, 0.3)] + [
        {"layout": "pp3", "step_s": 0.1}, {"layout": "pp3", "step_s": 5.0, "skipped": True}, {"step_s": 7.0}]
    assert seen.measured(rows) == {pp2: 0.3, pp3: 0.1}
    assert seen.limits == ModelLimits(blocks=6, tp_degrees=(1,))
    assert measured_step_s(rows, {}) == {}


def test_the_gpt_reports_its_blocks_and_the_tp_degrees_its_shape_divides():
    workload = CharGPT(n_layer=6, n_head=4, n_embd=32, block_size=16, corpus_chars=30000, tie_embeddings=False)
    before = torch.default_generator.get_state()
    limits = model_limits(workload, WorkloadConfig(name="chargpt"))
    assert limits == ModelLimits(blocks=6, tp_degrees=(1, 2, 4))
    assert torch.equal(torch.default_generator.get_state(), before)  # built on the meta device: nothing drawn


@pytest.mark.parametrize(("reported", "named"), [
    ({"blocks": 0, "tp_degrees": [1]}, "'blocks' is 0"),
    ({"blocks": 4, "tp_degrees": [0, 2]}, "'tp_degrees' is [0, 2]"),
    ({"blocks": 4}, "not {'blocks': 4}"),
    ([4, [1, 2]], "not [4, [1, 2]]"),
])
def test_a_workloads_bad_model_limits_are_refused_naming_what_is_wrong(reported, named):
    with pytest.raises(ValueError, match="workload 'mine': model_limits") as error:
        ModelLimits.reported(reported, workload="mine")
    assert named in str(error.value)


def test_parallel_degrees_takes_preferred_or_fixed():
    with pytest.raises(ValueError, match="parallel.degrees must be one of preferred, fixed, got 'any'"):
        ParallelConfig(pp=2, degrees="any")
