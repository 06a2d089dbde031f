"""CPU use of a benchmark's process tree while a run trains (Linux /proc), for benchmarks/throughput.py.

``CpuMeter`` samples every process below this one (Ray's and torchrun's too), the rank processes' threads and
the machine 4 times a second; ``CpuMeter.measurement`` splits a steady-state window's CPU into the rank
processes (and within them, each rank's training thread), the rest of the tree piece by piece
(``SUPPORT_PIECES``) and everything outside it, per step.
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
    support_cpu_ms_per_step_by_piece: dict[str, float] | None = None
    """Steady state: ``support_cpu_ms_per_step`` split by process (SUPPORT_PIECES; "driver": this process)."""
    training_thread_cpu_ms_per_step: float | None = None
    """Steady state: CPU ms per step of the ranks' training threads (each rank's busiest thread), together; the
    rest of ``rank_cpu_ms_per_step`` is the ranks' other threads (Ray's, gloo's, a stop vote's)."""
    training_thread_preemptions_per_step: float | None = None
    """Steady state: involuntary context switches per step of a rank's training thread (mean over the ranks):
    how often something else took its core."""


SUPPORT_PIECES = {
    "controller": ("ray::Controller",),
    "rendezvous store": ("ray::RendezvousKeys",),
    "ray services": ("gcs_server", "raylet", "ray-dashboard-", "dashboard.py", "monitor.py", "ray::DashboardAgent",
                     "ray::RuntimeEnvAgent", "multiprocessing"),
    "launcher": ("torch.distributed.run",),
    "idle Ray workers": ("ray::IDLE",),
}
"""A support process's piece: the first one a marker of which is in the name of its program (a Ray worker's title,
``ray::...``, once Ray has set it), its script or ``-c`` code, not in its options; "other Ray workers" if none
(a worker not titled yet); "driver": the benchmark's own process. An idle worker takes Ray's periodic wake-ups, and
a warm process of ours (actors/processes/setup_hook.py) its one-time import of torch and our modules."""
RECLASSIFIED = ("other Ray workers", "idle Ray workers")
"""Pieces looked at again at every sample: such a process may become a rank or another piece."""


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
    threads: dict[tuple[int, int], tuple[float, int]]
    """(rank pid, thread id) -> the thread's CPU seconds and involuntary context switches since it started."""


