"""Steady-state samples/s of our 2-worker DDP job against the same job run by torchrun with plain DDP.

Both sides train the same workload class from the same seed on the same global sample order and
global batch (split evenly over 2 ranks), with AdamW(lr=1e-3), DDP on gloo (25 MiB buckets) and
1 torch thread per rank. Rounds alternate ours / torchrun (the order flips every round), all our
rounds share one local Ray instance, and steady state means: the first 20% of steps are warm-up,
throughput = samples of the remaining steps / the wall time between their step commits. One
unmeasured run of each side comes first, so that what a machine does only once (a freshly started
Ray's services settling, cold file caches) lands in neither side's figures. On a shared 2-core VM a
single round's ratio swings by +-15%: the figures are medians over rounds. Run from the repository
root (about 10 minutes on 2 cores)::

    python benchmarks/throughput.py                                   # digits and chargpt, 6 rounds
    python benchmarks/throughput.py --workload digits --rounds 10

Writes benchmarks/results/throughput.json and throughput.png. The peer is benchmarks/_torchrun_ddp.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import ray
import torch

from cluster.connect import ray_session
from cluster.job import train
from cluster.loading import load_job_config

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results"
PEER_SCRIPT = REPO_ROOT / "benchmarks" / "_torchrun_ddp.py"
NUM_WORKERS = 2
WARMUP_FRACTION = 0.2
DEFAULT_STEPS = {"digits": 4000, "chargpt": 300}
"""~10 s of steady state at ~2.5 ms and ~40 ms per torchrun step on one core per rank: shorter windows
leave a run's figure to whatever the shared machine did in those few seconds."""
GOAL_RATIO = 0.95


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


def steady_samples_per_s(commit_times_s: list[float], global_batch_size: int) -> float:
    """Samples/s between the commit of the last warm-up step and the commit of the last step."""
    first = max(1, int(len(commit_times_s) * WARMUP_FRACTION)) - 1
    if len(commit_times_s) - 1 - first < 1:
        raise ValueError(f"need more steps to measure a steady state, got {len(commit_times_s)}")
    elapsed = commit_times_s[-1] - commit_times_s[first]
    return (len(commit_times_s) - 1 - first) * global_batch_size / elapsed


def run_ours(workload: str, steps: int, global_batch_size: int, run_dir: Path) -> Measurement:
    job = load_job_config(None, [
        f"name=throughput-{run_dir.name}", f"workload.name={workload}", f"training.steps={steps}",
        f"training.global_batch_size={global_batch_size}", f"scaling.min_workers={NUM_WORKERS}",
        f"scaling.max_workers={NUM_WORKERS}", "scaling.cpus_per_worker=1", "checkpoint.every_steps=0",
        "checkpoint.resume=never"])
    started, cpu = time.perf_counter(), _CpuMeter()
    result = train(job, run_dir=run_dir)
    wall_s = time.perf_counter() - started
    assert [row["step"] for row in result.history] == list(range(1, steps + 1)), "a step was redone or lost"
    times = [row["time_s"] for row in result.history]  # each worker's wall clock at its step commit
    return Measurement(round(steady_samples_per_s(times, global_batch_size), 1), round(wall_s, 2), cpu.other_cpu_s())


def run_torchrun(workload: str, steps: int, global_batch_size: int, run_dir: Path) -> Measurement:
    out = run_dir / "peer.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
               str(NUM_WORKERS), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               str(PEER_SCRIPT), "--workload", workload, "--steps", str(steps),
               "--global-batch-size", str(global_batch_size), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH"))
                                                       if p)}
    started, cpu = time.perf_counter(), _CpuMeter()
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"torchrun peer failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads(out.read_text())
    samples_per_s = steady_samples_per_s(report["step_times_s"], global_batch_size)
    return Measurement(round(samples_per_s, 1), round(wall_s, 2), cpu.other_cpu_s())


def max_param_diff(ours_dir: Path, peer_dir: Path) -> float:
    ours = torch.load(ours_dir / "model.pt", weights_only=True)
    peer = torch.load(peer_dir / "peer.json.pt", weights_only=True)
    return max((ours[k] - peer[k]).abs().max().item() for k in ours)


