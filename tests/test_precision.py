"""Mixed precision and torch.compile: what must survive a recovery, a checkpoint and accumulation.

- fp16's loss scaler (scale, growth tracker) is handed over in memory with the model, and saved in and
  loaded from checkpoints, so replicas keep one scale after a recovery or a resume; a checkpoint
  without scaler state (another precision, an older run) still loads (real gloo ranks, torch.amp.GradScaler("cpu")).
- fp16 runs under every strategy and layout, on CPU too (async_ps refuses it). Under zero1-3 an overflow in one
  rank's part of the gradients makes every rank skip that step and lower its scale alike
  (strategies/loss_scaling.py), and the steps around it train as fp32 does; a pipeline's backward starts from the
  scaled loss. The same on CUDA in a gpu-marked test.
- training.compile keeps DDP's ``no_sync``: with accumulation a step communicates once, not once per
  micro-batch (the harness compiles with backend="aot_eager", which takes seconds where inductor's C++
  build takes minutes on this machine; the real worker's inductor path runs end to end below).
- bf16 and compiled runs train end to end through cluster.job.train, bf16 through a killed worker.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from raylastic.actors.data.order import GlobalSampleOrder
from raylastic.actors.worker.optimizer_recipe import optimizer_factory
from raylastic.actors.worker.step import StepRunner
from raylastic.cluster.job import train
from raylastic.jobconfig import OptimConfig, StrategyConfig, load_job_config
from raylastic.strategies.base import GroupContext, init_optimizer_state, load_scaler, scaler_entries
from raylastic.strategies.build import build_strategy
from raylastic.strategies.checkpoint import Checkpointer, load_into
from raylastic.strategies.ddp import DDPStrategy
from raylastic.strategies.group_assignment import GroupAssignment
from raylastic.strategies.loss_scaling import GroupGradScaler, WholeGradientScaler, loss_scaler_for
from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.strategies.process_group import join_group
from raylastic.strategies.state_transfer import broadcast_training_state
from raylastic.workloads.digits import Digits
from tests.support import parallel_runs
from tests.support.distributed_harness import run_distributed
from tests.support.helpers import job

CPU = torch.device("cpu")
SAVED_SCALER = {"scale": 256.0, "_growth_tracker": 5}


def _scaler(**state: float) -> torch.amp.GradScaler:
    """A CPU GradScaler that has scaled once (its tensors exist, as in a running job), then holds ``state``."""
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    if state:
        scaler.load_state_dict({**scaler.state_dict(), **state})
    return scaler


def _linear_state(strategy_name: str = "ddp", seed: int = 0):
    strategy = build_strategy(StrategyConfig(name=strategy_name))
    torch.manual_seed(seed + dist.get_rank())  # different on every rank: the hand-over or the load must equalise them
    state = strategy.setup(lambda: torch.nn.Linear(4, 3), lambda m: torch.optim.Adam(m.parameters(), lr=0.1), CPU,
                           None)
    return strategy, state


def _hand_over_scaler() -> dict:
    """Rank 0 (the most advanced) has lowered its scale after overflows; rank 1 is a fresh replacement."""
    _, state = _linear_state()
    scaler = _scaler(scale=512.0, _growth_tracker=7) if dist.get_rank() == 0 else _scaler()
    broadcast_training_state(state.model, state.optimizer, 3 if dist.get_rank() == 0 else 0, source_rank=0,
                             device=CPU, scaler=scaler)
    return {"scale": scaler.get_scale(), "growth_tracker": int(scaler._growth_tracker)}


def test_the_hand_over_gives_every_replica_the_sources_loss_scale():
    assert run_distributed(_hand_over_scaler, 2) == [{"scale": 512.0, "growth_tracker": 7}] * 2


def _save(root: str, with_scaler: bool) -> str:
    strategy, state = _linear_state()
    init_optimizer_state(state.optimizer)
    broadcast_training_state(state.model, state.optimizer, 0, source_rank=0, device=CPU)
    entries = scaler_entries(_scaler(**SAVED_SCALER)) if with_scaler else {}
    checkpointer = Checkpointer(root=root, every_steps=0, num_to_keep=2, config_hash="test", global_batch_size=8)
    return checkpointer.save(7, {**strategy.state_dict(state), **entries}, strategy="ddp",
                             world_size=dist.get_world_size()).result()


def _restore(directory: str, strategy_name: str, with_scaler: bool) -> dict:
    """Load ``directory`` as TrainWorker.restore does, into the scaler TrainWorker makes for ``strategy_name`` (none
    without ``with_scaler``), before its first step; the scaler's state and the model's weight."""
    strategy, state = _linear_state(strategy_name, seed=100)
    init_optimizer_state(state.optimizer)
    flat = strategy.state_dict(state)
    load_into(flat, directory)
    strategy.load_state_dict(state, flat)
    scaler = loss_scaler_for(strategy_name, model_parallel=1, device_type="cpu") if with_scaler else None
    load_scaler(scaler, directory)
    weight = state.model.weight
    weight = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
    return {"scaler": scaler.state_dict() if scaler else None, "weight": weight.detach().clone()}


def _saved_weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3).weight.detach()


def test_a_checkpoint_keeps_the_loss_scale_across_world_sizes_and_strategies(tmp_path):
    directory = run_distributed(_save, 2, str(tmp_path), True)[0]
    for strategy_name, world_size in (("ddp", 1), ("zero3", 2)):  # a GradScaler, a GroupGradScaler on each rank
        for restored in run_distributed(_restore, world_size, directory, strategy_name, True):
            assert restored["scaler"]["scale"] == 256.0 and restored["scaler"]["_growth_tracker"] == 5
            torch.testing.assert_close(restored["weight"], _saved_weight())


def test_a_checkpoint_with_scaler_state_loads_into_a_run_without_a_scaler(tmp_path):
    directory = run_distributed(_save, 2, str(tmp_path), True)[0]
    for restored in run_distributed(_restore, 2, directory, "zero3", False):
        assert restored["scaler"] is None
        torch.testing.assert_close(restored["weight"], _saved_weight())


def test_a_checkpoint_without_scaler_state_still_loads_and_keeps_the_initial_scale(tmp_path):
    directory = run_distributed(_save, 2, str(tmp_path), False)[0]
    restored = run_distributed(_restore, 1, directory, "ddp", True)[0]
    assert restored["scaler"]["scale"] == 2.0**16 and restored["scaler"]["_growth_tracker"] == 0
    torch.testing.assert_close(restored["weight"], _saved_weight())


@pytest.mark.parametrize("overrides", [("strategy.name=ddp",), ("strategy.name=zero1",), ("strategy.name=zero2",),
                                       ("strategy.name=zero3",), ("strategy.name=diloco",),
                                       ("strategy.name=zero3", "parallel.tp=2", "scaling.max_workers=2"),
                                       ("strategy.name=zero1", "parallel.pp=2", "scaling.max_workers=2")])
def test_fp16_is_accepted_under_every_strategy_and_layout_on_cpu(overrides):
    assert load_job_config(None, ["training.precision=fp16", *overrides]).training.precision == "fp16"


def test_each_strategy_gets_the_scaler_whose_overflow_check_its_ranks_share():
    def kind(name: str, model_parallel: int = 1) -> type:
        return type(loss_scaler_for(name, model_parallel=model_parallel, device_type="cpu"))

    assert kind("ddp") is kind("diloco") is torch.amp.GradScaler  # whole gradients, no collective of its own
    assert kind("zero1") is WholeGradientScaler
    assert kind("zero2") is kind("zero3") is kind("ddp", 2) is kind("zero1", 4) is GroupGradScaler


FP16_OPTIM = OptimConfig(name="adamw", lr=1e-2)
OVERFLOW_STEP = 2
"""The step (1-based) whose gradient overflows in one rank's part only."""
FP16_STEPS = 4
FP16_BATCH = 8


