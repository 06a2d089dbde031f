"""AsyncWorker: leases a step, pulls the parameters, computes the step's gradient alone, pushes it.

Each ticket is one step of the global sample order (``global_batch_size`` samples, in micro-batches of
``training.micro_batch_size``), so a run trains on the same samples, in the same batches, as a
synchronous one; only the parameters each gradient is computed on differ. The RNG is seeded per
micro-batch from the run seed, the ticket and the position, as in a synchronous step. A worker never
waits for another: it waits only for the servers' answers and, when every remaining step is leased,
for more work. Every call it makes has a bound: a server's answer ``server_timeout_s``, the Controller's
``controller_timeout_s``, past which ``run`` raises ControllerUnanswered (the Controller replaces the worker as
lost). ``run`` returns when the run has no more steps for it::

    worker = AsyncWorkerActor.remote(spec, controller)
    done = worker.run.remote()     # resolves to the number of steps it computed; raises if it died
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import ray
import torch

from raylastic.actors.async_ps.leases import Lease, StepReport
from raylastic.actors.data.batch_split import BatchSplit
from raylastic.actors.data.leased_batches import LeasedBatches
from raylastic.actors.data.order import GlobalSampleOrder, micro_batch_count, micro_batches
from raylastic.actors.faults.step_hooks import fire, throttle_factor
from raylastic.actors.processes.allocator import keep_freed_memory
from raylastic.actors.worker.optimizer_recipe import clip_gradients
from raylastic.actors.worker.step import NonFiniteStep, autocast_for, backward_over_micro_batches
from raylastic.jobconfig import DataConfig, FaultConfig, OptimConfig, TrainingConfig, WorkloadConfig
from raylastic.jobconfig.link import LinkConfig
from raylastic.strategies.emulated_link import EmulatedLink
from raylastic.strategies.process_group import choose_device
from raylastic.workloads import load_workload

IDLE_WAIT_S = 0.05
"""How long a worker with nothing to lease waits before asking again."""


class ControllerUnanswered(TimeoutError):
    """The Controller left a lease, an admission or a give-back unanswered for its bound: the worker ends, and the
    Controller (if it answers again) takes it as lost, its leases and its undelivered update back."""


@dataclass(frozen=True, kw_only=True)
class AsyncWorkerSpec:
    name: str
    workload: WorkloadConfig
    training: TrainingConfig
    optim: OptimConfig
    data: DataConfig
    """data.num_workers processes fetch and collate a leased step's micro-batches (actors/data/leased_batches.py)."""
    use_gpu: bool
    torch_threads: int
    server_timeout_s: float
    """How long a pull or push may wait for a server (failure.collective_timeout_s)."""
    controller_timeout_s: float = 30.0
    """How long a lease, an admission or a give-back may wait for the Controller (failure.collective_timeout_s). It
    answers them from threads of its own, under a lock that nothing slow holds (a server restore does not)."""
    faults: tuple[FaultConfig, ...] = ()
    """The faults aimed at this worker's index."""
    link: LinkConfig = LinkConfig()
    """An emulated slow link (strategies/emulated_link.py), full duplex as the synchronous strategies' is (a rank
    in a ring all-reduce sends and receives at once, and is charged its bytes once): a pull waits what the
    parameters take to come in; a push occupies the outgoing direction for what the gradient takes, while the
    worker pulls and computes its next step; only a push that finds the last one still going waits for it."""


