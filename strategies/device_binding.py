"""Which CUDA device a GPU worker binds: the GPU Ray assigned it, among all the GPUs of its node that it sees.

By default Ray narrows a GPU actor's ``CUDA_VISIBLE_DEVICES`` to its own GPU, so two workers on one node cannot
open each other's device and NCCL moves every byte between them through host memory instead of NVLink/PCIe P2P.
Ray Train gives every worker on a node the union of its workers' GPUs, once, before training
(ray/train/v2/_internal/callbacks/accelerators.py); that cannot serve an elastic run, whose joiner or replacement
arrives after its peers have initialised CUDA with the visible set they had. Our GPU workers are started instead
with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` in their runtime environment (``worker_runtime_env``,
actors/processes/setup_hook.py), under which Ray leaves ``CUDA_VISIBLE_DEVICES`` as the node's raylet had it
(``NvidiaGPUAcceleratorManager.set_current_process_visible_accelerator_ids``, Ray 2.60): every worker, whenever it
started, sees all the node's GPUs, and binds its own one (``torch.cuda.set_device``) through the id Ray assigned it
(``ray.get_gpu_ids()``: an index into the node's GPUs, or, where the node's ``CUDA_VISIBLE_DEVICES`` was set, one of
its entries: an index or a GPU UUID).

Nothing here touches CUDA: the decision is ``cuda_device_index``, a pure function::

    cuda_device_index(["2"], "0,2,3")            # -> 1: the second device this process sees
    cuda_device_index([3], None)                 # -> 3: the node's GPUs, all visible
"""

from __future__ import annotations

import os
from collections.abc import Sequence

NOSET_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
"""With "1" in a process's environment, Ray leaves its CUDA_VISIBLE_DEVICES alone when it places a GPU actor in it."""
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def cuda_device_index(assigned_ids: Sequence[str | int], visible_devices: str | None) -> int:
    """The CUDA device index (as this process numbers its devices) of the one GPU Ray assigned it.

    ``assigned_ids``: ``ray.get_gpu_ids()``; ``visible_devices``: this process's CUDA_VISIBLE_DEVICES (None: unset,
    every GPU of the node visible in Ray's numbering). Raises ValueError when not exactly one GPU is assigned, or
    when the assigned one is not among the visible devices (naming both).
    """
    if len(assigned_ids) != 1:
        raise ValueError(f"a GPU worker needs exactly one GPU assigned by Ray, got ray.get_gpu_ids()="
                         f"{list(assigned_ids)!r} ({VISIBLE_DEVICES}={visible_devices!r}); a worker runtime "
                         f"environment that sets {VISIBLE_DEVICES} narrows what Ray can map: leave it to the node")
    assigned = str(assigned_ids[0]).strip()
    if visible_devices is None:
        if not assigned.isdigit():
            raise ValueError(f"Ray assigned GPU {assigned!r}, which is no index, and {VISIBLE_DEVICES} is unset: "
                             f"cannot tell which device it is")
        return int(assigned)
    visible = [entry.strip() for entry in visible_devices.split(",") if entry.strip()]
    if assigned not in visible:
        raise ValueError(f"Ray assigned GPU {assigned!r}, which is not among this process's visible devices "
                         f"{VISIBLE_DEVICES}={visible_devices!r}")
    return visible.index(assigned)


def assigned_cuda_device_index() -> int:
    """``cuda_device_index`` of this Ray worker (0 outside a Ray worker: a process of its own sees its GPU first)."""
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        return 0
    return cuda_device_index(ray.get_gpu_ids(), os.environ.get(VISIBLE_DEVICES))
