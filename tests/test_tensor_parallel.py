"""Tensor parallelism (parallel.tp) composed with the data-parallel strategies, on gloo.

Each layout trains the built-in GPT a few steps with AdamW, weight decay, clipping and a cosine schedule, and
ends with the parameters and optimizer state of one process training on the same global batches; its loss,
samples and sample ids are reported once per data-parallel rank, and its evaluation is the same. A checkpoint
saved in one layout loads exactly in others. A Ray run of dp2 x tp2 that loses a worker goes on at the layout
the survivors allow, from its checkpoint, and ends as an undisturbed run does.

    python -m pytest tests/test_tensor_parallel.py -q
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re

import pytest

from raylastic.actors.controller.layout_policy import LayoutPolicy
from raylastic.actors.controller.policies import Noop, ScalingPolicy, ScalingState, trained_workers
from raylastic.cluster.job import train
from raylastic.jobconfig import ParallelConfig
from raylastic.strategies.checkpoint_catalogue import complete_checkpoints
from raylastic.strategies.checkpoint_manifest import read_manifest
from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.workloads import check_workload, load_workload
from raylastic.workloads.chargpt import GPT
from raylastic.workloads.gpt_parallel import tensor_parallel_rule
from tests.support.distributed_harness import run_distributed
from tests.support.helpers import REORDERED_SUMS_ATOL, applied_samples, assert_states_close, job, load_model
from tests.support.parallel_runs import (
    ADAM_TOLERANCE,
    GLOBAL_BATCH,
    assert_loads_exactly_at_tp2_and_dp4,
    train_and_report,
)
from tests.support.strategy_runs import undisturbed_run

LLAMA = ("tests.support.hf_workload:TinyLlama", {})
"""A Hugging Face Llama that splits itself by its own tensor-parallel plan (its cases need transformers)."""
ONE_PROCESS = {"fp32": (None,), "bf16": (None, "ddp", "bf16"), "llama": (None, "ddp", "fp32", None, LLAMA)}
"""What each layout must end with: one process, no model parallelism (train_and_report's arguments)."""
TWO_RANKS = {"tp2": (ParallelLayout(tp=2), "ddp"), "bf16-tp2": (ParallelLayout(tp=2), "ddp", "bf16")}
FOUR_RANKS = {"hsdp-2copies-tp2": (ParallelLayout(dp_replicate=2, tp=2), "zero2"),
              "zero3-dp2-tp2": (ParallelLayout(dp_shard=2, tp=2), "zero3", "fp32"),  # and its checkpoint's root
              "llama-dp2-tp2": (ParallelLayout(dp_shard=2, tp=2), "zero2", "fp32", None, LLAMA)}


def train_each_and_report(cases: list[tuple]) -> list[dict]:
    """``train_and_report(*case)`` for each of ``cases`` in turn, on the same ranks."""
    return [train_and_report(*case) for case in cases]


def trained_each(world_size: int, cases: dict[str, tuple]) -> dict[str, dict]:
    """Every case of ``cases``, one after the other on the same ``world_size`` ranks: rank 0's report by name."""
    if importlib.util.find_spec("transformers") is None:
        cases = {name: case for name, case in cases.items() if LLAMA not in case}
    return dict(zip(cases, run_distributed(train_each_and_report, world_size, list(cases.values()),
                                           timeout_s=120 * len(cases))[0], strict=True))


@pytest.fixture(scope="module")
def one_process() -> dict[str, dict]:
    return trained_each(1, ONE_PROCESS)


@pytest.fixture(scope="module")
def reference(one_process) -> dict:
    return one_process["fp32"]


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, dict]:
    return trained_each(2, TWO_RANKS)


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory) -> str:
    """Where the zero3 dp2 x tp2 case saves its checkpoint."""
    return str(tmp_path_factory.mktemp("zero3-dp2-tp2"))


@pytest.fixture(scope="module")
def four_ranks(checkpoint_root) -> dict[str, dict]:
    cases = {**FOUR_RANKS, "zero3-dp2-tp2": (*FOUR_RANKS["zero3-dp2-tp2"], checkpoint_root)}
    return trained_each(4, cases)


