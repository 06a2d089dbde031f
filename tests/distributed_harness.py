"""Run a function on N local processes sharing one gloo process group (no Ray), with a timeout.

Processes start with the "forkserver" method, torch and the project's strategies preloaded: the
first group of a pytest session pays those imports once, in the fork server, and every rank
forks from it ready to run (with "spawn" every rank imports torch again: 10+ s per group on a
loaded 2-core machine). The group
rendezvous through a FileStore in a fresh temporary directory. Results travel back as bytes
(torch.save), not as shared-memory tensors, so a rank may exit as soon as it has put them.

Example::

    def _rank_main(n):                     # module level: the ranks import it
        t = torch.full((n,), float(dist.get_rank()))
        dist.all_reduce(t)
        return t

    results = run_distributed(_rank_main, 3, 4)   # [tensor of 3.0s] * 3, one per rank
"""

from __future__ import annotations

import io
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ("torch", "torch.distributed", "strategies")
"""Imported once by the fork server (a failing import is skipped): strategies pulls in DTensor, ~2 s."""


def run_distributed(function: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0,
                    start_method: str = "forkserver") -> list[Any]:
    """``function(*args)`` on every rank of a fresh gloo group; its return values by rank.

    Raises AssertionError with the rank's traceback if a rank fails or dies, TimeoutError if the
    ranks are not all done within ``timeout_s`` (the processes are then killed).
    """
    context = mp.get_context(start_method)
    if start_method == "forkserver":  # takes effect when the server starts: at the session's first call
        context.set_forkserver_preload([*PRELOAD, function.__module__])
    results: Any = context.Queue()
    with tempfile.TemporaryDirectory(prefix="raylastic-harness-") as directory:
        store_path = str(Path(directory) / "store")
        processes = [context.Process(target=_rank_main,
                                     args=(function, rank, world_size, store_path, args, results, timeout_s),
                                     daemon=True)
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        collected = None
        try:
            collected = _collect(results, processes, timeout_s)
        finally:
            for process in processes:
                process.join(timeout=5 if collected is not None else 0)  # on failure, don't wait for stragglers
                if process.is_alive():
                    process.kill()
                    process.join(timeout=5)
    return [torch.load(io.BytesIO(collected[rank]), weights_only=False) for rank in range(world_size)]


def _collect(results: Any, processes: Sequence[Any], timeout_s: float) -> dict[int, bytes]:
    deadline = time.monotonic() + timeout_s
    collected: dict[int, bytes] = {}
    while len(collected) < len(processes):
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            dead = [rank for rank, process in enumerate(processes)
                    if rank not in collected and process.exitcode not in (None, 0)]
            if dead:
                raise AssertionError(f"rank {dead[0]} died with exit code {processes[dead[0]].exitcode}") from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(processes))) - collected.keys())
                raise TimeoutError(f"ranks {missing} not done after {timeout_s} s") from None
            continue
        if not ok:
            raise AssertionError(f"rank {rank} failed:\n{value}")
        collected[rank] = value
    return collected


def _rank_main(function: Callable[..., Any], rank: int, world_size: int, store_path: str, args: tuple,
               results: Any, timeout_s: float) -> None:
    torch.set_num_threads(1)  # N ranks share a couple of cores
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        value = function(*args)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
        if dist.is_initialized():  # ``function`` may have left the group itself
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))


class FakeBucket:
    """A stand-in for ``dist.GradBucket``: ``buffer`` is the flat gradients of ``parameters``.

    Pass buckets to a hook in index order, 0 to ``bucket_count - 1``, as DDP does.

    Keep the same ``parameters`` objects from step to step: error feedback is keyed by parameter.
    """

    def __init__(self, index: int, parameters: list[torch.Tensor], buffer: torch.Tensor, *,
                 bucket_count: int = 1) -> None:
        assert buffer.numel() == sum(p.numel() for p in parameters) and 0 <= index < bucket_count
        self._index, self._parameters, self._buffer, self._count = index, parameters, buffer, bucket_count

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        """As DDP's: the last bucket of an iteration is the highest index (DDP runs 0, 1, ... in order)."""
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters

    def gradients(self) -> list[torch.Tensor]:
        views, offset = [], 0
        for parameter in self._parameters:
            views.append(self._buffer[offset:offset + parameter.numel()].view(parameter.shape))
            offset += parameter.numel()
        return views
