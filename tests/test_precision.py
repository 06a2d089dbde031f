"""Mixed precision and torch.compile: what must survive a recovery, a checkpoint and accumulation.

- fp16's loss scaler (scale, growth tracker) is handed over in memory with the model, and saved in and
  loaded from checkpoints, so replicas keep one scale after a recovery or a resume; a checkpoint
  without scaler state (another precision, an older run) still loads (real gloo ranks; the scaler is
  torch.amp.GradScaler("cpu"): fp16 itself is GPU-only, see tests/test_gpu.py).
- training.compile keeps DDP's ``no_sync``: with accumulation a step communicates once, not once per
  micro-batch (the harness compiles with backend="aot_eager", which takes seconds where inductor's C++
  build takes minutes on this machine; the real worker's inductor path runs end to end below).
- bf16 and compiled runs train end to end through cluster.job.train, bf16 through a killed worker.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from raylastic.actors.data.order import GlobalSampleOrder
from raylastic.actors.worker.step import StepRunner
from raylastic.cluster.job import train
from raylastic.jobconfig import OptimConfig, StrategyConfig
from raylastic.strategies.base import init_optimizer_state, load_scaler, scaler_entries
from raylastic.strategies.build import build_strategy
from raylastic.strategies.checkpoint import Checkpointer, load_into
from raylastic.strategies.ddp import DDPStrategy
from raylastic.strategies.state_transfer import broadcast_training_state
from raylastic.workloads.digits import Digits
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
    """Load ``directory`` as TrainWorker.restore does; the scaler's state (if any) and the model's weight."""
    strategy, state = _linear_state(strategy_name, seed=100)
    init_optimizer_state(state.optimizer)
    flat = strategy.state_dict(state)
    load_into(flat, directory)
    strategy.load_state_dict(state, flat)
    scaler = _scaler() if with_scaler else None
    load_scaler(scaler, directory)
    weight = state.model.weight
    weight = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
    return {"scaler": scaler.state_dict() if scaler else None, "weight": weight.detach().clone()}


def _saved_weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3).weight.detach()


def test_a_checkpoint_keeps_the_loss_scale_across_world_sizes(tmp_path):
    directory = run_distributed(_save, 2, str(tmp_path), True)[0]
    restored = run_distributed(_restore, 1, directory, "ddp", True)[0]
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
