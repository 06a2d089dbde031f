"""One training step, the same math at every world size.

Each rank runs forward/backward over its slice of the global batch in micro-batches (only the
last one communicates); the slices may differ in size (``split``: shares by speed, actors/data/balance.py).
The workload's ``training_step`` returns a micro-batch's mean loss; it is weighted by the
micro-batch's samples times dp / B, because DDP and FSDP average gradients over the dp data-parallel ranks
(every rank; under tensor parallelism each tp group counts as one, actors/worker/data_place.py): the result
is the gradient of the mean loss over the global batch, however the batch is split. Before each
micro-batch the RNG is seeded from the run seed, the step and the micro-batch's position in the
global batch, so dropout masks are a function of the data order, not of the process. The step sets
the scheduled lr, measures (and optionally clips) the global gradient norm and commits (the optimizer
steps) once its gradient communication has completed on this rank; a peer lost before that fails
the step, which is then discarded. A step makes no collective of its own besides the gradients' (and,
under FSDP, the norm's): it reports this rank's summed loss and sample count, and the Controller sums
them over the ranks; stopping at a common step boundary is actors/worker/stop_vote.py's job.

A step reads nothing from the device (no ``.item()``, no synchronisation): ``train`` leaves its loss sum,
gradient norm and skip flag there, in one small tensor (``UnreadStep``), and the host runs on to queue the next
step. ``read`` takes the steps since the last read in one transfer; the training loop reads at its log interval
(training.log_every_steps), at every stop vote, save and evaluation, at the last step, and every step when the
user asks for the samples (training.record_samples); ``run`` trains and reads at once (tests, benchmarks).
Clipping computes the norm and the clip coefficient on the device.

A step whose gradient norm is inf/NaN (training.on_nonfinite) is skipped, or fails the run, on every rank
alike without a collective of its own: after the gradient reduction every strategy holds the same gradients on
every rank, so the norm is the same everywhere, and a NaN loss on one rank makes it NaN. "skip" decides on the
device where the optimizer takes a found-inf flag (torch's fused AdamW, as GradScaler feeds it: the update and
the step count are left as they were); any other optimizer (sgd, a workload's own, ZeRO-1's) reads the norm on
the host in that step. "fail" steps whatever the norm and the read finds the step: the run fails there, naming
the first non-finite step, before a save can keep its state. Under fp16 an inf/NaN gradient is the loss
scaler's overflow signal instead: it skips the step and lowers the scale (on the device with fused AdamW;
GradScaler reads its found-inf flag on the host for other optimizers); only a non-finite loss then counts.

Test and demo machinery (injected faults, a throttled rank, an emulated slow link) acts through the step
hooks it is given (actors/faults/step_hooks.py), only when the job configures it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset

from raylastic.actors.data.batch_split import BatchSplit
from raylastic.actors.data.batches import planned_batches, to_device
from raylastic.actors.data.compute_clock import ComputeClock, ComputeTime
from raylastic.actors.data.order import GlobalSampleOrder, micro_batch_count, micro_batches
from raylastic.actors.faults.step_hooks import StepHook
from raylastic.actors.status.worker import StepResult
from raylastic.actors.worker.data_place import DataPlace
from raylastic.actors.worker.optimizer_recipe import (
    clip_gradients,
    learning_rate,
    set_learning_rate,
    step_unless_found_inf,
    supports_device_skip,
)
from raylastic.jobconfig import DataConfig, OptimConfig
from raylastic.strategies.base import Strategy, TrainState
from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.strategies.process_group import raise_if_aborted
from raylastic.workloads.protocol import Workload

if TYPE_CHECKING:
    from raylastic.actors.worker.pipeline_step import Pipeline


class NonFiniteStep(RuntimeError):
    """A step's loss or gradient norm is inf/NaN and training.on_nonfinite is "fail" (an error of the job)."""


