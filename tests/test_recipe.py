"""The optimizer recipe (lr schedule, param groups with lr_scale, global-norm clipping, refusing
non-element-wise optimizers under sharding) and distributed evaluation: every strategy at world
size 2 on gloo against a plain single-process torch loop (tests/support/recipe_runs.py).

    .venv/bin/pytest -q tests/test_recipe.py
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from raylastic.actors.worker.evaluation import Evaluator
from raylastic.actors.worker.optimizer_recipe import learning_rate, optimizer_factory, set_learning_rate
from raylastic.jobconfig import OptimConfig
from tests.support.distributed_harness import run_distributed
from tests.support.recipe_runs import (
    DECAY,
    EVAL_SAMPLES,
    FEATURES,
    LR_SCALE,
    TinyClassifier,
    evaluate_strategies,
    evaluate_two_samples,
    reference_train,
    refusals,
    train_cases,
)

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
STEPS = 3
TOTAL_STEPS = 3  # the schedule: warm-up step 0, then cosine from lr (step 1) to halfway (step 2)
OPTIM = {  # by workload (tests/support/recipe_runs.py's WORKLOADS)
    "default": OptimConfig(lr=2e-2, weight_decay=0.01, schedule="cosine", warmup_steps=1, min_lr=2e-3,
                           clip_grad_norm=0.05),
    "two_groups": OptimConfig(lr=2e-2, schedule="cosine", warmup_steps=1, min_lr=2e-3),
}


def expected_lr(k: int, optim: OptimConfig, total: int) -> float:
    """The schedule written out: linear warm-up, then constant, linear or cosine decay towards min_lr."""
    if k < optim.warmup_steps:
        return optim.lr * (k + 1) / optim.warmup_steps
    progress = (k - optim.warmup_steps) / (total - optim.warmup_steps)
    if optim.schedule == "constant":
        return optim.lr
    if optim.schedule == "linear":
        return optim.lr + progress * (optim.min_lr - optim.lr)
    return optim.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (optim.lr - optim.min_lr)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_learning_rate_follows_the_schedule_formula(schedule):
    optim = OptimConfig(lr=1e-3, schedule=schedule, warmup_steps=10, min_lr=1e-4)
    for k in range(101):
        assert learning_rate(k, optim, 100) == pytest.approx(expected_lr(k, optim, 100), rel=1e-12, abs=0), k


def test_learning_rate_landmarks():
    cosine = OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=10, min_lr=1e-4)
    assert learning_rate(0, cosine, 100) == pytest.approx(1e-4)  # lr / warmup_steps
    assert learning_rate(9, cosine, 100) == pytest.approx(1e-3)  # warm-up ends at lr
    assert learning_rate(10, cosine, 100) == pytest.approx(1e-3)
    assert learning_rate(55, cosine, 100) == pytest.approx(5.5e-4)  # halfway: the mean of lr and min_lr
    assert learning_rate(100, cosine, 100) == pytest.approx(1e-4)
    linear = OptimConfig(lr=1e-3, schedule="linear", min_lr=1e-4)
    assert [learning_rate(k, linear, 10) for k in (0, 5, 10)] == pytest.approx([1e-3, 5.5e-4, 1e-4])
    constant = OptimConfig(lr=1e-3, schedule="constant", warmup_steps=4, min_lr=1e-4)
    assert [learning_rate(k, constant, 10) for k in (0, 3, 4, 9)] == pytest.approx([2.5e-4, 1e-3, 1e-3, 1e-3])


def test_set_learning_rate_multiplies_each_group_by_its_lr_scale():
    model = torch.nn.Linear(3, 2)
    build = optimizer_factory(OptimConfig(), lambda m: torch.optim.SGD([{"params": [m.weight]},
                                                                        {"params": [m.bias], "lr_scale": 0.25}],
                                                                       lr=1.0))
    optimizer = build(model)
    assert [group["lr_scale"] for group in optimizer.param_groups] == [1.0, 0.25]  # the default filled in
    set_learning_rate(optimizer, 0.2)
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([0.2, 0.05])


def test_configure_optimizer_must_return_an_optimizer():
    with pytest.raises(TypeError, match="configure_optimizer must return a torch.optim.Optimizer"):
        optimizer_factory(OptimConfig(), lambda m: list(m.parameters()))(torch.nn.Linear(2, 2))


@pytest.fixture(scope="module")
def trained():
    """Every strategy's report for both workloads, by rank, from one process group of 2."""
    cases = [(strategy, workload) for strategy in STRATEGIES for workload in OPTIM]
    return run_distributed(train_cases, 2, cases, OPTIM, STEPS, TOTAL_STEPS, timeout_s=120)


@pytest.fixture(scope="module")
def reference():
    return {workload: reference_train(workload, optim, scheduled_lrs(optim)) for workload, optim in OPTIM.items()}


def scheduled_lrs(optim: OptimConfig) -> list[float]:
    return [expected_lr(k, optim, TOTAL_STEPS) for k in range(STEPS)]


