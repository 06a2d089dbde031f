"""One training step, the same math at every world size.

Each rank runs forward/backward over its slice of the global batch in micro-batches (only the
last one communicates), with each micro-batch's summed loss scaled by world_size / B, because
DDP averages gradients over ranks: the result is the gradient of the mean loss over the global
batch. The step commits (the optimizer steps) once its gradient communication has completed on
this rank; a peer lost before that fails the step, which is then discarded. A step makes no
collective of its own: it reports this rank's summed loss and sample count, and the Controller sums
them over the ranks (the loss the run reports); stopping at a common step boundary is
actors/stop_vote.py's job.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, TensorDataset, default_collate

from actors.data_order import GlobalSampleOrder, micro_batches
from strategies.base import Strategy, TrainState
from workloads.protocol import Workload


@dataclass(frozen=True)
class StepResult:
    step: int
    """The step's number, 1-based: after it, ``step`` optimizer steps are committed."""
    loss_sum: float
    """This rank's loss summed over its samples (the Controller sums it over the ranks)."""
    samples: int
    """The samples this rank trained on in this step."""
    duration_s: float
    finished_at: float
    """Wall-clock time (time.time()) when the step was committed."""
    sample_ids: tuple[int, ...] | None = None
    """The dataset indices all ranks trained on in this step, gathered (when samples are recorded)."""
    bytes_sent: int = 0
    """Gradient bytes this rank put on the wire (its payloads), and what float32 would have been."""
    uncompressed_bytes: int = 0
    comm_s: float | None = None
    """Time buckets spent in communication, and the part of it backward did not hide (None: not
    timed, unless strategy.comm_timing is set)."""
    exposed_comm_s: float | None = None
    skipped: bool = False
    """fp16: the loss scaler found inf/nan gradients and skipped the optimizer step."""


def gather_batch(dataset: Dataset, indices: torch.Tensor, device: torch.device) -> tuple:
    """The (inputs, targets) of ``indices``: one gather for a TensorDataset, else default_collate."""
    if isinstance(dataset, TensorDataset):
        inputs, targets = (t[indices] for t in dataset.tensors)
    else:
        inputs, targets = default_collate([dataset[i] for i in indices.tolist()])
    if inputs.device != device:
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
    return inputs, targets


@dataclass
class StepRunner:
    """Runs step k of the global sample order on the current group."""

    workload: Workload
    dataset: Dataset
    order: GlobalSampleOrder
    strategy: Strategy
    micro_batch_size: int | None
    device: torch.device
    record_samples: bool = False
    precision: str = "fp32"
    scaler: torch.amp.GradScaler | None = None
    """fp16 only: dynamic loss scaling (its state lives across steps and generations)."""

    def run(self, state: TrainState, step_index: int) -> StepResult:
        """Train on step ``step_index`` (0-based) and commit it; collectives fail if a peer is lost."""
        started = time.perf_counter()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        indices = self.order.rank_indices(step_index, rank, world_size)
        scale = world_size / self.order.global_batch_size
        chunks = micro_batches(indices, self.micro_batch_size)
        loss_sum: torch.Tensor | None = None
        state.optimizer.zero_grad(set_to_none=True)
        for position, chunk in enumerate(chunks):
            inputs, targets = gather_batch(self.dataset, chunk, self.device)
            last = position == len(chunks) - 1
            with contextlib.nullcontext() if last else self.strategy.no_sync(state), self._autocast():
                loss = self.workload.loss_sum(state.wrapped(inputs), targets)
            if self.precision != "fp32":
                loss = loss.float()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            scaled = loss * scale
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        backward_returned = time.perf_counter()
        consumed = self._gather_sample_ids(indices, world_size) if self.record_samples else None
        skipped = self._optimizer_step(state.optimizer)
        traffic = state.comm.state.take_traffic() if state.comm else None
        timing = state.comm.timer.take(backward_returned) if state.comm and state.comm.timer else None
        return StepResult(step=step_index + 1, loss_sum=loss_sum.item(), samples=len(indices),
                          duration_s=time.perf_counter() - started, finished_at=time.time(),
                          sample_ids=consumed, skipped=skipped,
                          bytes_sent=traffic.bytes_sent if traffic else 0,
                          uncompressed_bytes=traffic.uncompressed_bytes if traffic else 0,
                          comm_s=timing.comm_s if timing else None,
                          exposed_comm_s=timing.exposed_comm_s if timing else None)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16 if self.precision == "bf16" else torch.float16)

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step (through the loss scaler for fp16); True if the scaler skipped the step."""
        if self.scaler is None:
            optimizer.step()
            return False
        scale_before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() < scale_before

    def _gather_sample_ids(self, indices: torch.Tensor, world_size: int) -> tuple[int, ...]:
        """Every rank's sample ids of this step, in rank order, as each rank reports them (the ledger)."""
        width = -(-self.order.global_batch_size // world_size)
        padded = torch.full((width,), -1, dtype=torch.int64)
        padded[: len(indices)] = indices
        parts = [torch.empty_like(padded, device=self.device) for _ in range(world_size)]
        dist.all_gather(parts, padded.to(self.device))
        return tuple(i for part in parts for i in part.tolist() if i >= 0)
