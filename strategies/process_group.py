"""One torch.distributed process group per generation, rendezvoused through the run's store.

The run has one rendezvous store (a ``RayStore`` over the Controller's ``RendezvousKeys`` actor,
actors/rendezvous/store.py: no port of its own, every operation over Ray's authenticated channel);
generation g's group uses the key prefix ``<store_prefix>/generation/g`` of it, so survivors can
leave a broken group and join the next one in the same process. ``store_prefix`` is random per run.

On GPUs the group is NCCL, set up so that a survivor outlives its peer (ProcessGroupNCCL.hpp,
torch 2.13): ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (CleanUpOnly) has the watchdog abort the
communicators on an error or a timeout and leave the process alive, so the survivor's next
collective raises (the default, 3 = SkipCleanUp, and 1 = TearDown kill the process);
``TORCH_NCCL_ENABLE_MONITORING=0`` turns off the heartbeat monitor, which would also kill a process
whose watchdog is stuck (the Controller's hang watchdog replaces a worker that stops answering);
``TORCH_NCCL_DUMP_ON_TIMEOUT=0`` so a timeout is not held up writing debug dumps. The group's
timeout is failure.collective_timeout_s. A thread blocked in a collective whose peer is gone is
released by ``abort_group`` (it then raises), which must come before that thread is joined. On CPUs the group is
gloo, whose collectives are ended by shutting down its connections (strategies/group_connections.py).
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from raylastic.strategies.group_assignment import GroupAssignment, generation_prefix
from raylastic.strategies.group_connections import GroupConnections

NCCL_RECOVERY_ENVIRONMENT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0",
                             "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
"""Read by ProcessGroupNCCL when a group is created: errors abort the communicators, not the process."""


def choose_device(use_gpu: bool) -> torch.device:
    """cuda:0 for a GPU worker (Ray sets CUDA_VISIBLE_DEVICES to its own GPU), else the CPU.

    Raises ValueError when a GPU was asked for and this process sees none: training on the CPU
    instead would be a silent, much slower, different run.
    """
    if not use_gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"scaling.use_gpu=true, but this worker sees no CUDA device (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, node "
            f"{os.uname().nodename}): install a CUDA build of torch on the GPU nodes, or set scaling.use_gpu=false")
    return torch.device("cuda", 0)


def choose_backend(use_gpu: bool) -> str:
    """NCCL for a GPU worker, gloo otherwise (ValueError as ``choose_device`` when there is no GPU)."""
    return "nccl" if choose_device(use_gpu).type == "cuda" else "gloo"


def join_group(assignment: GroupAssignment, backend: str, store: dist.Store,
               connections: GroupConnections | None = None) -> None:
    """Leave the current group (if any, shutting down ``connections``) and join the one of ``assignment.generation``
    through ``store`` (the run's; keep it referenced until this group is left: the group holds only its C++ side).
    Call it inside ``connections.forming()``, with the generation's other groups, where they are kept."""
    leave_group(connections)
    if "nccl" in backend:  # also "cpu:gloo,cuda:nccl"
        os.environ.update(NCCL_RECOVERY_ENVIRONMENT)
    prefix = generation_prefix(assignment.store_prefix, assignment.generation)
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=assignment.rank,
                            world_size=assignment.world_size, timeout=timedelta(seconds=assignment.timeout_s))


def abort_group(connections: GroupConnections | None = None) -> None:
    """Make a thread blocked in a collective of the current groups raise now instead of at the timeout (a peer
    is gone, or blocked itself): NCCL's are aborted; gloo's ``connections`` (kept as the groups formed) are shut
    down, which also releases the peers blocked on this process. Call it before joining that thread."""
    if not dist.is_initialized():
        return
    if _uses_nccl():
        dist.distributed_c10d._abort_process_group()
    elif connections is not None:
        connections.shut_down()


def leave_group(connections: GroupConnections | None = None) -> None:
    """Abort (NCCL: a hung collective must not be waited out) or destroy the current groups. A gloo group, destroyed,
    waits for its collectives in flight, and those waiting on a live peer end only when that peer's connections
    close: ``connections`` are shut down first, so none is left waiting. A group closes its connections only when
    its last reference goes: one a failed step's leftovers hold in a reference cycle goes with the garbage
    collection that follows."""
    if not dist.is_initialized():
        return
    nccl = _uses_nccl()
    abort_group(connections)
    if not nccl:
        dist.destroy_process_group()
        gc.collect()


def _uses_nccl() -> bool:
    return "nccl" in dist.get_backend()  # "nccl", or one backend per device type: "cpu:gloo,cuda:nccl"
