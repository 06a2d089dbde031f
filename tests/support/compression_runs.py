"""Run on every rank by tests/test_communication.py (importable by forkserver processes): the digits classifier
trained once per gradient compression, in one process group, as a worker trains it (the strategy its config
builds, the worker's step runner, the worker's evaluator)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raylastic.actors.data.order import GlobalSampleOrder
from raylastic.actors.worker.evaluation import Evaluator
from raylastic.actors.worker.optimizer_recipe import optimizer_factory
from raylastic.actors.worker.step import StepRunner
from raylastic.jobconfig import JobConfig
from raylastic.strategies.build import build_strategy
from raylastic.workloads.digits import Digits


@dataclass(frozen=True)
class CompressedRun:
    accuracy: float
    """Held-out accuracy after the last step."""
    ratios: list[float]
    """Each step's uncompressed / sent gradient bytes, on this rank."""


def train_each_compression(jobs: dict[str, JobConfig]) -> dict[str, CompressedRun]:
    """Every job (one per ``strategy.compression``) trained from the same seed for ``training.steps`` steps."""
    return {kind: _train(job) for kind, job in jobs.items()}


def _train(job: JobConfig) -> CompressedRun:
    workload = Digits()
    strategy = build_strategy(job.strategy)
    torch.manual_seed(job.training.seed)
    build_optimizer = optimizer_factory(job.optim, getattr(workload, "configure_optimizer", None))
    state = strategy.setup(workload.build_model, build_optimizer, torch.device("cpu"), None)
    dataset = workload.train_dataset()
    runner = StepRunner(workload=workload, dataset=dataset, strategy=strategy, optim=job.optim,
                        total_steps=job.training.steps, seed=job.training.seed,
                        order=GlobalSampleOrder(len(dataset), job.training.global_batch_size, seed=job.training.seed),
                        micro_batch_size=job.training.micro_batch_size, device=torch.device("cpu"))
    results = [runner.run(state, step) for step in range(job.training.steps)]
    metrics = Evaluator(workload, batch_size=job.eval.batch_size, device=torch.device("cpu")).run(state.model)
    return CompressedRun(accuracy=metrics["accuracy"], ratios=[r.uncompressed_bytes / r.bytes_sent for r in results])
