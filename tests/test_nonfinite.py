"""A step with an inf/NaN loss or gradient (training.on_nonfinite), on a real local Ray (gloo).

One bad sample (NaN features) is trained on by rank 1 at step 5 of a 2-worker run: its loss is NaN there,
and after the all-reduce every rank's gradients are. "skip" discards that step's update on every rank and
the run goes on; "fail" ends the run at once with an error naming the step. Under fp16 an overflowing
gradient is the loss scaler's business: it skips the step itself, and on_nonfinite=fail lets it.
"""

from __future__ import annotations

import math

import pytest
import torch

from raylastic.actors.data.order import GlobalSampleOrder
from raylastic.actors.status.run import RunFailed
from raylastic.actors.worker.step import NonFiniteStep, StepRunner
from raylastic.cluster.job import train
from raylastic.jobconfig import OptimConfig
from raylastic.strategies.ddp import DDPStrategy
from tests.support.distributed_harness import run_distributed
from tests.support.helpers import job, load_model, strict_json
from tests.support.nan_workload import poison_index_for

BAD_STEP = 5
GLOBAL_BATCH = 48
BASE = ("workload.name=tests.support.nan_workload:PoisonedDigits",
        f"workload.options={{poison_index: {poison_index_for(BAD_STEP, 1, 2, GLOBAL_BATCH)}}}",
        f"training.global_batch_size={GLOBAL_BATCH}", "scaling.min_workers=2", "scaling.max_workers=2",
        "failure.step_timeout_s=4")


@pytest.mark.usefixtures("ray_local")
def test_skip_discards_the_nan_step_on_every_rank_and_trains_on(tmp_path):
    result = train(job(*BASE, "training.on_nonfinite=skip", name="skip"), run_dir=tmp_path / "skip")
    assert result.final_step == 20
    assert [row["step"] for row in result.history if row.get("skipped")] == [BAD_STEP]
    assert all(math.isfinite(row["loss"]) for row in result.history if row["step"] != BAD_STEP)
    assert all(torch.isfinite(tensor).all() for tensor in load_model(tmp_path / "skip").values())
    assert not [e for e in result.events if e.type == "worker_failed"]
    saved = strict_json(tmp_path / "skip" / "result.json")  # the NaN loss written as null, not a bare NaN
    assert [row["step"] for row in saved["history"] if row["loss"] is None] == [BAD_STEP]


@pytest.mark.usefixtures("ray_local")
def test_fail_ends_the_run_at_once_naming_the_step(tmp_path):
    config = job(*BASE, name="fail")  # training.on_nonfinite=fail is the default
    with pytest.raises(RunFailed) as raised:
        train(config, run_dir=tmp_path / "fail")
    message = str(raised.value)
    assert "NonFiniteStep" in message and f"step {BAD_STEP}:" in message and "training.on_nonfinite" in message
    assert "recovered" not in message


def _fp16_overflow_then_nan(on_nonfinite: str) -> list[str]:
    """One rank; a loss scale so large that the scaled gradients overflow (fp16's usual overflow, here in
    fp32), then a step whose loss itself is NaN. What each step did: "stepped", "skipped", or the error."""
    model = torch.nn.Linear(4, 1)
    strategy = DDPStrategy()
    state = strategy.setup(lambda: model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), torch.device("cpu"), None)
    inputs = torch.full((16, 4), 100.0)  # times the scale: gradients of ~2**133, beyond float32's range
    inputs[8] = float("nan")  # the first sample of step 2

    class Workload:
        def training_step(self, model, batch):
            return model(batch[0]).mean()

    dataset = torch.utils.data.TensorDataset(inputs)
    runner = StepRunner(workload=Workload(), dataset=dataset, strategy=strategy, optim=OptimConfig(name="sgd", lr=0.1),
                        total_steps=10, order=_InOrder(len(dataset), 8, seed=0), micro_batch_size=None,
                        device=torch.device("cpu"), scaler=torch.amp.GradScaler("cpu", init_scale=2.0**127),
                        on_nonfinite=on_nonfinite)
    outcomes = []
    for step in range(2):
        try:
            outcomes.append("skipped" if runner.run(state, step).skipped else "stepped")
        except NonFiniteStep as error:
            outcomes.append(str(error))
    return outcomes


class _InOrder(GlobalSampleOrder):
    """The data set in its own order (step k: samples [k*B, (k+1)*B))."""

    def permutation(self, epoch: int) -> torch.Tensor:
        return torch.arange(self.num_samples)


def test_fp16_overflow_is_left_to_the_scaler_but_a_nan_loss_fails():
    overflow, nan_loss = run_distributed(_fp16_overflow_then_nan, 1, "fail")[0]
    assert overflow == "skipped"  # the scaler lowered its scale; not a NonFiniteStep
    assert nan_loss.startswith("step 2: the loss on rank 0 is nan")
    assert run_distributed(_fp16_overflow_then_nan, 1, "skip")[0] == ["skipped", "skipped"]
