"""Fault injection from configuration (``faults: [{action, rank, step}]``): each fault fires once per run;
a ``throttle`` slows its rank's steps from ``step`` to ``until_step``, in every generation it spans.

The Controller keeps the faults not yet fired (``FaultPlan``) and gives each worker those aimed at
its rank when a generation starts training; the worker's ``FaultInjector`` checks before each
step, as torchft's tests inject ``fail_at(rank, step)``. A fault fires while its step is in flight,
so the peers are left inside that step's collectives, as with a real crash. ``ray_kill`` is
executed by the Controller instead: the worker waits inside its step until ``ray.kill`` comes
(actors/worker_group/poller.py)::

    plan = FaultPlan(job.faults)                          # Controller
    worker.train.remote(until_step, plan.for_rank(rank))
    plan.disarm(failed_ranks={1}, step=29)                # after a failure: fired faults never fire again

    injector = FaultInjector(faults, on_ray_kill=announce)  # worker, per generation
    injector.before_step(30)                              # step loop: fires the faults of step 30
    injector.throttle_factor(30)                          # 1.0, or a throttle's factor while one is on
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Sequence

import ray

from raylastic.jobconfig import FaultConfig


class InjectedFault(RuntimeError):
    """Raised by the ``raise`` fault: an ordinary exception in one worker's step."""


class FaultPlan:
    """The run's injected faults that have not fired yet; pure bookkeeping for the Controller.

        plan = FaultPlan([FaultConfig(action="kill", rank=1, step=30)])
        plan.for_rank(1)                        # (FaultConfig(action='kill', rank=1, step=30),)
        plan.disarm(failed_ranks={1}, step=29)  # rank 1 died with step 30 in flight: its fault fired
        plan.for_rank(1)                        # ()
    """

    def __init__(self, faults: Sequence[FaultConfig]) -> None:
        self.pending: list[FaultConfig] = list(faults)

    def for_rank(self, rank: int) -> tuple[FaultConfig, ...]:
        """The pending faults aimed at ``rank`` of the generation about to train."""
        return tuple(f for f in self.pending if f.rank == rank)

    def disarm(self, failed_ranks: set[int], step: int) -> None:
        """After a failure at committed step ``step``: drop the faults of steps already begun (up to
        ``step + 1``, on every rank), and the first later one of each failed rank (it may have fired
        after the last step the Controller heard of). A throttle stays until its last step is committed."""
        throttles = [f for f in self.pending if f.action == "throttle" and (f.until_step or step + 1) > step]
        fired = [min((f for f in self.pending if f.rank == rank and f.step > step and f.action != "throttle"),
                     key=lambda f: f.step, default=None) for rank in failed_ranks]
        self.pending = throttles + [f for f in self.pending
                                    if f.step > step + 1 and f not in fired and f.action != "throttle"]


class FaultInjector:
    """The faults aimed at one worker's rank in one generation; the step loop calls ``before_step``."""

    def __init__(self, faults: Sequence[FaultConfig] = (), *, on_ray_kill: Callable[[], None]) -> None:
        self.faults = tuple(faults)
        self.on_ray_kill = on_ray_kill
        """Tells the Controller this worker waits to be killed (the worker's phase "awaiting_kill")."""

    def before_step(self, step: int) -> None:
        """Fire the faults of ``step`` (1-based), in their order; only ``raise`` returns (by raising)."""
        for fault in self.faults:
            if fault.step != step or fault.action == "throttle":
                continue
            if fault.action == "ray_kill":
                self._wait_for_ray_kill()
            else:
                fire(fault)

    def throttle_factor(self, step: int) -> float:
        """How many times its compute time step ``step`` (1-based) takes on this rank: 1.0 unless throttled."""
        return throttle_factor(self.faults, step)

    def _wait_for_ray_kill(self) -> None:
        """Never returns: the Controller sees the announcement and ray.kill()s this actor."""
        self.on_ray_kill()
        threading.Event().wait()


def throttle_factor(faults: Sequence[FaultConfig], step: int) -> float:
    """How many times its compute time step ``step`` (1-based) takes under ``faults``' throttles: 1.0 for none."""
    return max((f.factor for f in faults if f.action == "throttle" and f.active_at(step)), default=1.0)


def fire(fault: FaultConfig) -> None:
    """Carry out ``fault`` in this worker process (does not return for kill, stall, remove_node)."""
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "stall":
        # Sent to this thread: a SIGSTOP sent to the process is taken by its main thread, and the thread
        # that sent it runs on until the stop reaches it (long enough to finish and report a step).
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        threading.Event().wait()  # continued (SIGCONT), it stays hung, as a stalled step does
    elif fault.action == "raise":
        raise InjectedFault(f"injected fault at step {fault.step} on rank {fault.rank}")
    elif fault.action == "remove_node":
        _kill_own_raylet()


def _kill_own_raylet() -> None:
    node_id = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    if "node:__internal_head__" in node["Resources"]:
        raise InjectedFault("remove_node refused: this worker runs on the head node, removing it would end "
                            "the whole cluster")
    raylet = os.getppid()  # a Ray worker process is a child of its node's raylet
    with open(f"/proc/{raylet}/comm") as handle:
        if handle.read().strip() != "raylet":
            raise InjectedFault(f"remove_node: parent process {raylet} is not a raylet")
    os.kill(raylet, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)

