"""Run a function on N local processes sharing one gloo process group (no Ray), with a timeout.

Processes start with the "forkserver" method, torch and the project's strategies preloaded: the
first group of a pytest session pays those imports once, in the fork server, and every rank
forks from it ready to run (with "spawn" every rank imports torch again: 10+ s per group on a
loaded 2-core machine). The group
rendezvous through a FileStore in a fresh temporary directory. Results travel back as bytes
(torch.save), not as shared-memory tensors, so a rank may exit as soon as it has put them.

When a rank fails, the error names every rank's end, the cause first: a rank that died (a signal,
with its stderr: the faulting thread's native stack, every thread's Python stack) or raised comes
before the ranks that only lost it as a peer (gloo's "Connection reset by peer").

Example::

    def _rank_main(n):                     # module level: the ranks import it
        t = torch.full((n,), float(dist.get_rank()))
        dist.all_reduce(t)
        return t

    results = run_distributed(_rank_main, 3, 4)   # [tensor of 3.0s] * 3, one per rank
"""

from __future__ import annotations

import faulthandler
import io
import os
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "raylastic.strategies", "ray", "pytest",
           "tests.support.strategy_runs", "tests.support.parallel_runs")
"""Imported once by the fork server (a failing import is skipped), not again in every rank: torch._dynamo is what
a rank's first optimizer imports (~2 s of CPU), ray and pytest what the ranks' modules import (~0.5 s), the two
support modules hold most of the suite's rank functions."""
GRACE_S = 10.0
"""After the first failure, how long the other ranks have to report theirs before they are killed."""
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Socket closed")
"""gloo's errors in a rank whose peer went first: such a rank is listed after the peer's own end."""
STDERR_TAIL_CHARS = 12_000


@dataclass(frozen=True)
class _Outcome:
    """How one rank ended: ``returned`` (``detail``: its value, torch.save bytes), ``raised`` (its traceback),
    ``died`` (the signal or exit code, its stderr), ``running`` (when the others were done or failed)."""

    status: Literal["returned", "raised", "died", "running"]
    detail: Any

    @property
    def order(self) -> int:
        """Causes first, then the ranks that only lost a peer, then the rest."""
        if self.status == "raised" and any(text in self.detail for text in PEER_LOST):
            return 1
        return {"died": 0, "raised": 0, "running": 2, "returned": 3}[self.status]


def run_distributed(function: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0,
                    start_method: str = "forkserver") -> list[Any]:
    """``function(*args)`` on every rank of a fresh gloo group; its return values by rank.

    Raises AssertionError naming every rank's end (the cause first) if a rank fails or dies,
    TimeoutError if the ranks are not all done within ``timeout_s``; the processes left are then killed.
    """
    context = mp.get_context(start_method)
    if start_method == "forkserver":  # takes effect when the server starts: at the session's first call
        context.set_forkserver_preload([*PRELOAD, function.__module__])
    results: Any = context.Queue()
    with tempfile.TemporaryDirectory(prefix="raylastic-harness-") as directory:
        processes = [context.Process(target=_rank_main,
                                     args=(function, rank, world_size, directory, args, results, timeout_s),
                                     daemon=True)
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        outcomes: dict[int, _Outcome] = {}
        try:
            outcomes = _collect(results, processes, timeout_s, directory)
        finally:
            done = len(outcomes) == world_size and all(o.status == "returned" for o in outcomes.values())
            for process in processes:
                process.join(timeout=5 if done else 0)  # on failure, don't wait for stragglers
                if process.is_alive():
                    process.kill()
                    process.join(timeout=5)
        failed = [rank for rank, outcome in outcomes.items() if outcome.status in ("raised", "died")]
        if failed:
            raise AssertionError(_report(f"ranks {sorted(failed)} of {world_size} failed", outcomes))
        running = [rank for rank, outcome in outcomes.items() if outcome.status == "running"]
        if running:
            raise TimeoutError(_report(f"ranks {running} not done after {timeout_s} s", outcomes))
    return [torch.load(io.BytesIO(outcomes[rank].detail), weights_only=False) for rank in range(world_size)]


def _collect(results: Any, processes: Sequence[Any], timeout_s: float, directory: str) -> dict[int, _Outcome]:
    """Every rank's outcome, in the order they came; after the first failure, GRACE_S more for the others."""
    deadline = time.monotonic() + timeout_s
    outcomes: dict[int, _Outcome] = {}
    while len(outcomes) < len(processes) and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.2)
            outcomes[rank] = _Outcome("returned" if ok else "raised", value)
        except queue.Empty:
            for rank, process in enumerate(processes):
                if rank not in outcomes and process.exitcode not in (None, 0):
                    outcomes[rank] = _Outcome("died", _death(rank, process.exitcode, directory))
        if any(outcome.status != "returned" for outcome in outcomes.values()):
            deadline = min(deadline, time.monotonic() + GRACE_S)
    for rank, process in enumerate(processes):
        if rank not in outcomes:  # gone without a word (exit code 0: only if ``function`` exits itself), or not done
            exitcode = process.exitcode
            outcomes[rank] = _Outcome("running", None) if exitcode is None else \
                _Outcome("died", _death(rank, exitcode, directory))
    return outcomes


def _report(headline: str, outcomes: dict[int, _Outcome]) -> str:
    parts = [f"{headline}; every rank's end, the cause first:"]
    for rank, outcome in sorted(outcomes.items(), key=lambda item: item[1].order):  # stable: in the order they came
        if outcome.status == "returned":
            parts.append(f"rank {rank} returned")
        elif outcome.status == "running":
            parts.append(f"rank {rank} still running (killed)")
        else:
            lost = " (only lost a peer)" if outcome.order == 1 else ""
            parts.append(f"rank {rank} {outcome.status}{lost}:\n{outcome.detail}")
    return "\n\n".join(parts)


def _death(rank: int, exitcode: int, directory: str) -> str:
    how = f"killed by {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exit code {exitcode}"
    path = Path(directory, f"rank{rank}.stderr")
    if not path.exists():
        return f"{how} before it started"
    # c10 printed every thread's native stack: keep the one of the thread that faulted (it went
    # through fatalSignalHandler), then faulthandler's Python stacks, and whatever else the rank wrote
    blocks = path.read_text(errors="replace").split("\n\n")
    kept = [block for block in blocks if "stacktraceSignalHandler" not in block or "fatalSignalHandler(" in block]
    return f"{how}; its stderr, the faulting thread's native stack and every thread's Python stack:\n" \
           + "\n\n".join(kept)[-STDERR_TAIL_CHARS:]


def _rank_main(function: Callable[..., Any], rank: int, world_size: int, directory: str, args: tuple,
               results: Any, timeout_s: float) -> None:
    torch.set_num_threads(1)  # N ranks share a couple of cores
    stderr = open(Path(directory, f"rank{rank}.stderr"), "w")  # open until the process ends
    os.dup2(stderr.fileno(), 2)  # C++ messages (gloo's) too, for the report if this rank dies
    faulthandler.enable(all_threads=True)  # a segfault in any thread (gloo's loop) dumps the Python stacks,
    torch._C._set_print_stack_traces_on_fatal_signal(True)  # after c10's native stacks (it chains to faulthandler)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(str(Path(directory, "store")), world_size),
                                rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
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