def assert_parameters_match(parameters, expected):
    assert parameters.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(parameters[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_clipped_step_matches_single_process_reference(trained, reference, strategy):
    optim, expected = OPTIM["default"], reference["default"]
    assert min(expected.grad_norms) > 2 * optim.clip_grad_norm  # clipping is active at every step
    unclipped = reference_train("default", dataclasses.replace(optim, clip_grad_norm=0.0), scheduled_lrs(optim))
    assert not torch.allclose(unclipped.parameters["head.weight"], expected.parameters["head.weight"], rtol=1e-3)
    for rank, by_case in enumerate(trained):
        report = by_case[strategy, "default"]
        assert report.grad_norms == pytest.approx(expected.grad_norms, rel=1e-5), f"rank {rank}"
        assert report.lrs == pytest.approx(scheduled_lrs(optim), rel=1e-12)
    assert_parameters_match(trained[0][strategy, "default"].parameters, expected.parameters)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_configured_param_groups_match_single_process_reference(trained, reference, strategy):
    expected = reference["two_groups"]
    last_lr = scheduled_lrs(OPTIM["two_groups"])[-1]
    for rank, by_case in enumerate(trained):
        report = by_case[strategy, "two_groups"]
        assert report.param_groups == [
            {"lr": pytest.approx(last_lr), "weight_decay": DECAY, "lr_scale": 1.0},
            {"lr": pytest.approx(last_lr * LR_SCALE), "weight_decay": 0.0, "lr_scale": LR_SCALE},
        ], f"rank {rank}"
        assert report.grad_norms == pytest.approx(expected.grad_norms, rel=1e-5), f"rank {rank}"
    assert_parameters_match(trained[0][strategy, "two_groups"].parameters, expected.parameters)


@pytest.fixture(scope="module")
def refused():
    return run_distributed(refusals, 2, ["ddp", "zero1", "zero2", "zero3"])


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_sharding_strategies_refuse_lbfgs(refused, strategy):
    for messages in refused:
        message = messages[strategy]
        assert message is not None, f"{strategy} accepted torch.optim.LBFGS"
        assert f"strategy.name={strategy}" in message and "element-wise" in message and "LBFGS" in message


def test_ddp_accepts_lbfgs(refused):
    assert all(messages["ddp"] is None for messages in refused)


def single_process_metrics() -> dict[str, float]:
    workload = TinyClassifier()
    torch.manual_seed(0)
    model = workload.build_model().eval()
    features, labels = workload.eval_dataset().tensors
    with torch.no_grad():
        logits = model(features)
        probe = model(torch.ones(1, FEATURES))[0, 0].item()
    return {"eval_loss": F.cross_entropy(logits, labels, reduction="sum").item() / EVAL_SAMPLES,
            "correct": (logits.argmax(dim=-1) == labels).sum().item() / EVAL_SAMPLES, "probe": probe}


@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_evaluation_matches_single_process(world_size):
    expected = single_process_metrics()
    # batch size 4: at world size 3 the shares are 12, 12 and 13, so ranks 0 and 1 run a discarded 4th batch
    for rank, metrics in enumerate(run_distributed(evaluate_strategies, world_size, ["ddp", "zero3"], 4)):
        for strategy in ("ddp", "zero3"):
            assert metrics[strategy] == pytest.approx(expected, rel=1e-5, abs=1e-6), (strategy, rank)


def test_an_eval_set_smaller_than_the_world_is_evaluated_whole():
    for metrics in run_distributed(evaluate_two_samples, 3):
        assert metrics == {"value": 5.5}


class TensorMetrics(TinyClassifier):
    """An ``evaluate`` as users write it: a 0-d tensor (no ``.item()``), a one-element tensor and an int."""

    def __init__(self, extra: object = None) -> None:
        self.extra = extra

    def evaluate(self, model: torch.nn.Module) -> dict[str, object]:
        features, labels = self.eval_dataset().tensors
        accuracy = (model(features).argmax(dim=-1) == labels).float().mean()
        return {"accuracy": accuracy, "one": torch.ones(1), "count": len(labels)} | (
            {"extra": self.extra} if self.extra is not None else {})


def test_evaluate_may_return_tensors_and_ints_and_the_metrics_are_floats():
    """A 0-d tensor from evaluate() reached the end of a run as a tensor, where the Controller's rounding of the final
    metrics raised TypeError and failed the finished run."""
    torch.manual_seed(0)
    workload = TensorMetrics()
    model = workload.build_model()
    metrics = Evaluator(workload, batch_size=8, device=torch.device("cpu")).run(model)
    assert {name: type(value) for name, value in metrics.items()} == {
        "accuracy": float, "one": float, "count": float, "eval_loss": float, "correct": float}
    assert metrics["one"] == 1.0 and metrics["count"] == EVAL_SAMPLES and 0 <= metrics["accuracy"] <= 1
    with pytest.raises(ValueError, match=r"evaluate\(\) returned extra='high': a metric is a number or a "
                                         r"one-element tensor"):
        Evaluator(TensorMetrics(extra="high"), batch_size=8, device=torch.device("cpu")).run(model)