class AsyncWorker:
    def __init__(self, spec: AsyncWorkerSpec, controller: Any) -> None:
        keep_freed_memory()
        torch.set_num_threads(spec.torch_threads)
        self.spec, self.controller = spec, controller
        self.device = choose_device(spec.use_gpu)
        self.workload = load_workload(spec.workload.name, spec.workload.options)
        dataset = self.workload.train_dataset()
        self.batches = LeasedBatches(dataset, collate=getattr(self.workload, "collate", None), data=spec.data,
                                     pin_memory=self.device.type == "cuda")
        training = spec.training
        self.order = GlobalSampleOrder(len(dataset), training.global_batch_size, training.seed)
        self.split = BatchSplit.even(training.global_batch_size, 1)
        self.model = self.workload.build_model().to(self.device)
        self.parameters = dict(self.model.named_parameters())
        self.fired: set[FaultConfig] = set()
        self.link = EmulatedLink.of(spec.link)
        self.sending_until = 0.0
        """When the emulated link's outgoing direction is free again (time.monotonic())."""

    def ping(self) -> bool:
        """Answered from the actor's second thread while ``run`` computes: the process is alive."""
        return True

    def run(self) -> int:
        """Compute steps until the run has none left; returns how many this worker had admitted."""
        admitted = 0
        while True:
            lease: Lease = self._ask_controller("lease", self.spec.name)
            if lease.finished:
                self.batches.close()
                return admitted
            if lease.ticket is None:
                time.sleep(IDLE_WAIT_S)
                continue
            admitted += self._compute(lease)

    def _compute(self, lease: Lease) -> int:
        """One leased step: 1 if its gradient was admitted and pushed."""
        started = time.perf_counter()
        try:
            pulled = ray.get([server.pull.remote() for server in lease.servers], timeout=self.spec.server_timeout_s)
        except (ray.exceptions.RayError, TimeoutError):
            # a server is lost (the Controller restores the servers) or failed (the Controller fails the run)
            self._ask_controller("give_back", self.spec.name, lease.ticket)
            time.sleep(IDLE_WAIT_S)
            return 0
        if any(epoch != lease.epoch for epoch, _, _ in pulled):  # the servers were restored since the lease
            self._ask_controller("give_back", self.spec.name, lease.ticket)
            return 0
        received = self._load(pulled)
        pull_delay_s = self._cross_link(received)
        self._fire_faults(lease.ticket)
        loss_sum, samples, sample_ids = self._gradient(lease.ticket)
        compute_s = time.perf_counter() - started - pull_delay_s
        factor = throttle_factor(self.spec.faults, lease.ticket + 1)
        if factor > 1:
            time.sleep((factor - 1) * compute_s)
        grad_norm = clip_gradients(self.model.parameters(), self.spec.optim.clip_grad_norm).item()  # reported now
        finite = math.isfinite(loss_sum) and math.isfinite(grad_norm)
        if not finite and self.spec.training.on_nonfinite == "fail":
            raise NonFiniteStep(f"step {lease.ticket + 1}: the loss on {self.spec.name} is {loss_sum / samples} and "
                                f"the gradient norm is {grad_norm}; training.on_nonfinite=skip discards such steps "
                                "instead of failing the run")
        shares = [{name: self.parameters[name].grad.detach() for name in names} if finite else {}
                  for names in lease.shards]
        sent = sum(g.numel() * g.element_size() for share in shares for g in share.values())
        send_wait_s = self._wait_to_send(sent)
        report = StepReport(ticket=lease.ticket, read_versions=[version for _, version, _ in pulled],
                            loss_sum=loss_sum, samples=samples, compute_s=compute_s,
                            step_s=time.perf_counter() - started, grad_norm=grad_norm, bytes_sent=sent,
                            bytes_received=received, link_delay_s=pull_delay_s + send_wait_s, skipped=not finite,
                            sample_ids=sample_ids)
        update = self._ask_controller("admit", self.spec.name, report)
        if update is None:  # too stale: the step goes back in the queue
            return 0
        buffers = {name: b.detach() for name, b in self.model.named_buffers()}
        pushes = [server.push.remote(lease.epoch, update, version, share, buffers if i == 0 else {}, lease.ticket)
                  for i, (server, version, share) in enumerate(zip(lease.servers, report.read_versions, shares,
                                                                   strict=True))]
        try:
            ray.get(pushes, timeout=self.spec.server_timeout_s)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # a server is lost (its restore takes this update back) or failed (the Controller fails the run)
        return 1

    def _ask_controller(self, method: str, *args: Any) -> Any:
        """The Controller's answer to ``method(*args)``; ControllerUnanswered past ``controller_timeout_s``."""
        return ask_within(self.controller, method, *args, timeout_s=self.spec.controller_timeout_s)

    def _cross_link(self, num_bytes: int) -> float:
        """Sleep what ``num_bytes`` take to come in over the emulated link (one message); returns the seconds."""
        delay_s = self.link.delay_s(num_bytes, messages=1) if self.link else 0.0
        if delay_s:
            time.sleep(delay_s)
        return delay_s

    def _wait_to_send(self, num_bytes: int) -> float:
        """Wait for the emulated link's outgoing direction to be free, then occupy it with ``num_bytes`` (one
        message); returns the seconds waited."""
        if not self.link:
            return 0.0
        wait_s = max(0.0, self.sending_until - time.monotonic())
        if wait_s:
            time.sleep(wait_s)
        self.sending_until = time.monotonic() + self.link.delay_s(num_bytes, messages=1)
        return wait_s

    def _load(self, pulled: list[tuple[int, int, dict[str, torch.Tensor]]]) -> int:
        """The pulled parameters (and buffers) into the model; returns the bytes received."""
        received = 0
        buffers = dict(self.model.named_buffers())
        with torch.no_grad():
            for _, _, tensors in pulled:
                for name, tensor in tensors.items():
                    is_buffer = name.startswith("buffer.")
                    (buffers[name.removeprefix("buffer.")] if is_buffer else self.parameters[name]).copy_(tensor)
                    received += tensor.numel() * tensor.element_size()
        return received

    def _fire_faults(self, ticket: int) -> None:
        """The injected faults of this worker due by step ``ticket + 1`` fire once (the first step it computes)."""
        for fault in self.spec.faults:
            if fault.action != "throttle" and fault.step <= ticket + 1 and fault not in self.fired:
                self.fired.add(fault)
                fire(fault)

    def _gradient(self, ticket: int) -> tuple[float, int, list[int] | None]:
        """The mean loss's gradient over step ``ticket``'s samples: (summed loss, samples, their ids if recorded)."""
        training = self.spec.training
        indices = self.order.split_indices(ticket, self.split, 0)
        count = micro_batch_count(self.split, training.micro_batch_size)
        batches = self.batches.fetch([chunk.tolist() for chunk in micro_batches(indices, count)])
        self.model.zero_grad(set_to_none=True)
        self.model.train()
        loss_sum = backward_over_micro_batches(
            self.workload, self.model, batches, indices, count, device=self.device, seed=training.seed,
            step_index=ticket, position=0, weight=1 / len(indices),
            autocast=lambda: autocast_for(training.precision, self.device))
        return loss_sum.item(), len(indices), indices.tolist() if training.record_samples else None


def ask_within(actor: Any, method: str, *args: Any, timeout_s: float) -> Any:
    """``actor.method(*args)``'s answer, waited for at most ``timeout_s`` (ControllerUnanswered past it)."""
    try:
        return ray.get(getattr(actor, method).remote(*args), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ControllerUnanswered(f"the Controller left {method} unanswered for {timeout_s:g}s "
                                   "(failure.collective_timeout_s)") from None


AsyncWorkerActor = ray.remote(max_concurrency=2)(AsyncWorker)
