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

A step whose gradient norm is inf/NaN (training.on_nonfinite) is skipped, or fails the run, on every
rank alike without a collective of its own: after the gradient reduction every strategy holds the same
gradients on every rank, so the norm is the same everywhere, and a NaN loss on one rank makes it NaN.
Under fp16 an inf/NaN gradient is the loss scaler's overflow signal instead: it skips the step and
lowers the scale; only a non-finite loss then counts.

Test and demo machinery (injected faults, a throttled rank, an emulated slow link) acts through the step
hooks it is given (actors/faults/step_hooks.py), only when the job configures it.
"""

from __future__ import annotations

import contextlib
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
from raylastic.actors.data.compute_clock import ComputeClock
from raylastic.actors.data.order import GlobalSampleOrder, micro_batch_count, micro_batches
from raylastic.actors.faults.step_hooks import StepHook
from raylastic.actors.status.worker import StepResult
from raylastic.actors.worker.data_place import DataPlace
from raylastic.actors.worker.optimizer_recipe import clip_gradients, learning_rate, set_learning_rate
from raylastic.jobconfig import DataConfig, OptimConfig
from raylastic.strategies.base import Strategy, TrainState
from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.strategies.process_group import raise_if_aborted
from raylastic.workloads.protocol import Workload

if TYPE_CHECKING:
    from raylastic.actors.worker.pipeline_step import Pipeline


class NonFiniteStep(RuntimeError):
    """A step's loss or gradient norm is inf/NaN and training.on_nonfinite is "fail" (an error of the job)."""


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
        """Train on step ``step_index`` (0-based), its micro-batches taken from ``batches`` (this rank's,
        in order: ``self.batches``; None: fetched from ``self.dataset`` now), and commit it; collectives fail
        if a peer is lost. ``hooks``: the step hooks the job configures (none by default). ``before_reduction``
        is called before the backward that reduces the gradients: what every rank must have done before any
        rank can commit this step."""
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
        with place.loss_context():
            if self.pipeline is None:
                loss_sum = backward_over_micro_batches(
                    self.workload, state.wrapped, batches, indices, micro_batch_count(split, self.micro_batch_size),
                    device=self.device, seed=self.seed, step_index=step_index, position=split.bounds(place.rank)[0],
                    weight=weight, autocast=self.autocast, no_sync=lambda: self.strategy.no_sync(state),
                    scale=self.scaler.scale if self.scaler else None, before_last=before_reduction,
                    stream=place.stream)
            else:
                loss_sum = self._pipelined(step_index, batches, split.bounds(place.rank)[0], before_reduction,
                                           hooks)
        backward_returned = time.perf_counter()
        compute_s = self.clock.compute_s(backward_returned - started) if self.clock else backward_returned - started
        consumed = self._gather_sample_ids(indices, split, place) if self.record_samples else None
        if self.scaler is not None:
            self.scaler.unscale_(state.optimizer)  # the norm and the clipping see the true gradients
        grad_norm = clip_gradients(state.model.parameters(), self.optim.clip_grad_norm,
                                   across=self.pipeline.group if self.pipeline is not None else None)
        loss_value = loss_sum.item()
        raise_if_aborted()  # NCCL: a reduction our abort ended may have returned as if complete
        self._check_finite(step_index + 1, loss_value, grad_norm, rank)
        if math.isfinite(grad_norm) or self.scaler is not None:
            skipped = self._optimizer_step(state.optimizer)
        else:  # on_nonfinite=skip: no rank steps (all see this norm); the step still counts
            state.optimizer.zero_grad(set_to_none=True)
            skipped = True
        between_steps = self.strategy.after_step(state, step_index + 1, len(indices),
                                                 last=step_index + 1 == self.total_steps)
        traffic = state.comm.state.take_traffic() if state.comm else None
        timing = state.comm.timer.take(backward_returned) if state.comm and state.comm.timer else None
        bytes_sent = (traffic.bytes_sent if traffic else 0) + between_steps.bytes_sent
        result = StepResult(step=step_index + 1, loss_sum=loss_value if place.reports else 0.0,
                            samples=len(indices) if place.reports else 0,
                            duration_s=time.perf_counter() - started, finished_at=time.time(),
                            sample_ids=consumed, skipped=skipped, lr=lr, grad_norm=grad_norm, compute_s=compute_s,
                            bytes_sent=bytes_sent,
                            uncompressed_bytes=(traffic.uncompressed_bytes if traffic else 0)
                            + between_steps.uncompressed_bytes,
                            comm_s=timing.comm_s if timing else None,
                            exposed_comm_s=timing.exposed_comm_s if timing else None)
        for hook in hooks:
            result = hook.after_step(result)
        return result

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

    def _check_finite(self, step: int, loss: float, grad_norm: float, rank: int) -> None:
        """Raise NonFiniteStep (training.on_nonfinite=fail) for an inf/NaN loss on this rank, or an inf/NaN
        gradient norm - unless fp16's scaler is there to skip that step as an overflow."""
        overflow_is_handled = self.scaler is not None
        if self.on_nonfinite == "skip" or (math.isfinite(loss) and (math.isfinite(grad_norm) or overflow_is_handled)):
            return
        raise NonFiniteStep(f"step {step}: the loss on rank {rank} is {loss} and the gradient norm is {grad_norm}; "
                            "training.on_nonfinite=skip discards such steps instead of failing the run")

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step (through the loss scaler for fp16); True if the scaler skipped the step."""
        if self.scaler is None:
            optimizer.step()
            return False
        scale_before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() < scale_before

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
