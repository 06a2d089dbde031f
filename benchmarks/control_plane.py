"""The Controller's cost as the group grows, simulated to thousands of workers in one process.

For each N, one run through the real Controller (its state machine, policies, run log and share book) over the fake
worker group of tests/support/fake_group.py (no Ray, no processes; every member commits a step per poll): a member
found dead at the third poll, the re-formation without it, the replacement's scale-up, a drain. Every transition
is timed, and the fake group's own calls (building N ranks' news for a poll, a final checkpoint) are timed apart
and taken off, so what is reported is the Controller's:

- per poll: a training generation's transition (taking in N ranks' step results, the judge, the scaling check);
- per failure: the poll that finds the loss (its verdict) and the recovery's decision (the failure policy);
- per generation formed: the layout, the state-source choice, the events;
- per resize: the membership change's decision (the scale-up, the drain);
- peak memory of the run (tracemalloc, in a second run).

The objects that exist before the runs (this process's imports: torch, for the fake group's checkpoint) are
frozen out of the garbage collector (``gc.freeze``): the Controller's process imports no torch, and the collector's
full passes over torch's objects would show here as pauses of ~150 ms that are not the Controller's.

Goal (issue 34): under 50 ms per poll and per decision at 4,096 workers, growing no faster than N log N (the
exponent of the last two sizes' times on a log-log plot at most ~1.1). Run from the repository root (~1 minute)::

    .venv/bin/python -m benchmarks.control_plane
    .venv/bin/python -m benchmarks.control_plane --workers 16 256 4096

Writes benchmarks/results/control_plane.json and control_plane.png.

``--real`` runs the real half instead (benchmarks/_control_plane_real.py: 2, 4, 8 and 16 worker processes on this
machine, one killed; forming, recovery and the support CPU per step; ~5 minutes a round) and writes
control_plane_real.json and control_plane_real.png::

    .venv/bin/python -m benchmarks.control_plane --real
    .venv/bin/python -m benchmarks.control_plane --real --workers 2 16 --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from benchmarks import _control_plane_real as real
from benchmarks.common import RESULTS, machine_info, save_figure, write_json
from raylastic.actors.controller.states import Recovering
from tests.support.fake_group import controller, events, with_member

STEPS = 12
GOAL_MS = 50.0
FAKE_CALLS = ("place", "form", "sync_state", "restore", "restore_from_peers", "save_checkpoint", "full_model_file",
              "evaluate", "memory", "start_training", "poll", "end_generation", "admit_ready_joiners",
              "remove_drained")
KINDS = ("poll", "failure", "formation", "resize")


def simulate(num_workers: int, scratch: Path, *, trace_memory: bool = False) -> dict:
    """One run of ``num_workers`` fake workers; the Controller's seconds by kind of transition."""
    run, group = controller(scratch, f"scaling.min_workers={num_workers // 2}", f"scaling.max_workers={num_workers}",
                            f"training.global_batch_size={4 * num_workers}", f"training.steps={STEPS}",
                            workers=num_workers, free_slots=1)
    fake_s = [0.0]
    for name in FAKE_CALLS:
        setattr(group, name, _timed(getattr(group, name), fake_s))
    group.on_poll(lambda status: status)
    group.on_poll(lambda status: status)
    group.on_poll(lambda status: with_member(status, "w7", dead="actor died: killed"))
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    drained = False
    if trace_memory:
        tracemalloc.start()
    while run.state.name not in ("finished", "failed", "stopped"):
        before, fake_before, started = run.state, fake_s[0], time.perf_counter()
        after = run.advance()
        spent = time.perf_counter() - started - (fake_s[0] - fake_before)
        kind = {"running": "poll", "recovering": "failure", "forming": "formation", "resizing": "resize"}.get(
            before.name)
        if kind == "poll" and isinstance(after, Recovering):
            kind = "failure"  # the poll that found the loss, with its verdict
        if kind is not None:
            times[kind].append(spent)
        if not drained and len(events(run, "worker_joined")) == 1 and after.name == "running":
            drained = bool(run.drain(rank=5))
    peak = tracemalloc.get_traced_memory()[1] if trace_memory else None
    if trace_memory:
        tracemalloc.stop()
    if run.state.name != "finished" or not drained:
        raise RuntimeError(f"the simulated run of {num_workers} ended {run.state.name} (drained: {drained})")
    return {"times": times, "peak_bytes": peak}


def _timed(method, total: list[float]):
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - started
    return timed


