"""Pipeline parallelism (parallel.pp) on gloo, against one process on the same batches: the built-in GPT's stages
through StepRunner's pipelined step (actors/worker/pipeline_step.py), 2 stages under 1f1b and GPipe, with FSDP
over the data-parallel ranks and tensor parallelism inside each stage, end with the parameters (AdamW, clipping
over every stage, a cosine schedule), the reported losses, samples and sample ids of the whole model.

    python -m pytest tests/test_pipeline_parallel.py -q
"""

from __future__ import annotations

import dataclasses

import pytest

from raylastic.cluster.job import train
from raylastic.strategies.checkpoint_catalogue import complete_checkpoints
from raylastic.strategies.checkpoint_manifest import read_manifest
from raylastic.strategies.parallel_layout import ParallelLayout
from tests.support.distributed_harness import run_distributed
from tests.support.helpers import (
    REORDERED_SUMS_ATOL,
    assert_states_close,
    job,
    load_model,
    tokenized_stdlib,
)
from tests.support.parallel_runs import (
    ADAM_TOLERANCE,
    UNTIED,
    assert_loads_exactly_at_tp2_and_dp4,
    pipeline_train_and_report,
    train_and_report,
)
from tests.support.strategy_runs import TINY_GPT_OPTIONS, assert_trained_as_undisturbed, undisturbed_alongside

PIPELINED = {  # pipeline_train_and_report's layout, strategy, schedule and micro-batches
    "pp2-1f1b": (ParallelLayout(pp=2), "zero3", "1f1b", 2),
    "pp2-gpipe": (ParallelLayout(pp=2), "zero2", "gpipe", 4),
    "pp2-tp2": (ParallelLayout(pp=2, tp=2), "zero3", "1f1b", 2),
    "pp2-dp2": (ParallelLayout(pp=2, dp_shard=2), "zero3", "1f1b", 2),
    "pp2-interleaved": (ParallelLayout(pp=2, stages_per_rank=2), "zero3", "interleaved_1f1b", 4),
    "pp2-zbv": (ParallelLayout(pp=2, stages_per_rank=2, v_shape=True), "zero2", "zbv", 4),
    "zero1-pp2-dp2": (ParallelLayout(pp=2, dp_shard=2), "zero1", "1f1b", 2),
}
BF16_PP2_TP2 = (ParallelLayout(pp=2, tp=2), "zero3", "1f1b", 2, "bf16")
INTERLEAVED_DP2 = ParallelLayout(pp=2, dp_shard=2, stages_per_rank=2)
"""The layout whose checkpoint test_a_checkpoint_of_interleaved_stages_... saves and loads elsewhere."""


def gpt_eval_workload(data_dir: str) -> tuple[str, dict]:
    """The gpt workload's 11 eval samples, on the tokens in ``data_dir``."""
    return ("gpt", {"data_dir": data_dir, "n_layer": 4, "n_head": 2, "n_embd": 32, "block_size": 16, "dropout": 0.0,
                    "eval_blocks": 11, "tie_embeddings": False})


def train_each_and_report(cases: list[tuple]) -> list[dict]:
    """``train_and_report(*case)`` for each of ``cases`` in turn, on the same ranks."""
    return [train_and_report(*case) for case in cases]


def pipeline_train_each_and_report(cases: list[tuple]) -> list[dict]:
    """``pipeline_train_and_report(*case)`` for each of ``cases`` in turn, on the same ranks."""
    return [pipeline_train_and_report(*case) for case in cases]


def run_each(function, world_size: int, cases: dict[str, tuple]) -> dict[str, dict]:
    """Every case of ``cases`` through ``function``, one after the other on the same ``world_size`` ranks: rank
    0's report by name."""
    return dict(zip(cases, run_distributed(function, world_size, list(cases.values()),
                                           timeout_s=120 * len(cases))[0], strict=True))


