"""What benchmarks/memory.py and benchmarks/checkpoint.py share: a strategy set up on the chargpt GPT
in the current gloo group (as actors/worker/train_worker.py does it, without Ray), and the machine description."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from raylastic.actors.data.order import GlobalSampleOrder
from raylastic.actors.worker.optimizer_recipe import optimizer_factory
from raylastic.actors.worker.step import StepRunner
from raylastic.jobconfig import OptimConfig, StrategyConfig
from raylastic.strategies.base import GroupContext, Strategy, TrainState
from raylastic.strategies.build import build_strategy
from raylastic.workloads import load_workload

GPT_50M = {"n_layer": 8, "n_head": 8, "n_embd": 720, "block_size": 64}
"""50,073,120 parameters (workloads/chargpt.py)."""
SEED = 0


@dataclass
class Setup:
    strategy: Strategy
    state: TrainState
    runner: StepRunner


def set_up(strategy_name: str, model: dict[str, int], *, global_batch_size: int, micro_batch_size: int,
           corpus_chars: int = 30_000) -> Setup:
    """``strategy_name`` on a fresh GPT of shape ``model`` in the current group, AdamW(lr=1e-3), seed 0."""
    workload = load_workload("chargpt", {**model, "corpus_chars": corpus_chars})
    strategy = build_strategy(StrategyConfig(name=strategy_name))
    context = GroupContext(node_ids=("local",) * dist.get_world_size(), completed_steps=0)
    torch.manual_seed(SEED)  # identical initialisation on every rank
    optim = OptimConfig(name="adamw", lr=1e-3)
    state = strategy.setup(workload.build_model, optimizer_factory(optim),
                           torch.device("cpu"), None, context)
    dataset = workload.train_dataset()
    runner = StepRunner(workload=workload, dataset=dataset, strategy=strategy, optim=optim, total_steps=10**6,
                        order=GlobalSampleOrder(len(dataset), global_batch_size, seed=SEED),
                        micro_batch_size=micro_batch_size, device=torch.device("cpu"))
    return Setup(strategy=strategy, state=state, runner=runner)
