"""A training step reads nothing from the device except at the log interval (training.log_every_steps) and where the
user asks for a read: the loss, gradient norm and skip flag of the steps since the last read come back in one
transfer at a stop vote, a save, an evaluation, the last step or every log_every_steps steps.

A shim on ``Tensor.item``/``tolist``/``__bool__``/``__float__``/``__int__``/``__index__`` and the CUDA
synchronisations counts the host reads made during each step of the worker's step loop (actors/worker/
training_loop.py, on a 1-rank gloo group); every step that is not a read step must make none, with the defaults
and with on_nonfinite=skip and clipping, where a NaN step is skipped on the device (fused AdamW takes the found-inf
flag). On CPU every tensor is a host tensor, so the count is stricter than on a GPU; ``test_gpu_*`` runs the same
on CUDA.
"""

from __future__ import annotations

import math
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

from raylastic.actors.data.compute_clock import ComputeClock
from raylastic.actors.data.order import GlobalSampleOrder
from raylastic.actors.faults.step_hooks import StepHook
from raylastic.actors.worker import stop_vote
from raylastic.actors.worker.evaluation import Evaluator
from raylastic.actors.worker.mailbox import StatusMailbox
from raylastic.actors.worker.optimizer_recipe import optimizer_factory
from raylastic.actors.worker.saver import AsyncSaver
from raylastic.actors.worker.step import StepRunner
from raylastic.actors.worker.training_loop import TrainingLoop
from raylastic.jobconfig import DataConfig, EvalConfig, OptimConfig, TrainingConfig
from raylastic.strategies.checkpoint import Checkpointer
from raylastic.strategies.checkpoint_catalogue import CheckpointSettings
from raylastic.strategies.ddp import DDPStrategy
from tests.support.distributed_harness import run_distributed
from tests.support.nan_workload import PoisonedDigits, poison_index_for

STEPS = 24
LOG_EVERY = 8
BATCH = 16
BAD_STEP = 5
READS = (("item", torch.Tensor), ("tolist", torch.Tensor), ("__bool__", torch.Tensor), ("__float__", torch.Tensor),
         ("__int__", torch.Tensor), ("__index__", torch.Tensor), ("synchronize", torch.cuda),
         ("synchronize", torch.cuda.Event), ("synchronize", torch.cuda.Stream))


class _StepCounter(StepHook):
    """Which step of the loop is running: ``before_step`` opens it, and the work at its boundary belongs to it. With
    ``peer_lost_at``, that step fails as a step whose peer is lost does."""

    def __init__(self, peer_lost_at: int | None = None) -> None:
        self.step = 0
        self.peer_lost_at = peer_lost_at

    def before_step(self, step: int) -> None:
        self.step = step
        if step == self.peer_lost_at:
            raise dist.DistNetworkError("Connection reset by peer")


def _run_loop(on_nonfinite: str, clip: float, poisoned: bool, device_type: str, peer_lost_at: int | None = None,
              read_aborted: bool = False) -> dict:
    """The loop over STEPS steps with a shim counting host reads by step; its results, end and read counts.
    ``read_aborted``: from the lost peer's step on, a read fails as one after our NCCL abort does."""
    device = torch.device(device_type)
    stop_vote.VOTE_PERIOD_S = 1e9  # votes 100 steps apart: only the first two steps vote, the log interval shows
    workload = PoisonedDigits(poison_index_for(BAD_STEP, 0, 1, BATCH))
    dataset = workload.train_dataset() if poisoned else workload.digits.train_dataset()
    training = TrainingConfig(steps=STEPS, global_batch_size=BATCH, on_nonfinite=on_nonfinite,
                              log_every_steps=LOG_EVERY)
    optim = OptimConfig(lr=1e-3, clip_grad_norm=clip)
    strategy = DDPStrategy()
    torch.manual_seed(0)
    state = strategy.setup(workload.build_model, optimizer_factory(optim, skips_on_device=on_nonfinite == "skip"),
                           device, None)
    runner = StepRunner(workload=workload, order=GlobalSampleOrder(len(dataset), BATCH, 0), strategy=strategy,
                        micro_batch_size=None, device=device, optim=optim, total_steps=STEPS,
                        on_nonfinite=on_nonfinite, clock=ComputeClock(device))
    runner.clock.attach(state.model)  # as TrainWorker times each rank's compute (on a GPU, with CUDA events)
    status = StatusMailbox()
    with tempfile.TemporaryDirectory() as root:
        saver = AsyncSaver(Checkpointer.of(CheckpointSettings(root=root, every_steps=0, num_to_keep=1, config_hash="x",
                                                              global_batch_size=BATCH)),
                           strategy=strategy, scaler=None, status=status)
        loop = TrainingLoop(runner=runner, dataset=dataset, evaluator=Evaluator(workload, batch_size=BATCH,
                                                                                device=device),
                            saver=saver, status=status, device=device, training=training, data=DataConfig(),
                            eval=EvalConfig())
        counter, reads = _StepCounter(peer_lost_at), [0] * (STEPS + 1)
        voted: list[int] = []
        close = stop_vote.StopVote.close

        def recording_close(vote: stop_vote.StopVote, step_index: int) -> bool:
            voted.append(step_index + 1)
            return close(vote, step_index)

        originals = [(owner, name, getattr(owner, name)) for name, owner in READS]

        def counting(original):
            def read(*args, **kwargs):
                if _from_the_device(args, device, sys._getframe(1).f_code.co_name):
                    reads[counter.step] += 1
                return original(*args, **kwargs)
            return read

        for owner, name, original in originals:
            setattr(owner, name, counting(original))
        if read_aborted:
            read_steps = runner.read

            def aborted_after_the_loss(steps):
                if counter.step >= peer_lost_at:
                    raise RuntimeError("the NCCL communicator was aborted")
                return read_steps(steps)

            runner.read = aborted_after_the_loss
        stop_vote.StopVote.close = recording_close
        try:
            loop.start(state, until_step=STEPS, hooks=(counter,))
            loop.wait(timeout_s=120)
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)
            stop_vote.StopVote.close = close
        answer = status.poll()
    return {"phase": answer.phase, "error": answer.error, "cause": answer.error_cause, "step": answer.step,
            "reads": reads, "voted": voted, "state_ahead": loop.state_ahead_of_commit,
            "results": [(r.step, r.loss_sum, r.samples, r.grad_norm, r.skipped, r.compute_s) for r in answer.results]}


