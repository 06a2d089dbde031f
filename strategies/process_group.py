"""One torch.distributed process group per generation, rendezvoused through the Controller's store.

The Controller hosts a TCPStore for the whole run; generation g's group uses the key prefix
``generation/g`` of it, so survivors can leave a broken group and join the next one in the
same process without any port being bound again.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class GroupAssignment:
    """What the Controller hands a worker for one generation."""

    generation: int
    rank: int
    world_size: int
    store_host: str
    store_port: int
    timeout_s: float
    run_step: int = 0
    """Steps the run had committed when this generation was formed (the same on every rank)."""


def choose_backend(use_gpu: bool) -> str:
    """NCCL when the worker was given a GPU, gloo otherwise."""
    return "nccl" if use_gpu and torch.cuda.is_available() else "gloo"


def choose_device(use_gpu: bool) -> torch.device:
    # Ray sets CUDA_VISIBLE_DEVICES to the worker's own GPU, so it is always cuda:0 here.
    return torch.device("cuda", 0) if use_gpu and torch.cuda.is_available() else torch.device("cpu")


def join_group(assignment: GroupAssignment, backend: str) -> None:
    """Leave the current group (if any) and join the one of ``assignment.generation``."""
    leave_group()
    store = dist.TCPStore(assignment.store_host, assignment.store_port, is_master=False,
                          timeout=timedelta(seconds=assignment.timeout_s))
    dist.init_process_group(backend, store=dist.PrefixStore(f"generation/{assignment.generation}", store),
                            rank=assignment.rank, world_size=assignment.world_size,
                            timeout=timedelta(seconds=assignment.timeout_s))


def leave_group() -> None:
    """Abort (NCCL: a hung collective must not be waited out) or destroy the current group."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()


def host_store(host: str) -> dist.TCPStore:
    """The Controller's rendezvous store on ``host`` (a free port); it lives as long as the object."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
