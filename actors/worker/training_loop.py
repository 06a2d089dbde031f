"""A worker's step loop, in a thread of its own so that the actor keeps answering ``poll`` while it trains.

Each step: the step hooks' work before it (injected faults: actors/faults/step_hooks.py), a stop vote when
one is due, the step itself, its result to the status mailbox once read from the device (every step since the
last read in one transfer, at training.log_every_steps, a vote, a save, an evaluation and the last step: between
them a step makes no host synchronisation; actors/worker/step.py), the buddy copy of the sharded state
(strategies/buddy_copy.py), the profiler, a periodic save and a periodic evaluation. The hang watchdog
(failure.max_step_s) sees the step and the work at its boundary, a save included. With
``balance`` on, each vote also hands every rank's compute rate to every rank, and the batch split
follows them (actors/data/balance.py): a new split takes effect at the step after the vote, on every rank.
The loop ends at ``until_step`` ("finished"), after a stop vote ("stopped") or on an error ("failed",
with its cause)::

    loop = TrainingLoop(runner=runner, dataset=dataset, evaluator=evaluator, saver=saver, status=status,
                        device=device, training=spec.training, data=spec.data, eval=spec.eval,
                        balance=BalanceSettings(enabled=True, straggler_factor=4.0, node_id=node))
    loop.start(state, until_step=100, hooks=step_hooks(faults, link))  # () unless faults or a link
    loop.request_stop()                 # every rank stops after the same step
    loop.leave(collective_timeout_s=60)  # before joining another group; raises TrainingThreadHung
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from raylastic.actors.data.balance import Balancer
from raylastic.actors.faults.step_hooks import StepHook
from raylastic.actors.status.peer_loss import is_peer_loss
from raylastic.actors.status.run import Event
from raylastic.actors.status.worker import StepResult
from raylastic.actors.worker.actor import TrainingThreadHung
from raylastic.actors.worker.evaluation import Evaluator
from raylastic.actors.worker.mailbox import StatusMailbox
from raylastic.actors.worker.saver import AsyncSaver
from raylastic.actors.worker.step import NonFiniteStep, ReadSteps, StepRunner, UnreadStep
from raylastic.actors.worker.stop_vote import CheckpointAsks, StopVote, stops_early
from raylastic.jobconfig import DataConfig, EvalConfig, TrainingConfig
from raylastic.strategies.base import TrainState
from raylastic.strategies.buddy_copy import BuddyCopies
from raylastic.strategies.group_connections import GroupConnections
from raylastic.strategies.process_group import abort_group, raise_if_aborted

LOOP_EXIT_GRACE_S = 5.0
"""Beyond the collective timeout: how long a leaving loop thread may take to give up on its peers."""


@dataclass(frozen=True)
class BalanceSettings:
    enabled: bool = False
    """scaling.balance=auto: the split follows the ranks' measured speeds."""
    straggler_factor: float = 4.0
    node_id: str = ""
    """This worker's node, named in its ``straggler`` event."""


class RateMeter:
    """Samples and compute seconds since the last vote: this rank's rate to cast."""

    def __init__(self) -> None:
        self.samples, self.compute_s = 0, 0.0

    def add(self, samples: int, compute_s: float) -> None:
        self.samples += samples
        self.compute_s += compute_s

    def take(self) -> float:
        rate = self.samples / self.compute_s if self.compute_s > 0 else 0.0
        self.samples, self.compute_s = 0, 0.0
        return rate