def _from_the_device(args: tuple, device: torch.device, caller: str) -> bool:
    """Whether a read is one of the device's tensors (or a synchronisation). On CPU every tensor is the host's: all
    count but torch's optimizer step counters (``_get_value``), which torch keeps on the CPU on every device."""
    if not args or not isinstance(args[0], torch.Tensor):
        return True
    if device.type == "cuda":
        return args[0].is_cuda
    return caller != "_get_value"


def _reference_losses(clip: float) -> list[float]:
    """The same steps read one by one (``StepRunner.run``): what the loop must report."""
    workload = PoisonedDigits(0)
    dataset = workload.digits.train_dataset()
    optim = OptimConfig(lr=1e-3, clip_grad_norm=clip)
    strategy = DDPStrategy()
    torch.manual_seed(0)
    state = strategy.setup(workload.build_model, optimizer_factory(optim), torch.device("cpu"), None)
    runner = StepRunner(workload=workload, order=GlobalSampleOrder(len(dataset), BATCH, 0), strategy=strategy,
                        micro_batch_size=None, device=torch.device("cpu"), optim=optim, total_steps=STEPS,
                        dataset=dataset)
    return [runner.run(state, step).loss_sum for step in range(STEPS)]


def _read_steps(outcome: dict) -> set[int]:
    return set(outcome["voted"]) | set(range(LOG_EVERY, STEPS + 1, LOG_EVERY)) | {STEPS}


def _assert_no_reads_between(outcome: dict) -> None:
    quiet = [step for step in range(1, STEPS + 1) if step not in _read_steps(outcome)]
    assert len(quiet) >= STEPS - 6, outcome["voted"]
    assert {step: outcome["reads"][step] for step in quiet if outcome["reads"][step]} == {}


def _loops(device_type: str) -> tuple[dict, dict, dict, dict, dict, list[float]]:
    return (_run_loop("fail", 0.0, False, device_type), _run_loop("skip", 1.0, True, device_type),
            _run_loop("fail", 0.0, True, device_type), _run_loop("fail", 0.0, True, device_type, BAD_STEP + 1),
            _run_loop("fail", 0.0, False, device_type, BAD_STEP + 1, read_aborted=True), _reference_losses(0.0))


def _check(default: dict, skipping: dict, failing: dict, failing_then_lost: dict, aborted: dict,
           reference: list[float], rel: float = 1e-5) -> None:
    assert default["phase"] == "finished" and default["step"] == STEPS, default["error"]
    assert not default["state_ahead"]
    _assert_no_reads_between(default)
    assert [r[0] for r in default["results"]] == list(range(1, STEPS + 1))
    assert [r[1] for r in default["results"]] == pytest.approx(reference, rel=rel)
    assert all(r[2] == BATCH and math.isfinite(r[3]) and r[3] > 0 and not r[4] and r[5] > 0
               for r in default["results"])

    assert skipping["phase"] == "finished" and skipping["step"] == STEPS, skipping["error"]
    _assert_no_reads_between(skipping)
    assert [r[0] for r in skipping["results"] if r[4]] == [BAD_STEP]  # skipped on the device, read later
    assert all(math.isfinite(r[1]) for r in skipping["results"] if r[0] != BAD_STEP)

    assert failing["phase"] == "failed" and f"NonFiniteStep: step {BAD_STEP}:" in failing["error"]
    assert [r[0] for r in failing["results"]] == list(range(1, BAD_STEP))  # the steps before it are reported
    assert failing["step"] == BAD_STEP - 1
    # A peer lost before the read: the unread NaN step is still found, and the run fails as the job's error (a
    # recovery would carry its state on).
    assert failing_then_lost["cause"] == "job" and f"NonFiniteStep: step {BAD_STEP}:" in failing_then_lost["error"]
    assert failing_then_lost["step"] == BAD_STEP - 1
    # Steps trained but never committed (their read failed after an abort): the live state is ahead of the committed
    # step, and the worker must not keep or send it (TrainWorker._leave).
    assert aborted["cause"] == "peer_lost" and aborted["step"] < BAD_STEP and aborted["state_ahead"], aborted


def test_the_log_interval_is_a_positive_number_of_steps():
    with pytest.raises(ValueError, match="training.log_every_steps must be a positive integer, got 0"):
        TrainingConfig(log_every_steps=0)


def test_a_step_reads_nothing_from_the_device_between_log_intervals():
    _check(*run_distributed(_loops, 1, "cpu", timeout_s=240)[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_step_reads_nothing_from_the_device_between_log_intervals():
    _check(*run_distributed(_loops, 1, "cuda", timeout_s=240)[0], rel=1e-3)  # CUDA's kernels against CPU's
