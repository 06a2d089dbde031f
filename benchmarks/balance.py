"""Batch shares by measured speed (issue 19): one rank throttled 2x, ours balanced against ours with equal
shares and against torchrun DDP; and what balancing costs when every rank is equally fast.

One job for every side: digits with a wide MLP (hidden=HIDDEN), global batch GLOBAL_BATCH, AdamW
(lr=1e-3, as the torchrun peer builds it), the same seed and sample order, 1 CPU and 1 torch thread per
rank, no checkpoint but the final one. Five sides, each at every worker count of ``--workers``:

- ``ours_auto_throttled``: ``scaling.balance: auto`` (the default), the last rank throttled 2x from step 1
  (``faults: [{action: throttle, rank: N-1, step: 1, factor: 2.0}]``: before each step it sleeps 1x its
  previous step's unthrottled compute);
- ``ours_off_throttled``: the same with ``scaling.balance: off`` (equal shares);
- ``torchrun_throttled``: benchmarks/_torchrun_ddp.py on as many ranks, ``--throttle N-1:2.0`` (the same rule);
- ``ours_auto_unthrottled``, ``ours_off_unthrottled``: no throttle.

Samples/s is throughput.py's steady state: the first 20% of steps are warm-up, then samples over the wall
time between rank 0's step commits. Each round runs the five sides, in reverse order every other round,
after one unmeasured short run of ours and of torchrun; all of ours share one local Ray. Ratios are of
medians over rounds (the paired ones, per round, are in the JSON). The ideal gain of balancing N ranks
with one of them F times slower is (F(N-1) + 1) / N: 1.67x at N=3, 1.5x at N=2 (compute only; a step's
fixed costs - the gradient all-reduce, the optimizer, Python - are not shared out and shrink it). Ranks that
share cores (3 on 2 cores) hand the throttled rank's sleeping core to the others: there the unthrottled equal
split bounds what balancing can win (docs/benchmarks-notes.md). Run from the repository root (about 13
minutes on 2 quiet cores at the defaults)::

    .venv/bin/python -m benchmarks.balance --rounds 3
    .venv/bin/python -m benchmarks.balance --rounds 1 --steps 60 --workers 3

Writes benchmarks/results/balance.json and balance.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from benchmarks.common import RESULTS, alternated, code_version, machine_info
from benchmarks.sides import WARMUP_FRACTION, measure_ours, run_torchrun
from raylastic.actors.status.run import RunResult
from raylastic.cluster.connect import ray_session
from raylastic.jobconfig import job_config_from_dict

HIDDEN, GLOBAL_BATCH, FACTOR = 1024, 768, 2.0
"""A step that is mostly compute (~30 of ~40 ms at 2 workers). At the issue's hidden=2048 and ~96 samples, the
all-reduce and AdamW over 4.3M parameters took 60-75% of a step: a 2x throttle cost the equal split 1.34x at 2
workers and 0-12% at 3, leaving balancing little to win."""
DEFAULT_STEPS = 250
WARMUP_RUN_STEPS = 20
WORKER_COUNTS = (3, 2)
SETTLED_WITHIN = 0.10
"""Convergence: the throttled rank's share over the others' median is within this of its final value."""
GOALS = {"auto_over_off_throttled_at_least": 1.5, "auto_over_off_unthrottled_at_least": 0.95}
"""Issue 19's goals, stated for 3 workers; at 2 workers the throttled goal is read as the same 90% of the ideal."""


@dataclass(frozen=True)
class Side:
    name: str
    runner: Literal["ours", "torchrun"]
    balance: Literal["auto", "off"]
    """ours' scaling.balance (torchrun always splits evenly)."""
    throttled: bool


SIDES = (Side("ours_auto_throttled", "ours", "auto", True), Side("ours_off_throttled", "ours", "off", True),
         Side("torchrun_throttled", "torchrun", "off", True), Side("ours_auto_unthrottled", "ours", "auto", False),
         Side("ours_off_unthrottled", "ours", "off", False))


def ideal_gain(workers: int, factor: float = FACTOR) -> float:
    """Balanced over equal samples/s when one of ``workers`` ranks computes ``factor`` times slower (compute only)."""
    return (factor * (workers - 1) + 1) / workers


