"""Fault injection from configuration (``faults: [{action, rank, step}]``), executed inside a worker.

The worker checks before each step; a fault fires while its step is in flight, so the peers are
left inside that step's collectives, as with a real crash. ``ray_kill`` is executed by the
Controller instead: the worker waits inside its step until ``ray.kill`` comes (actors/watch.py).
"""

from __future__ import annotations

import os
import signal

import ray

from jobconfig import FaultConfig


class InjectedFault(RuntimeError):
    """Raised by the ``raise`` fault: an ordinary exception in one worker's step."""


def fire(fault: FaultConfig) -> None:
    """Carry out ``fault`` in this worker process (does not return for kill, stall, remove_node)."""
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "stall":
        os.kill(os.getpid(), signal.SIGSTOP)
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
