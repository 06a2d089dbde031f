"""TrainWorker: one Ray actor per GPU or CPU slot, training in a thread of its own.

The actor outlives process-group generations: the Controller tells it to join generation g,
to hand over or receive state (in memory for replicated strategies, from a checkpoint for
sharded ones), and to train up to a step. Training runs in a thread so the actor keeps
answering ``poll`` while it trains.

Lifecycle (each call from the Controller, on every member together)::

    worker.join(assignment)            -> JoinReport(step=committed steps, ...)
    worker.sync_state(source_rank)     replicated state: the most advanced rank's goes to all
    worker.restore(path | None)        sharded state: from a checkpoint (None: a fresh start)
    worker.train(until_step, faults)   starts the loop thread; returns at once
    worker.poll(wait_s, seen)          -> WorkerStatus(phase, step, new StepResults, events, error)

``poll`` is a long poll: it answers at once when something happened since version ``seen`` (a
phase change, an event, an error) and otherwise after ``wait_s``, with the step results of the
meantime. So the Controller hears of news at once and costs a training worker one call a second.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
import torch
import torch.distributed as dist

from actors.data_order import GlobalSampleOrder
from actors.evaluation import Evaluator
from actors.failures import is_peer_loss
from actors.faults import fire
from actors.priority import run_at_normal_priority
from actors.recipe import optimizer_factory
from actors.step_loop import StepResult, StepRunner
from actors.stop_vote import StopVote
from jobconfig import (
    DataConfig,
    EvalConfig,
    FaultConfig,
    OptimConfig,
    StrategyConfig,
    TrainingConfig,
    WorkloadConfig,
)
from strategies import build_strategy
from strategies.base import (
    GroupContext,
    TrainState,
    init_optimizer_state,
    load_scaler,
    memory_breakdown,
    scaler_entries,
)
from strategies.checkpoint import Checkpointer, CheckpointWriteError, load_into
from strategies.process_group import GroupAssignment, abort_group, choose_backend, choose_device, join_group
from strategies.state_transfer import broadcast_training_state
from workloads import load_workload

logger = logging.getLogger(__name__)

Phase = Literal["idle", "training", "stopped", "finished", "failed", "awaiting_kill"]
ErrorCause = Literal["peer_lost", "job"]
"""Why a worker failed: a collective lost its peer (recovered), or the job itself raised (fatal)."""
LOOP_EXIT_GRACE_S = 5.0
"""Beyond the collective timeout: how long a leaving loop thread may take to give up on its peers."""


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """Everything a worker needs to build its part of the job; each piece is its own config."""

    workload: WorkloadConfig
    training: TrainingConfig
    optim: OptimConfig
    strategy: StrategyConfig
    data: DataConfig
    eval: EvalConfig
    use_gpu: bool
    torch_threads: int
    checkpointer: Checkpointer
    profile_dir: str | None = None
    """Where rank 0 writes its torch profiler trace when training.profile_steps > 0."""


@dataclass(frozen=True)
class JoinReport:
    node_id: str
    step: int
    """Committed optimizer steps this worker holds (its candidate state for the hand-over). A worker whose
    state a hand-over left half-received has rebuilt it from the seed: 0."""


@dataclass(frozen=True)
class WorkerStatus:
    phase: Phase
    step: int
    results: list[StepResult] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    error: str | None = None
    """The error and its full traceback (phase "failed")."""
    error_cause: ErrorCause | None = None
    evaluations: list[dict] = field(default_factory=list)
    """Periodic evaluations since the last poll (rank 0 reports them): ``{"step", "time", metrics...}``."""
    version: int = 0
    """Counts the news (phase changes, events, errors) so far; pass it back as ``poll``'s ``seen``."""
    step_running_s: float | None = None
    """How long the step in flight has been running (None: none is), for the Controller's hang watchdog."""