class TrainingLoop:
    def __init__(self, *, runner: StepRunner, dataset: Dataset, evaluator: Evaluator, saver: AsyncSaver,
                 status: StatusMailbox, device: torch.device, training: TrainingConfig, data: DataConfig,
                 eval: EvalConfig, profile_dir: str | None = None, balance: BalanceSettings = BalanceSettings(),
                 connections: GroupConnections | None = None) -> None:
        """``connections``: the generation's gloo connections, shut down when the thread is stuck in one of its
        collectives as the worker leaves."""
        self.runner = runner
        self.dataset = dataset
        self.evaluator = evaluator
        self.saver = saver
        self.status = status
        self.device = device
        self.training = training
        self.data = data
        self.eval = eval
        self.profile_dir = profile_dir
        """Where rank 0 writes its torch profiler trace when training.profile_steps > 0."""
        self.balance = balance
        self.connections = connections
        self._stop_requested = threading.Event()
        self.checkpoint_asks = CheckpointAsks()
        """The time-based checkpoints the Controller asked for, voted on with the stop."""
        self._thread: threading.Thread | None = None
        self._profiled = False
        self._unread: list[UnreadStep] = []
        """Steps trained (their optimizer stepped) whose results are not read from the device yet."""
        self._unread_from_nonfinite: list[UnreadStep] = []
        self.state_ahead_of_commit = False
        """The loop ended with steps trained but not committed (their read failed, or our NCCL abort ended one of
        their reductions): the live state holds updates past ``status.step``, and may hold one made from an
        aborted reduction, so it is no member's state to keep or send."""
        self._reading = threading.Lock()
        """Held while ``_unread`` is appended to or read: the loop's thread and ``report_now``'s caller both read."""

    def start(self, state: TrainState, until_step: int, hooks: Sequence[StepHook] = (),
              copies: BuddyCopies | None = None) -> None:
        """Start the thread; it trains ``state`` until ``until_step``, a stop vote, or an error. ``hooks``: the
        step hooks the job configures; ``copies``: the generation's buddy exchange of the sharded state (one
        each step)."""
        self.wait(timeout_s=0.0)
        self.status.set_phase("training")
        self._thread = threading.Thread(target=self._run, args=(state, until_step, hooks, copies),
                                        name="step-loop", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Vote to stop at a step boundary (the next vote's, ~actors.worker.stop_vote.VOTE_PERIOD_S away)."""
        self._stop_requested.set()

    def request_checkpoint(self, number: int) -> None:
        """Vote for the time-based checkpoint ``number`` (actors/controller/timed_checkpoints.py); every rank saves
        after the same step, in the background."""
        self.checkpoint_asks.asked = max(self.checkpoint_asks.asked, number)

    def forget_stop_request(self) -> None:
        self._stop_requested.clear()

    def leave(self, collective_timeout_s: float) -> None:
        """Before this worker leaves its group: let the thread end. One stuck in a collective of the broken
        generation is made to raise (``abort_group``) and has the collective timeout to give up on its peers; a
        thread that failed has the same done to its groups at once, so that nothing still in flight on them (a
        save, a buddy copy, a peer's collective waiting on this one) waits for the timeout."""
        if self._thread is not None:
            self._thread.join(LOOP_EXIT_GRACE_S)  # a loop that stopped at a step boundary is ending anyway
            if self._thread.is_alive() or self.status.phase == "failed":
                abort_group(self.connections)  # a broken generation: nothing in flight on its groups can end well
        self.wait(timeout_s=collective_timeout_s + LOOP_EXIT_GRACE_S)

    def wait(self, timeout_s: float) -> None:
        """Let the thread end; one still running after ``timeout_s`` is hung (in user code, or in a
        collective its peers left), and this worker cannot join another group beside it."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TrainingThreadHung(f"the training thread is still running {timeout_s:.0f}s after it was "
                                         f"asked to end (phase {self.status.phase}, step {self.status.step})")
            self._thread = None

    def _run(self, state: TrainState, until_step: int, hooks: Sequence[StepHook], copies: BuddyCopies | None
             ) -> None:
        try:
            with self._profiler() as profiler:
                self._steps(state, until_step, hooks, profiler, copies)
        except BaseException as error:  # noqa: BLE001 - any failure is reported (DCP's errors are BaseExceptions)
            error = self._report_after(error)
            cause = "peer_lost" if is_peer_loss(error) else "job"
            self.status.set_phase("failed", f"{type(error).__name__}: {error}\n"
                                  f"{''.join(traceback.format_exception(error))}", cause)

    def _report_after(self, error: BaseException) -> BaseException:
        """Report the steps trained before ``error`` and not read yet (they count: unless our NCCL abort ended one);
        the error to report: a non-finite step among them (training.on_nonfinite=fail) is the job's, not ``error``
        (a peer lost after it must not hand its state to a recovery)."""
        try:
            self._report_unread()
        except NonFiniteStep as nonfinite:
            nonfinite.__context__ = None  # not a peer loss (is_peer_loss follows the chain)
            return nonfinite
        except BaseException:  # noqa: BLE001 - the steps are not reported; ``error`` says why the loop ended
            self.state_ahead_of_commit = True
        return error

    def _steps(self, state: TrainState, until_step: int, hooks: Sequence[StepHook], profiler: Any,
               copies: BuddyCopies | None) -> None:
        status, compiling = self.status, self.training.compile
        strategy, scaler = self.runner.strategy, self.runner.scaler
        balancer = (Balancer(self.runner.current_split(), self.balance.straggler_factor)
                    if self.balance.enabled and dist.get_world_size() > 1 else None)
        vote = StopVote(first_step=status.step, device=self.device, share_rates=balancer is not None)
        meter = RateMeter()
        batches = self.runner.batches(self.dataset, status.step, until_step, self.data)
        step = status.step
        self._unread, self.state_ahead_of_commit = [], False
        if copies is not None:
            copies.start(strategy, state, scaler, step)  # the state this generation starts from
        while step < until_step:
            for hook in hooks:
                hook.before_step(step + 1)
            step_index = step
            voting = vote.due(step_index)
            if voting:
                vote.open(step_index, stop=self._stop_requested.is_set(), rate=meter.take(), asks=self.checkpoint_asks)
            with status.step_in_flight():
                unread = self.runner.train(state, step_index, batches, hooks,
                                           before_reduction=copies.finish if copies is not None else None)
            step = unread.result.step
            with self._reading:
                self._unread.append(unread)  # a failure from here on still reports it (_run, report_now)
            if compiling:  # torch.compile compiles lazily, in the generation's first step
                status.post_event(Event("compiled", step, details={"first_step_s": round(unread.result.duration_s, 3)}))
                compiling = False
            with status.step_in_flight():  # the hang watchdog sees the boundary's work too (a save on a dead mount)
                if copies is not None:
                    copies.start(strategy, state, scaler, step)
                stop = vote.close(step_index) if voting else False
                asked = voting and vote.checkpoint_due
                evaluating = self._evaluates_after(step)
                if (voting or evaluating or step == until_step or step % self.training.log_every_steps == 0
                        or self.runner.record_samples or self.saver.saves_after(step, asked=asked)):
                    for result in self._report_unread():  # before a save: a non-finite step fails the run
                        meter.add(result.samples, result.compute_s)
                if voting and balancer is not None and self._rebalance(balancer, vote.rates):
                    batches = self.runner.batches(self.dataset, step, until_step, self.data)
                if profiler is not None:
                    profiler.step()
                self.saver.after_step(step, asked=asked)
            if evaluating:
                self._evaluate_periodically(state)
            if stops_early(stop, step, until_step):
                status.set_phase("stopped")
                return
        status.set_phase("finished")

    def _evaluates_after(self, step: int) -> bool:
        """A periodic evaluation follows ``step`` (every rank reaches it; the last step's is _finish's)."""
        return bool(self.eval.every_steps) and step % self.eval.every_steps == 0 and step < self.training.steps

    def _report_unread(self) -> list[StepResult]:
        """Read the steps trained since the last read (one host read) and commit their results to the mailbox;
        raise NonFiniteStep for a non-finite one (training.on_nonfinite=fail), after committing those before it."""
        with self._reading:
            read = self._commit_unread()
        if read.nonfinite is not None:
            raise read.nonfinite
        return read.results

    def report_now(self) -> None:
        """On a CPU, commit the steps trained but not read yet: the Controller ends the generation and takes the
        results the mailbox holds, and a survivor blocked in a collective with a lost peer would otherwise keep
        them. Never waits: on a GPU the device may be stuck in that collective, and the steps are reported when the
        loop's thread fails; while the thread reads, its read reports them."""
        if self.device.type == "cuda" or not self._reading.acquire(blocking=False):
            return
        try:
            read = self._commit_unread()
            if read.nonfinite is not None:  # the loop's next read finds it again and fails the run
                self._unread[:0] = self._unread_from_nonfinite
        finally:
            self._reading.release()

    def _commit_unread(self) -> ReadSteps:
        """Read ``_unread`` (hold ``_reading``) and commit the results before the first non-finite step; the steps
        from that one on are kept in ``_unread_from_nonfinite``."""
        unread, self._unread = self._unread, []
        read = self.runner.read(unread)
        raise_if_aborted()  # NCCL: a reduction of these steps our abort ended may have returned as if complete
        for result in read.results:
            self.status.commit(result)
        self._unread_from_nonfinite = unread[len(read.results):]
        return read

    def _rebalance(self, balancer: Balancer, rates: tuple[float, ...]) -> bool:
        """Take a vote's rates; True when the split changes from the next step on (the same on every rank)."""
        decision = balancer.decide(rates)
        rank = dist.get_rank()
        if rank in decision.stragglers:
            others = statistics.median(r for i, r in enumerate(balancer.rates) if i != rank)
            self.status.post_event(Event("straggler", self.status.step, details={
                "rank": rank, "node_id": self.balance.node_id,
                "speed_vs_median": round(balancer.rates[rank] / others, 3)}))
        if decision.split is None:
            return False
        self.runner.split = decision.split
        if rank == 0:
            self.status.post_event(Event("shares_changed", self.status.step, details={
                "shares": list(decision.split.sizes), "rates": [round(r, 1) for r in balancer.rates]}))
        return True

    def _evaluate_periodically(self, state: TrainState) -> None:
        metrics = self.evaluator.run(state.model)
        if dist.get_rank() == 0:
            self.status.post_evaluation({"step": self.status.step, "time": time.time(), **metrics})

    def _profiler(self) -> contextlib.AbstractContextManager:
        """Rank 0 traces ``training.profile_steps`` steps once per run (after 1 wait + 1 warm-up step)."""
        steps = self.training.profile_steps
        if not steps or self._profiled or dist.get_rank() != 0 or self.profile_dir is None:
            return contextlib.nullcontext()
        self._profiled = True
        schedule = torch.profiler.schedule(wait=1, warmup=1, active=steps, repeat=1)
        return torch.profiler.profile(schedule=schedule,
                                      on_trace_ready=torch.profiler.tensorboard_trace_handler(self.profile_dir))
