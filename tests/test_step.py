"""One step's forward and backward over its micro-batches (actors/worker/step.py), which the synchronous step and an
async_ps worker share: the gradient of the summed loss times the weight whatever the micro-batching, padding
weighed 0, dropout masks a function of the data order.

    python -m pytest tests/test_step.py -q
"""

from __future__ import annotations

import inspect

import torch

from raylastic.actors.data.order import micro_batches
from raylastic.actors.worker.step import backward_over_micro_batches

DEVICE = torch.device("cpu")
FEATURES = torch.randn(32, 6, generator=torch.Generator().manual_seed(0))
TARGETS = torch.randn(32, 1, generator=torch.Generator().manual_seed(1))


class DictBatches:
    """A user's workload: dict batches, a mean-squared loss, optional dropout."""

    def __init__(self, dropout: float = 0.0) -> None:
        self.dropout = dropout

    def build_model(self) -> torch.nn.Module:
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(self.dropout), torch.nn.Linear(16, 1))

    def training_step(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def gradients(workload: DictBatches, indices: torch.Tensor, count: int, process_seed: int = 0
              ) -> tuple[float, list[torch.Tensor]]:
    model = workload.build_model()
    torch.manual_seed(process_seed)  # where the process's generator stands when the step begins
    batches = ({"x": FEATURES[chunk], "y": TARGETS[chunk]} for chunk in micro_batches(indices, count))
    loss_sum = backward_over_micro_batches(workload, model, batches, indices, count, device=DEVICE, seed=7,
                                           step_index=5, position=0, weight=1 / len(indices))
    return loss_sum.item(), [parameter.grad.clone() for parameter in model.parameters()]


def test_the_gradient_is_the_mean_losss_whatever_the_number_of_micro_batches():
    indices = torch.arange(12)
    whole_loss, whole = gradients(DictBatches(), indices, 1)
    for count in (2, 3, 5):
        loss, split = gradients(DictBatches(), indices, count)
        assert abs(loss - whole_loss) < 1e-4 * abs(whole_loss)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(split, whole, strict=True))


def test_padding_micro_batches_weigh_nothing():
    indices = torch.arange(2)  # 4 micro-batches of a 2-sample slice: 2 of them copies of its last sample
    assert [len(chunk) for chunk in micro_batches(indices, 4)] == [1, 1, 1, 1]
    padded_loss, padded = gradients(DictBatches(), indices, 4)
    loss, plain = gradients(DictBatches(), indices, 2)
    assert padded_loss == loss and all(torch.equal(a, b) for a, b in zip(padded, plain, strict=True))


def test_dropout_masks_are_drawn_from_the_step_and_position_not_the_process():
    indices = torch.arange(12)
    first = gradients(DictBatches(dropout=0.5), indices, 3, process_seed=123)
    again = gradients(DictBatches(dropout=0.5), indices, 3, process_seed=456)
    assert first[0] == again[0] and all(torch.equal(a, b) for a, b in zip(first[1], again[1], strict=True))


def test_the_step_cost_benchmarks_stand_ins_take_the_arguments_of_the_functions_they_replace():
    """benchmarks/step_costs.py times StepRunner.run with some of actors/worker/step.py's functions replaced; a stand-in
    that lags behind a changed signature fails the benchmark's every round (``clip_gradients`` gained ``across``)."""
    from benchmarks.step_costs import ABLATIONS
    from raylastic.actors.worker import step

    for variant, replacements in ABLATIONS.items():
        for name, stand_in in replacements.items():
            expected = list(inspect.signature(getattr(step, name)).parameters)
            assert list(inspect.signature(stand_in).parameters) == expected, (variant, name)