def assert_trains_as_one_process(got: dict, reference: dict) -> None:
    assert any(key.startswith("optim.state.") for key in reference["state"])
    assert_states_close(got["state"], reference["state"], rtol=1e-4, atol=ADAM_TOLERANCE)
    (one_rank,) = reference["reported"]
    for step, expected in enumerate(one_rank):
        reports = [rank[step] for rank in got["reported"]]
        assert sum(samples for _, samples, _ in reports) == GLOBAL_BATCH == expected[1]
        assert sum(loss for loss, _, _ in reports) == pytest.approx(expected[0], rel=1e-5)
        assert all(ids == expected[2] for _, _, ids in reports)  # every rank gathers the same step's samples
    assert got["metrics"] == pytest.approx(reference["metrics"], rel=1e-5)


@pytest.mark.parametrize("case", ["tp2", "hsdp-2copies-tp2"])
def test_a_tensor_parallel_layout_trains_as_one_process(reference, two_ranks, four_ranks, case):
    cases = {**TWO_RANKS, **FOUR_RANKS}
    got = {**two_ranks, **four_ranks}[case]
    assert_trains_as_one_process_reporting_once_per_tp_group(got, reference, cases[case][0])


def assert_trains_as_one_process_reporting_once_per_tp_group(got: dict, reference: dict,
                                                            layout: ParallelLayout) -> None:
    for rank, reports in enumerate(got["reported"]):  # one rank of each tp group reports its samples
        assert all((samples > 0) == (rank % layout.tp == 0) for _, samples, _ in reports), (rank, reports)
    assert_trains_as_one_process(got, reference)


def test_a_hugging_face_llama_split_by_its_own_plan_trains_as_one_process(one_process, four_ranks):
    pytest.importorskip("transformers")
    one, two = one_process["llama"], four_ranks["llama-dp2-tp2"]
    assert any(key.endswith("self_attn.q_proj.weight") for key in one["state"])
    assert_trains_as_one_process(two, one)


def test_bf16_under_tp2_trains_as_one_process_in_bf16(one_process, two_ranks):
    """bf16 rounds the split matmuls' sums differently, and Adam turns that into a step of ~lr on any entry whose
    gradient is near 0 (as fp32 against bf16 on one process does: 7% on the matrices): the losses agree closely
    and the matrices roughly, where a wrong split would be off by their whole size."""
    one, two = one_process["bf16"], two_ranks["bf16-tp2"]
    assert [r[0] for r in two["reported"][0]] == pytest.approx([r[0] for r in one["reported"][0]], rel=1e-3)
    for key, expected in one["state"].items():
        if key.startswith("model.") and expected.dim() == 2:
            assert (two["state"][key] - expected).norm() < 0.15 * expected.norm(), key


def test_zero3_at_dp2_tp2_trains_as_one_process_and_its_checkpoint_loads_exactly_at_tp2_and_dp4(
        reference, four_ranks, checkpoint_root):
    got = four_ranks["zero3-dp2-tp2"]
    assert_trains_as_one_process_reporting_once_per_tp_group(got, reference, FOUR_RANKS["zero3-dp2-tp2"][0])
    path = complete_checkpoints(checkpoint_root)[-1].path
    assert_loads_exactly_at_tp2_and_dp4(path, got["state"])  # and exports it whole