class _LinearInOutput:
    """loss = mean(model(x) * c): linear in the output, so a sample's huge coefficient for output 7 overflows the
    fp16 gradient of output 7 alone (weight row 7, bias 7: under zero2/zero3 in rank 1's shard of 2) while the
    loss stays finite."""

    def build_model(self) -> torch.nn.Module:
        return torch.nn.Linear(4, 8)

    def training_step(self, model: torch.nn.Module, batch) -> torch.Tensor:
        inputs, coefficients = batch
        return (model(inputs).float() * coefficients).mean()


def _join_nccl(store_path: str) -> torch.device:
    """Leave the harness's gloo group for an NCCL group of the same ranks (``join_group``, as a GPU TrainWorker
    joins a generation), rank r on GPU r."""
    device = torch.device("cuda", dist.get_rank())
    torch.cuda.set_device(device)
    store = dist.FileStore(store_path, dist.get_world_size())
    _NCCL_STORES.append(store)
    join_group(GroupAssignment(generation=0, rank=dist.get_rank(), world_size=dist.get_world_size(), store=None,
                               store_prefix="fp16", timeout_s=120.0), "nccl", store)
    return device


_NCCL_STORES: list[dist.Store] = []
"""Kept while their groups live (a group holds only the C++ side of its store)."""


