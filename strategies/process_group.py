"""One torch.distributed process group per generation, rendezvoused through the run's store.

The run has one rendezvous store (a ``RayStore`` over the Controller's ``RendezvousKeys`` actor,
actors/rendezvous/store.py: no port of its own, every operation over Ray's authenticated channel);
generation g's group uses the key prefix ``<store_prefix>/generation/g`` of it, so survivors can
leave a broken group and join the next one in the same process. ``store_prefix`` is random per run.

On GPUs the group is NCCL, bound to this worker's own GPU (``choose_device``: strategies/device_binding.py) through
``device_id``, so torch forms its communicator at once and splits sub-groups from it (distributed_c10d.py:1741-1750,
2333-2335). A survivor outlives its peer: ``NCCL_RECOVERY_ENVIRONMENT`` leaves the errors and timeouts torch's
watchdog detects to our one abort (strategies/nccl_recovery.py), which ``abort_group`` runs, bounded in time, and
which a generation's ``NcclWatch`` runs on the first error the watchdog records. The group's timeout is
failure.collective_timeout_s. A thread blocked in a collective whose peer is gone is released by ``abort_group`` (it
then raises), which must come before that thread is joined. On CPUs the group is gloo, whose collectives are ended
by shutting down its connections (strategies/group_connections.py); on GPUs the side groups (checkpoints, buddy
copies) are gloo too, and their connections are shut down the same way.
"""

from __future__ import annotations

import gc
import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from raylastic.strategies.device_binding import VISIBLE_DEVICES, assigned_cuda_device_index
from raylastic.strategies.group_assignment import GroupAssignment, generation_prefix
from raylastic.strategies.group_connections import GroupConnections
from raylastic.strategies.nccl_recovery import (
    NCCL_RECOVERY_ENVIRONMENT,
    AbortHung,
    BoundedAbort,
    NcclWatch,
    abort_steps,
)

logger = logging.getLogger(__name__)

_nccl_abort = BoundedAbort(lambda: dist.distributed_c10d._abort_process_group())
"""The process's one abort of its NCCL groups (torch's groups are the process's: so is their abort)."""
_nccl_watch: NcclWatch | None = None
"""The current NCCL generation's watch (None on gloo, or between generations)."""


def choose_device(use_gpu: bool) -> torch.device:
    """For a GPU worker, the GPU Ray assigned it, made this process's current device (``torch.cuda.set_device``);
    else the CPU.

    Raises ValueError when a GPU was asked for and this process sees none: training on the CPU
    instead would be a silent, much slower, different run.
    """
    if not use_gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"scaling.use_gpu=true, but this worker sees no CUDA device (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda}; {VISIBLE_DEVICES}={os.environ.get(VISIBLE_DEVICES)!r}, node "
            f"{os.uname().nodename}): install a CUDA build of torch on the GPU nodes, or set scaling.use_gpu=false")
    device = torch.device("cuda", assigned_cuda_device_index())
    torch.cuda.set_device(device)  # before anything touches CUDA: its context, NCCL's and the allocator's go there
    return device


def choose_backend(use_gpu: bool) -> str:
    """NCCL for a GPU worker, gloo otherwise (ValueError as ``choose_device`` when there is no GPU)."""
    return "nccl" if choose_device(use_gpu).type == "cuda" else "gloo"


