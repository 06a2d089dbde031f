"""A training step's allocation pattern in miniature, and the page faults it takes in a thread of its own.

Each round allocates and touches 30 tensors of 256 KiB to 4 MiB (about 50 MiB) and frees them all, as a
step does with its activations. In a secondary thread's glibc arena with glibc's default thresholds the
heap top is returned to the kernel after every round and faulted back in the next (thousands of minor
faults a round); with actors.processes.allocator.keep_freed_memory the heap is reused (next to none).
"""

from __future__ import annotations

import resource
import threading

import torch

SIZES = [1 << 16, 1 << 18, 3 << 18, 1 << 20, 1 << 17] * 6  # float32 elements


def page_faults_per_round(rounds: int = 6, warmup: int = 3) -> float:
    """Minor page faults of one round, averaged over ``rounds`` after ``warmup``, run in a new thread."""
    faults: list[int] = []

    def churn() -> None:
        for round_index in range(warmup + rounds):
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            tensors = [torch.empty(size).fill_(1.0) for size in SIZES]
            del tensors
            if round_index >= warmup:
                faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    thread = threading.Thread(target=churn)
    thread.start()
    thread.join(timeout=60)
    return sum(faults) / rounds