def _fp16_with_one_rank_overflowing(precision: str, strategy_name: str, device: torch.device = CPU) -> dict:
    """``FP16_STEPS`` steps of AdamW (fused under fp16, as TrainWorker builds it, so that it skips on the device)
    under ``strategy_name`` at ``precision``: with fp16, step ``OVERFLOW_STEP``
    trains rank 0 on a sample whose gradient overflows; with fp32 it is left out (what skipping it does).
    Every rank's skipped steps and scale; rank 0 also the whole model (on the CPU)."""
    workload = _LinearInOutput()
    generator = torch.Generator().manual_seed(0)
    inputs, coefficients = torch.randn(64, 4, generator=generator), torch.randn(64, 8, generator=generator)
    order = GlobalSampleOrder(len(inputs), FP16_BATCH, seed=0)
    coefficients[order.rank_indices(OVERFLOW_STEP - 1, rank=0, world_size=2)[0], 7] = 1e30
    strategy = build_strategy(StrategyConfig(name=strategy_name))
    torch.manual_seed(0)
    state = strategy.setup(lambda: workload.build_model().to(device),
                           optimizer_factory(FP16_OPTIM, skips_on_device=precision == "fp16"), device, None,
                           GroupContext(node_ids=("node",) * dist.get_world_size(), completed_steps=0))
    scaler = (loss_scaler_for(strategy_name, model_parallel=1, device_type=device.type) if precision == "fp16"
              else None)
    runner = StepRunner(workload=workload, dataset=torch.utils.data.TensorDataset(inputs, coefficients),
                        strategy=strategy, optim=FP16_OPTIM, total_steps=100, order=order,
                        micro_batch_size=None, device=device, precision=precision, scaler=scaler)
    steps = range(FP16_STEPS) if scaler else [s for s in range(FP16_STEPS) if s != OVERFLOW_STEP - 1]
    skipped = [result.step for result in (runner.run(state, step) for step in steps) if result.skipped]
    model = {}
    for key, value in strategy.state_dict(state).items():
        if key.startswith("model."):
            model[key] = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().cpu()
    return {"skipped": skipped, "scale": scaler.get_scale() if scaler else None,
            "model": model if dist.get_rank() == 0 else None}


def _fp16_and_fp32(run: Callable[..., dict], *args: Any, nccl_store: str | None = None) -> list[dict]:
    """``run(precision, *args)`` at fp16, then at fp32, on the same ranks; ``nccl_store``: on the ranks' GPUs over
    NCCL, the group formed through a FileStore at that path."""
    device = _join_nccl(nccl_store) if nccl_store is not None else None
    return [run(precision, *args, *([device] if device else [])) for precision in ("fp16", "fp32")]