def job_sections(side: Side, workers: int, steps: int) -> dict:
    """The job config of one side (the torchrun peer reads it as JSON and gets the throttle as an option)."""
    sections = {"workload": {"name": "digits", "options": {"hidden": HIDDEN}},
                "training": {"steps": steps, "global_batch_size": GLOBAL_BATCH},
                "scaling": {"min_workers": workers, "max_workers": workers, "cpus_per_worker": 1,
                            "balance": side.balance},
                "checkpoint": {"every_steps": 0, "resume": "never"}}
    if side.throttled and side.runner == "ours":
        sections["faults"] = [{"action": "throttle", "rank": workers - 1, "step": 1, "factor": FACTOR}]
    job_config_from_dict(sections)  # a bad section fails here, before any run starts
    return sections


def run_side(side: Side, workers: int, steps: int, run_dir: Path) -> dict[str, Any]:
    """One run: its Measurement's fields, and for ours what the shares did."""
    run_dir.mkdir(parents=True)
    sections = job_sections(side, workers, steps)
    load = os.getloadavg()[0]
    if side.runner == "torchrun":
        options = ["--throttle", f"{workers - 1}:{FACTOR}"] if side.throttled else []
        return {**asdict(run_torchrun(sections, run_dir, workers, options)), "load_average_at_start": load}
    run = measure_ours(job_config_from_dict({**sections, "name": f"balance-{run_dir.name}"}), run_dir)
    return {**asdict(run.measurement), "load_average_at_start": load, **shares_summary(run.result, workers - 1)}


def shares_summary(result: RunResult, watched_rank: int) -> dict[str, Any]:
    """What the split did: final shares, convergence of ``watched_rank``'s share, per-rank compute in the steady
    state, every change of shares (from the history: the split each step really ran) and the policy's rates."""
    rows = result.history
    steady = rows[max(1, int(len(rows) * WARMUP_FRACTION)) - 1:]
    ratios = [share_ratio(row["shares"], watched_rank) for row in rows]
    final = ratios[-1]
    within = [abs(ratio - final) <= SETTLED_WITHIN * final for ratio in ratios]
    first_within = rows[within.index(True)]
    settled = rows[len(within) - within[::-1].index(False)] if False in within else rows[0]  # within from here on
    changes = [[row["step"], row["shares"]] for previous, row in zip([None, *rows], rows, strict=False)
               if previous is None or row["shares"] != previous["shares"]]
    compute = [[row["compute_s"][rank] for row in steady] for rank in range(len(rows[-1]["shares"]))]
    return {
        "final_shares": rows[-1]["shares"], "final_share_ratio": round(final, 3),
        "first_step_within_10pct": first_within["step"],
        "first_within_after_s": round(first_within["time_s"] - rows[0]["time_s"], 2),
        "settled_from_step": settled["step"], "settled_after_s": round(settled["time_s"] - rows[0]["time_s"], 2),
        "share_changes": len(changes) - 1,
        "steady_compute_ms_per_rank": [round(1000 * statistics.median(c), 1) for c in compute],
        "steady_compute_imbalance": round(statistics.median(max(r["compute_s"]) / min(r["compute_s"])
                                                            for r in steady), 3),
        "steady_step_ms": round(1000 * statistics.median(r["step_s"] for r in steady), 1),
        "shares_timeline": changes,
        "decisions": [{"step": e.step, **e.details} for e in result.events if e.type == "shares_changed"],
        "stragglers": [{"step": e.step, **e.details} for e in result.events if e.type == "straggler"]}


def share_ratio(shares: list[int], rank: int) -> float:
    """``rank``'s share over the median of the others'."""
    return shares[rank] / statistics.median(s for r, s in enumerate(shares) if r != rank)


def benchmark(workers: int, steps: int, rounds: int, scratch: Path) -> dict[str, Any]:
    """Every side ``rounds`` times at ``workers`` ranks, after an unmeasured short run of ours and of torchrun."""
    for side in (SIDES[0], SIDES[2]):
        run_side(side, workers, WARMUP_RUN_STEPS, scratch / f"w{workers}-warmup-{side.runner}")
    print(f"  {workers} workers: warm-up runs done", flush=True)
    runs: dict[str, list[dict]] = {side.name: [] for side in SIDES}
    for index in range(rounds):
        for side in alternated(SIDES, index):
            run = run_side(side, workers, steps, scratch / f"w{workers}-{side.name}-{index}")
            runs[side.name].append(run)
            shares = f"  final shares {run['final_shares']}, settled at step {run['settled_from_step']}" \
                if "final_shares" in run else ""
            print(f"  {workers} workers, round {index + 1}/{rounds} {side.name:22s} {run['samples_per_s']:8.0f} "
                  f"samples/s (load {run['load_average_at_start']:.1f}){shares}", flush=True)
    return {"workers": workers, "steps": steps, "warmup_steps": max(1, int(steps * WARMUP_FRACTION)),
            "throttled_rank": workers - 1, "ideal_gain": round(ideal_gain(workers), 4),
            **summarize(runs, workers), "runs": runs}


