"""CPU use of a benchmark's process tree while a run trains (Linux /proc), for benchmarks/throughput.py.

``CpuMeter`` samples every process below this one (Ray's and torchrun's too) and the machine 4 times a
second; ``CpuMeter.measurement`` splits a steady-state window's CPU into the rank processes, the rest of
the tree and everything outside it, per step.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Measurement:
    samples_per_s: float
    """Steady-state throughput: warm-up steps excluded."""
    wall_s: float
    """The whole run as the user waits for it: start-up, training, end-of-run save and evaluation."""
    other_cpu_s: float | None
    """CPU seconds that processes outside this benchmark used during the run (Linux): a shared machine's noise."""
    max_param_diff: float = 0.0
    """Largest |ours - torchrun| over the final parameters (torchrun rows only): same work, same result."""
    rank_cpu_ms_per_step: float | None = None
    """Steady state: CPU ms per step of the 2 rank processes together (Linux)."""
    support_cpu_ms_per_step: float | None = None
    """Steady state: CPU ms per step of the rest of this benchmark's process tree (ours: driver, Controller,
    Ray's services; torchrun's: its launcher and the idle Ray): on 2 cores that 2 ranks fill, theirs to lose."""
    other_cpu_ms_per_step: float | None = None
    """Steady state: CPU ms per step of the machine's other processes (a shared machine's noise)."""


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux; none elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc/stat").exists() else ():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) if entry.name.isdigit() else None
        except (OSError, IndexError):
            continue
        if parent is not None:
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


@dataclass(frozen=True)
class _CpuSample:
    at: float
    """time.time() of the sample."""
    by_pid: dict[int, float]
    """CPU seconds each process of the benchmark's tree used since the meter started (the sampler excluded)."""
    busy_s: float
    """The machine's busy CPU seconds since the meter started."""


class CpuMeter:
    """CPU use during a run, sampled 4 times a second: of each process of this benchmark's tree (this
    process and its descendants, Ray's too; processes ending meanwhile still count up to their last
    sample) and of the machine. ``measurement`` splits a time window's CPU into the rank processes (a
    command line holding ``rank_marker``, not torchrun's launcher), the rest of the tree ("support")
    and the processes outside it. The sampler thread's own CPU is left out. Linux only (None elsewhere)."""

    def __init__(self, rank_marker: str) -> None:
        self._rank_marker = rank_marker
        self._ranks: set[int] = set()
        self._first: dict[int, float] = {}
        self._busy_first = 0.0
        self._sampler_cpu_s = 0.0
        self.samples: list[_CpuSample] = []
        self._linux = Path("/proc/stat").exists()
        self._sample(first=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def measurement(self, samples_per_s: float, wall_s: float, steady_window: tuple[float, float] | None,
                    steady_steps: int) -> Measurement:
        """The run's Measurement; CPU per step over ``steady_window`` (time.time() at its ends)."""
        self._stop.set()
        self._thread.join()
        self._sample()
        per_step: dict[str, float | None] = {"rank": None, "support": None, "other": None}
        if self._linux and steady_window is not None and len(self.samples) >= 2:
            begin, end = (self._at(t) for t in steady_window)
            for kind in per_step:
                per_step[kind] = round(1000 * (end[kind] - begin[kind]) / steady_steps, 2)
        whole = self._split(self.samples[-1]) if self._linux else None
        return Measurement(round(samples_per_s, 1), round(wall_s, 2), round(whole["other"], 2) if whole else None,
                           rank_cpu_ms_per_step=per_step["rank"], support_cpu_ms_per_step=per_step["support"],
                           other_cpu_ms_per_step=per_step["other"])

    def _at(self, when: float) -> dict[str, float]:
        """CPU seconds by kind at ``when``, interpolated between the samples around it."""
        later = next((i for i, s in enumerate(self.samples) if s.at >= when), len(self.samples) - 1)
        before, after = self.samples[max(0, later - 1)], self.samples[later]
        share = 0.0 if after.at == before.at else min(1.0, max(0.0, (when - before.at) / (after.at - before.at)))
        a, b = self._split(before), self._split(after)
        return {kind: a[kind] + share * (b[kind] - a[kind]) for kind in a}

    def _split(self, sample: _CpuSample) -> dict[str, float]:
        rank = sum(cpu for pid, cpu in sample.by_pid.items() if pid in self._ranks)
        tree = sum(sample.by_pid.values())
        return {"rank": rank, "support": tree - rank, "other": sample.busy_s - tree}

    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            started = time.thread_time()
            self._sample()
            self._sampler_cpu_s += time.thread_time() - started

    def _sample(self, first: bool = False) -> None:
        """Records utime + stime of every process in our tree and the machine's busy CPU seconds."""
        if not self._linux:
            return
        tick = os.sysconf("SC_CLK_TCK")
        stats, children = {}, {}
        for entry in Path("/proc").iterdir():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split() if entry.name.isdigit() else None
            except (OSError, IndexError):
                continue
            if fields:
                stats[int(entry.name)] = fields
                children.setdefault(int(fields[1]), []).append(int(entry.name))
        previous = self.samples[-1].by_pid if self.samples else {}
        by_pid, todo = dict(previous), [os.getpid()]
        while todo:
            pid = todo.pop()
            if pid in stats:
                cpu = (int(stats[pid][11]) + int(stats[pid][12])) / tick
                if first:
                    self._first[pid] = cpu
                by_pid[pid] = cpu - self._first.get(pid, 0.0)
                if pid not in self._ranks and self._is_rank(pid):
                    self._ranks.add(pid)
            todo += children.get(pid, [])
        by_pid[os.getpid()] = by_pid.get(os.getpid(), 0.0) - self._sampler_cpu_s  # not the sampler's own CPU
        user, nice, system = (int(v) for v in Path("/proc/stat").read_text().split()[1:4])
        busy = (user + nice + system) / tick
        if first:
            self._busy_first = busy
        self.samples.append(_CpuSample(time.time(), by_pid, busy - self._busy_first))

    def _is_rank(self, pid: int) -> bool:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return False
        return self._rank_marker in command and "torch.distributed.run" not in command