def join_group(assignment: GroupAssignment, backend: str, store: dist.Store,
               connections: GroupConnections | None = None) -> None:
    """Leave the current group (if any, shutting down ``connections``) and join the one of ``assignment.generation``
    through ``store`` (the run's; keep it referenced until this group is left: the group holds only its C++ side).
    Call it inside ``connections.forming()``, with the generation's other groups, where they are kept. An NCCL
    group is bound to the current CUDA device (``choose_device`` made it this worker's)."""
    global _nccl_watch
    leave_group(connections)
    nccl = "nccl" in backend  # also "cpu:gloo,cuda:nccl"
    if nccl:
        os.environ.update(NCCL_RECOVERY_ENVIRONMENT)
    _nccl_abort.forget()
    prefix = generation_prefix(assignment.store_prefix, assignment.generation)
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=assignment.rank,
                            world_size=assignment.world_size, timeout=timedelta(seconds=assignment.timeout_s),
                            device_id=torch.device("cuda", torch.cuda.current_device()) if nccl else None)
    if nccl:
        _nccl_watch = NcclWatch(read_errors=_nccl_errors,
                                on_error=lambda errors: _abort_on_error(errors, connections)).start()


def abort_group(connections: GroupConnections | None = None) -> None:
    """Make a thread blocked in a collective of the current groups raise now instead of at the timeout (a peer
    is gone, or blocked itself): gloo's ``connections`` (kept as the groups formed) are shut down, which also
    releases the peers blocked on this process, then NCCL's groups are aborted (``BoundedAbort``: at most
    nccl_recovery.ABORT_TIMEOUT_S). Call it before joining that thread."""
    if not dist.is_initialized():
        if _nccl_abort.in_flight:  # one the watch started: wait for it (bounded)
            _nccl_abort.run()
        return
    for step in abort_steps(dist.get_backend(), has_connections=connections is not None):
        if step == "shut_down_gloo_connections":
            connections.shut_down()
        elif step == "abort_nccl_groups":
            _stop_watch()
            _nccl_abort.run()


def raise_if_aborted() -> None:
    """Raise a DistError if this generation's NCCL groups were aborted: a collective the abort ended may have returned
    as if it had completed, and the step it belongs to must not step the optimizer or count. Call it after the
    step's reduction was waited for (its loss read), before the optimizer steps."""
    if _nccl_abort.started:
        raise dist.DistNetworkError("this generation's NCCL groups were aborted (a peer lost or a collective past "
                                    "failure.collective_timeout_s): the step in flight is discarded")


def leave_group(connections: GroupConnections | None = None) -> None:
    """Abort (NCCL: a hung collective must not be waited out) or destroy the current groups. A gloo group, destroyed,
    waits for its collectives in flight, and those waiting on a live peer end only when that peer's connections
    close: ``connections`` are shut down first, so none is left waiting. A group closes its connections only when
    its last reference goes: one a failed step's leftovers hold in a reference cycle goes with the garbage
    collection that follows. Raises AbortHung when the NCCL groups' abort has not returned in its bound."""
    _stop_watch()
    if not dist.is_initialized() and not _nccl_abort.in_flight:
        return
    nccl = dist.is_initialized() and _uses_nccl()
    abort_group(connections)
    if _nccl_abort.in_flight:
        raise AbortHung(f"aborting this worker's NCCL groups has not returned after {_nccl_abort.timeout_s:.0f} s: "
                        f"it cannot join another group")
    if not nccl and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _abort_on_error(errors: str, connections: GroupConnections | None) -> None:
    logger.warning("NCCL reported %s: aborting this generation's groups", errors)
    abort_group(connections)


def _nccl_errors() -> list[str]:
    """The errors torch's watchdog recorded on this process's NCCL groups (names of ErrorType other than SUCCESS)."""
    if not dist.is_nccl_available():
        return []
    errors = []
    for group in list(dist.distributed_c10d._world.pg_names):
        backend = group._get_backend(torch.device("cuda"))
        if isinstance(backend, dist.ProcessGroupNCCL):
            error = backend.get_error().name
            if error != "SUCCESS":
                errors.append(error)
    return errors


def _stop_watch() -> None:
    global _nccl_watch
    if _nccl_watch is not None:
        _nccl_watch.stop()
        _nccl_watch = None


def _uses_nccl() -> bool:
    return "nccl" in dist.get_backend()  # "nccl", or one backend per device type: "cpu:gloo,cuda:nccl"