def _assert_every_rank_skipped_the_overflow(ranks: list[list[dict]]) -> None:
    fp16, fp32 = ([rank[i] for rank in ranks] for i in range(2))
    assert [rank["skipped"] for rank in fp16] == [[OVERFLOW_STEP]] * len(ranks)
    assert [rank["scale"] for rank in fp16] == [2.0**15] * len(ranks)  # torch's initial 2**16, halved once
    _assert_trained_alike(fp16[0]["model"], fp32[0]["model"])


def _assert_trained_alike(fp16: dict[str, torch.Tensor], fp32: dict[str, torch.Tensor]) -> None:
    """AdamW moves an element whose gradient is near zero by up to lr (1e-2) either way, on the noise of fp16's
    forward: so the whole model's mean difference (~1e-5; stepping the overflowing step too: ~5e-3)."""
    assert torch.cat([(fp16[key] - value).flatten() for key, value in fp32.items()]).abs().mean() < 1e-4


@pytest.mark.parametrize("strategy_name", ["zero1", "zero2", "zero3"])
def test_fp16_an_overflow_on_one_rank_skips_the_step_on_every_rank(strategy_name):
    _assert_every_rank_skipped_the_overflow(run_distributed(_fp16_and_fp32, 2, _fp16_with_one_rank_overflowing,
                                                            strategy_name))


GPU_RANKS = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(GPU_RANKS == 0, reason="needs a CUDA device")
@pytest.mark.parametrize("strategy_name", ["ddp", "zero1", "zero2", "zero3"])
def test_fp16_on_gpus_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path, strategy_name):
    """As on CPU, over NCCL on up to 2 GPUs (the found-inf flag reduced on the GPUs; with one GPU, rank 0 alone)."""
    _assert_every_rank_skipped_the_overflow(run_distributed(_fp16_and_fp32, GPU_RANKS, _fp16_with_one_rank_overflowing,
                                                            strategy_name, nccl_store=str(tmp_path / "store"),
                                                            timeout_s=240))


def _overflowing_on_rank_0(scaler: torch.amp.GradScaler, step: int) -> None:
    """Fault injection: at ``scaler``'s ``step``-th unscale, rank 0 finds an inf in its first local gradient (under a
    pipeline: an overflow in the first stage's weights alone, which its activations' gradients do not carry on)."""
    unscale, calls = scaler.unscale_, itertools.count(1)

    def unscale_(optimizer: torch.optim.Optimizer) -> None:
        if next(calls) == step and dist.get_rank() == 0:
            gradient = next(p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
            (gradient.to_local() if isinstance(gradient, DTensor) else gradient).view(-1)[0] = float("inf")
        unscale(optimizer)

    scaler.unscale_ = unscale_


TWO_BLOCKS = (parallel_runs.UNTIED[0], {**parallel_runs.UNTIED[1], "n_layer": 2})


def _pipeline_fp16_with_one_stage_overflowing(precision: str) -> dict:
    """``parallel_runs.STEPS`` steps of a 2-stage pipeline (1f1b, 2 micro-batches): with fp16, rank 0's stage
    overflows at step ``OVERFLOW_STEP``; with fp32 that step is left out. As ``_fp16_with_one_rank_overflowing``."""
    scaler = loss_scaler_for("ddp", model_parallel=2, device_type="cpu") if precision == "fp16" else None
    if scaler is not None:
        _overflowing_on_rank_0(scaler, OVERFLOW_STEP)
    layout = ParallelLayout(pp=2, dp_shard=1)
    _, strategy, state, runner = parallel_runs.setup(layout, "ddp", precision, TWO_BLOCKS, "none", "1f1b", 2,
                                                     scaler=scaler)
    steps = [s for s in range(parallel_runs.STEPS) if scaler is not None or s != OVERFLOW_STEP - 1]
    skipped = [result.step for result in (runner.run(state, step) for step in steps) if result.skipped]
    stages = [None] * layout.pp
    dist.all_gather_object(stages, parallel_runs.whole_state(strategy, state), group=runner.pipeline.group)
    return {"skipped": skipped, "scale": scaler.get_scale() if scaler else None,
            "model": {k: v for stage in stages for k, v in stage.items() if k.startswith("model.")}}


def test_fp16_a_pipeline_scales_its_loss_and_an_overflow_in_one_stage_skips_every_stage():
    fp16, fp32 = ([rank[i] for rank in run_distributed(_fp16_and_fp32, 2, _pipeline_fp16_with_one_stage_overflowing,
                                                       timeout_s=120)] for i in range(2))
    assert [rank["skipped"] for rank in fp16] == [[OVERFLOW_STEP]] * 2
    assert [rank["scale"] for rank in fp16] == [2.0**15] * 2
    _assert_trained_alike(fp16[0]["model"], fp32[0]["model"])


MICRO_BATCHES = 3


def _train_with_accumulation(compiled: bool) -> dict:
    """Two steps of 3 micro-batches per rank under DDP with the fp16 hook (which counts the bytes it sends)."""
    workload = Digits(hidden=16)
    strategy = DDPStrategy(compression="fp16")
    torch.manual_seed(0)
    state = strategy.setup(workload.build_model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), CPU, None)
    if compiled:  # as TrainWorker.join does with training.compile
        state.wrapped = torch.compile(state.wrapped, backend="aot_eager")
    dataset = workload.train_dataset()
    global_batch = 2 * 4 * MICRO_BATCHES
    runner = StepRunner(workload=workload, dataset=dataset, strategy=strategy, optim=OptimConfig(name="sgd", lr=0.1),
                        total_steps=100, order=GlobalSampleOrder(len(dataset), global_batch, seed=0),
                        micro_batch_size=4, device=CPU)
    sent = [runner.run(state, step).bytes_sent for step in range(2)]
    return {"bytes_sent": sent, "model": {k: v.detach().clone() for k, v in state.model.state_dict().items()}}


