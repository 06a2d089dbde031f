"""How an NCCL generation ends when something goes wrong: one abort, ours, bounded in time.

torch 2.13 offers two mechanisms that must not both act on a communicator. Its watchdog aborts the communicators
itself on an error or a timeout when ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is 1 or 2 (ProcessGroupNCCL.hpp:160-176:
``SHOULD_CLEAN_UP(a) (a != NoHandling && a != SkipCleanUp)``); ``_abort_process_group`` aborts every group of the
process at once, inside one ``ncclGroupStart/End`` so the communicators' aborts cannot deadlock each other
(distributed_c10d.py:2493-2506), and its note asks for the watchdog's handling off (distributed_c10d.py:2471-2474:
"this API should be used with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` turned off (i.e. set to 0)"). We follow the note,
as torchft's NCCL wrapper does (it aborts the process group itself under a timeout of its own):

- ``NCCL_RECOVERY_ENVIRONMENT`` sets the handling to 0 (NoHandling). The watchdog still detects an error and a
  collective past the group's timeout (failure.collective_timeout_s) and records it as the backend's error
  (``Backend.get_error()``, torch/_C/_distributed_c10d.pyi:350), but aborts nothing and ends no process;
  ``TORCH_NCCL_ENABLE_MONITORING=0`` keeps the heartbeat monitor, which would end the process, off too.
- ``NcclWatch`` reads those errors twice a second and, on the first, runs our abort: a generation broken by a lost
  peer or a hung collective ends here, at the same bound as before, through one mechanism.
- ``BoundedAbort`` runs ``_abort_process_group`` on a thread of its own and waits for it at most ``timeout_s``
  (before NCCL 2.25 ``ncclCommAbort`` blocks while a kernel of the communicator still runs): an abort that does not
  return leaves this process unfit to join another group, which ``leave_group`` reports.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

NCCL_RECOVERY_ENVIRONMENT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_ENABLE_MONITORING": "0",
                             "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
"""Read by ProcessGroupNCCL when a group is created: it reports errors and timeouts, our abort acts on them
(TORCH_NCCL_DUMP_ON_TIMEOUT=0: a timeout is not held up writing debug dumps)."""
WATCH_PERIOD_S = 0.5
ABORT_TIMEOUT_S = 30.0
"""How long an abort of the NCCL groups may take before this process is taken as unfit to go on."""

AbortStep = str
"""One step of an abort: "shut_down_gloo_connections" or "abort_nccl_groups"."""


def abort_steps(backend: str, *, has_connections: bool) -> tuple[AbortStep, ...]:
    """What aborting the current groups does, in order, for the default group's ``backend`` ("gloo", "nccl" or one
    backend per device type, "cpu:gloo,cuda:nccl"). The gloo connections (the side groups', and the gloo part of a
    mixed default group) go first: shutting them down cannot hang, and it releases the threads blocked on them
    (a background save, a buddy copy) here and at the peers while the NCCL abort may still take its time."""
    steps: list[AbortStep] = []
    if has_connections:
        steps.append("shut_down_gloo_connections")
    if "nccl" in backend:
        steps.append("abort_nccl_groups")
    return tuple(steps)


class AbortHung(RuntimeError):
    """The NCCL groups' abort did not return within its bound: this process cannot join another group."""


class BoundedAbort:
    """Runs ``abort`` (``_abort_process_group``) once per generation, on a thread of its own, waiting at most
    ``timeout_s`` for it; a later caller waits for the same abort."""

    def __init__(self, abort: Callable[[], None], *, timeout_s: float = ABORT_TIMEOUT_S) -> None:
        self._abort, self.timeout_s = abort, timeout_s
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.started = False
        """An abort began since ``forget``: a collective it ended may have returned as if it completed."""

    def forget(self) -> None:
        """A new generation's groups: none of them was aborted."""
        self.started = False

    def run(self) -> bool:
        """Abort (or join this generation's abort); True when it has returned, False when it is still running."""
        with self._lock:
            if not self.started:
                self.started = True  # before the abort: a collective it ends returns after this is seen
                self._thread = threading.Thread(target=self._run_abort, name="nccl-abort", daemon=True)
                self._thread.start()
            thread = self._thread
        thread.join(self.timeout_s)
        if thread.is_alive():
            logger.error("aborting the NCCL groups has not returned after %.0f s", self.timeout_s)
            return False
        return True

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run_abort(self) -> None:
        try:
            self._abort()
        except Exception:  # noqa: BLE001 - a group already gone, or one NCCL refuses to abort: the others are
            logger.warning("aborting the NCCL groups raised", exc_info=True)


@dataclass
class NcclWatch:
    """Watches the current generation's NCCL backends for the errors torch's watchdog records (a peer lost, a
    collective past its timeout) and calls ``on_error`` with the first, once, from a thread of its own.

    ``read_errors()`` returns the names of the backends' errors other than SUCCESS ("TIMEOUT", "COMM_ERROR",
    "REMOTE_ERROR"); an empty list while all is well."""

    read_errors: Callable[[], list[str]]
    on_error: Callable[[str], None]
    period_s: float = WATCH_PERIOD_S

    def __post_init__(self) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="nccl-watch", daemon=True)

    def start(self) -> NcclWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """No call to ``on_error`` begins after this returns (one in progress may still be running)."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.period_s + 1.0)

    def _watch(self) -> None:
        while not self._stopped.wait(self.period_s):
            try:
                errors = self.read_errors()
            except Exception:  # noqa: BLE001 - groups being made or aborted meanwhile: read them at the next turn
                continue
            if errors and not self._stopped.is_set():
                self._stopped.set()
                self.on_error(", ".join(errors))
                return
