"""Hooks into a worker's steps, installed only when the job configures what they emulate: injected faults
(``faults:``), a slow rank (the ``throttle`` fault) and a slow link (``link:``). A step without them runs
none of this code: ``step_hooks`` returns no hook. Ray is imported only by the faults that act through it: the
step imports this module, and runs where Ray is not installed (the device check's torch.distributed group).

A fault fires before its step, while the peers are already in it, so they are left inside that step's
collectives, as with a real crash (torchft's tests inject ``fail_at(rank, step)`` the same way)::

    hooks = step_hooks(faults, EmulatedLink.of(spec.link))    # the worker, per generation
    for hook in hooks:
        hook.before_step(30)                                  # the training loop: fires the faults of step 30
    runner.run(state, 29, batches, hooks=hooks)               # a throttle sleeps inside the step's compute;
                                                              # a slow link after its communication
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Sequence

from raylastic.actors.status.worker import StepResult
from raylastic.jobconfig import FaultConfig
from raylastic.strategies.emulated_link import EmulatedLink


class InjectedFault(RuntimeError):
    """Raised by the ``raise`` fault: an ordinary exception in one worker's step."""


class StepHook:
    """The points of a step a hook may act at; each does nothing unless a hook overrides it."""

    def before_step(self, step: int) -> None:
        """Before step ``step`` (1-based) begins on this rank."""

    def before_compute(self, step: int) -> None:
        """Inside the step, before its forward: what runs here counts as the step's compute."""

    def before_microbatch(self, step: int, microbatch: int) -> None:
        """Through a pipeline: inside the step's schedule, before this rank's stage runs ``microbatch``'s forward."""

    def after_step(self, result: StepResult) -> StepResult:
        """After the step's communication, before it is reported: the result to report."""
        return result


def step_hooks(faults: Sequence[FaultConfig], link: EmulatedLink | None) -> tuple[StepHook, ...]:
    """The hooks ``faults`` (those aimed at this rank in this generation) and ``link`` call for; () for none."""
    hooks: list[StepHook] = []
    if any(fault.action != "throttle" for fault in faults):
        hooks.append(FaultInjector(faults))
    if any(fault.action == "throttle" for fault in faults):
        hooks.append(Throttle(faults))
    if link is not None:
        hooks.append(SlowLink(link))
    return tuple(hooks)


class FaultInjector(StepHook):
    """Fires the faults aimed at this rank, each before its step."""

    def __init__(self, faults: Sequence[FaultConfig]) -> None:
        self.faults = tuple(fault for fault in faults if fault.action != "throttle")

    def before_step(self, step: int) -> None:
        """Fire the faults of ``step`` (those not aimed at a micro-batch), in their order; only ``raise`` returns
        (by raising)."""
        for fault in self.faults:
            if fault.step == step and fault.microbatch is None:
                fire(fault)

    def before_microbatch(self, step: int, microbatch: int) -> None:
        for fault in self.faults:
            if (fault.step, fault.microbatch) == (step, microbatch):
                fire(fault)


class Throttle(StepHook):
    """A slow rank: while a ``throttle`` is on, each step's compute takes ``factor`` times as long (a sleep
    of (factor - 1) times the last step's compute without it)."""

    def __init__(self, faults: Sequence[FaultConfig]) -> None:
        self.faults = tuple(fault for fault in faults if fault.action == "throttle")
        self._slept_s = 0.0
        self._unthrottled_compute_s = 0.0

    def before_compute(self, step: int) -> None:
        started = time.perf_counter()
        factor = throttle_factor(self.faults, step)
        if factor > 1:
            time.sleep((factor - 1) * self._unthrottled_compute_s)
        self._slept_s = time.perf_counter() - started

    def after_step(self, result: StepResult) -> StepResult:
        self._unthrottled_compute_s = max(0.0, result.compute_s - self._slept_s)
        return result


class SlowLink(StepHook):
    """An emulated slow link: a step that sent bytes ends with a sleep of what they would take on it."""

    def __init__(self, link: EmulatedLink) -> None:
        self.link = link

    def after_step(self, result: StepResult) -> StepResult:
        delay_s = self.link.delay_s(result.bytes_sent, messages=1 if result.bytes_sent else 0)
        if not delay_s:
            return result
        time.sleep(delay_s)
        return dataclasses.replace(result, duration_s=result.duration_s + delay_s,
                                   finished_at=result.finished_at + delay_s, link_delay_s=delay_s)


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
    elif fault.action == "ray_kill":
        _ray_kill_self()
    elif fault.action == "remove_node":
        _kill_own_raylet()


def _ray_kill_self() -> None:
    """Ray kills this actor from outside, as an operator's ``ray.kill`` would: a task asks for it; the step
    waits inside, its peers inside its collectives. The task's process skips the training imports, so the kill
    comes within a second, not after a worker's start-up."""
    import ray

    from raylastic.actors.processes.setup_hook import TRAINS_NOTHING

    kill = ray.remote(num_cpus=0)(_ray_kill)
    kill.options(runtime_env=TRAINS_NOTHING).remote(ray.get_runtime_context().current_actor)
    threading.Event().wait()


def _ray_kill(actor) -> None:
    import ray

    ray.kill(actor, no_restart=True)


def _kill_own_raylet() -> None:
    import ray

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

