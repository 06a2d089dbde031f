"""Telling a lost peer from an error of the job itself.

A collective fails on every survivor when a peer dies or hangs: that is recovered (the survivors
join the next generation). Anything else a worker raises - a bug or a NaN in the workload, CUDA
out of memory, a checkpoint that cannot be written - would fail again the same way on a
replacement, so it ends the run at once with its traceback.
"""

from __future__ import annotations

import re
import sys

PEER_LOSS_MARKERS = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "ProcessGroupNCCL",
                     "NCCL communicator", "Socket Timeout", "failed to recv, got 0 bytes")
"""What the collectives of torch 2.x raise when a peer is gone: gloo's errors are plain RuntimeErrors
that name its transport; NCCL's and the store's are DistErrors."""


def is_peer_loss(error: BaseException) -> bool:
    """True when ``error`` says a collective lost its peer (died, hung, aborted), not that the job is wrong."""
    dist = sys.modules.get("torch.distributed")  # imported wherever one of its errors was unpickled
    seen: set[int] = set()
    while error is not None and id(error) not in seen:  # DCP and Ray wrap the collective's error
        seen.add(id(error))
        if (dist is not None and isinstance(error, dist.DistError)) or any(m in str(error) for m in PEER_LOSS_MARKERS):
            return True
        error = error.__cause__ or error.__context__
    return False


def plain_error(error: BaseException) -> str:
    """``error`` as text without the terminal colour codes Ray puts in the errors it relays."""
    return re.sub(r"\x1b\[[0-9;]*m", "", str(error))