# -- refusals and policies (no processes) ------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.tp=2", "strategy.name=diloco"],
     "strategy.name must be ddp, zero1, zero2, zero3 with parallel.tp or parallel.pp > 1"),
    (["parallel.tp=2", "strategy.compression=bf16"], "strategy.compression must be left at its default"),
    (["parallel.tp=2", "strategy.hierarchical=true"], "strategy.hierarchical must be left at its default"),
    (["parallel.tp=2", "training.compile=true"], "training.compile must be false with parallel.tp or parallel.pp"),
    (["parallel.tp=2", "scaling.max_workers=3"],
     "scaling.max_workers must be a multiple of parallel.tp x parallel.pp (2)"),
    (["parallel.tp=4", "scaling.max_workers=8", "scaling.min_workers=3"],
     "scaling.min_workers must be a multiple or a divisor of parallel.tp x parallel.pp (4)"),
    (["parallel.tp=2", "scaling.max_workers=8", "training.global_batch_size=3"],
     "cannot be split across the 4 data-parallel ranks"),
    (["parallel.pp=2", "scaling.max_workers=2", "parallel.pp_schedule=zbv", "parallel.stages_per_rank=3"],
     "parallel.stages_per_rank must be 2 with parallel.pp_schedule=zbv"),
    (["parallel.pp=2", "scaling.max_workers=2", "training.micro_batch_size=4"],
     "training.micro_batch_size must be null with parallel.pp > 1"),
    (["parallel.pp=2", "scaling.max_workers=2", "parallel.pp_schedule=zbv", "strategy.name=zero3"],
     "strategy.name must be ddp, zero1 or zero2 with parallel.pp_schedule=zbv"),
    (["parallel.pp=2", "scaling.max_workers=4", "training.global_batch_size=6"],
     "training.global_batch_size must be a multiple of 4 with parallel.pp > 1"),
    (["parallel.tp=0"], "parallel.tp must be a positive integer"),
    (["parallel.pp=2", "scaling.max_workers=2", "faults=[{action: kill, rank: 0, step: 1, microbatch: 2}]"],
     "faults[0].microbatch must be null without parallel.pp > 1, else below parallel.pp_microbatches (2)"),
    (["faults=[{action: throttle, rank: 0, step: 1, factor: 2, microbatch: 0}]"],
     "faults[].microbatch must be null, or a non-negative integer with action kill, stall or raise"),
])
def test_a_layout_that_cannot_work_is_refused_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        job(*overrides)


def test_a_workload_without_parallelize_or_pipeline_stages_and_a_gpt_that_does_not_divide_are_refused():
    with pytest.raises(ValueError, match=r"parallel.tp=2, parallel.pp=1 needs the workload to split its model: "
                                         r".*Digits.* no parallelize\(model, tp_mesh\)"):
        check_workload("digits", tp=2)
    with pytest.raises(ValueError, match=r"no pipeline_split\(model, stage, num_stages\) and no pipeline_loss"):
        check_workload("digits", pp=2)
    check_workload("chargpt", tp=2, pp=2, eval_every_steps=25)


class PipelinedWithEvaluateOnly:
    """A workload that splits into pipeline stages and evaluates with ``evaluate(model)`` alone (only what it
    defines matters to check_workload)."""

    build_model = train_dataset = training_step = evaluate = pipeline_split = pipeline_loss = None


def test_a_periodic_evaluation_through_a_pipeline_without_an_eval_dataset_is_refused_naming_the_fields():
    workload = "tests.test_tensor_parallel:PipelinedWithEvaluateOnly"
    with pytest.raises(ValueError, match=r"eval.every_steps=25 with parallel.pp=2 needs the workload's "
                                         r"eval_dataset\(\) and eval_step\(\).*PipelinedWithEvaluateOnly.* has no "
                                         r"eval_dataset.*or set eval.every_steps=0"):
        check_workload(workload, pp=2, eval_every_steps=25)
    check_workload(workload, pp=2)  # no periodic evaluation: a pipeline's end has no metrics, and says so
    check_workload(workload, eval_every_steps=25)  # one process holds the whole model for evaluate()
    model = GPT(n_layer=1, n_head=3, n_embd=12, block_size=8)
    assert "parallel.tp=2 must divide the GPT's workload.options.n_head (3)" in tensor_parallel_rule(model, 2)
    assert tensor_parallel_rule(model, 1) is None


def test_a_generation_trains_whole_tp_groups_and_spares_complete_one():
    assert [trained_workers(n, 4) for n in range(0, 10)] == [0, 1, 2, 2, 4, 4, 4, 4, 8, 8]
    scaling = ScalingPolicy(min_workers=1, max_workers=4, unit=2)
    assert scaling.decide(ScalingState(num_workers=2, num_placeable=0, num_spares_ready=1)) == Noop()
    grown = scaling.decide(ScalingState(num_workers=2, num_placeable=1, num_spares_ready=1))
    assert (grown.num_workers, grown.from_spares) == (4, 1)
    # the spare taken alone completes no tp pair: no boundary until the new worker is built too
    assert [scaling.grows_at_a_boundary(world_size=2, ready=ready) for ready in (0, 1, 2)] == [False, False, True]
    assert ScalingPolicy(min_workers=1, max_workers=4).grows_at_a_boundary(world_size=2, ready=1)
    policy = LayoutPolicy(parallel=ParallelConfig(tp=2), replicas=4, global_batch_size=8)  # ddp: a copy per dp rank
    assert policy.decide(3) == ParallelLayout(dp_replicate=1, tp=2)
    assert policy.decide(4) == ParallelLayout(dp_replicate=2, tp=2)
    assert policy.decide(1) == ParallelLayout()
    assert LayoutPolicy().decide(4) is None


