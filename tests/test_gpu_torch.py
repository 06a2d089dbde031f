"""The GPU path without Ray: every strategy and precision on one GPU, and on several the multi-rank paths (every
compression hook, tensor and pipeline parallelism, buddy copies in pinned memory, P2P between two processes that
see each other's GPUs), each on an NCCL group that ``join_group`` forms as a GPU TrainWorker's, through
``build_strategy`` and ``StepRunner`` (tests/support/gpu_runs.py). Nothing here imports Ray, so these run where Ray
is missing: the device check (benchmarks/device_check.py) runs this module with Ray hidden. Skipped without CUDA;
those needing more GPUs than the machine has are skipped naming how many.

    python -m benchmarks.device_check              # this module, then the GPU tests that need Ray
    python -m pytest tests/test_gpu_torch.py -v    # this module alone
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from raylastic.jobconfig import load_job_config
from raylastic.strategies.parallel_layout import ParallelLayout
from tests.support.distributed_harness import run_distributed
from tests.support.gpu_runs import (
    GpuRun,
    lose_a_rank_and_restore_from_its_buddy,
    peer_to_peer_all_reduce,
    train_on_gpus,
)

pytestmark = pytest.mark.gpu
NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
TIMEOUT_S = 240.0
"""A run's bound: the ranks' CUDA contexts and NCCL communicators form within it, and a few steps take seconds."""


def needs_gpus(count: int) -> pytest.MarkDecorator:
    reason = "needs a CUDA device" if NUM_GPUS == 0 else f"needs {count} CUDA devices, this machine has {NUM_GPUS}"
    return pytest.mark.skipif(NUM_GPUS < count, reason=reason)


def _assert_trained(losses: list[float]) -> None:
    assert losses and all(math.isfinite(loss) for loss in losses), losses
    assert losses[-1] < losses[0], losses


def _refusal(run: GpuRun) -> str | None:
    """What the job config says against ``run`` (a combination no user can start), or None."""
    overrides = [f"strategy.name={run.strategy}", f"training.precision={run.precision}", "scaling.use_gpu=true",
                 *(f"strategy.{key}={str(value).lower()}" for key, value in run.options.items())]
    try:
        load_job_config(None, overrides)
    except ValueError as error:
        return str(error)
    return None


ONE_GPU_STRATEGIES = {
    "ddp": GpuRun(strategy="ddp"),
    "zero1": GpuRun(strategy="zero1"),
    "zero2": GpuRun(strategy="zero2"),
    "zero3": GpuRun(strategy="zero3"),
    "zero2-offload": GpuRun(strategy="zero2", options={"offload": True}),
    "zero3-offload": GpuRun(strategy="zero3", options={"offload": True}),
    "diloco": GpuRun(strategy="diloco", options={"sync_every": 2}),
}


@needs_gpus(1)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", ONE_GPU_STRATEGIES)
def test_every_strategy_trains_in_every_precision_on_one_gpu(tmp_path, record_property, name, precision):
    run = GpuRun(strategy=ONE_GPU_STRATEGIES[name].strategy, options=ONE_GPU_STRATEGIES[name].options,
                 precision=precision)
    if refusal := _refusal(run):
        pytest.skip(f"the job config refuses it: {refusal}")
    record_property("ranks", 1)
    (result,) = run_distributed(train_on_gpus, 1, str(tmp_path / "store"), run, timeout_s=TIMEOUT_S)
    _assert_trained(result["losses"])
    assert result["parameter_devices"] == (["cpu"] if run.options.get("offload") else ["cuda"])
    if precision == "fp16":
        assert result["scale"] > 0


COMPRESSIONS = {
    "none": {}, "fp16": {"compression": "fp16"}, "bf16": {"compression": "bf16"},
    "powersgd": {"compression": "powersgd", "powersgd_start_iter": 2},
    "topk": {"compression": "topk"}, "onebit": {"compression": "onebit", "onebit_warmup_steps": 2},
    "int8": {"compression": "int8"},
}


@needs_gpus(2)
@pytest.mark.parametrize("name", COMPRESSIONS)
def test_every_compression_hook_keeps_two_gpus_replicas_equal_over_nccl(tmp_path, record_property, name):
    """The hooks' arithmetic on CUDA tensors with a peer to send to: every rank steps on the same gradient."""
    record_property("ranks", 2)
    run = GpuRun(strategy="ddp", options=COMPRESSIONS[name], steps=8)
    results = run_distributed(train_on_gpus, 2, str(tmp_path / "store"), run, timeout_s=TIMEOUT_S)
    _assert_trained(results[0]["losses"])
    assert [r["device"] for r in results] == ["cuda:0", "cuda:1"]
    for key, value in results[0]["local_state"].items():
        assert torch.equal(value, results[1]["local_state"][key]), key