class CpuMeter:
    """CPU use during a run, sampled 4 times a second: of each process of this benchmark's tree (this
    process and its descendants, Ray's too; processes ending meanwhile still count up to their last
    sample) and of the machine. ``measurement`` splits a time window's CPU into the rank processes (a
    command line holding ``rank_marker``, not torchrun's launcher), the rest of the tree ("support")
    and the processes outside it. The sampler thread's own CPU is left out. Linux only (None elsewhere)."""

    def __init__(self, rank_marker: str) -> None:
        self._rank_marker = rank_marker
        self._ranks: set[int] = set()
        self._pieces: dict[int, str] = {}
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
        per_step: dict[str, float] | None = None
        threads: tuple[float, float] | None = None
        if self._linux and steady_window is not None and len(self.samples) >= 2:
            begin, end = (self._at(t) for t in steady_window)
            per_step = {kind: round(1000 * (end[kind] - begin.get(kind, 0.0)) / steady_steps, 2) for kind in end}
            threads = self._training_threads(steady_window, steady_steps)
        whole = self._split(self.samples[-1]) if self._linux else None
        pieces = {kind.removeprefix("support:"): value for kind, value in (per_step or {}).items()
                  if kind.startswith("support:")}
        return Measurement(round(samples_per_s, 1), round(wall_s, 2), round(whole["other"], 2) if whole else None,
                           rank_cpu_ms_per_step=per_step and per_step["rank"],
                           support_cpu_ms_per_step=per_step and per_step["support"],
                           other_cpu_ms_per_step=per_step and per_step["other"],
                           support_cpu_ms_per_step_by_piece=dict(sorted(pieces.items())) if per_step else None,
                           training_thread_cpu_ms_per_step=threads and threads[0],
                           training_thread_preemptions_per_step=threads and threads[1])

    def _training_threads(self, window: tuple[float, float], steps: int) -> tuple[float, float] | None:
        """The ranks' training threads (each rank's busiest in ``window``): their CPU ms per step together, and
        their involuntary context switches per step, mean over the ranks."""
        first = next((s for s in self.samples if s.at >= window[0]), None)
        last = next((s for s in reversed(self.samples) if s.at <= window[1]), None)
        if first is None or last is None or last.at <= first.at:
            return None
        busiest: dict[int, tuple[float, int]] = {}
        for (pid, tid), (cpu, switches) in last.threads.items():
            cpu_before, switches_before = first.threads.get((pid, tid), (0.0, 0))
            used = (cpu - cpu_before, switches - switches_before)
            if used > busiest.get(pid, (-1.0, 0)):
                busiest[pid] = used
        if not busiest:
            return None
        scale = (window[1] - window[0]) / (last.at - first.at) / steps  # the samples' span, stretched to the window
        return (round(1000 * scale * sum(cpu for cpu, _ in busiest.values()), 2),
                round(scale * sum(switches for _, switches in busiest.values()) / len(busiest), 1))

    def _at(self, when: float) -> dict[str, float]:
        """CPU seconds by kind at ``when``, interpolated between the samples around it."""
        later = next((i for i, s in enumerate(self.samples) if s.at >= when), len(self.samples) - 1)
        before, after = self.samples[max(0, later - 1)], self.samples[later]
        share = 0.0 if after.at == before.at else min(1.0, max(0.0, (when - before.at) / (after.at - before.at)))
        a, b = self._split(before), self._split(after)
        return {kind: a.get(kind, 0.0) + share * (b.get(kind, 0.0) - a.get(kind, 0.0)) for kind in a | b}

    def _split(self, sample: _CpuSample) -> dict[str, float]:
        split = {"rank": 0.0, "support": 0.0}
        for pid, cpu in sample.by_pid.items():
            if pid in self._ranks:
                split["rank"] += cpu
            else:
                split["support"] += cpu
                piece = f"support:{self._pieces.get(pid, 'other Ray workers')}"
                split[piece] = split.get(piece, 0.0) + cpu
        return split | {"other": sample.busy_s - split["rank"] - split["support"]}

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
                if pid not in self._ranks and self._pieces.get(pid, "other Ray workers") in RECLASSIFIED:
                    self._classify(pid)
            todo += children.get(pid, [])
        by_pid[os.getpid()] = by_pid.get(os.getpid(), 0.0) - self._sampler_cpu_s  # not the sampler's own CPU
        user, nice, system = (int(v) for v in Path("/proc/stat").read_text().split()[1:4])
        busy = (user + nice + system) / tick
        if first:
            self._busy_first = busy
        self.samples.append(_CpuSample(time.time(), by_pid, busy - self._busy_first, self._rank_threads(tick)))

    def _classify(self, pid: int) -> None:
        """A rank (its command line holds the rank marker) or a support process's piece (SUPPORT_PIECES); an
        unmarked Ray worker is looked at again at the next sample, in case it became one of them."""
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            return
        command = " ".join(argv)
        if self._rank_marker in command and "torch.distributed.run" not in command:
            self._ranks.add(pid)
        elif pid == os.getpid():
            self._pieces[pid] = "driver"
        else:
            names = [Path(arg).name for arg in argv[:4] if not arg.startswith("-")]  # program, script, module, code
            self._pieces[pid] = next((piece for piece, markers in SUPPORT_PIECES.items()
                                      if any(marker in name for marker in markers for name in names)),
                                     "other Ray workers")

    def _rank_threads(self, tick: int) -> dict[tuple[int, int], tuple[float, int]]:
        """CPU seconds and involuntary context switches of every thread of the rank processes (a thread that ended
        keeps its last values, as a process does)."""
        threads = dict(self.samples[-1].threads) if self.samples else {}
        for pid in self._ranks:
            for task in Path(f"/proc/{pid}/task").glob("*") if Path(f"/proc/{pid}").exists() else ():
                try:
                    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                    status = (task / "status").read_text()
                except (OSError, IndexError):
                    continue
                switches = next(int(line.split()[1]) for line in status.splitlines()
                                if line.startswith("nonvoluntary_ctxt_switches"))
                threads[(pid, int(task.name))] = ((int(fields[11]) + int(fields[12])) / tick, switches)
        return threads


