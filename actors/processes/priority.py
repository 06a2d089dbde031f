"""Training workers run at a normal process's CPU priority (niceness 0), as torchrun's ranks do, and so do the
Controller and the run's rendezvous store, which must answer first when a failure comes under load.

Ray starts its worker processes at niceness ``worker_niceness`` (15 by default) so that the raylet
and the GCS stay responsive beside CPU-hungry tasks. A training rank is not such a task: it owns the
CPU slot it reserved, and the whole step waits for the slowest rank's all-reduce. At niceness 15
every nice-0 process that wakes on a busy machine (the driver, the raylet, the GCS, the metrics
agent) takes the core from a rank first (what that costs: docs/cluster.md, "Worker priority").

Three ways to get there: the local instance ``raylastic train`` starts sets ``worker_niceness`` 0
(cluster/connect.py); clusters started with ``RAY_worker_niceness=0`` (cluster.yaml) do the same; and
otherwise a worker's process lowers its own niceness here, before it imports torch (the job's setup hook, the
worker actor): those imports take seconds of CPU, which at niceness 15 a busy node's other processes take first
(minutes, on a loaded 2-core machine). Linux keeps a niceness per thread, and new threads
inherit their creator's: so every thread the worker process has is lowered, and the threads it starts
later (the step loop, gloo's) follow. Lowering niceness needs root or CAP_SYS_NICE; without either
the worker keeps Ray's niceness and says how to start Ray so that it does not apply one. The Controller and the
rendezvous store lower theirs too: at 15 beside nice-0 ranks on busy cores, a set and a get took the store
77-87 ms against 5-6 ms at 0.

Example::

    warning = run_at_normal_priority()   # None, or why the process could not
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

NORMAL_NICENESS = 0


def run_at_normal_priority(role: str = "training worker") -> str | None:
    """Set every thread of this process to niceness 0 if it is higher; a warning naming ``role`` (what this process
    is) if not permitted."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current <= NORMAL_NICENESS:
        return None
    try:
        for thread_id in _thread_ids():
            with contextlib.suppress(ProcessLookupError):  # the thread ended since it was listed
                os.setpriority(os.PRIO_PROCESS, thread_id, NORMAL_NICENESS)
    except PermissionError:
        return (f"this {role} runs at niceness {current} (Ray's worker_niceness) and may not lower it (needs root "
                "or CAP_SYS_NICE): the ranks and Ray's own processes can take its core first. Start "
                "Ray with RAY_worker_niceness=0 in the environment of `ray start` (cluster.yaml does) for "
                "full speed")
    return None


def _thread_ids() -> list[int]:
    """This process's thread ids (Linux: /proc/self/task); elsewhere the process itself."""
    tasks = Path("/proc/self/task")
    return [int(entry.name) for entry in tasks.iterdir()] if tasks.is_dir() else [0]