def summarize(runs: dict[str, list[dict]], workers: int) -> dict[str, Any]:
    medians = {name: round(statistics.median(r["samples_per_s"] for r in side_runs), 1)
               for name, side_runs in runs.items()}
    pairs = {"auto_over_off_throttled": ("ours_auto_throttled", "ours_off_throttled"),
             "auto_over_off_unthrottled": ("ours_auto_unthrottled", "ours_off_unthrottled"),
             "ours_auto_over_torchrun_throttled": ("ours_auto_throttled", "torchrun_throttled"),
             "ours_off_over_torchrun_throttled": ("ours_off_throttled", "torchrun_throttled"),
             "auto_throttled_over_off_unthrottled": ("ours_auto_throttled", "ours_off_unthrottled")}
    ratios = {key: round(medians[a] / medians[b], 4) for key, (a, b) in pairs.items()}
    paired = {key: [round(x["samples_per_s"] / y["samples_per_s"], 4) for x, y in zip(runs[a], runs[b], strict=True)]
              for key, (a, b) in pairs.items()}
    throttled_goal = GOALS["auto_over_off_throttled_at_least"] * ideal_gain(workers) / ideal_gain(3)
    goals_met = {"auto_over_off_throttled_at_least": ratios["auto_over_off_throttled"] >= round(throttled_goal, 2),
                 "auto_over_off_unthrottled_at_least": ratios["auto_over_off_unthrottled"]
                 >= GOALS["auto_over_off_unthrottled_at_least"]}
    balanced = runs["ours_auto_throttled"]
    shares = {field: statistics.median(r[field] for r in balanced)
              for field in ("final_share_ratio", "first_step_within_10pct", "first_within_after_s",
                            "settled_from_step", "settled_after_s", "share_changes", "steady_compute_imbalance")}
    return {"median_samples_per_s": medians, "ratios_of_medians": ratios, "paired_ratios": paired,
            "throttled_goal": round(throttled_goal, 2), "goals_met": goals_met,
            "balanced_throttled_run_medians": shares,
            "unthrottled_auto_share_changes": [r["share_changes"] for r in runs["ours_auto_unthrottled"]]}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(11, 3.6 * len(results)), squeeze=False)
    for (shares_ax, bars_ax), result in zip(axes, results, strict=True):
        workers, runs = result["workers"], result["runs"]
        balanced = runs["ours_auto_throttled"]
        run = sorted(balanced, key=lambda r: r["samples_per_s"])[len(balanced) // 2]  # the median round's
        timeline = run["shares_timeline"]  # [step, shares] where the shares changed, from step 1
        shares_ax.axvspan(1, result["warmup_steps"], color="0.9", label="warm-up (not measured)")
        at_factor = GLOBAL_BATCH / (ideal_gain(workers) * workers)  # the share of a rank FACTOR times slower
        shares_ax.axhline(at_factor, color="0.5", linestyle=":", label=f"{at_factor:.0f}: 1/{FACTOR:g} of the others'")
        for rank in range(workers):
            xs = [step for step, _ in timeline] + [result["steps"]]
            ys = [shares[rank] for _, shares in timeline] + [timeline[-1][1][rank]]
            shares_ax.step(xs, ys, where="post", label=f"rank {rank}" + (" (throttled 2x)" if rank == workers - 1
                                                                         else ""))
        shares_ax.set_xlabel("step")
        shares_ax.set_ylabel(f"samples of each step's {GLOBAL_BATCH}")
        shares_ax.set_title(f"{workers} workers, balance auto, rank {workers - 1} throttled: shares\n"
                            f"(median round; settled at step {run['settled_from_step']})", fontsize=10)
        shares_ax.legend(fontsize=8)
        for x, side in enumerate(SIDES):
            values = [r["samples_per_s"] for r in runs[side.name]]
            bars_ax.bar(x, statistics.median(values), width=0.6, alpha=0.8,
                        color="tab:gray" if side.runner == "torchrun" else
                        ("tab:blue" if side.balance == "auto" else "tab:orange"),
                        hatch="//" if side.throttled else None)
            bars_ax.scatter([x] * len(values), values, color="black", s=10, zorder=3)
        bars_ax.set_xticks(range(len(SIDES)), [s.name.replace("_", "\n", 1) for s in SIDES], fontsize=7)
        bars_ax.set_ylabel("samples/s (steady state)")
        ratios = result["ratios_of_medians"]
        bars_ax.set_title(f"{workers} workers: auto/off throttled {ratios['auto_over_off_throttled']:.2f} "
                          f"(ideal {result['ideal_gain']:.2f}), unthrottled {ratios['auto_over_off_unthrottled']:.2f}",
                          fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def describe(steps: int) -> dict[str, Any]:
    """The JSON's "job" and "definitions"."""
    job = {"workload": f"digits(hidden={HIDDEN})", "global_batch_size": GLOBAL_BATCH, "steps": steps,
           "optimizer": "AdamW(lr=1e-3)", "cpus_per_worker": 1, "torch_threads_per_rank": 1,
           "throttle": f"rank N-1 from step 1, factor {FACTOR}: before each step it sleeps (factor - 1) x its "
                       "previous step's compute (step start to its last local gradient, without the sleep)"}
    definitions = {
        "samples_per_s": f"steady state: the first {WARMUP_FRACTION:.0%} of steps are warm-up; samples of the rest "
                         "over the wall time between rank 0's commits of the last warm-up step and of the last step",
        "ratios_of_medians": "median samples/s over rounds of one side over another's; paired_ratios: the same "
                             "per round",
        "ideal_gain": "(F(N-1) + 1) / N: balanced over equal samples/s when one of N ranks computes F times "
                      "slower, on a core of its own, and a step is all compute",
        "auto_throttled_over_off_unthrottled": "how much of the unthrottled speed the balanced throttled run keeps: "
                                               "N / (F(N-1) + 1) (0.75 at N=2) with a core per rank; up to 1 where "
                                               "ranks share cores, since the throttle only adds sleep",
        "throttled_goal": "issue 19's 1.5 at 3 workers (0.9 of the ideal), the same 0.9 of the ideal at 2",
        "final_share_ratio": "the throttled rank's share over the median of the others' shares at the last step",
        "first_step_within_10pct": f"the first step whose share ratio is within {SETTLED_WITHIN:.0%} of the final "
                                   "one (first_within_after_s: its commit after step 1's)",
        "settled_from_step": "the first step from which the share ratio stays within 10% of the final one "
                             "(settled_after_s: its commit after step 1's)",
        "steady_compute_ms_per_rank": "median over the steady-state steps of each rank's compute_s (history rows: "
                                      "step start to the last local gradient, the throttle's sleep included)",
        "steady_compute_imbalance": "median over the steady-state steps of the longest rank compute over the shortest",
        "shares_timeline": "[step, shares] at step 1 and at every step whose shares differ from the step before "
                           "(history rows); decisions: the shares_changed events (step of the vote, new shares, "
                           "the window's mean rates in samples/s of compute)",
        "other_cpu_ms_per_step": "CPU of processes outside this benchmark during the steady state, per step: the "
                                 "shared machine's load (benchmarks/_cpu_meter.py)"}
    return {"job": job, "definitions": definitions}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the five sides (order flipped every round)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps per run")
    parser.add_argument("--workers", type=int, nargs="+", default=list(WORKER_COUNTS), choices=(2, 3))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 20:
        parser.error("need --rounds >= 1 and --steps >= 20")

    os.chdir(Path(__file__).resolve().parent.parent)  # Ray workers import the workloads from here
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="raylastic-balance-") as scratch, ray_session(min_cpus=max(args.workers)):
        results = [benchmark(workers, args.steps, args.rounds, Path(scratch)) for workers in args.workers]
    machine = {**machine_info(), "load_average_1_5_15_before": [round(v, 2) for v in load_before],
               "load_average_at_end": [round(v, 2) for v in os.getloadavg()]}
    report = {"benchmark": "batch shares by speed: one rank throttled 2x, balance auto vs off vs torchrun DDP",
              "command": machine["command"], "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "code": code_version(), "machine": machine, **describe(args.steps), "goals": GOALS,
              "goals_met": {f"{r['workers']}_workers": r["goals_met"] for r in results}, "results": results}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "balance.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(results, RESULTS / "balance.png")
    for r in results:
        print(f"{r['workers']} workers: {json.dumps(r['median_samples_per_s'])}\n"
              f"  ratios {json.dumps(r['ratios_of_medians'])}\n  goals met {r['goals_met']}\n"
              f"  balanced throttled runs {json.dumps(r['balanced_throttled_run_medians'])}")
    print(f"wrote {RESULTS / 'balance.json'} and balance.png")


if __name__ == "__main__":
    main()