class TrainWorker:
    def __init__(self, spec: WorkerSpec) -> None:
        priority_warning = run_at_normal_priority()  # before any thread of ours starts: they inherit it
        if priority_warning:
            logger.warning(priority_warning)
        torch.set_num_threads(spec.torch_threads)
        self.spec = spec
        self.device = choose_device(spec.use_gpu)
        self.backend = choose_backend(spec.use_gpu)
        self.workload = load_workload(spec.workload.name, spec.workload.options)
        self.strategy = build_strategy(spec.strategy)
        self.build_optimizer = optimizer_factory(spec.optim, getattr(self.workload, "configure_optimizer", None))
        self.dataset = self.workload.train_dataset()
        training = spec.training
        self.runner = StepRunner(
            workload=self.workload, strategy=self.strategy,
            order=GlobalSampleOrder(len(self.dataset), training.global_batch_size, training.seed),
            micro_batch_size=training.micro_batch_size, device=self.device, optim=spec.optim,
            total_steps=training.steps, seed=training.seed, record_samples=training.record_samples,
            precision=training.precision, scaler=torch.amp.GradScaler("cuda") if training.precision == "fp16" else None,
            on_nonfinite=training.on_nonfinite)
        self.evaluator = Evaluator(self.workload, batch_size=spec.eval.batch_size, device=self.device,
                                   autocast=self.runner.autocast)
        self.state: TrainState | None = None
        self.step = 0
        self.checkpoint_group: dist.ProcessGroup | None = None
        self._pending_save: Future | None = None
        self._last_save: tuple[int, Future] | None = None
        self._lock = threading.Condition(threading.Lock())
        self._version = 0
        self._phase: Phase = "idle"
        self._results: list[StepResult] = []
        self._events: list[dict] = []
        self._evaluations: list[dict] = []
        self._error: str | None = None
        self._error_cause: ErrorCause | None = None
        self._step_started: float | None = None
        self._state_intact = True
        """False while (and after) a hand-over into this worker's state is incomplete."""
        self._stop_requested = threading.Event()
        self._thread: threading.Thread | None = None
        self._profiled = False
        gc.freeze()  # the collection at every new generation then only walks what came after (~0.4 s less)

    def pid(self) -> int:
        return os.getpid()

    def join(self, assignment: GroupAssignment) -> JoinReport:
        """Leave the old group and join generation ``assignment.generation``. A replicated strategy
        keeps its model and optimizer; a sharded one builds them afresh for the new group."""
        if self._thread is not None:
            self._thread.join(LOOP_EXIT_GRACE_S)  # a loop that stopped at a step boundary is ending anyway
            if self._thread.is_alive():
                abort_group()  # NCCL: the loop is stuck in the broken generation's collective; make it raise now
        self._wait_for_loop(timeout_s=assignment.timeout_s + LOOP_EXIT_GRACE_S)
        self._wait_for_save()
        self._last_save = None
        with self._lock:  # step results the Controller did not take before the last generation ended
            self._results = []
        keep = self.strategy.replicated and self.state is not None and self._state_intact
        previous = self.state.kept_across_groups() if keep else None
        if self.strategy.replicated and not self._state_intact:  # rebuilt from the seed below: a valid step-0 state
            self.step, self._state_intact = 0, True
        self.state, self.checkpoint_group = None, None
        gc.collect()  # the old DDP's reducer, its autograd hooks and its hold on the old group must be gone
        join_group(assignment, self.backend)
        self.checkpoint_group = dist.new_group(backend="gloo")  # async saves must not share the training group
        node_ids: list[str] = [""] * assignment.world_size
        dist.all_gather_object(node_ids, ray.get_runtime_context().get_node_id(), group=self.checkpoint_group)
        context = GroupContext(node_ids=tuple(node_ids), completed_steps=assignment.run_step)
        if previous is None:
            torch.manual_seed(self.spec.training.seed)  # identical initialisation on every rank
        self.state = self.strategy.setup(self._build_model, self.build_optimizer, self.device, previous, context)
        if self.spec.training.compile:
            self.state.wrapped = torch.compile(self.state.wrapped)
        if previous is None and not self.strategy.replicated:
            self.step = 0
        self._set_phase("idle")
        self._stop_requested.clear()
        return JoinReport(node_id=ray.get_runtime_context().get_node_id(), step=self.step)

    def sync_state(self, source_rank: int) -> int:
        """Replicated strategies: receive (or send, on ``source_rank``) model, optimizer and step. A receiver
        whose source is lost midway holds a mix of two states: it is never a source, and rebuilds at its next join."""
        receiving = dist.get_rank() != source_rank
        if receiving:
            self._state_intact = False
        self.step = broadcast_training_state(self.state.model, self.state.optimizer, self.step,
                                             source_rank=source_rank, device=self.device, scaler=self.runner.scaler)
        self._state_intact = True
        return self.step

    def restore(self, path: str | None, step: int) -> int:
        """Collective: load checkpoint ``path`` (saved at ``step``) resharded to this group."""
        if path is not None:
            init_optimizer_state(self.state.optimizer)
            flat = self.strategy.state_dict(self.state)
            load_into(flat, path, group=self.checkpoint_group)
            self.strategy.load_state_dict(self.state, flat)
            load_scaler(self.runner.scaler, path, group=self.checkpoint_group)
        self.step = step
        return self.step

    def train(self, until_step: int, faults: tuple[FaultConfig, ...] = ()) -> None:
        """Start the step loop in a thread; it runs until ``until_step``, a stop vote, or an error.

        ``faults`` are the injected faults aimed at this worker's rank in this generation.
        """
        self._wait_for_loop(timeout_s=0.0)
        self._set_phase("training")
        self._thread = threading.Thread(target=self._loop, args=(until_step, faults), name="step-loop",
                                        daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Vote to stop at a step boundary (the next vote's, ~actors.stop_vote.VOTE_PERIOD_S away);
        every rank stops after the same step."""
        self._stop_requested.set()

    def poll(self, wait_s: float = 0.0, seen: int = -1) -> WorkerStatus:
        """Phase, committed step and the step results since the last poll; waits up to ``wait_s``
        for news after version ``seen``."""
        with self._lock:
            self._lock.wait_for(lambda: self._version != seen, timeout=wait_s)
            results, self._results = self._results, []
            events, self._events = self._events, []
            evaluations, self._evaluations = self._evaluations, []
            running = None if self._step_started is None else time.monotonic() - self._step_started
            return WorkerStatus(self._phase, self.step, results, events, self._error, self._error_cause, evaluations,
                                self._version, running)

    def _set_phase(self, phase: Phase, error: str | None = None, cause: ErrorCause | None = None) -> None:
        """Only "failed" carries an error; every other phase clears it."""
        with self._lock:
            self._phase, self._error, self._error_cause = phase, error, cause
            self._announce()

    def _announce(self) -> None:
        """News for a waiting ``poll`` (call with the lock held)."""
        self._version += 1
        self._lock.notify_all()

    def save_checkpoint(self) -> str:
        """Collective: write this step's checkpoint now (unless the loop already did) and wait for it."""
        if self._last_save is not None and self._last_save[0] == self.step:
            try:
                return self._last_save[1].result()
            except BaseException:  # noqa: BLE001 - that save failed: write it again
                pass
        self._wait_for_save()
        return self._start_save(record=False).result()

    def full_state_dict(self, keep: bool = True) -> dict[str, torch.Tensor] | None:
        """Collective for sharded strategies: the model's full state on CPU, as a plain state dict. Every rank
        takes part in gathering the shards; only one (``keep``) returns the copy, so the Controller receives one."""
        full = {}
        for name, tensor in self.state.model.state_dict().items():
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if keep:
                full[name] = tensor.detach().cpu().clone()
        return full if keep else None

    def evaluate(self) -> dict[str, float]:
        """Collective: the workload's ``evaluate`` and its distributed ``eval_step`` metrics."""
        return self.evaluator.run(self.state.model)

    def memory(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds."""
        return memory_breakdown(self.state)

    def _build_model(self) -> torch.nn.Module:
        return self.workload.build_model().to(self.device)

    def _start_save(self, *, record: bool = True) -> Future:
        """Start this step's save; with ``record`` (a periodic save), rank 0 reports a "checkpointed" event when
        it completes, or "checkpoint_failed" with the cause: the run carries on and the next save tries again."""
        started, step, reporter = time.perf_counter(), self.step, record and dist.get_rank() == 0
        try:
            future = self.spec.checkpointer.save(
                step, {**self.strategy.state_dict(self.state), **scaler_entries(self.runner.scaler)},
                strategy=self.strategy.name,
                world_size=dist.get_world_size(), group=self.checkpoint_group)
        except CheckpointWriteError as error:  # every rank gets it: DCP gathers the ranks' write results
            future = Future()
            future.set_exception(error)

        def report(done: Future) -> None:
            if not reporter:
                return
            error = done.exception()
            event = ({"type": "checkpointed", "step": step, "path": done.result(),
                      "duration_s": round(time.perf_counter() - started, 4)} if error is None else
                     {"type": "checkpoint_failed", "step": step, "path": self.spec.checkpointer.directory(step),
                      "error": str(error)})
            with self._lock:
                self._events.append(event)
                self._announce()

        future.add_done_callback(report)
        self._pending_save = future
        self._last_save = (step, future)
        return future

    def _wait_for_save(self) -> None:
        """Let an async save in flight finish (or fail: its directory then has no manifest)."""
        if self._pending_save is not None:
            try:
                self._pending_save.result()
            except BaseException:  # noqa: BLE001 - reported by its callback; an incomplete checkpoint is never loaded
                pass
            self._pending_save = None

    def _loop(self, until_step: int, faults: tuple[FaultConfig, ...]) -> None:
        try:
            with self._profiler() as profiler:
                self._steps(until_step, faults, profiler)
        except BaseException as error:  # noqa: BLE001 - any failure is reported (DCP's errors are BaseExceptions)
            cause = "peer_lost" if is_peer_loss(error) else "job"
            self._set_phase("failed", f"{type(error).__name__}: {error}\n{traceback.format_exc()}", cause)
        finally:
            self._step_started = None

    def _steps(self, until_step: int, faults: tuple[FaultConfig, ...], profiler: Any) -> None:
        compiling = self.spec.training.compile
        vote = StopVote(first_step=self.step, device=self.device)
        batches = self.runner.batches(self.dataset, self.step, until_step, self.spec.data)
        eval_every = self.spec.eval.every_steps
        while self.step < until_step:
            for fault in faults:
                if fault.step == self.step + 1 and fault.action == "ray_kill":
                    self._set_phase("awaiting_kill")  # the Controller sees it and ray.kill()s this actor
                    threading.Event().wait()
                elif fault.step == self.step + 1:
                    fire(fault)
            step_index = self.step
            voting = vote.due(step_index)
            if voting:
                vote.open(step_index, stop=self._stop_requested.is_set())
            self._step_started = time.monotonic()
            result = self.runner.run(self.state, step_index, batches)
            self._step_started = None
            with self._lock:
                self.step = result.step
                self._results.append(result)
                if compiling:  # torch.compile compiles lazily, in the generation's first step
                    self._events.append({"type": "compiled", "step": self.step,
                                         "first_step_s": round(result.duration_s, 3)})
                    self._announce()
                    compiling = False
            # Only now: the optimizer has stepped, so a vote that fails (a peer lost since its gradients
            # arrived) must find the step counted, or the next generation would train this step again.
            stop = vote.close(step_index) if voting else False
            if profiler is not None:
                profiler.step()
            if self.spec.checkpointer.due(self.step):
                self._wait_for_save()
                self._start_save()
            if eval_every and self.step % eval_every == 0 and self.step < self.spec.training.steps:
                self._evaluate_periodically()  # every rank reaches this step: the last one is _finish's
            if stop:
                self._set_phase("stopped")
                return
        self._set_phase("finished")

    def _evaluate_periodically(self) -> None:
        metrics = self.evaluator.run(self.state.model)
        if dist.get_rank() == 0:
            with self._lock:
                self._evaluations.append({"step": self.step, "time": time.time(), **metrics})
                self._announce()

    def _profiler(self) -> contextlib.AbstractContextManager:
        """Rank 0 traces ``training.profile_steps`` steps once per run (after 1 wait + 1 warm-up step)."""
        steps = self.spec.training.profile_steps
        if not steps or self._profiled or dist.get_rank() != 0 or self.spec.profile_dir is None:
            return contextlib.nullcontext()
        self._profiled = True
        schedule = torch.profiler.schedule(wait=1, warmup=1, active=steps, repeat=1)
        return torch.profiler.profile(schedule=schedule,
                                      on_trace_ready=torch.profiler.tensorboard_trace_handler(self.spec.profile_dir))

    def _wait_for_loop(self, timeout_s: float) -> None:
        """Let the loop thread end; one still running after ``timeout_s`` is hung (in user code, or in a
        collective its peers left), and this worker cannot join another group beside it."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TrainingThreadHung(f"the training thread is still running {timeout_s:.0f}s after it was "
                                         f"asked to end (phase {self._phase}, step {self.step})")
            self._thread = None

class TrainingThreadHung(RuntimeError):
    """The step-loop thread did not end when asked: the Controller replaces this worker."""


TrainWorkerActor = ray.remote(TrainWorker)
