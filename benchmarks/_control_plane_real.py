"""The real half of benchmarks/control_plane.py (``--real``): the same elastic job at 2, 4, 8 and 16 workers on
this machine, each in a local Ray of its own with 4 logical CPUs that the workers share (fractional CPUs), a tiny
model, one worker killed.

The job: the digits MLP (hidden 32), global batch 240, ``scaling.min_workers`` N - 1 and ``max_workers`` N, the
default failure timeouts; rank 1 SIGKILLs its own process just before step K (the ``kill`` fault). For each N:

- ``formation_s``: forming the first generation (N workers join the process group, the state is initialised):
  its ``generation_formed`` event's ``duration_s``, and ``rendezvous_calls``, the calls its members made to the
  run's keys (with the growth exponent of the last two sizes);
- ``recovery_s``: from the commit of step K-1 to the next committed step, and its parts
  (``_recovery_helpers.recovery_breakdown``: heard of, forming started, formed, first step);
- ``support_cpu_ms_per_step``: CPU of every process of this benchmark's tree except the rank processes (the
  driver, the Controller, the rendezvous keys, Ray's services, the warm process), per step over steps
  ``STEADY_FROM``..K-1, in all and per worker; ``rank_cpu_ms_per_step`` the ranks' alike;
- ``step_ms``: the median step time over the same steps.

Goals (issue 34): recovery at 16 within 1.5x of recovery at 2; support CPU per step per worker not growing with N.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from pathlib import Path

import ray

from benchmarks._cpu_meter import CpuMeter
from benchmarks._recovery_helpers import RECOVERY_BREAKDOWN, recovery_breakdown, summarize_failure
from benchmarks.common import local_ray
from raylastic.cluster.job import train
from raylastic.jobconfig import job_config_from_dict

SIZES = (2, 4, 8, 16)
STEPS = 60
KILL_STEP = 40
STEADY_FROM = 10
LOGICAL_CPUS = 4
GLOBAL_BATCH = 240
RECOVERY_GOAL_RATIO = 1.5


def measure(num_workers: int, run_dir: Path) -> dict:
    """One run of ``num_workers`` workers, rank 1 killed before step KILL_STEP, on a local Ray of its own."""
    sections = {"name": f"cp-real-{num_workers}", "workload": {"name": "digits", "options": {"hidden": 32}},
                "training": {"steps": STEPS, "global_batch_size": GLOBAL_BATCH},
                "scaling": {"min_workers": num_workers - 1, "max_workers": num_workers,
                            "cpus_per_worker": round((LOGICAL_CPUS - 1) / num_workers, 4)},
                "checkpoint": {"every_steps": 0, "resume": "never"},
                "faults": [{"action": "kill", "rank": 1, "step": KILL_STEP}]}
    origins: list[float] = []  # when the run log started: an event's arrival less its time_s (~ms late)

    def follow(progress) -> None:
        origins.extend(time.time() - event.time_s for event in progress.events)

    local_ray(LOGICAL_CPUS)
    try:
        cpu, started = CpuMeter(rank_marker="ray::TrainWorker"), time.perf_counter()
        result = train(job_config_from_dict(sections), run_dir=run_dir, on_progress=follow)
        wall_s = time.perf_counter() - started
    finally:
        ray.shutdown()
    origin = min(origins)
    commits = sorted(((row["step"], origin + row["time_s"]) for row in result.history), key=lambda c: c[1])
    formed = [e for e in result.events if e.type == "generation_formed"]
    failed = next(e for e in result.events if e.type == "worker_failed")
    after = next(e for e in formed if e.time_s > failed.time_s)
    steady = [t for s, t in commits if STEADY_FROM <= s <= KILL_STEP - 1]
    steady_steps = len(steady) - 1
    measured = cpu.measurement(steady_steps * GLOBAL_BATCH / (steady[-1] - steady[0]), wall_s,
                               (steady[0], steady[-1]), steady_steps)
    recovery = summarize_failure(commits, KILL_STEP)
    return {"workers": num_workers, "formation_s": formed[0].details["duration_s"],
            "rendezvous_calls": formed[0].details["rendezvous_calls"],
            "reformation_s": after.details["duration_s"], "state_source_after": after.details["state_source"],
            "recovery_s": recovery["recovery_s"], "steps_redone": recovery["steps_redone"],
            **recovery_breakdown(commits, KILL_STEP, origin, failed, after),
            "step_ms": round(1000 * statistics.median(b - a for a, b in itertools.pairwise(steady)), 2),
            "support_cpu_ms_per_step": measured.support_cpu_ms_per_step,
            "support_cpu_ms_per_step_per_worker": round(measured.support_cpu_ms_per_step / num_workers, 3),
            "rank_cpu_ms_per_step": measured.rank_cpu_ms_per_step}


FIGURES = ("formation_s", "rendezvous_calls", "reformation_s", "recovery_s", *RECOVERY_BREAKDOWN, "step_ms",
           "support_cpu_ms_per_step", "support_cpu_ms_per_step_per_worker", "rank_cpu_ms_per_step")


def summarize(sizes: list[int], runs: dict[int, list[dict]]) -> dict:
    """Medians over rounds by size, and the goals: recovery at the largest size against the smallest; support CPU
    per step per worker at the largest against the smallest."""
    rows = {n: {key: round(statistics.median(run[key] for run in runs[n]), 4) for key in FIGURES} for n in sizes}
    smallest, largest = sizes[0], sizes[-1]
    recovery_ratio = round(rows[largest]["recovery_s"] / rows[smallest]["recovery_s"], 2)
    support_ratio = round(rows[largest]["support_cpu_ms_per_step_per_worker"] /
                          rows[smallest]["support_cpu_ms_per_step_per_worker"], 2)
    below = sizes[-2] if len(sizes) > 1 else smallest
    calls_exponent = (round(math.log(rows[largest]["rendezvous_calls"] / rows[below]["rendezvous_calls"]) /
                            math.log(largest / below), 2) if below != largest else None)
    return {"by_workers": rows, "recovery_largest_over_smallest": recovery_ratio,
            "rendezvous_calls_growth_exponent": calls_exponent,
            "support_per_worker_largest_over_smallest": support_ratio,
            "meets_goal": {"recovery": recovery_ratio <= RECOVERY_GOAL_RATIO, "support_cpu": support_ratio <= 1.0}}


def plot(sizes: list[int], rows: dict[int, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.common import save_figure

    fig, (times, cpu) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("recovery_s", "kill -> next step"), ("formation_s", "first generation formed"),
                       ("reformation_s", "survivors' generation formed")):
        times.plot(sizes, [rows[n][key] for n in sizes], marker="o", label=label)
    times.set(xscale="log", xlabel="workers (real processes)", ylabel="s", title="Forming and recovering")
    times.set_xticks(sizes, [str(n) for n in sizes])
    times.legend(fontsize=8)
    for key, label in (("support_cpu_ms_per_step_per_worker", "support, per worker"),
                       ("support_cpu_ms_per_step", "support, in all")):
        cpu.plot(sizes, [rows[n][key] for n in sizes], marker="o", label=label)
    cpu.set(xscale="log", xlabel="workers (real processes)", ylabel="CPU ms per step",
            title="CPU beside the ranks, per step")
    cpu.set_xticks(sizes, [str(n) for n in sizes])
    cpu.legend(fontsize=8)
    save_figure(fig, path)
