"""The time-based checkpoint's cost (checkpoint.every_minutes) in benchmarks/redundancy.py's ``timed`` side: the
defaults a user gets, with the period shortened so that a steady run takes several saves, each measured.

A save of step S starts on every rank right after S commits and is written in the background; the steps trained
meanwhile (those committed up to its ``duration_s`` plus two steps after S) are slower. A save's cost is what
those steps took beyond the run's median step; the default's cost is that over the default period
(``JobConfig().checkpoint.every_minutes``): the share of a run's time it takes. The alternative the issue names,
a second buddy copy, would cost another transfer of each shard every step: the GPT pair's buddy cost again.
"""

from __future__ import annotations

import statistics
from typing import Any

from raylastic.jobconfig import JobConfig

DEFAULT_MINUTES = JobConfig().checkpoint.every_minutes
MEASURED_MINUTES = 0.03
"""The timed side's period: a save every 1.8 s, several in a steady run of 200 digits steps."""


def save_costs(history: list[dict], events: list[Any], step_s: float) -> dict[str, Any]:
    """Each periodic save of a steady run: its step, duration and the seconds the steps trained meanwhile took
    beyond ``step_s`` (the run's median step)."""
    times = {row["step"]: row["time_s"] for row in history}
    saves = []
    for event in events:
        if event.type != "checkpointed" or "duration_s" not in event.details or event.step not in times:
            continue  # the end of the run's save is the Controller's (no duration): not a periodic one
        start, duration = times[event.step], event.details["duration_s"]
        during = [step for step in times if step > event.step and times[step] <= start + duration + 2 * step_s]
        excess = sum(times[step] - times[step - 1] - step_s for step in during if step - 1 in times)
        saves.append({"step": event.step, "duration_s": duration, "steps_during": len(during),
                      "excess_s": round(excess, 4)})
    excess = [save["excess_s"] for save in saves]
    return {"saves": saves, "num_saves": len(saves),
            "excess_s_per_save": round(statistics.median(excess), 4) if excess else None,
            "save_duration_s": round(statistics.median(s["duration_s"] for s in saves), 4) if saves else None}


def summarize(rounds: list[dict], second_copy_cost: float | None) -> dict[str, Any]:
    """Medians over the rounds' steady ``timed`` runs, the default's cost, and samples/s against ``buddy``'s;
    ``second_copy_cost``: the share of a step's time a second buddy copy would add (the GPT pair's one copy's)."""
    finished = [r["steady_timed"] for r in rounds if r.get("steady_timed", {}).get("status") == "finished"]
    per_save = [run["excess_s_per_save"] for run in finished if run.get("excess_s_per_save") is not None]
    excess = statistics.median(per_save) if per_save else None
    paired = [r["steady_timed"]["samples_per_s"] / r["steady_buddy"]["samples_per_s"] for r in rounds
              if r.get("steady_timed", {}).get("status") == r.get("steady_buddy", {}).get("status") == "finished"]
    cost = None if excess is None else round(max(0.0, excess) / (DEFAULT_MINUTES * 60), 6)
    return {"default_every_minutes": DEFAULT_MINUTES, "excess_s_per_save": excess,
            "save_duration_s": statistics.median(run["save_duration_s"] for run in finished) if finished else None,
            "saves_per_run": [run["num_saves"] for run in finished],
            "default_cost_fraction": cost, "second_copy_cost_fraction": second_copy_cost,
            "below_a_second_copy": None if cost is None or second_copy_cost is None else cost < second_copy_cost,
            "timed_over_buddy_samples_per_s_paired_median": round(statistics.median(paired), 3) if paired else None}


def describe(every_minutes: float) -> dict[str, str]:
    return {"timed_checkpoint": (
        f"the timed side's steady run saves every {every_minutes:g} min; excess_s_per_save: the median over its "
        "saves of what the steps committed from the save's step to its duration_s + 2 steps after took beyond the "
        f"run's median step; default_cost_fraction: that over the default period ({DEFAULT_MINUTES:g} min); "
        "timed_over_buddy_samples_per_s_paired_median: the steady runs' samples/s, timed / buddy, per round; "
        "second_copy_cost_fraction: 1 - the GPT pair's samples/s with the buddy copy / without, what a second copy "
        "would add to every step")}