class _CpuMeter:
    """CPU seconds that processes outside this benchmark use meanwhile: the machine's busy CPU minus
    that of this process and its descendants (Ray's too), sampled twice a second so that processes
    ending meanwhile still count. Linux only (None elsewhere)."""

    def __init__(self) -> None:
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._busy_start = self._sample(first=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            self._sample()

    def other_cpu_s(self) -> float | None:
        self._stop.set()
        self._thread.join()
        busy_end = self._sample()
        if busy_end is None or self._busy_start is None:
            return None
        ours = sum(cpu - self._first.get(pid, 0.0) for pid, cpu in self._last.items())
        return round(busy_end - self._busy_start - ours, 2)

    def _sample(self, first: bool = False) -> float | None:
        """Records utime + stime of every process in our tree; returns the machine's busy CPU seconds."""
        if not Path("/proc/stat").exists():
            return None
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
        todo = [os.getpid()]
        while todo:
            pid = todo.pop()
            if pid in stats:
                self._last[pid] = (int(stats[pid][11]) + int(stats[pid][12])) / tick
                if first:
                    self._first[pid] = self._last[pid]
            todo += children.get(pid, [])
        user, nice, system = (int(v) for v in Path("/proc/stat").read_text().split()[1:4])
        return (user + nice + system) / tick


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def benchmark(workload: str, steps: int, global_batch_size: int, rounds: int, scratch: Path) -> dict:
    ours: list[Measurement] = []
    peer: list[Measurement] = []
    for side, run in (("ours", run_ours), ("torchrun", run_torchrun)):  # warm-up: not measured
        run_dir = scratch / f"{workload}-{side}-warmup"
        run_dir.mkdir(parents=True)
        run(workload, steps, global_batch_size, run_dir)
        print(f"  {workload} warm-up run of {side} done", flush=True)
    for round_index in range(rounds):
        ours_dir, peer_dir = scratch / f"{workload}-ours-{round_index}", scratch / f"{workload}-peer-{round_index}"
        peer_dir.mkdir(parents=True)
        sides = [("ours", run_ours, ours_dir), ("torchrun", run_torchrun, peer_dir)]
        for side, run, run_dir in sides if round_index % 2 == 0 else sides[::-1]:  # flip order against drift
            measurement = run(workload, steps, global_batch_size, run_dir)
            (ours if side == "ours" else peer).append(measurement)
            print(f"  {workload} round {round_index + 1}/{rounds} {side:9s} "
                  f"{measurement.samples_per_s:9.0f} samples/s  (run {measurement.wall_s:.1f}s, "
                  f"other processes used {measurement.other_cpu_s} CPU s)", flush=True)
        peer[-1] = dataclasses.replace(peer[-1], max_param_diff=max_param_diff(ours_dir, peer_dir))
    ours_median = statistics.median(m.samples_per_s for m in ours)
    peer_median = statistics.median(m.samples_per_s for m in peer)
    round_ratios = [round(o.samples_per_s / p.samples_per_s, 4) for o, p in zip(ours, peer, strict=True)]
    paired = statistics.median(round_ratios)
    return {"workload": workload, "steps": steps, "warmup_steps": max(1, int(steps * WARMUP_FRACTION)),
            "global_batch_size": global_batch_size, "num_workers": NUM_WORKERS,
            "ours": [asdict(m) for m in ours], "torchrun": [asdict(m) for m in peer],
            "ours_median_samples_per_s": round(ours_median, 1),
            "torchrun_median_samples_per_s": round(peer_median, 1),
            "ratio_ours_over_torchrun": round(ours_median / peer_median, 4),
            "paired_ratio_median": round(paired, 4), "paired_ratios": round_ratios,
            "rounds_ours_faster": sum(r >= 1 for r in round_ratios),
            "meets_goal": ours_median / peer_median >= GOAL_RATIO}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.8), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        for x, (side, color) in enumerate([("ours", "tab:blue"), ("torchrun", "tab:gray")]):
            values = [m["samples_per_s"] for m in result[side]]
            ax.bar(x, statistics.median(values), color=color, alpha=0.8, width=0.6)
            ax.scatter([x] * len(values), values, color="black", s=12, zorder=3)
        ax.set_xticks([0, 1], ["Raylastic (Ray)", "torchrun + DDP"])
        ax.set_ylabel("samples/s (steady state)")
        ax.set_title(f"{result['workload']}, B={result['global_batch_size']}, 2 workers\n"
                     f"ours/torchrun = {result['ratio_ours_over_torchrun']:.3f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine_info() -> dict:
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
            "python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": _git_describe(),
            "command": shlex.join(["python", os.path.relpath(sys.argv[0], REPO_ROOT), *sys.argv[1:]])}


