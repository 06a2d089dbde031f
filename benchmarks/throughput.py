"""Steady-state samples/s of our 2-worker DDP job against the same job run by torchrun with plain DDP.

Both sides read one job config, so they train the same workload from the same seed on the same global
sample order and global batch (split evenly over 2 ranks), with the same recipe, DDP on gloo (25 MiB
buckets) and 1 torch thread per rank. digits (an MLP) and chargpt (a GPT without dropout) train on
in-memory tensors with AdamW(lr=1e-3); gpt is the GPT recipe: workloads.gpt.TokenGPT with dropout
over a memory-mapped token file (a slice of the stdlib's source, tokenized into the scratch
directory), AdamW in two param groups (its configure_optimizer), warm-up + cosine lr, global-norm
clipping at 1.0 and bf16 autocast (on this AVX512-BF16 CPU ~0.6x the fp32 step time), fetched by a
torch DataLoader on both sides. Rounds alternate ours / torchrun (the order flips every round), all
our rounds share one local Ray instance, and steady state means: the first 20% of steps are warm-up,
throughput = samples of the remaining steps / the wall time between their step commits. One
unmeasured run of each side comes first, so that what a machine does only once (a freshly started
Ray's services settling, cold file caches) lands in neither side's figures. On a shared 2-core VM a
single round's ratio swings by +-15%: the figures are medians over rounds. Every run also records
the CPU seconds of its rank processes and of the rest of the benchmark's process tree (ours: the
driver, the Controller and Ray's services; torchrun's: its launcher and the idle Ray). Run from the
repository root (about 12 minutes on 2 cores)::

    python -m benchmarks.throughput --rounds 3                        # digits, chargpt and gpt
    python -m benchmarks.throughput --workloads gpt digits --rounds 6
    python -m benchmarks.throughput --rounds 3 --peer-allocator ours  # the peer keeps freed memory too
    python -m benchmarks.throughput --rounds 3 --peer-allocator ours --workers 1  # a core to spare

Our workers fix glibc's malloc thresholds (actors/processes/allocator.py); torchrun's ranks run with glibc's
defaults, as a torchrun user gets them, unless ``--peer-allocator ours`` gives them the same thresholds.

Writes benchmarks/results/throughput.json and throughput.png (throughput_same_allocator.* with
``--peer-allocator ours``, and ``_1_worker`` added to the name with ``--workers 1``: one rank a side on 2 cores,
so that what runs beside the ranks has a core of its own). The peer is benchmarks/_torchrun_ddp.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import tempfile
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks._cpu_meter import Measurement
from benchmarks.common import REPO_ROOT, RESULTS, alternated, machine_info
from benchmarks.sides import NUM_WORKERS, WARMUP_FRACTION, job_sections, measure_ours, run_torchrun
from raylastic.actors.processes.allocator import MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES
from raylastic.cluster.connect import ray_session
from raylastic.jobconfig import job_config_from_dict

WORKLOADS = ("digits", "chargpt", "gpt")
DEFAULT_STEPS = {"digits": 4000, "chargpt": 300, "gpt": 300}
"""~10 s of steady state at ~2.5, ~40 and ~50 ms per torchrun step on one core per rank: shorter windows
leave a run's figure to whatever the shared machine did in those few seconds."""
GOAL_RATIO = 0.98
PEER_ALLOCATORS = {"glibc": {}, "ours": {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES),
                                         "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES)}}
"""The peer ranks' extra environment per --peer-allocator: glibc's defaults, or actors/processes/allocator.py's
thresholds."""
PEER_ALLOCATOR_TEXT = {"glibc": "glibc's defaults", "ours": "actors/processes/allocator.py's, as our workers set them"}


def run_ours(sections: dict, run_dir: Path) -> Measurement:
    return measure_ours(job_config_from_dict({**sections, "name": f"throughput-{run_dir.name}"}), run_dir).measurement


def max_param_diff(ours_dir: Path, peer_dir: Path) -> float:
    ours = torch.load(ours_dir / "model.pt", weights_only=True)
    peer = torch.load(peer_dir / "peer.json.pt", weights_only=True)
    return max((ours[k] - peer[k]).abs().max().item() for k in ours)


def benchmark(workload: str, steps: int, global_batch_size: int, rounds: int, scratch: Path,
              peer_env: Mapping[str, str], num_workers: int = NUM_WORKERS) -> dict:
    sections = job_sections(workload, steps, global_batch_size, scratch, num_workers)
    run_peer = functools.partial(run_torchrun, num_workers=num_workers, peer_env=peer_env)
    ours: list[Measurement] = []
    peer: list[Measurement] = []
    for side, run in (("ours", run_ours), ("torchrun", run_peer)):  # warm-up: not measured
        run_dir = scratch / f"{workload}-{side}-warmup"
        run_dir.mkdir(parents=True)
        run(sections, run_dir)
        print(f"  {workload} warm-up run of {side} done", flush=True)
    for round_index in range(rounds):
        ours_dir, peer_dir = scratch / f"{workload}-ours-{round_index}", scratch / f"{workload}-peer-{round_index}"
        peer_dir.mkdir(parents=True)
        sides = [("ours", run_ours, ours_dir), ("torchrun", run_peer, peer_dir)]
        for side, run, run_dir in alternated(sides, round_index):
            measurement = run(sections, run_dir)
            (ours if side == "ours" else peer).append(measurement)
            print(f"  {workload} round {round_index + 1}/{rounds} {side:9s} "
                  f"{measurement.samples_per_s:9.0f} samples/s  (run {measurement.wall_s:.1f}s; CPU ms/step: "
                  f"ranks {measurement.rank_cpu_ms_per_step} (training threads "
                  f"{measurement.training_thread_cpu_ms_per_step}, preempted "
                  f"{measurement.training_thread_preemptions_per_step} times), support "
                  f"{measurement.support_cpu_ms_per_step} {measurement.support_cpu_ms_per_step_by_piece}, "
                  f"other processes {measurement.other_cpu_ms_per_step})", flush=True)
        peer[-1] = dataclasses.replace(peer[-1], max_param_diff=max_param_diff(ours_dir, peer_dir))
    ours_median = statistics.median(m.samples_per_s for m in ours)
    peer_median = statistics.median(m.samples_per_s for m in peer)
    round_ratios = [round(o.samples_per_s / p.samples_per_s, 4) for o, p in zip(ours, peer, strict=True)]
    paired = statistics.median(round_ratios)
    return {"workload": workload, "steps": steps, "warmup_steps": max(1, int(steps * WARMUP_FRACTION)),
            "global_batch_size": global_batch_size, "num_workers": num_workers,
            "job": {k: v for k, v in sections.items() if k in ("workload", "training", "optim")},
            "ours": [asdict(m) for m in ours], "torchrun": [asdict(m) for m in peer],
            "ours_median_samples_per_s": round(ours_median, 1),
            "torchrun_median_samples_per_s": round(peer_median, 1),
            "ratio_ours_over_torchrun": round(ours_median / peer_median, 4),
            "paired_ratio_median": round(paired, 4), "paired_ratios": round_ratios,
            "rounds_ours_faster": sum(r >= 1 for r in round_ratios),
            "median_cpu_ms_per_step": {side: _median_cpu(measurements)
                                       for side, measurements in (("ours", ours), ("torchrun", peer))},
            "meets_goal": ours_median / peer_median >= GOAL_RATIO}


def _median_cpu(measurements: list[Measurement]) -> dict:
    """Medians over the rounds of each CPU figure per step: the ranks', their training threads' (and those
    threads' preemptions), the support processes' (in all and by piece) and the machine's other processes'."""
    def median(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return round(statistics.median(present), 2) if present else None

    medians = {kind: median([getattr(m, f"{kind}_cpu_ms_per_step") for m in measurements])
               for kind in ("rank", "training_thread", "support", "other")}
    medians["training_thread_preemptions"] = median([m.training_thread_preemptions_per_step for m in measurements])
    pieces = dict.fromkeys(piece for m in measurements for piece in m.support_cpu_ms_per_step_by_piece or {})
    medians["support_by_piece"] = {piece: median([(m.support_cpu_ms_per_step_by_piece or {}).get(piece, 0.0)
                                                  for m in measurements]) for piece in sorted(pieces)}
    return medians


def carried_results(path: Path, ran: set[str]) -> list[dict]:
    """The previous file's results of the workloads not run now (``carried_from``: the run that measured each), so
    that running one workload again keeps the others'."""
    if not path.exists():
        return []
    previous = json.loads(path.read_text())
    origin = {key: previous.get("machine", {}).get(key) for key in ("date", "git", "processor", "command")}
    return [{**result, "carried_from": result.get("carried_from", origin)}
            for result in previous.get("results", []) if result["workload"] not in ran]


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
        workers = result["num_workers"]
        ax.set_xticks([0, 1], ["Raylastic (Ray)", "torchrun + DDP" if workers > 1 else "torchrun"])
        ax.set_ylabel("samples/s (steady state)")
        ax.set_title(f"{result['workload']}, B={result['global_batch_size']}, "
                     f"{workers} worker{'s' if workers > 1 else ''}\n"
                     f"ours/torchrun = {result['ratio_ours_over_torchrun']:.3f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS), metavar="NAME",
                        help=f"which of {', '.join(WORKLOADS)} (default: all)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps per run (default per workload: {DEFAULT_STEPS})")
    parser.add_argument("--rounds", type=int, default=6, help="alternating ours/torchrun rounds (after a warm-up)")
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--peer-allocator", choices=PEER_ALLOCATORS, default="glibc",
                        help="the torchrun ranks' malloc thresholds: glibc's defaults, as a torchrun user gets them "
                             "(writes throughput.json), or ours, as actors/processes/allocator.py sets them in our "
                             "workers (writes throughput_same_allocator.json)")
    parser.add_argument("--workers", type=int, choices=(1, 2), default=NUM_WORKERS,
                        help="ranks on each side (default 2, one per core of a 2-core machine; 1 leaves a core to the "
                             "Controller, the driver and Ray's services: writes <file>_1_worker.json)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or (args.steps is not None and args.steps < 5) or args.global_batch_size < args.workers:
        parser.error(f"need --rounds >= 1, --steps >= 5 and --global-batch-size >= {args.workers}")

    os.chdir(REPO_ROOT)  # Ray workers import the workloads from the current directory
    results = []
    with tempfile.TemporaryDirectory(prefix="raylastic-throughput-") as scratch, ray_session(min_cpus=args.workers):
        for workload in dict.fromkeys(args.workloads):
            load_before = os.getloadavg()
            steps = args.steps or DEFAULT_STEPS[workload]
            results.append(benchmark(workload, steps, args.global_batch_size, args.rounds, Path(scratch),
                                     PEER_ALLOCATORS[args.peer_allocator], args.workers))
            results[-1]["load_average_1_5_15_min"] = {"before": [round(v, 2) for v in load_before],
                                                      "after": [round(v, 2) for v in os.getloadavg()]}

    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = ("throughput" if args.peer_allocator == "glibc" else "throughput_same_allocator") + (
        "" if args.workers == NUM_WORKERS else f"_{args.workers}_worker")
    results = sorted(results + carried_results(RESULTS / f"{stem}.json", ran=set(args.workloads)),
                     key=lambda r: WORKLOADS.index(r["workload"]))
    payload = {
        "benchmark": (f"steady-state samples/s, Raylastic {args.workers}-worker DDP vs torchrun --nproc-per-node "
                      f"{args.workers} plain DDP" + (" (at 1 rank neither side wraps the model)" if args.workers == 1
                                                    else "")),
        "machine": machine_info(), "goal_ratio": GOAL_RATIO, "results": results,
        "peer_allocator": args.peer_allocator,
        "method": {
            "warmup_fraction": WARMUP_FRACTION,
            "ours": f"cluster.job.train, {args.workers} worker(s) x 1 CPU (1 torch thread), checkpoint only at the "
                    "end; times are the workers' step-commit wall clocks from RunResult.history; one Ray for all "
                    "rounds (its long polls: actors/worker_group/group.py LONG_POLL_S, cluster/job.py PROGRESS_WAIT_S)",
            "torchrun": "benchmarks/_torchrun_ddp.py, reading the same job config: DDP(gloo, 25 MiB buckets), "
                        "same seed, GlobalSampleOrder, optimizer, lr schedule, clipping, precision, per-step dropout "
                        "seed and loss scaling; TensorDatasets indexed in memory, gpt's TokenBlocks through a torch "
                        "DataLoader; no metrics all-reduce, rank 0 logs loss.item() of its slice; times are rank "
                        "0's perf_counter after each optimizer step; the idle Ray stays up",
            "cpu_ms_per_step": "CPU of the rank processes (and of their training threads: each rank's busiest), "
                               "of the rest of the benchmark's process tree (support; by piece: "
                               "benchmarks/_cpu_meter.py SUPPORT_PIECES) and of the machine's other processes, "
                               "over the steady-state window, per step; training_thread_preemptions: involuntary "
                               "context switches of a rank's training thread per step, mean over the ranks; /proc "
                               "sampled every 0.25 s and interpolated",
            "torchrun_malloc_thresholds": PEER_ALLOCATOR_TEXT[args.peer_allocator],
            "rounds": "one unmeasured warm-up run of each side, then rounds alternating, order flipped every "
                      "round; ratio: median ours / median torchrun; paired: the median over rounds of ours / "
                      "torchrun in the same round (less sensitive to a machine whose speed drifts between rounds)"},
    }
    (RESULTS / f"{stem}.json").write_text(json.dumps(payload, indent=1) + "\n")
    plot(results, RESULTS / f"{stem}.png")

    print(f"\n{'workload':9s} {'steps':>5s} {'B':>4s} {'ours samples/s':>15s} {'torchrun':>10s} {'ratio':>7s} "
          f"{'paired':>7s}")
    for r in results:
        print(f"{r['workload']:9s} {r['steps']:5d} {r['global_batch_size']:4d} "
              f"{r['ours_median_samples_per_s']:15.0f} {r['torchrun_median_samples_per_s']:10.0f} "
              f"{r['ratio_ours_over_torchrun']:7.3f} {r['paired_ratio_median']:7.3f}  (goal >= {GOAL_RATIO}; "
              f"ours faster in {r['rounds_ours_faster']} of {len(r['paired_ratios'])} rounds)")
    print(f"wrote {RESULTS / stem}.json and {stem}.png")


if __name__ == "__main__":
    main()