def summarize(sizes: list[int], runs: dict[int, dict]) -> dict:
    rows = {}
    for n in sizes:
        times = runs[n]["times"]
        rows[n] = {"poll_ms_median": _ms(statistics.median(times["poll"])), "poll_ms_max": _ms(max(times["poll"])),
                   "failure_ms": _ms(sum(times["failure"])),
                   "formation_ms_median": _ms(statistics.median(times["formation"])),
                   "resize_ms_max": _ms(max(times["resize"])), "peak_mb": round(runs[n]["peak_bytes"] / 2**20, 2)}
    largest, below = sizes[-1], sizes[-2] if len(sizes) > 1 else None
    exponents = ({key: round(math.log(rows[largest][key] / rows[below][key]) / math.log(largest / below), 2)
                  for key in ("poll_ms_median", "failure_ms", "formation_ms_median", "resize_ms_max")
                  if rows[below][key] > 0} if below else {})
    worst = max(rows[largest][key] for key in ("poll_ms_max", "failure_ms", "formation_ms_median", "resize_ms_max"))
    return {"by_workers": rows, "growth_exponent_last_two": exponents, "worst_ms_at_largest": worst,
            "meets_goal": worst < GOAL_MS and all(e <= 1.1 for e in exponents.values())}


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def plot(sizes: list[int], rows: dict[int, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for key, label in (("poll_ms_median", "a poll (median)"), ("failure_ms", "a failure's decisions"),
                       ("formation_ms_median", "a generation formed"), ("resize_ms_max", "a resize's decision")):
        ax.plot(sizes, [rows[n][key] for n in sizes], marker="o", label=label)
    ax.axhline(GOAL_MS, color="grey", linestyle="--", label=f"goal: {GOAL_MS:.0f} ms")
    ax.set(xscale="log", yscale="log", xlabel="workers (simulated)", ylabel="the Controller's ms",
           title="The Controller's work as the group grows")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+",
                        help="group sizes (default 16 64 256 1024 4096 simulated; with --real 2 4 8 16)")
    parser.add_argument("--real", action="store_true", help="real worker processes on this machine, one killed")
    parser.add_argument("--rounds", type=int, default=1, help="with --real: runs per size, medians reported")
    args = parser.parse_args(argv)
    command = "python -m benchmarks.control_plane " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.real:
        main_real(sorted(set(args.workers or real.SIZES)), args.rounds, command)
        return
    sizes = sorted(set(args.workers or (16, 64, 256, 1024, 4096)))
    gc.freeze()
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        for n in sizes:
            measured = simulate(n, Path(scratch) / f"time-{n}")
            measured["peak_bytes"] = simulate(n, Path(scratch) / f"memory-{n}", trace_memory=True)["peak_bytes"]
            runs[n] = measured
            print(f"{n:5d} workers: poll {_ms(statistics.median(measured['times']['poll'])):8.3f} ms, failure "
                  f"{_ms(sum(measured['times']['failure'])):8.3f} ms, formation "
                  f"{_ms(statistics.median(measured['times']['formation'])):8.3f} ms", flush=True)
    summary = summarize(sizes, runs)
    result = {"benchmark": "control_plane", "command": command, "machine": machine_info(), "steps": STEPS,
              "goal_ms": GOAL_MS, **summary,
              "raw_ms": {n: {kind: [_ms(t) for t in runs[n]["times"][kind]] for kind in KINDS} for n in sizes}}
    print(f"wrote {write_json('control_plane', result)}")
    plot(sizes, summary["by_workers"], RESULTS / "control_plane.png")
    print(f"at {sizes[-1]}: worst {summary['worst_ms_at_largest']} ms (goal {GOAL_MS:.0f}); growth exponents "
          f"{summary['growth_exponent_last_two']}")


def main_real(sizes: list[int], rounds: int, command: str) -> None:
    if sizes[0] < 2:
        raise SystemExit("--real needs at least 2 workers a size: one of them is killed")
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(rounds):
            for n in sizes:
                measured = real.measure(n, Path(scratch) / f"real-{n}-{round_index}")
                runs[n].append(measured)
                print(f"round {round_index + 1}/{rounds}, {n:2d} workers: formed in {measured['formation_s']:.2f} s, "
                      f"kill -> next step {measured['recovery_s']:.2f} s, step {measured['step_ms']:.1f} ms, "
                      f"support CPU {measured['support_cpu_ms_per_step']:.1f} ms a step", flush=True)
    summary = real.summarize(sizes, runs)
    result = {"benchmark": "control_plane_real", "command": command, "machine": machine_info(),
              "steps": real.STEPS, "kill_step": real.KILL_STEP, "steady_from_step": real.STEADY_FROM,
              "logical_cpus": real.LOGICAL_CPUS, "global_batch_size": real.GLOBAL_BATCH,
              "recovery_goal_ratio": real.RECOVERY_GOAL_RATIO, **summary, "runs": runs}
    print(f"wrote {write_json('control_plane_real', result)}")
    real.plot(sizes, summary["by_workers"], RESULTS / "control_plane_real.png")
    print(f"recovery at {sizes[-1]} over at {sizes[0]}: {summary['recovery_largest_over_smallest']} (goal <= "
          f"{real.RECOVERY_GOAL_RATIO}); support CPU per step per worker: "
          f"{summary['support_per_worker_largest_over_smallest']} (goal <= 1)")


if __name__ == "__main__":
    main()
