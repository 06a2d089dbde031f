"""Training workers keep the memory a step frees for the next step, instead of handing it back to the OS.

A training step allocates and frees the same activations and gradients every step. glibc's malloc
adapts its thresholds to that (``M_MMAP_THRESHOLD`` rises to the largest block freed, up to 32 MiB, and
``M_TRIM_THRESHOLD`` follows at twice that), but not far enough for a training step: it keeps handing the
top of the heap back to the kernel and faulting it in again on the next step. The gpt recipe's step took
1,500-4,000 minor page faults and ~10% more time for it, and a secondary thread's arena, where a
TrainWorker's step loop runs, fares worse than the main thread's (tests/support/memory_churn.py's churn: no faults
a round in the main thread after a few rounds, thousands in another).

Setting both thresholds at the ceilings glibc's own adaptation would reach, from the start, removes
those faults in every thread: blocks under 32 MiB are reused from the heap, and up to 64 MiB of free
heap is kept. A user who sets a malloc threshold in the environment (``MALLOC_*_`` or
``GLIBC_TUNABLES``) keeps theirs; elsewhere than glibc (macOS, musl) this does nothing.

Example::

    keep_freed_memory()   # True when glibc took the settings
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""mallopt parameter numbers, from glibc's malloc.h."""

MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES
"""glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, and the trim threshold its adaptation pairs with it."""

USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds at their adaptive ceilings; False where not applied."""
    if any(name in os.environ for name in USER_SETTINGS) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    return all(mallopt(parameter, value) == 1 for parameter, value in
               ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)))


def _glibc_mallopt():
    """glibc's ``mallopt``, or None where the C library is not glibc."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    libc = ctypes.CDLL(libc_name)
    if not hasattr(libc, "gnu_get_libc_version"):
        return None
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt
