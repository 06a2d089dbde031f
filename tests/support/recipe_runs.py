"""Functions run on every rank by tests/test_recipe.py (importable by forkserver processes), the tiny
workload they train, and the plain single-process loop the tests compare them with."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from raylastic.actors.data.order import GlobalSampleOrder
from raylastic.actors.worker.evaluation import Evaluator
from raylastic.actors.worker.optimizer_recipe import optimizer_factory
from raylastic.actors.worker.step import StepRunner
from raylastic.jobconfig import OptimConfig, StrategyConfig
from raylastic.strategies.build import build_strategy
from tests.support.helpers import step_indices

FEATURES, HIDDEN, CLASSES = 6, 9, 5  # odd sizes: dim-0 shards are uneven at world sizes 2 and 3
GLOBAL_BATCH = 12
MICRO_BATCH = 4  # 6 samples per rank at world size 2: micro-batches of 4 and 2
EVAL_SAMPLES = 37  # divisible by neither the world sizes nor the eval batch size


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN)])
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:  # a ModuleList: each block is an FSDP unit of its own
            x = F.gelu(block(x))
        return self.head(self.norm(x))


def random_task(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(samples, FEATURES, generator=generator)
    return TensorDataset(features, torch.randint(0, CLASSES, (samples,), generator=generator))


class TinyClassifier:
    """A workload with every optional part: eval_dataset/eval_step and evaluate (no configure_optimizer)."""

    def build_model(self) -> torch.nn.Module:
        return Classifier()

    def train_dataset(self) -> TensorDataset:
        return random_task(96, seed=1)

    def training_step(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        features, labels = batch
        return F.cross_entropy(model(features), labels)

    def eval_dataset(self) -> TensorDataset:
        return random_task(EVAL_SAMPLES, seed=2)

    def eval_step(self, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        features, labels = batch
        logits = model(features)
        return {"eval_loss": F.cross_entropy(logits, labels, reduction="sum"),
                "correct": (logits.argmax(dim=-1) == labels).sum()}

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        return {"probe": model(torch.ones(1, FEATURES))[0, 0].item()}  # a forward on every rank (zero3)


DECAY, LR_SCALE = 0.1, 0.5


class TwoGroupClassifier(TinyClassifier):
    """AdamW with weight decay on the matrices only, and half the lr on the rest."""

    def configure_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        others = [p for p in model.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": matrices, "weight_decay": DECAY},
                                  {"params": others, "weight_decay": 0.0, "lr_scale": LR_SCALE}])


class LBFGSClassifier(TinyClassifier):
    def configure_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(model.parameters())


WORKLOADS = {"default": TinyClassifier, "two_groups": TwoGroupClassifier, "lbfgs": LBFGSClassifier}


@dataclass
class TrainReport:
    grad_norms: list[float]
    """StepResult.grad_norm of every step (the reference: clip_grad_norm_'s total norm)."""
    lrs: list[float]
    param_groups: list[dict[str, float]]
    """Every group's lr, weight_decay and lr_scale after the last step."""
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)
    """The full parameters after the last step (rank 0 only)."""


def setup(strategy_name: str, workload_name: str, optim: OptimConfig):
    """The strategy and its state as the worker builds them (model seeded, the workload's optimizer)."""
    workload = WORKLOADS[workload_name]()
    strategy = build_strategy(StrategyConfig(name=strategy_name))
    torch.manual_seed(0)
    build_optimizer = optimizer_factory(optim, getattr(workload, "configure_optimizer", None))
    return workload, strategy, strategy.setup(workload.build_model, build_optimizer, torch.device("cpu"), None)


def train(strategy_name: str, workload_name: str, optim: OptimConfig, steps: int, total_steps: int) -> TrainReport:
    workload, strategy, state = setup(strategy_name, workload_name, optim)
    dataset = workload.train_dataset()
    runner = StepRunner(workload=workload, dataset=dataset, strategy=strategy, optim=optim, total_steps=total_steps,
                        order=GlobalSampleOrder(len(dataset), GLOBAL_BATCH, seed=0), micro_batch_size=MICRO_BATCH,
                        device=torch.device("cpu"))
    results = [runner.run(state, step) for step in range(steps)]
    groups = [{key: group[key] for key in ("lr", "weight_decay", "lr_scale")} for group in state.optimizer.param_groups]
    parameters = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()  # collective
                  for name, p in state.model.named_parameters()}
    return TrainReport(grad_norms=[r.grad_norm for r in results], lrs=[r.lr for r in results], param_groups=groups,
                       parameters=parameters if dist.get_rank() == 0 else {})


def train_cases(cases: list[tuple[str, str]], optim: dict[str, OptimConfig], steps: int, total_steps: int
                ) -> dict[tuple[str, str], TrainReport]:
    """``train`` for every (strategy, workload) case in one process group; ``optim`` by workload."""
    return {(strategy, workload): train(strategy, workload, optim[workload], steps, total_steps)
            for strategy, workload in cases}


def refusals(strategy_names: list[str]) -> dict[str, str | None]:
    """The ValueError each strategy raises when set up with the L-BFGS workload (None: accepted)."""
    messages: dict[str, str | None] = {}
    for name in strategy_names:
        try:
            setup(name, "lbfgs", OptimConfig())
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
    return messages


def evaluate_strategies(strategy_names: list[str], batch_size: int) -> dict[str, dict[str, float]]:
    """Evaluator.run on the freshly built (seed 0) model under every strategy; collective."""
    metrics = {}
    for name in strategy_names:
        workload, _, state = setup(name, "default", OptimConfig())
        metrics[name] = Evaluator(workload, batch_size=batch_size, device=torch.device("cpu")).run(state.model)
    return metrics


def reference_train(workload_name: str, optim: OptimConfig, lrs: list[float]) -> TrainReport:
    """The plain single-process loop: mean loss over each step's global batch, torch's clip_grad_norm_,
    every group's lr set to ``lrs[step]`` times its lr_scale."""
    workload = WORKLOADS[workload_name]()
    torch.manual_seed(0)
    model = workload.build_model()
    if hasattr(workload, "configure_optimizer"):
        optimizer = workload.configure_optimizer(model)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)
    features, labels = workload.train_dataset().tensors
    order = GlobalSampleOrder(len(features), GLOBAL_BATCH, seed=0)
    grad_norms = []
    for step, lr in enumerate(lrs):
        indices = step_indices(order, step)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        optimizer.zero_grad()
        F.cross_entropy(model(features[indices]), labels[indices]).backward()
        max_norm = optim.clip_grad_norm if optim.clip_grad_norm > 0 else math.inf
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
    groups = [{key: group.get(key, 1.0) for key in ("lr", "weight_decay", "lr_scale")}
              for group in optimizer.param_groups]
    return TrainReport(grad_norms=grad_norms, lrs=list(lrs), param_groups=groups,
                       parameters={name: p.detach().clone() for name, p in model.named_parameters()})


class TwoSamples:
    """An eval set smaller than the world size: rank 0 holds all of it."""

    def eval_dataset(self) -> TensorDataset:
        return TensorDataset(torch.tensor([1.0, 10.0]))

    def eval_step(self, model: torch.nn.Module, batch: tuple[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"value": batch[0].sum()}


def evaluate_two_samples() -> dict[str, float]:
    return Evaluator(TwoSamples(), batch_size=1, device=torch.device("cpu")).run(torch.nn.Identity())
