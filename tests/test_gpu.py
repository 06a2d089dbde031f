"""GPU workers (NCCL): mixed precision, and a survivor that outlives its killed peer.

The GPU tests run one worker per visible GPU (at most 2) through cluster.job.train and are skipped
where torch sees no CUDA device; the kill test needs two GPUs (with one, a compression hook has nothing
to send: its arithmetic on CUDA tensors runs only with two). Without CUDA, what runs instead is
what a user then gets from scaling.use_gpu=true: an error naming the field, not a silent CPU run (a
local Ray is given 2 logical GPUs, so the workers are placed and the error comes from them).

    python -m pytest tests/test_gpu.py -v     # on a GPU machine
"""

from __future__ import annotations

import logging
import math
import time

import pytest
import ray
import torch

from raylastic.actors.status.run import RunFailed
from raylastic.cluster.job import train
from raylastic.jobconfig.naming import NAMESPACE
from raylastic.strategies.checkpoint import load_into
from raylastic.strategies.process_group import choose_backend, choose_device
from tests.conftest import REPO_ROOT
from tests.support.helpers import assert_states_close, job, load_model

NUM_GPUS = min(2, torch.cuda.device_count())
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
requires_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
without_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


@without_cuda
def test_use_gpu_without_a_cuda_device_is_an_error_naming_the_field():
    for choose in (choose_device, choose_backend):
        with pytest.raises(ValueError, match=r"scaling\.use_gpu=true, but this worker sees no CUDA device"):
            choose(True)
    assert choose_device(False) == torch.device("cpu") and choose_backend(False) == "gloo"


@pytest.fixture
def ray_with_logical_gpus(local_ray):
    """A local Ray that believes it has 2 GPUs (logical resources): GPU workers are placed, CUDA is absent."""
    local_ray.stop()
    ray.init(address="local", num_cpus=4, num_gpus=2, namespace=NAMESPACE, include_dashboard=False,
             logging_level=logging.WARNING, runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})
    try:
        yield
    finally:
        ray.shutdown()


@without_cuda
def test_a_gpu_job_on_workers_without_cuda_fails_at_once_naming_the_field(ray_with_logical_gpus, tmp_path):
    config = job("scaling.use_gpu=true", "scaling.min_workers=2", "scaling.max_workers=2",
                 "scaling.placement_timeout_s=300", name="nocuda")
    started = time.monotonic()
    with pytest.raises(RunFailed) as raised:
        train(config, run_dir=tmp_path)
    assert "scaling.use_gpu=true, but this worker sees no CUDA device" in str(raised.value)
    assert time.monotonic() - started < config.scaling.placement_timeout_s / 3  # not retried until placement gives up


def _gpu_job(*overrides: str, name: str):
    return job("scaling.use_gpu=true", "scaling.cpus_per_worker=1", f"scaling.min_workers={max(1, NUM_GPUS - 1)}",
               f"scaling.max_workers={NUM_GPUS}", "optim.lr=0.01", *overrides, name=name)


def _saved_scale(checkpoint: str) -> float:
    entries = {"scaler.scale": torch.zeros((), dtype=torch.float64)}
    load_into(entries, checkpoint)
    return entries["scaler.scale"].item()


@requires_cuda
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_gpu_workers_train_with_nccl(tmp_path, precision):
    result = train(_gpu_job(f"training.precision={precision}", name=f"gpu-{precision}"), run_dir=tmp_path)
    assert result.final_step == 20 and {row["world_size"] for row in result.history} == {NUM_GPUS}
    losses = [row["loss"] for row in result.history]
    assert all(math.isfinite(loss) for loss in losses) and sum(losses[-3:]) < 0.5 * sum(losses[:3])
    if precision == "fp16":  # the loss scaler's state is part of the checkpoint
        assert _saved_scale(result.checkpoint) > 0


GPU_STRATEGIES = {
    "zero1": ("strategy.name=zero1",),
    "zero2": ("strategy.name=zero2",),
    "zero3": ("strategy.name=zero3",),
    "zero3-offload": ("strategy.name=zero3", "strategy.offload=true"),
    "chargpt-zero2-offload": ("workload.name=chargpt", "workload.options={corpus_chars: 60000, block_size: 32}",
                              "strategy.name=zero2", "strategy.offload=true", "training.precision=bf16"),
    "powersgd": ("strategy.compression=powersgd", "strategy.powersgd_start_iter=2"),
    "topk": ("strategy.compression=topk",),
    "onebit": ("strategy.compression=onebit", "strategy.onebit_warmup_steps=5"),
    "int8": ("strategy.compression=int8",),
    "diloco-bf16": ("strategy.name=diloco", "strategy.sync_every=5", "strategy.compression=bf16"),
    "accumulation": ("training.micro_batch_size=12", "training.precision=bf16"),
}


@requires_cuda
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("overrides", GPU_STRATEGIES.values(), ids=GPU_STRATEGIES.keys())
def test_every_strategy_trains_on_nccl_workers_and_exports_a_cpu_model(tmp_path, overrides):
    """The comm hooks, FSDP2 and DiLoCo's outer step on CUDA tensors; model.pt loads on a machine without CUDA."""
    result = train(_gpu_job(*overrides, name="gpu-strategy"), run_dir=tmp_path)
    assert result.final_step == 20 and {row["world_size"] for row in result.history} == {NUM_GPUS}
    losses = [row["loss"] for row in result.history]
    assert all(math.isfinite(loss) for loss in losses) and sum(losses[-3:]) < sum(losses[:3])
    assert {tensor.device.type for tensor in load_model(tmp_path).values()} == {"cpu"}


@requires_two_gpus
@pytest.mark.usefixtures("ray_local")
def test_nccl_survivor_carries_on_when_its_peer_is_killed(tmp_path):
    """fp16: the replacement receives the survivor's loss scale with the model, so both scale alike."""
    common = ("training.precision=fp16", "failure.collective_timeout_s=10", "failure.step_timeout_s=10")
    undisturbed = train(_gpu_job(*common, name="nccl-undisturbed"), run_dir=tmp_path / "undisturbed")
    killed = train(_gpu_job(*common, "faults=[{action: kill, rank: 1, step: 8}]", name="nccl-kill"),
                   run_dir=tmp_path / "kill")
    assert killed.final_step == 20
    assert sum(e.type == "worker_failed" for e in killed.events) == 1
    recovered = next(e for e in killed.events if e.type == "recovered")
    assert recovered.details["recovery_s"] < 10 + 10  # the survivor raised in time, it did not die with its peer
    assert_states_close(load_model(tmp_path / "kill"), load_model(tmp_path / "undisturbed"), rtol=1e-3, atol=1e-4)
    assert _saved_scale(killed.checkpoint) == _saved_scale(undisturbed.checkpoint)