def test_compile_keeps_no_sync_one_communication_per_step():
    eager = run_distributed(_train_with_accumulation, 2, False, timeout_s=120)
    compiled = run_distributed(_train_with_accumulation, 2, True, timeout_s=300)
    one_step = sum(p.numel() for p in Digits(hidden=16).build_model().parameters()) * 2  # fp16 payload
    assert eager[0]["bytes_sent"] == [one_step, one_step]
    assert compiled[0]["bytes_sent"] == eager[0]["bytes_sent"]  # not MICRO_BATCHES times as much
    for key, value in eager[0]["model"].items():
        torch.testing.assert_close(compiled[0]["model"][key], value)


def _losses(result) -> list[float]:
    return [row["loss"] for row in result.history]


@pytest.mark.usefixtures("ray_local")
def test_bf16_run_recovers_from_a_killed_worker_and_learns(tmp_path):
    config = job("training.precision=bf16", "optim.lr=0.01", "scaling.min_workers=2", "scaling.max_workers=2",
                 "failure.step_timeout_s=4", "faults=[{action: kill, rank: 1, step: 8}]", name="bf16")
    result = train(config, run_dir=tmp_path / "bf16")
    assert result.final_step == 20
    assert any(e.type == "recovered" for e in result.events)
    losses = _losses(result)
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3


@pytest.mark.usefixtures("ray_local")
def test_compiled_run_trains_and_communicates_once_per_step(tmp_path):
    """The worker's own torch.compile (inductor), accumulating 3 micro-batches per rank per step."""
    common = ("training.steps=6", "training.global_batch_size=24", "training.micro_batch_size=4",
              "strategy.compression=fp16", "scaling.min_workers=2", "scaling.max_workers=2",
              "failure.step_timeout_s=300", "failure.collective_timeout_s=300")  # the first step compiles: minutes here
    eager = train(job(*common, name="eager"), run_dir=tmp_path / "eager")
    compiled = train(job(*common, "training.compile=true", name="compiled"), run_dir=tmp_path / "compiled")
    assert compiled.final_step == 6 and any(e.type == "compiled" for e in compiled.events)
    assert [row["bytes_sent"] for row in compiled.history] == [row["bytes_sent"] for row in eager.history]
    torch.testing.assert_close(_losses(compiled), _losses(eager), rtol=1e-3, atol=1e-4)