@pytest.fixture(scope="module")
def gpt_data(tmp_path_factory) -> str:
    return str(tokenized_stdlib(tmp_path_factory.mktemp("tokens"), 100_000))


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory) -> str:
    """Where the interleaved dp2 x pp2 case saves its checkpoint."""
    return str(tmp_path_factory.mktemp("interleaved"))


@pytest.fixture(scope="module")
def one_process(gpt_data) -> dict[str, dict]:
    """One process, no pipeline, on the same batches: what the pipelined cases must end with."""
    return run_each(train_each_and_report, 1, {
        "fp32": (None, "ddp", "fp32", None, UNTIED), "bf16": (None, "ddp", "bf16", None, UNTIED),
        "gpt-eval": (None, "ddp", "fp32", None, gpt_eval_workload(gpt_data))})


@pytest.fixture(scope="module")
def reference(one_process) -> dict:
    return one_process["fp32"]


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, dict]:
    return run_each(pipeline_train_each_and_report, 2,
                    {name: case for name, case in PIPELINED.items() if case[0].world_size == 2})


@pytest.fixture(scope="module")
def four_ranks(gpt_data, checkpoint_root) -> dict[str, dict]:
    return run_each(pipeline_train_each_and_report, 4, {
        **{name: case for name, case in PIPELINED.items() if case[0].world_size == 4},
        "bf16-pp2-tp2": BF16_PP2_TP2,
        "gpt-eval-zbv": (ParallelLayout(pp=2, dp_shard=2, stages_per_rank=2, v_shape=True), "zero2", "zbv", 4, "fp32",
                         None, gpt_eval_workload(gpt_data)),
        "interleaved-dp2": (INTERLEAVED_DP2, "zero3", "interleaved_1f1b", 4, "fp32", checkpoint_root)})


@pytest.mark.parametrize("case", PIPELINED)
def test_a_pipelined_step_trains_as_one_process(reference, request, case):
    layout = PIPELINED[case][0]
    got = request.getfixturevalue({2: "two_ranks", 4: "four_ranks"}[layout.world_size])[case]
    assert_states_close(got["state"], reference["state"], rtol=1e-4, atol=ADAM_TOLERANCE)
    (one_rank,) = reference["reported"]
    for rank, reports in enumerate(got["reported"]):  # the last stage's tp-rank 0 of each dp rank reports
        assert all((samples > 0) == layout.reports(rank) for _, samples, _ in reports), (rank, reports)
    for step, (loss, samples, ids) in enumerate(one_rank):
        reports = [rank[step] for rank in got["reported"]]
        assert sum(s for _, s, _ in reports) == samples and all(i == ids for _, _, i in reports)
        assert sum(r_loss for r_loss, _, _ in reports) == pytest.approx(loss, rel=1e-5)


def test_evaluation_through_a_pipeline_is_the_mean_loss_of_the_eval_samples_as_on_one_process(one_process,
                                                                                               four_ranks):
    """The gpt workload's 11 eval samples over 2 data-parallel ranks (6 and 5) in rounds of 4 (the micro-batches,
    one sample each), through 2 stages on each of 2 pipeline ranks in a V: the last round padded and the padding
    left out, the eval_loss is eval_step's on one process."""
    one, got = one_process["gpt-eval"], four_ranks["gpt-eval-zbv"]
    assert got["metrics"] == pytest.approx({"eval_loss": one["metrics"]["eval_loss"]}, rel=1e-5)


def test_bf16_under_tp2_pp2_trains_as_one_process_in_bf16(one_process, four_ranks):
    """As tests/test_tensor_parallel.py's bf16 test: the losses agree closely and the matrices roughly (bf16's
    rounding of split sums, which Adam turns into steps of ~lr where a gradient is near 0)."""
    one, got = one_process["bf16"], four_ranks["bf16-pp2-tp2"]
    losses = [sum(rank[step][0] for rank in got["reported"]) for step in range(len(one["reported"][0]))]
    assert losses == pytest.approx([loss for loss, _, _ in one["reported"][0]], rel=1e-3)
    for key, expected in one["state"].items():
        if key.startswith("model.") and expected.dim() == 2:
            assert (got["state"][key] - expected).norm() < 0.15 * expected.norm(), key


