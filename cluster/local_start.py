"""Starting a local Ray instance on a machine too busy for Ray's start-up bound.

Ray's raylet aborts when its dashboard agent has not written its ports within 15 s (a loaded machine's Python
imports can take that long); ``ray.init`` then fails after 30 s with "The current node timed out during startup",
and the failed start's GCS server, dashboard and agents go on running. ``start_local_ray`` ends those processes
(the ones this call started, by pid) and starts again, at most ``START_ATTEMPTS`` times.

Example::

    start_local_ray(num_cpus=2, include_dashboard=False)   # as ray.init(address="local", ...)
"""

from __future__ import annotations

import warnings

import psutil
import ray

START_ATTEMPTS = 3
NODE_TIMED_OUT = "timed out during startup"
"""What Ray's exception says when the node it started did not come up."""


def start_local_ray(**init_options) -> None:
    """``ray.init(address="local", **init_options)``, started again when the node did not come up."""
    for attempt in range(1, START_ATTEMPTS + 1):
        before = _children()
        try:
            ray.init(address="local", **init_options)
            return
        except Exception as error:  # Ray raises a bare Exception for a node that did not come up
            if NODE_TIMED_OUT not in str(error):
                raise
            ray.shutdown()
            _end(_children() - before)
            if attempt == START_ATTEMPTS:
                raise RuntimeError(f"the local Ray instance did not come up in {START_ATTEMPTS} attempts ({error}); "
                                   "its raylet's log says why: /tmp/ray/session_latest/logs/raylet.out") from error
            warnings.warn(f"the local Ray instance did not come up (attempt {attempt} of {START_ATTEMPTS}: its "
                          "raylet gives up on agents slower than 15 s to start, as on a busy machine): starting it "
                          "again", RuntimeWarning, stacklevel=3)


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def _end(pids: set[int], timeout_s: float = 10.0) -> None:
    """Kill ``pids`` (processes a failed start left) and reap them."""
    processes = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            process.kill()
            processes.append(process)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=timeout_s)
