"""TrainWorker: one Ray actor per GPU or CPU slot, training in a thread of its own.

The actor outlives process-group generations: the Controller tells it to join generation g,
to hand over or receive state (in memory: from the most advanced rank for replicated strategies,
from the ranks' kept shards for sharded ones; or from a checkpoint), and to train up to a step.
Training runs in a thread so the actor keeps answering ``poll`` while it trains.

Lifecycle (each call from the Controller, on every member together)::

    worker.join(assignment)            -> JoinReport(step=committed steps, ..., shard_copies=what it kept)
    worker.sync_state(source_rank)     replicated state: the most advanced rank's goes to all
    worker.restore_from_peers(plan)    sharded state: from the shards the members kept (strategies/peer_restore.py)
    worker.restore(path | None)        sharded state: from a checkpoint (None: a fresh start)
    worker.train(until_step, faults)   starts the loop thread; returns at once
    worker.status.poll(wait_s, seen)   -> WorkerStatus(phase, step, new StepResults, events, error)

The worker keeps the group lifecycle and composes the rest, one job each: the step loop
(actors/worker/training_loop.py), the status mailbox ``status`` that the Controller polls
(actors/worker/mailbox.py, a long poll), the checkpoint saves (actors/worker/saver.py) and fault injection
(actors/faults/plan.py).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import io
import logging
import os
import threading
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from raylastic.actors.data.batch_split import BatchSplit
from raylastic.actors.data.compute_clock import ComputeClock
from raylastic.actors.data.order import GlobalSampleOrder
from raylastic.actors.faults.step_hooks import step_hooks
from raylastic.actors.processes.allocator import keep_freed_memory
from raylastic.actors.processes.priority import run_at_normal_priority
from raylastic.actors.processes.setup_hook import ProcessStart
from raylastic.actors.rendezvous.store import RayStore
from raylastic.actors.worker.actor import JoinReport, WorkerSpec
from raylastic.actors.worker.evaluation import Evaluator
from raylastic.actors.worker.mailbox import StatusMailbox
from raylastic.actors.worker.model_build import build_rank_model, model_limits
from raylastic.actors.worker.optimizer_recipe import optimizer_factory
from raylastic.actors.worker.pipeline_step import Pipeline
from raylastic.actors.worker.saver import AsyncSaver
from raylastic.actors.worker.step import StepRunner
from raylastic.actors.worker.training_loop import BalanceSettings, TrainingLoop
from raylastic.jobconfig import (
    FaultConfig,
)
from raylastic.strategies.base import GroupContext, TrainState, init_optimizer_state, load_scaler, memory_breakdown
from raylastic.strategies.buddy_copy import BuddyCopies, RegionBuddyCopies
from raylastic.strategies.build import build_strategy
from raylastic.strategies.checkpoint import Checkpointer, load_into, verify_for_load
from raylastic.strategies.emulated_link import EmulatedLink
from raylastic.strategies.group_assignment import GroupAssignment
from raylastic.strategies.group_connections import GroupConnections
from raylastic.strategies.loss_scaling import loss_scaler_for
from raylastic.strategies.model_parts import canonical_name
from raylastic.strategies.parallel_mesh import ParallelMesh, parallel_mesh
from raylastic.strategies.peer_restore import PeerRestorePlan
from raylastic.strategies.plain_objects import all_gather_plain, all_gather_tensors
from raylastic.strategies.process_group import choose_backend, choose_device, join_group, leave_group
from raylastic.strategies.region_copy import KeptRegions, keep_regions, restore_regions
from raylastic.strategies.region_plan import RegionCopy, RegionRestorePlan, RestoreTraffic
from raylastic.strategies.shard_copy import KeptShards, gather_shards, keep_shards, load_full_state
from raylastic.strategies.shard_layout import effective_replicas
from raylastic.workloads import load_workload

logger = logging.getLogger(__name__)


def _not_a_known_two_step_redistribution(record: logging.LogRecord) -> bool:
    """DTensor warns each time a redistribution over a 2-D mesh takes two collectives; under tensor parallelism
    with a data-parallel mesh every gradient-norm reduction and every gather of the final model does, by design."""
    return not record.getMessage().startswith("While redistributing from")


class TrainWorker:
    def __init__(self, spec: WorkerSpec) -> None:
        priority_warning = run_at_normal_priority()  # before any thread of ours starts: they inherit it
        if priority_warning:
            logger.warning(priority_warning)
        self.keeps_freed_memory = keep_freed_memory()
        """False where the user set malloc thresholds of their own, or the C library is not glibc."""
        torch.set_num_threads(spec.torch_threads)
        logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_not_a_known_two_step_redistribution)
        self.spec = spec
        self.device = choose_device(spec.use_gpu)
        self.backend = choose_backend(spec.use_gpu)
        self.rendezvous_stores: list[RayStore] = []
        """Every group's store, kept: a group holds only the C++ side of its Python store."""
        self.connections = GroupConnections()
        """The generation's gloo connections, shut down as it is left: nothing of it is left waiting."""
        self.workload = load_workload(spec.workload.name, spec.workload.options)
        self.strategy = build_strategy(spec.strategy, spec.parallel)
        replans = spec.parallel.model_parallel > 1 and spec.parallel.degrees == "preferred"
        self.model_limits = model_limits(self.workload, spec.workload) if replans else None
        """How far the model splits, for the Controller's re-plans (its JoinReports carry it)."""
        training = spec.training
        self.build_optimizer = optimizer_factory(
            spec.optim, getattr(self.workload, "configure_optimizer", None),
            skips_on_device=training.on_nonfinite == "skip" or training.precision == "fp16")
        dataset = self.workload.train_dataset()
        self.runner = StepRunner(
            workload=self.workload, strategy=self.strategy,
            order=GlobalSampleOrder(len(dataset), training.global_batch_size, training.seed),
            micro_batch_size=training.micro_batch_size, device=self.device, optim=spec.optim,
            total_steps=training.steps, seed=training.seed, record_samples=training.record_samples,
            precision=training.precision,
            scaler=(loss_scaler_for(spec.strategy.name, model_parallel=spec.parallel.model_parallel,
                                    device_type=self.device.type) if training.precision == "fp16" else None),
            on_nonfinite=training.on_nonfinite, clock=ComputeClock(self.device))
        self.link = EmulatedLink.of(spec.link)
        self.evaluator = Evaluator(self.workload, batch_size=spec.eval.batch_size, device=self.device,
                                   autocast=self.runner.autocast)
        self.status = StatusMailbox()
        self.saver = AsyncSaver(Checkpointer.of(spec.checkpointer), strategy=self.strategy, scaler=self.runner.scaler,
                                status=self.status)
        self.loop = TrainingLoop(runner=self.runner, dataset=dataset, evaluator=self.evaluator, saver=self.saver,
                                 status=self.status, device=self.device, training=training, data=spec.data,
                                 eval=spec.eval, profile_dir=spec.profile_dir, connections=self.connections,
                                 balance=BalanceSettings(enabled=spec.balance == "auto",
                                                         straggler_factor=spec.straggler_factor,
                                                         node_id=ray.get_runtime_context().get_node_id()))
        self.state: TrainState | None = None
        self.checkpoint_group: dist.ProcessGroup | None = None
        self._state_intact = True
        """False while (and after) a hand-over into this worker's state is incomplete."""
        self._generation: int | None = None
        self._leaving = threading.Lock()
        """Held while this worker leaves a group: a spare's ``leave`` may still wait on its last generation's
        thread when its next ``join`` comes (the actor takes calls concurrently)."""
        self._mesh: ParallelMesh | None = None
        """The generation's model-parallel mesh (parallel.tp > 1); None without model parallelism."""
        self._kept: list[KeptShards] = []
        """Sharded strategies: this worker's CPU copies of shards of an earlier generation's state."""
        self._kept_regions: list[KeptRegions] = []
        """Under model parallelism: this worker's CPU copy of its part of an earlier generation's state."""
        self._rank: int | None = None
        """This worker's rank in the current generation."""
        self.copies: BuddyCopies | None = None
        """Sharded strategies with one copy of the state: this generation's buddy exchange."""
        self._holds_run_state = False
        """Sharded strategies: the live state is the run's (restored, or trained), so the next join keeps it."""
        # The first optimizer (and DDP) imports torch._dynamo (~0.25 s on top of our modules): pay it here, not in
        # the first join, which every rank waits for (a warm spare's is on the failure path).
        importlib.import_module("torch._dynamo")
        gc.freeze()  # the collection at every new generation then only walks what came after (~0.4 s less)

    def pid(self) -> int:
        return os.getpid()

    def alive(self) -> bool:
        """Answers while another call runs: the Controller's liveness ping."""
        return True

    def process_start(self) -> ProcessStart:
        return ProcessStart.of_this_process()

    def join(self, assignment: GroupAssignment) -> JoinReport:
        """Leave the old group and join generation ``assignment.generation``. A replicated strategy
        keeps its model and optimizer; a sharded one builds them afresh for the new group."""
        with self._leaving:
            previous = self._leave(assignment.timeout_s)
        store = RayStore(assignment.store, timeout=timedelta(seconds=assignment.timeout_s))
        self.rendezvous_stores.append(store)
        store.num_keys()  # this process's connection to the run's keys, opened before the groups' are looked for
        with self.connections.forming():  # every group of the generation: the mesh's and the strategy's too
            join_group(assignment, self.backend, store, self.connections)
            self._generation, self._rank = assignment.generation, assignment.rank
            self._mesh = parallel_mesh(self.device, assignment.layout) if assignment.layout is not None else None
            self.runner.layout = self.evaluator.layout = assignment.layout
            timeout = timedelta(seconds=assignment.timeout_s)
            self.checkpoint_group = dist.new_group(backend="gloo", timeout=timeout)  # async saves: not training's
            copies_group = (dist.new_group(backend="gloo", timeout=timeout) if self._keeps_buddy_copies(assignment)
                            else None)
            node_ids = all_gather_plain(ray.get_runtime_context().get_node_id(), group=self.checkpoint_group)
            context = GroupContext(node_ids=tuple(node_ids), completed_steps=assignment.run_step, mesh=self._mesh)
            if previous is None:
                torch.manual_seed(self.spec.training.seed)  # identical initialisation on every rank
            self.state = self.strategy.setup(self._build_model, self.build_optimizer, self.device, previous, context)
        self.runner.pipeline = Pipeline.for_generation(
            self.state.model, self._mesh, self.spec.parallel, device=self.device,
            loss=getattr(self.workload, "pipeline_loss", None), global_batch_size=self.spec.training.global_batch_size,
            seed=self.spec.training.seed, scale=self.runner.scaler.scale if self.runner.scaler is not None else None)
        self.evaluator.pipeline = self.runner.pipeline
        if self.spec.training.compile:
            self.state.wrapped = torch.compile(self.state.wrapped)
        self.runner.clock.attach(self.state.model)
        self.saver.attach(self.state, self.checkpoint_group, assignment.layout)
        if copies_group is not None:
            self.copies = (RegionBuddyCopies(group=copies_group, layout=assignment.layout, rank=assignment.rank,
                                             generation=assignment.generation, timeout_s=assignment.timeout_s)
                           if assignment.layout is not None else
                           BuddyCopies(group=copies_group, layout=self.state.layout, generation=assignment.generation,
                                       timeout_s=assignment.timeout_s))
        if previous is None and not self.strategy.replicated:
            self.status.step = 0
        self.status.set_phase("idle")
        self.loop.forget_stop_request()
        return JoinReport(node_id=ray.get_runtime_context().get_node_id(), step=self.status.step,
                          shard_copies=tuple(kept.copy for kept in self._kept),
                          region_copies=tuple(kept.copy for kept in self._kept_regions),
                          model_limits=self.model_limits, store_calls=store.calls)

    def leave(self, collective_timeout_s: float) -> tuple[RegionCopy, ...]:
        """Leave the current group without joining another (a spare again: a generation's layout left this worker
        out). Its peers blocked in a collective with it fail now instead of at the collective timeout. Returns the
        parts of the state it keeps (``kept_part`` hands one over)."""
        with self._leaving:
            self._leave(collective_timeout_s)
            leave_group(self.connections)
            return tuple(kept.copy for kept in self._kept_regions)

    def kept_part(self, copy: RegionCopy) -> KeptRegions:
        """A spare's kept part ``copy``, for the member that sends it in a restore (through Ray's object store)."""
        return next(kept for kept in self._kept_regions if kept.copy == copy)

    def _leave(self, collective_timeout_s: float) -> TrainState | None:
        """End the current generation's work and let go of its state and groups; the state a replicated strategy
        carries into the next generation (None: it is built afresh)."""
        self.loop.leave(collective_timeout_s=collective_timeout_s)
        if self.loop.state_ahead_of_commit:  # updates past status.step, maybe from an aborted reduction
            self._state_intact = self._holds_run_state = False
        self.saver.detach()
        if self.copies is not None:
            self.copies.close()
        self.status.drop_results()  # step results the Controller did not take before the last generation ended
        self._keep_shards()
        self.copies = None
        keep = self.strategy.replicated and self.state is not None and self._state_intact
        previous = self.state.kept_across_groups() if keep else None
        if self.strategy.replicated and not self._state_intact:  # rebuilt from the seed below: a valid step-0 state
            self.status.step, self._state_intact = 0, True
        self.state, self.checkpoint_group, self._mesh = None, None, None
        self.runner.pipeline = self.evaluator.pipeline = None
        gc.collect()  # the old DDP's reducer, its autograd hooks and its hold on the old group must be gone
        return previous

    def _keeps_buddy_copies(self, assignment: GroupAssignment) -> bool:
        """Whether this generation's sharded state exists once (one copy: strategy.replicas 1, or a world size it
        does not divide; under model parallelism no data-parallel copies), so each rank's shard (its part) is also
        sent to its buddy after every step."""
        strategy, layout = self.spec.strategy, assignment.layout
        copies = (layout.dp_replicate if layout is not None
                  else effective_replicas(strategy.replicas, assignment.world_size))
        return not self.strategy.replicated and strategy.buddy_copy and assignment.world_size > 1 and copies == 1

    def _keep_shards(self) -> None:
        """Sharded strategies, before the state goes: keep this rank's shard of it in CPU memory, with the copies
        its buddy exchange holds (under model parallelism: its part, ``keep_regions``). A state that is not the
        run's (a join, then no restore) leaves the copies made before it, which are still the run's."""
        if self.strategy.replicated or self.state is None or not self._holds_run_state:
            return
        self._holds_run_state = False
        kept = self.copies.kept() if self.copies is not None else []
        if not any(k.copy.holder == "own" and k.copy.step == self.status.step for k in kept):
            try:
                live = (keep_regions(self.strategy, self.state, copy=RegionCopy(
                            generation=self._generation, layout=self._mesh.layout, rank=self._rank,
                            step=self.status.step)) if self._mesh is not None else
                        keep_shards(self.strategy, self.state, self.runner.scaler, generation=self._generation,
                                    step=self.status.step))
                kept += [live] if live is not None else []
            except Exception:  # noqa: BLE001 - a copy spares a checkpoint load; failing to make one must not end the run
                logger.warning("no copy of this rank's shard is kept for the next generation", exc_info=True)
        if self._mesh is not None:
            self._kept_regions = kept
        else:
            self._kept = kept

    def sync_state(self, source_rank: int) -> int:
        """Replicated strategies: receive (or send, on ``source_rank``) model, optimizer and step (the strategy's
        ``hand_over``; diloco merges every member's inner progress too). A receiver
        whose source is lost midway holds a mix of two states: it is never a source, and rebuilds at its next join."""
        receiving = dist.get_rank() != source_rank
        if receiving:
            self._state_intact = False
        self.status.step = self.strategy.hand_over(self.state, self.status.step, source_rank=source_rank,
                                                   device=self.device, scaler=self.runner.scaler)
        self._state_intact = True
        return self.status.step

    def restore(self, path: str | None, step: int) -> str | None:
        """Collective: load checkpoint ``path`` (saved at ``step``) resharded to this group, once its files' checksums
        are found intact (each rank compares a share). Returns why the checkpoint was refused (the same on every
        rank; nothing was loaded), or None."""
        if path is not None:
            refused = verify_for_load(path, group=self.checkpoint_group)
            if refused is not None:
                return refused
            init_optimizer_state(self.state.optimizer)
            flat = self.strategy.state_dict(self.state)
            load_into(flat, path, group=self.checkpoint_group)
            self.strategy.load_state_dict(self.state, flat)
            load_scaler(self.runner.scaler, path, group=self.checkpoint_group)
        self.status.step = step
        self._now_holds_run_state()
        return None

    def restore_from_peers(self, plan: PeerRestorePlan) -> int:
        """Collective, sharded strategies: rebuild the state of ``plan`` (``plan_peer_restore`` of the members'
        JoinReports) from the shards the members kept, resharded to this group; no file is read. Each shard is
        broadcast by its sender over the generation's gloo group; every rank holds the whole state in CPU
        memory meanwhile. Returns the step. A restore cut short leaves the kept copy for the next generation."""
        full = gather_shards(self._kept, plan, group=self.checkpoint_group)
        load_full_state(self.strategy, self.state, self.runner.scaler, full)
        self.status.step = plan.step
        self._now_holds_run_state()
        return self.status.step

    def restore_regions(self, plan: RegionRestorePlan, *delivered: KeptRegions) -> RestoreTraffic:
        """Collective, under model parallelism: lay the state of ``plan`` (``plan_region_restore`` of the members'
        JoinReports) out in this generation's layout from the parts the members kept, and the parts spares kept
        that were ``delivered`` to this rank, each rank receiving, point to point, only the regions it lacks; no
        file is read. Returns what this rank received."""
        traffic = restore_regions(self._kept_regions + list(delivered), plan, self.strategy, self.state,
                                  group=self.checkpoint_group)
        delivered_bytes = sum(tensor.numel() * tensor.element_size() for kept in delivered
                              for _, tensor in kept.parts.values())
        traffic = dataclasses.replace(traffic, bytes_received=traffic.bytes_received + delivered_bytes)
        self.status.step = plan.step
        self._now_holds_run_state()
        return traffic

    def _now_holds_run_state(self) -> None:
        """The live state is the run's from now on: copies kept from an earlier generation are obsolete once this
        generation's buddy exchange has made its own."""
        if (self._kept or self._kept_regions) and self.copies is not None:
            self.copies.inherited = self._kept or self._kept_regions
        self._kept, self._kept_regions, self._holds_run_state = [], [], True

    def train(self, until_step: int, faults: tuple[FaultConfig, ...] = (), shares: tuple[int, ...] | None = None
              ) -> None:
        """Start the step loop in a thread; it runs until ``until_step``, a stop vote, or an error.

        ``faults`` are the injected faults aimed at this worker's rank in this generation; ``shares`` how many
        of each step's samples every rank takes at first (None: even shares).
        """
        self.runner.split = BatchSplit(tuple(shares)) if shares else None
        self._now_holds_run_state()
        self.loop.start(self.state, until_step, step_hooks(faults, self.link), self.copies)

    def request_stop(self) -> None:
        """Vote to stop at a step boundary (the next vote's, ~actors.worker.stop_vote.VOTE_PERIOD_S away);
        every rank stops after the same step."""
        self.loop.request_stop()

    def request_checkpoint(self, number: int) -> None:
        """Vote for the time-based checkpoint ``number``: every rank saves after the same step, in the background."""
        self.loop.request_checkpoint(number)

    def save_checkpoint(self) -> str:
        """Collective: write this step's checkpoint now (unless the loop already did) and wait for it."""
        return self.saver.save_now(self.status.step)

    def full_state_dict(self, keep: bool = True) -> dict[str, torch.Tensor] | None:
        """Collective for sharded strategies: the model's full state on CPU, as a plain state dict. Every rank
        takes part in gathering the shards; only one (``keep``) returns the copy, so the Controller receives one.
        Under pipeline parallelism each stage's is gathered, then the stages' parts go to that one."""
        staged = self.runner.pipeline is not None
        full = {}
        for name, tensor in self.state.model.state_dict().items():
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if keep or staged:
                full[canonical_name(name)] = tensor.detach().cpu().clone()
        if staged:  # tensors as tensors, their names and shapes as JSON: nothing a peer sends is unpickled
            stages = all_gather_tensors(full, group=self.runner.pipeline.group, device=self.device)
            full = {name: tensor for stage in stages for name, tensor in stage.items()}
        return full if keep else None

    def full_model_file(self, keep: bool = True) -> bytes | None:
        """Collective for sharded strategies: ``full_state_dict`` as the bytes of its ``torch.save`` (model.pt's),
        so that it passes through the Controller, which imports no torch, without its tensors being unpickled
        there (cluster/run_dir.py's ``read_model_file`` reads it back in the driver)."""
        state = self.full_state_dict(keep)
        if state is None:
            return None
        file = io.BytesIO()
        torch.save(state, file)
        return file.getvalue()

    def evaluate(self) -> dict[str, float]:
        """Collective: the workload's ``evaluate`` and its distributed ``eval_step`` metrics."""
        return self.evaluator.run(self.state.model)

    def memory(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds, and of the buddy copies (host)."""
        return {**memory_breakdown(self.state), "buddy_copies": self.copies.host_bytes() if self.copies else 0}

    def _build_model(self) -> torch.nn.Module:
        return build_rank_model(self.workload, self.device, mesh=self._mesh,
                                activation_checkpointing=self.spec.training.activation_checkpointing)