def test_a_checkpoint_of_interleaved_stages_loads_exactly_at_tp2_and_at_dp4_and_exports_whole(four_ranks,
                                                                                               checkpoint_root):
    """Saved at (dp2, pp2) with two stages on each pipeline rank (each parameter under its whole-model name),
    loaded at (dp1, pp1, tp2) and at (dp4, pp1, tp1): every parameter and optimizer entry equal."""
    saved = four_ranks["interleaved-dp2"]["state"]
    path = complete_checkpoints(checkpoint_root)[-1].path
    assert read_manifest(path).layout == dataclasses.asdict(INTERLEAVED_DP2)
    assert_loads_exactly_at_tp2_and_dp4(path, saved, UNTIED)


@pytest.mark.usefixtures("ray_local")
def test_a_zbv_run_ends_with_the_whole_models_parameters_gathered_from_its_stages(tmp_path):
    """Two ranks of two stages each, in a V (the first rank holds the first and the last stage)."""
    calm = job("workload.name=chargpt", TINY_GPT_OPTIONS.replace("n_layer: 2", "n_layer: 4"), "parallel.pp=2",
               "parallel.pp_schedule=zbv", "strategy.name=ddp", "training.steps=4", "training.global_batch_size=8",
               "scaling.cpus_per_worker=0.5", name="pp-calm")
    undisturbed = undisturbed_alongside(calm)
    result = train(calm, run_dir=tmp_path / "run")
    assert [row["layout"] for row in result.history] == ["pp2 (2 stages each, V)"] * 4
    _, parameters = undisturbed.result(timeout=600)
    assert_states_close(load_model(tmp_path / "run"), parameters, rtol=1e-4, atol=REORDERED_SUMS_ATOL)  # model.pt


@pytest.mark.usefixtures("ray_local")
def test_a_tp2_pp2_run_that_loses_a_worker_goes_on_from_its_buddys_copy(tmp_path):
    """Two stages, each split over two workers (no data-parallel copy: each rank's part goes to its buddy, the next
    rank, after every step); one killed at step 5, no checkpoint written: the three survivors allow tp2 (one waits
    as a spare), which takes the whole model from the survivors' own parts and the lost one's buddy copy, at most
    one committed step redone; the run ends with an undisturbed run's parameters and every step applied once."""
    steps = 8
    disturbed = job("workload.name=chargpt", TINY_GPT_OPTIONS, "parallel.pp=2", "parallel.tp=2", "strategy.name=zero3",
                    "scaling.min_workers=1", "scaling.max_workers=4", f"training.steps={steps}",
                    "training.global_batch_size=8", "training.record_samples=true", "checkpoint.every_steps=0",
                    "scaling.cpus_per_worker=0.25", "faults=[{action: kill, rank: 1, step: 5}]", name="tp-pp-kill")
    undisturbed = undisturbed_alongside(disturbed)
    result = train(disturbed, run_dir=tmp_path / "run")
    formed = [e for e in result.events if e.type == "generation_formed"]
    assert [(e.details["layout"], e.details["state_source"]) for e in formed[:2]] == [
        ("pp2 x tp2", "initialisation"), ("tp2", "buddy")], formed
    assert formed[1].details["previous_layout"] == "pp2 x tp2" and formed[1].details["steps_lost"] <= 1, formed
    for grown in formed[2:]:  # spares and the replacement, as they came: from the members' memory, nothing lost
        assert (grown.details["state_source"], grown.details["steps_lost"]) == ("peers", 0), formed
    assert_trained_as_undisturbed(result, disturbed, tmp_path / "run", steps, undisturbed.result(timeout=600))