@dataclass(frozen=True)
class UnreadStep:
    """A trained, committed step whose loss, gradient norm and skip flag are still on the device."""

    result: StepResult
    """Everything known on the host; ``loss_sum``, ``grad_norm`` and ``skipped`` are filled in by ``read``."""
    readings: torch.Tensor
    """[this rank's loss sum, the gradient norm, 1.0 if the update was skipped], float32 on the device."""
    rank: int
    reports: bool
    """This rank reports the step's loss (``DataPlace.reports``)."""
    device_timing: ComputeTime | None = None
    """On a GPU: the step's compute time, read with the rest (``result.compute_s`` holds the host's until then)."""


@dataclass(frozen=True)
class ReadSteps:
    """What ``StepRunner.read`` found."""

    results: list[StepResult]
    nonfinite: NonFiniteStep | None
    """training.on_nonfinite=fail: the first non-finite step's error (``results`` end before that step)."""


@dataclass
class StepRunner:
    """Runs step k of the global sample order on the current group."""

    workload: Workload
    order: GlobalSampleOrder
    strategy: Strategy
    micro_batch_size: int | None
    device: torch.device
    optim: OptimConfig
    total_steps: int
    """training.steps: the length of the lr schedule."""
    seed: int = 0
    record_samples: bool = False
    precision: str = "fp32"
    scaler: torch.amp.GradScaler | None = None
    """fp16 only: dynamic loss scaling (its state lives across steps and generations)."""
    on_nonfinite: Literal["fail", "skip"] = "fail"
    """training.on_nonfinite: what an inf/NaN step does (NonFiniteStep, or a skipped update)."""
    dataset: Dataset | None = None
    """Where ``run`` fetches a step's batches when it is given none (tests, benchmarks)."""
    split: BatchSplit | None = None
    """How each step's global batch is split over the ranks (None: evenly over the current group)."""
    clock: ComputeClock | None = None
    """Measures each step's compute time (None: the step's duration stands for it)."""
    layout: ParallelLayout | None = None
    """The current group's model-parallel layout (parallel.tp or pp > 1; ``split`` is then not used); None: every
    rank is a data-parallel rank."""
    pipeline: Pipeline | None = None
    """The current group's pipeline (parallel.pp > 1): each step's forward and backward run through its schedule."""

    def place(self) -> DataPlace:
        return DataPlace.in_group(self.layout)

    def current_split(self, place: DataPlace | None = None) -> BatchSplit:
        """``place``: this rank's (``self.place()`` if not given)."""
        ranks = (place or self.place()).ranks
        if self.split is not None and self.split.world_size == ranks and self.layout is None:
            return self.split
        return BatchSplit.even(self.order.global_batch_size, ranks)

    def batches(self, dataset: Dataset, first_step: int, until_step: int, data: DataConfig | None = None
                ) -> Iterator[Any]:
        """This rank's micro-batches of steps [first_step, until_step) in the current group, collated by the
        workload's ``collate`` (if it has one), for ``run``."""
        return planned_batches(dataset, self.order, split=self.current_split(), rank=self.place().rank,
                               first_step=first_step, until_step=until_step, micro_batch_size=self.micro_batch_size,
                               collate=getattr(self.workload, "collate", None), data=data or DataConfig(),
                               pin_memory=self.device.type == "cuda")

    def run(self, state: TrainState, step_index: int, batches: Iterator[Any] | None = None,
            hooks: Sequence[StepHook] = (), before_reduction: Callable[[], None] | None = None) -> StepResult:
        """``train`` the step and ``read`` it at once (a host read every step: tests, benchmarks); raises
        NonFiniteStep as ``read`` does."""
        read = self.read([self.train(state, step_index, batches, hooks, before_reduction)])
        if read.nonfinite is not None:
            raise read.nonfinite
        return read.results[0]

    def train(self, state: TrainState, step_index: int, batches: Iterator[Any] | None = None,
              hooks: Sequence[StepHook] = (), before_reduction: Callable[[], None] | None = None) -> UnreadStep:
        """Train on step ``step_index`` (0-based), its micro-batches taken from ``batches`` (this rank's,
        in order: ``self.batches``; None: fetched from ``self.dataset`` now), and commit it; collectives fail
        if a peer is lost. ``hooks``: the step hooks the job configures (none by default). ``before_reduction``
        is called before the backward that reduces the gradients: what every rank must have done before any
        rank can commit this step. Nothing is read from the device: the loss, gradient norm and skip flag stay
        there until ``read``."""
        started = time.perf_counter()
        if self.clock is not None:
            self.clock.start()
        for hook in hooks:
            hook.before_compute(step_index + 1)
        if batches is None:
            batches = self.batches(self.dataset, step_index, step_index + 1)
        rank, place = dist.get_rank(), self.place()
        split = self.current_split(place)
        indices = self.order.split_indices(step_index, split, place.rank)
        # Averaged gradients (DDP, FSDP, over the data-parallel ranks): weights that make the average the global
        # batch's mean; a rank stepping on its own gradient (diloco): its own mean.
        weight = place.ranks / self.order.global_batch_size if self.strategy.averages_gradients else 1 / len(indices)
        lr = learning_rate(step_index, self.optim, self.total_steps)
        set_learning_rate(state.optimizer, lr)
        state.optimizer.zero_grad(set_to_none=True)
        scaler = self._scaler()
        with place.loss_context():
            if self.pipeline is None:
                loss_sum = backward_over_micro_batches(
                    self.workload, state.wrapped, batches, indices, micro_batch_count(split, self.micro_batch_size),
                    device=self.device, seed=self.seed, step_index=step_index, position=split.bounds(place.rank)[0],
                    weight=weight, autocast=self.autocast, no_sync=lambda: self.strategy.no_sync(state),
                    scale=scaler.scale if scaler else None, before_last=before_reduction,
                    stream=place.stream)
            else:
                loss_sum = self._pipelined(step_index, batches, split.bounds(place.rank)[0], before_reduction,
                                           hooks)
        backward_returned = time.perf_counter()
        step_s = backward_returned - started
        compute_time = self.clock.measure(step_s) if self.clock else ComputeTime(step_s)
        consumed = self._gather_sample_ids(indices, split, place) if self.record_samples else None
        if scaler is not None:
            scaler.unscale_(state.optimizer)  # the norm and the clipping see the true gradients
        grad_norm = clip_gradients(state.model.parameters(), self.optim.clip_grad_norm,
                                   across=self.pipeline.group if self.pipeline is not None else None)
        raise_if_aborted()  # NCCL: a reduction our abort ended may have returned as if complete
        skipped = self._optimizer_step(state.optimizer, grad_norm.to(self.device, torch.float32), scaler)
        between_steps = self.strategy.after_step(state, step_index + 1, len(indices),
                                                 last=step_index + 1 == self.total_steps)
        traffic = state.comm.state.take_traffic() if state.comm else None
        timing = state.comm.timer.take(backward_returned) if state.comm and state.comm.timer else None
        bytes_sent = (traffic.bytes_sent if traffic else 0) + between_steps.bytes_sent
        result = StepResult(step=step_index + 1, loss_sum=0.0, samples=len(indices) if place.reports else 0,
                            duration_s=time.perf_counter() - started, finished_at=time.time(),
                            sample_ids=consumed, lr=lr, compute_s=compute_time.host_s, bytes_sent=bytes_sent,
                            uncompressed_bytes=(traffic.uncompressed_bytes if traffic else 0)
                            + between_steps.uncompressed_bytes,
                            comm_s=timing.comm_s if timing else None,
                            exposed_comm_s=timing.exposed_comm_s if timing else None)
        for hook in hooks:
            result = hook.after_step(result)
        loss_sum = loss_sum.float()
        readings = torch.stack([loss_sum, grad_norm.to(loss_sum.device, torch.float32),
                                skipped.to(loss_sum.device, torch.float32)])
        return UnreadStep(result, readings, rank=rank, reports=place.reports,
                          device_timing=compute_time if compute_time.events is not None else None)

    def read(self, steps: Sequence[UnreadStep]) -> ReadSteps:
        """``steps``' results, their loss, gradient norm and skip flag read from the device in one transfer (the
        host waits for the device here, and only here). ``nonfinite``: the NonFiniteStep of the first step whose
        loss or gradient norm is inf/NaN where training.on_nonfinite=fail; ``results`` then end before it."""
        if not steps:
            return ReadSteps([], None)
        values = torch.stack([step.readings for step in steps]).tolist()  # a CPU-GPU sync point
        results = []
        for step, (loss, grad_norm, skipped) in zip(steps, values, strict=True):
            error = self._nonfinite(step.result.step, loss, grad_norm, step.rank)
            if error is not None:
                return ReadSteps(results, error)
            timing = step.device_timing
            results.append(dataclasses.replace(step.result, loss_sum=loss if step.reports else 0.0,
                                               grad_norm=grad_norm, skipped=skipped > 0,
                                               compute_s=timing.seconds() if timing else step.result.compute_s))
        return ReadSteps(results, None)

    def _pipelined(self, step_index: int, batches: Iterator[Any], position: int,
                   before_reduction: Callable[[], None] | None, hooks: Sequence[StepHook]) -> torch.Tensor:
        """This rank's stage of the step's forward and backward (its share is one batch of (inputs, targets)); the
        share's summed loss on every stage of the pipeline, for the non-finite check and the report."""
        inputs, targets = to_device(next(batches), self.device)
        if before_reduction is not None:
            before_reduction()

        def before_microbatch(chunk: int) -> None:
            for hook in hooks:
                hook.before_microbatch(step_index + 1, chunk)

        with self.autocast():
            loss_sum = self.pipeline.step(step_index, position, inputs, targets,
                                          before_microbatch=before_microbatch if hooks else None).to(self.device)
        dist.all_reduce(loss_sum, group=self.pipeline.group)  # only the last stage computed it
        return loss_sum

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast_for(self.precision, self.device)

    def _scaler(self) -> torch.amp.GradScaler | None:
        """fp16's loss scaler, when it scales (a GradScaler made for a device type absent here disables itself)."""
        return self.scaler if self.scaler is not None and self.scaler.is_enabled() else None

    def _nonfinite(self, step: int, loss: float, grad_norm: float, rank: int) -> NonFiniteStep | None:
        """The NonFiniteStep (training.on_nonfinite=fail) for an inf/NaN loss on this rank, or an inf/NaN gradient
        norm - unless fp16's scaler is there to skip that step as an overflow."""
        overflow_is_handled = self._scaler() is not None
        if self.on_nonfinite == "skip" or (math.isfinite(loss) and (math.isfinite(grad_norm) or overflow_is_handled)):
            return None
        return NonFiniteStep(f"step {step}: the loss on rank {rank} is {loss} and the gradient norm is {grad_norm}; "
                             "training.on_nonfinite=skip discards such steps instead of failing the run")

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor,
                        scaler: torch.amp.GradScaler | None) -> torch.Tensor:
        """Step the optimizer, or skip its update; whether it skipped, as a tensor on the device.

        fp16: the loss scaler skips an overflowing step and lowers its scale. on_nonfinite=skip: a step whose
        gradient norm is inf/NaN is skipped on every rank (each holds the same norm). Both decide on the device
        when the optimizer takes a found-inf flag (``supports_device_skip``: fused adamw); otherwise the flag is
        read on the host here (GradScaler's own ``.item()`` for fp16). on_nonfinite=fail steps whatever the norm:
        ``read`` finds a non-finite step, and the run fails there, before a save can keep it."""
        if scaler is not None:
            scaler.step(optimizer)
            found = [t.to(grad_norm.device) for t in scaler._found_inf_per_device(optimizer).values()]
            scaler.update()
            return torch.stack(found).sum() if found else torch.zeros((), device=grad_norm.device)
        if self.on_nonfinite == "fail":
            optimizer.step()
            return torch.zeros((), device=grad_norm.device)
        found_inf = (~torch.isfinite(grad_norm)).float()
        if supports_device_skip(optimizer):
            step_unless_found_inf(optimizer, found_inf)
        elif found_inf.item():  # a host read: this optimizer cannot skip on the device
            optimizer.zero_grad(set_to_none=True)
        else:
            optimizer.step()
        return found_inf

    def _gather_sample_ids(self, indices: torch.Tensor, split: BatchSplit, place: DataPlace) -> tuple[int, ...]:
        """Every data-parallel rank's sample ids of this step, in their order, as each rank reports them (the
        ledger): each one's once, from its reporting rank."""
        padded = torch.full((max(split.sizes),), -1, dtype=torch.int64)
        if place.reports:
            padded[: len(indices)] = indices
        parts = [torch.empty_like(padded, device=self.device) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, padded.to(self.device))
        return tuple(i for part in parts for i in part.tolist() if i >= 0)


