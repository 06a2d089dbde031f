"""Functions run on every rank by tests/test_gpu_torch.py: a generation joined as a GPU TrainWorker joins one (an
NCCL group through ``join_group``, each rank bound to its own GPU, every GPU visible to every rank), a strategy
built by ``build_strategy`` and a few steps through ``StepRunner``, on CUDA. Nothing here imports Ray.

    results = run_distributed(train_on_gpus, 2, store_path, GpuRun(strategy="zero2", precision="bf16"))
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from raylastic.actors.data.order import GlobalSampleOrder
from raylastic.actors.worker.model_build import build_rank_model
from raylastic.actors.worker.optimizer_recipe import optimizer_factory
from raylastic.actors.worker.pipeline_step import Pipeline
from raylastic.actors.worker.step import StepRunner
from raylastic.jobconfig import OptimConfig, ParallelConfig, StrategyConfig
from raylastic.strategies.base import GroupContext
from raylastic.strategies.buddy_copy import BuddyCopies
from raylastic.strategies.build import build_strategy
from raylastic.strategies.group_assignment import GroupAssignment
from raylastic.strategies.loss_scaling import loss_scaler_for
from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.strategies.parallel_mesh import parallel_mesh
from raylastic.strategies.peer_restore import plan_peer_restore
from raylastic.strategies.process_group import join_group, leave_group
from raylastic.strategies.shard_copy import gather_shards, load_full_state
from raylastic.workloads import load_workload

WORKLOAD = ("chargpt", {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "corpus_chars": 60_000,
                        "tie_embeddings": False})
"""Untied: a pipeline puts the embedding and the head on different stages."""
GLOBAL_BATCH = 8
OPTIM = OptimConfig(name="adamw", lr=1e-2, clip_grad_norm=1.0)
_stores: list[dist.Store] = []
"""Every group's store, kept while its group lives (a group holds only the C++ side)."""


@dataclass(frozen=True)
class GpuRun:
    """One run of ``train_on_gpus``: the job's strategy, precision and layout fields it stands for."""

    strategy: str = "ddp"
    """strategy.name."""
    precision: str = "fp32"
    """training.precision."""
    options: dict[str, Any] = field(default_factory=dict)
    """Further StrategyConfig fields: offload, compression and its settings, sync_every."""
    layout: ParallelLayout | None = None
    """parallel.tp / parallel.pp over the ranks; None: every rank a data-parallel one."""
    steps: int = 6


def join_nccl(store_path: str, generation: int = 0, timeout_s: float = 120.0) -> torch.device:
    """Leave the harness's gloo group and join an NCCL group of the same ranks through ``join_group``, rank r bound
    to GPU r (``torch.cuda.set_device`` before anything touches CUDA, as ``choose_device`` does in a Ray worker)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.FileStore(f"{store_path}-{generation}", world_size)
    _stores.append(store)
    join_group(GroupAssignment(generation=generation, rank=rank, world_size=world_size, store=None,
                               store_prefix="gpu-check", timeout_s=timeout_s), "nccl", store)
    return device


def setup(run: GpuRun, device: torch.device):
    """The strategy, state and step runner of this rank, set up as TrainWorker.join sets a generation up."""
    workload = load_workload(*WORKLOAD)
    layout = run.layout
    parallel = ParallelConfig(tp=layout.tp, pp=layout.pp) if layout is not None else ParallelConfig()
    strategy = build_strategy(StrategyConfig(name=run.strategy, **run.options), parallel)
    mesh = parallel_mesh(device, layout) if layout is not None else None
    torch.manual_seed(0)
    state = strategy.setup(lambda: build_rank_model(workload, device, mesh=mesh),
                           optimizer_factory(OPTIM, getattr(workload, "configure_optimizer", None)), device, None,
                           GroupContext(node_ids=("node",) * dist.get_world_size(), completed_steps=0, mesh=mesh))
    dataset = workload.train_dataset()
    scaler = (loss_scaler_for(run.strategy, model_parallel=parallel.model_parallel, device_type=device.type)
              if run.precision == "fp16" else None)
    pipelined = layout is not None and layout.pp > 1
    runner = StepRunner(workload=workload, dataset=dataset, strategy=strategy, optim=OPTIM, total_steps=run.steps,
                        order=GlobalSampleOrder(len(dataset), GLOBAL_BATCH, seed=0),
                        micro_batch_size=None if pipelined else 4, device=device, precision=run.precision,
                        scaler=scaler, layout=layout,
                        pipeline=Pipeline.for_generation(state.model, mesh, parallel, device=device,
                                                         loss=getattr(workload, "pipeline_loss", None),
                                                         global_batch_size=GLOBAL_BATCH, seed=0))
    return strategy, state, runner


def train_on_gpus(store_path: str, run: GpuRun) -> dict[str, Any]:
    """``run.steps`` steps on an NCCL group of every rank; this rank's reported losses (mean per sample, the steps
    it reports), where its parameters live, fp16's loss scale, and its part of the trained state (on the CPU)."""
    device = join_nccl(store_path)
    strategy, state, runner = setup(run, device)
    results = [runner.run(state, step) for step in range(run.steps)]
    local = {key: (value.to_local() if isinstance(value, DTensor) else value).detach().cpu()
             for key, value in strategy.state_dict(state).items() if isinstance(value, torch.Tensor)}
    return {"losses": [r.loss_sum / r.samples for r in results if r.samples],
            "parameter_devices": sorted({p.device.type for p in state.model.parameters()}),
            "scale": runner.scaler.get_scale() if runner.scaler is not None else None,
            "local_state": local, "device": str(device)}


