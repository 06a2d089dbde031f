"""Sub-groups of the current process group that keep its timeout (failure.collective_timeout_s).

torch gives a group made by ``dist.new_group`` or ``init_device_mesh`` the backend's default timeout (30 min on
gloo, 10 on NCCL) unless told otherwise, so a pipeline send, a tensor-parallel all-reduce or a node's reduce
whose peer is stopped would wait that long instead of failing within the run's collective timeout. Every
sub-group our code makes goes through here.

Example (every rank of the current group, in the same order: ``new_group`` is collective over it)::

    node = sub_group([0, 1])          # ranks 0 and 1 only; every rank calls it
    group_timeout()                   # timedelta(seconds=30): the current group's, failure.collective_timeout_s
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


def group_timeout() -> timedelta:
    """The timeout the current (default) group was made with (``join_group``: failure.collective_timeout_s)."""
    default = dist.distributed_c10d._get_default_group()
    return default._get_backend(default._device_types[0]).options._timeout


def sub_group(ranks: list[int]) -> dist.ProcessGroup:
    """A group of the global ``ranks`` with the current group's timeout. Every rank of the current group calls it
    for every sub-group, member or not, in the same order."""
    return dist.new_group(ranks, timeout=group_timeout())