@needs_gpus(2)
def test_diloco_with_a_compressed_outer_step_trains_on_two_gpus(tmp_path, record_property):
    record_property("ranks", 2)
    run = GpuRun(strategy="diloco", options={"sync_every": 2, "compression": "bf16"}, steps=8)
    results = run_distributed(train_on_gpus, 2, str(tmp_path / "store"), run, timeout_s=TIMEOUT_S)
    _assert_trained(results[0]["losses"])
    for key, value in results[0]["local_state"].items():  # step 8 ends with an outer step: the ranks agree
        if key.startswith("model."):
            assert torch.equal(value, results[1]["local_state"][key]), key


LAYOUTS = {
    "tp2": (ParallelLayout(tp=2), "ddp"),
    "pp2": (ParallelLayout(pp=2), "ddp"),
    "tp2-zero3": (ParallelLayout(tp=2), "zero3"),
    "dp2xtp2": (ParallelLayout(dp_shard=2, tp=2), "zero2"),
    "dp2xpp2": (ParallelLayout(dp_replicate=2, pp=2), "ddp"),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_model_parallel_layouts_train_over_nccl(tmp_path, record_property, name):
    layout, strategy = LAYOUTS[name]
    if NUM_GPUS < layout.world_size:
        pytest.skip("needs a CUDA device" if NUM_GPUS == 0 else
                    f"needs {layout.world_size} CUDA devices, this machine has {NUM_GPUS}")
    record_property("ranks", layout.world_size)
    run = GpuRun(strategy=strategy, layout=layout)
    results = run_distributed(train_on_gpus, layout.world_size, str(tmp_path / "store"), run, timeout_s=TIMEOUT_S)
    reported = [r["losses"] for r in results if r["losses"]]
    assert reported, "no rank reported a loss"
    for losses in reported:
        _assert_trained(losses)


@needs_gpus(2)
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_a_lost_gpu_ranks_shard_is_rebuilt_from_its_buddys_pinned_copy(tmp_path, record_property, strategy):
    record_property("ranks", 2)
    results = run_distributed(lose_a_rank_and_restore_from_its_buddy, 2, str(tmp_path / "store"), strategy,
                              timeout_s=TIMEOUT_S)
    survivor = results[0]
    assert survivor["plan_step"] == 3 and survivor["parameter_devices"] == ["cuda"]
    assert survivor["restored"].keys() == survivor["trained"].keys()
    for key, value in survivor["trained"].items():
        assert torch.equal(survivor["restored"][key], value), key


@needs_gpus(2)
def test_two_processes_that_see_both_gpus_bind_their_own_and_talk_p2p(tmp_path, record_property):
    record_property("ranks", 2)
    results = run_distributed(peer_to_peer_all_reduce, 2, str(tmp_path), str(tmp_path / "store"), timeout_s=TIMEOUT_S)
    assert [r["index"] for r in results] == [0, 1] and all(r["current"] == r["index"] for r in results)
    assert all(r["count"] >= 2 and r["sum"] == 3.0 for r in results)
    if not results[0]["peer_access"]:
        pytest.skip("these GPUs have no peer access (NVLink or PCIe P2P) to each other")
    log = "".join(path.read_text() for path in Path(tmp_path).glob("nccl.*.log"))
    assert "via P2P" in log and "via SHM" not in log, log[-4000:]