# -- a Ray run --------------------------------------------------------------------------------------------


KILL_STEPS = 8
KILL_JOB = ("workload.name=chargpt",
            "workload.options={n_layer: 1, n_head: 2, n_embd: 32, block_size: 16, corpus_chars: 30000}",
            "parallel.tp=2", "strategy.name=zero3", "scaling.min_workers=2", "scaling.max_workers=4",
            f"training.steps={KILL_STEPS}", "training.global_batch_size=8", "training.record_samples=true",
            "scaling.cpus_per_worker=0.25", "faults=[{action: kill, rank: 1, step: 7}]")


@pytest.fixture(scope="module")
def undisturbed() -> tuple[int, dict, dict]:
    """The kill runs' job undisturbed (the same whether a lost part comes from a buddy copy or a checkpoint): the
    training set's size, each step's samples, the parameters it ends with."""
    config = job(*KILL_JOB)
    num_samples = len(load_workload(config.workload.name, config.workload.options).train_dataset())
    return num_samples, *undisturbed_run(config, num_samples)


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("buddy_copy", [True, False], ids=["buddy-copy", "checkpoint"])
def test_a_dp2_tp2_run_that_loses_a_worker_goes_on_at_the_survivors_layout(tmp_path, buddy_copy, undisturbed):
    """dp2 x tp2 on 4 workers under zero3; one is killed at step 7. With buddy copies (the default) its part comes
    from its buddy's memory, at most one committed step redone and no checkpoint written or read; without them, from
    the step-4 checkpoint (written asynchronously by then). Either way the 3 left train as dp1 x tp2 (the third waits
    as a spare); a scale-up back to dp2 x tp2 takes the state from the members' memory; the run ends with an
    undisturbed run's parameters."""
    steps = KILL_STEPS
    disturbed = job(*KILL_JOB, f"checkpoint.every_steps={0 if buddy_copy else 4}",
                    f"strategy.buddy_copy={str(buddy_copy).lower()}", name="tp-kill")
    result = train(disturbed, run_dir=tmp_path / "run")
    formed = [e for e in result.events if e.type == "generation_formed"]
    assert (formed[0].details["layout"], formed[0].details["state_source"], formed[0].step) == (
        "dp2 x tp2", "initialisation", 0), formed
    lost = formed[1].details
    if buddy_copy:
        assert (lost["layout"], lost["state_source"], lost["previous_layout"]) == ("tp2", "buddy", "dp2 x tp2"), formed
        assert lost["steps_lost"] <= 1 and formed[1].step >= 5, formed
    else:
        assert (lost["layout"], lost["state_source"], formed[1].step) == ("tp2", "checkpoint", 4), formed
    for grown in formed[2:]:  # the replacement and the spare, if they came in time: from the members, nothing lost
        assert (grown.details["layout"], grown.details["state_source"], grown.details["steps_lost"]) == (
            "dp2 x tp2", "peers", 0), formed
        assert grown.details["previous_layout"] == "tp2" and grown.details["moved_bytes"] > 0, formed
    assert {row["layout"] for row in result.history} <= {"dp2 x tp2", "tp2"}
    assert [row["layout"] for row in result.history][:4] == ["dp2 x tp2"] * 4
    final_layout = {"dp2 x tp2": ParallelLayout(dp_shard=2, tp=2), "tp2": ParallelLayout(tp=2)}[
        formed[-1].details["layout"]]
    assert read_manifest(result.checkpoint).layout == dataclasses.asdict(final_layout)
    num_samples, samples, parameters = undisturbed
    assert applied_samples(result.ledger, steps, num_samples) == samples
    assert_states_close(load_model(tmp_path / "run"), parameters, rtol=1e-4, atol=REORDERED_SUMS_ATOL)