def backward_over_micro_batches(workload: Workload, model: torch.nn.Module, batches: Iterator[Any],
                                indices: torch.Tensor, count: int, *, device: torch.device, seed: int, step_index: int,
                                position: int, weight: float,
                                autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                                no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                                scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
                                before_last: Callable[[], None] | None = None, stream: int = 0) -> torch.Tensor:
    """Forward and backward over one step's micro-batches on this rank - the synchronous step's and an async_ps
    worker's alike - accumulating ``weight`` x each micro-batch's summed loss into the gradients; the summed loss.

    ``indices``: this rank's samples of the step, in ``count`` micro-batches (``micro_batches``), whose batches
    come from ``batches`` in order; ``position``: where the first one starts in the step's global batch (each
    micro-batch seeds the RNG from it); ``no_sync``: the context every micro-batch but the last runs in (the
    strategy's); ``scale``: fp16's loss scaling; ``before_last``: called before the backward that reduces the
    gradients; ``stream``: this rank's random stream among the ranks that take the same samples (``DataPlace``)."""
    loss_sum: torch.Tensor | None = None
    chunks = micro_batches(indices, count)
    last_chunk = len(chunks) - 1
    for number, chunk in enumerate(chunks):
        batch = to_device(next(batches), device)
        seed_rng(step_seed(seed, step_index, position, stream), device)
        samples = len(chunk) if number < len(indices) else 0  # 0: padding, for the same count on every rank
        position += samples
        with contextlib.nullcontext() if number == last_chunk else no_sync(), autocast():
            loss = workload.training_step(model, batch)
        samples_loss = loss.float() * samples
        detached = samples_loss.detach()  # under loss_parallel, a DTensor replicated over the tp ranks
        detached = detached.full_tensor() if isinstance(detached, DTensor) else detached
        loss_sum = detached if loss_sum is None else loss_sum + detached
        scaled = samples_loss * weight
        if number == last_chunk and before_last is not None:
            before_last()
        (scale(scaled) if scale else scaled).backward()
    return loss_sum if loss_sum is not None else torch.zeros((), device=device)


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context a forward runs in under training.precision (none for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def step_seed(seed: int, step: int, position: int, stream: int = 0) -> int:
    """The RNG seed of the micro-batch that starts at ``position`` of step ``step``'s global batch, in random
    stream ``stream`` (``DataPlace.stream``)."""
    return (((seed * 1_000_003 + step) * 1_000_033 + position) + stream * 1_000_000_007) % 2**63


def seed_rng(seed: int, device: torch.device) -> None:
    """Seed the generators a forward on ``device`` draws from (torch.manual_seed seeds every backend: ~50 us)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)  # the current device's generator