def _git_describe() -> str | None:
    done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["digits", "chargpt", "both"], default="both")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps per run (default per workload: {DEFAULT_STEPS})")
    parser.add_argument("--rounds", type=int, default=6, help="alternating ours/torchrun rounds (after a warm-up)")
    parser.add_argument("--global-batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    if args.rounds < 1 or (args.steps is not None and args.steps < 5) or args.global_batch_size < NUM_WORKERS:
        parser.error("need --rounds >= 1, --steps >= 5 and --global-batch-size >= 2")
    workloads = ["digits", "chargpt"] if args.workload == "both" else [args.workload]

    os.chdir(REPO_ROOT)  # Ray workers import the workloads from the current directory
    results = []
    with tempfile.TemporaryDirectory(prefix="raylastic-throughput-") as scratch, ray_session(min_cpus=NUM_WORKERS):
        for workload in workloads:
            steps = args.steps or DEFAULT_STEPS[workload]
            results.append(benchmark(workload, steps, args.global_batch_size, args.rounds, Path(scratch)))

    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "steady-state samples/s, Raylastic 2-worker DDP vs torchrun --nproc-per-node 2 plain DDP",
        "machine": machine_info(), "goal_ratio": GOAL_RATIO, "results": results,
        "method": {
            "warmup_fraction": WARMUP_FRACTION,
            "ours": "cluster.job.train, 2 workers x 1 CPU (1 torch thread), checkpoint only at the end; times "
                    "are the workers' step-commit wall clocks from RunResult.history; one Ray for all rounds "
                    "(its long polls: actors/watch.py LONG_POLL_S, cluster/job.py PROGRESS_WAIT_S)",
            "torchrun": "benchmarks/_torchrun_ddp.py: DDP(gloo, 25 MiB buckets), same seed, GlobalSampleOrder, "
                        "AdamW and loss scaling; no metrics all-reduce, rank 0 logs loss.item() of its slice; "
                        "times are rank 0's perf_counter after each optimizer step; the idle Ray stays up",
            "rounds": "one unmeasured warm-up run of each side, then rounds alternating, order flipped every "
                      "round; ratio: median ours / median torchrun; paired: the median over rounds of ours / "
                      "torchrun in the same round (less sensitive to a machine whose speed drifts between rounds)"},
    }
    (RESULTS / "throughput.json").write_text(json.dumps(payload, indent=1) + "\n")
    plot(results, RESULTS / "throughput.png")

    print(f"\n{'workload':9s} {'steps':>5s} {'B':>4s} {'ours samples/s':>15s} {'torchrun':>10s} {'ratio':>7s} "
          f"{'paired':>7s}")
    for r in results:
        print(f"{r['workload']:9s} {r['steps']:5d} {r['global_batch_size']:4d} "
              f"{r['ours_median_samples_per_s']:15.0f} {r['torchrun_median_samples_per_s']:10.0f} "
              f"{r['ratio_ours_over_torchrun']:7.3f} {r['paired_ratio_median']:7.3f}  (goal >= {GOAL_RATIO}; "
              f"ours faster in {r['rounds_ours_faster']} of {len(r['paired_ratios'])} rounds)")
    print(f"wrote {RESULTS / 'throughput.json'} and throughput.png")


if __name__ == "__main__":
    main()
