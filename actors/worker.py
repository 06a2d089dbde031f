"""TrainWorker: one Ray actor per GPU or CPU slot, training in a thread of its own.

The actor keeps its model and optimizer across generations: the Controller tells it to join
generation g (a new process group), to hand over or receive state, and to train up to a step.
Training runs in a thread so the actor keeps answering ``poll`` while it trains.

Lifecycle (each call from the Controller)::

    worker.join(assignment)            -> JoinReport(step=committed steps)
    worker.sync_state(source_rank)     every rank, together
    worker.train(until_step)           starts the loop thread; returns at once
    worker.poll()                      -> WorkerStatus(phase, step, new StepResults, error)
"""

from __future__ import annotations

import gc
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Literal

import ray
import torch

from actors.data_order import GlobalSampleOrder
from actors.faults import fire
from actors.step_loop import StepResult, StepRunner
from cluster.config import FaultConfig, OptimConfig, StrategyConfig, TrainingConfig, WorkloadConfig
from strategies import build_strategy
from strategies.checkpoint import Checkpointer, load_checkpoint_state
from strategies.process_group import GroupAssignment, choose_backend, choose_device, join_group, leave_group
from strategies.state_transfer import broadcast_training_state
from workloads import load_workload

Phase = Literal["idle", "training", "stopped", "finished", "failed"]


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """Everything a worker needs to build its part of the job; each piece is its own config."""

    workload: WorkloadConfig
    training: TrainingConfig
    optim: OptimConfig
    strategy: StrategyConfig
    use_gpu: bool
    torch_threads: int
    checkpointer: Checkpointer


@dataclass(frozen=True)
class JoinReport:
    node_id: str
    step: int
    """Committed optimizer steps this worker holds (its candidate state for the hand-over)."""


@dataclass(frozen=True)
class WorkerStatus:
    phase: Phase
    step: int
    results: list[StepResult] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    error: str | None = None


def build_optimizer(config: OptimConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    if config.name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                           weight_decay=config.weight_decay)


class TrainWorker:
    def __init__(self, spec: WorkerSpec) -> None:
        torch.set_num_threads(spec.torch_threads)
        torch.manual_seed(spec.training.seed)
        self.spec = spec
        self.device = choose_device(spec.use_gpu)
        self.backend = choose_backend(spec.use_gpu)
        self.workload = load_workload(spec.workload.name, spec.workload.options)
        self.model = self.workload.build_model().to(self.device)
        self.optimizer = build_optimizer(spec.optim, self.model)
        dataset = self.workload.train_dataset()
        self.runner = StepRunner(
            workload=self.workload, dataset=dataset,
            order=GlobalSampleOrder(len(dataset), spec.training.global_batch_size, spec.training.seed),
            strategy=build_strategy(spec.strategy), optimizer=self.optimizer,
            micro_batch_size=spec.training.micro_batch_size, device=self.device,
            record_samples=spec.training.record_samples)
        self.wrapped: torch.nn.Module = self.model
        self.step = 0
        self._lock = threading.Lock()
        self._phase: Phase = "idle"
        self._results: list[StepResult] = []
        self._events: list[dict] = []
        self._error: str | None = None
        self._stop_vote = threading.Event()
        self._thread: threading.Thread | None = None

    def pid(self) -> int:
        return os.getpid()

    def join(self, assignment: GroupAssignment) -> JoinReport:
        """Leave the old group and join generation ``assignment.generation``; keeps model and optimizer."""
        self._wait_for_loop()
        self.wrapped = self.model
        gc.collect()  # the old DDP's reducer (and its autograd hooks on our parameters) must be gone
        join_group(assignment, self.backend)
        self.wrapped = self.runner.strategy.wrap(self.model, self.device)
        self._phase, self._error = "idle", None
        self._stop_vote.clear()
        return JoinReport(node_id=ray.get_runtime_context().get_node_id(), step=self.step)

    def sync_state(self, source_rank: int) -> int:
        """Receive (or send, on ``source_rank``) the model, optimizer and step; returns the step."""
        self.step = broadcast_training_state(self.model, self.optimizer, self.step,
                                             source_rank=source_rank, device=self.device)
        return self.step

    def load_checkpoint(self, path: str) -> int:
        """Load a checkpoint's full state into this worker (then hand it over with ``sync_state``)."""
        state = load_checkpoint_state(path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        return self.step

    def train(self, until_step: int, faults: tuple[FaultConfig, ...] = ()) -> None:
        """Start the step loop in a thread; it runs until ``until_step``, a stop vote, or an error.

        ``faults`` are the injected faults aimed at this worker's rank in this generation.
        """
        self._wait_for_loop()
        self._phase = "training"
        self._thread = threading.Thread(target=self._loop, args=(until_step, faults), name="step-loop",
                                        daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Vote to stop at the next step boundary; every rank stops after the same step."""
        self._stop_vote.set()

    def poll(self) -> WorkerStatus:
        """Phase, committed step and the step results since the last poll."""
        with self._lock:
            results, self._results = self._results, []
            events, self._events = self._events, []
            return WorkerStatus(self._phase, self.step, results, events, self._error)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full state on CPU (a plain state dict that loads without this project)."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def training_state(self) -> dict:
        """Model, optimizer and step, on CPU, for a checkpoint."""
        return {"model": self.full_state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step}

    def save_checkpoint(self, world_size: int) -> str:
        """Write the full state as the checkpoint of the current step (rank 0 calls this)."""
        return str(self.spec.checkpointer.save(self.step, world_size, self.training_state))

    def evaluate(self) -> dict[str, float]:
        return self.workload.evaluate(self.model)

    def shutdown(self) -> None:
        self._stop_vote.set()
        self._wait_for_loop()
        leave_group()

    def _loop(self, until_step: int, faults: tuple[FaultConfig, ...]) -> None:
        try:
            while self.step < until_step:
                for fault in faults:
                    if fault.step == self.step + 1:
                        fire(fault)
                result = self.runner.run(self.wrapped, self.step, stop_vote=self._stop_vote.is_set())
                with self._lock:
                    self.step = result.step
                    self._results.append(result)
                if self.spec.checkpointer.due(self.step) and torch.distributed.get_rank() == 0:
                    started = time.perf_counter()
                    path = self.save_checkpoint(torch.distributed.get_world_size())
                    with self._lock:
                        self._events.append({"type": "checkpointed", "step": self.step, "path": path,
                                             "duration_s": round(time.perf_counter() - started, 4)})
                if result.stop_requested:
                    self._phase = "stopped"
                    return
            self._phase = "finished"
        except Exception as error:  # noqa: BLE001 - any failure is reported to the Controller
            self._error = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=4)}"
            self._phase = "failed"

    def _wait_for_loop(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


TrainWorkerActor = ray.remote(TrainWorker)