def lose_a_rank_and_restore_from_its_buddy(store_path: str, strategy_name: str) -> dict[str, Any] | None:
    """Two ranks train 3 steps of ``strategy_name`` on their GPUs, keeping buddy copies in pinned host memory (as
    TrainWorker keeps them on a GPU); rank 1 leaves. Rank 0, alone in the next generation, rebuilds the whole state
    from its own shard and its buddy's copy of rank 1's. On rank 0: the whole state trained and the one rebuilt."""
    device = join_nccl(store_path)
    dist_rank = dist.get_rank()
    run = GpuRun(strategy=strategy_name, steps=3)
    strategy, state, runner = setup(run, device)
    copies = BuddyCopies(group=dist.new_group(backend="gloo"), layout=state.layout, generation=0, timeout_s=60)
    for step in range(run.steps):
        runner.run(state, step, before_reduction=copies.finish)
        copies.start(strategy, state, None, step + 1)
    copies.finish()
    trained = _whole(strategy, state)
    kept = copies.kept()
    dist.barrier()
    copies.close()
    del state, runner
    leave_group()  # as a worker leaves its generation: NCCL's groups aborted, not waited on
    if dist_rank == 1:
        return None
    single = dist.FileStore(str(Path(store_path).with_name("survivor")), 1)
    _stores.append(single)
    join_group(GroupAssignment(generation=1, rank=0, world_size=1, store=None, store_prefix="gpu-check",
                               timeout_s=60), "nccl", single)
    plan = plan_peer_restore([tuple(k.copy for k in kept)])
    strategy, state, _ = setup(run, device)
    load_full_state(strategy, state, None, gather_shards(kept, plan))
    restored = _whole(strategy, state)
    return {"plan_step": plan.step, "trained": trained, "restored": restored,
            "parameter_devices": sorted({p.device.type for p in state.model.parameters()})}


def peer_to_peer_all_reduce(log_dir: str, store_path: str) -> dict[str, Any]:
    """Two ranks, each seeing both GPUs and bound to its own, all-reduce 4 MiB over NCCL with its INIT and P2P
    debug lines written under ``log_dir``: what each sees, whether it can open its peer's device, the sum."""
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,P2P",
                      NCCL_DEBUG_FILE=str(Path(log_dir, "nccl.%h.%p.log")))
    device = join_nccl(store_path)
    peer = 1 - dist.get_rank()
    total = torch.full((1 << 20,), float(dist.get_rank() + 1), device=device)
    dist.all_reduce(total)
    return {"index": device.index, "count": torch.cuda.device_count(), "current": torch.cuda.current_device(),
            "peer_access": torch.cuda.can_device_access_peer(device.index, peer), "sum": total[0].item()}


def _whole(strategy, state) -> dict[str, torch.Tensor]:
    """The strategy's state, every DTensor gathered whole (collective), on the CPU."""
    return {key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
            for key, value in strategy.state_dict(state).items() if isinstance(value, torch.Tensor)}
