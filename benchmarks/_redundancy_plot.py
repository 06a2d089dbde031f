"""The plot of benchmarks/redundancy.py: the steps around the kill and around the replacement's rejoin on both
sides (median round), the steady runs' samples/s per round, and the bytes per rank against the formulas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LABELS = {"r2": ("strategy.replicas 2", "tab:blue"), "r1": ("strategy.replicas 1", "tab:red")}


def plot(rounds: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((kill, rejoin), (speed, held)) = plt.subplots(2, 2, figsize=(15, 9.5))
    runs = {side: median_round(rounds, f"kill_{side}", "time_lost_s") for side in LABELS}
    plot_kill(kill, runs)
    plot_rejoin(rejoin, runs)
    plot_throughput(speed, rounds, summary)
    plot_bytes(held, summary["bytes_per_rank"])
    loads = [r["load_average_at_start"][0] for r in rounds]
    fig.suptitle(f"zero3, 4 workers of 0.5 CPU, a checkpoint every 50 steps, rank 1 SIGKILLed before step K: "
                 f"{len(rounds)} rounds on a shared 2-core machine (1-min load average {min(loads):.0f}-"
                 f"{max(loads):.0f} at round starts)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def median_round(rounds: list[dict], key: str, field: str) -> dict | None:
    done = sorted((r[key] for r in rounds if field in r.get(key, {})), key=lambda run: run[field])
    return done[len(done) // 2] if done else None


def plot_steps(axes: Any, timeline: list[list], origin_s: float, origin_step: int, color: str) -> None:
    """Commits at world size 4 as dots, at world size 3 as crosses."""
    for world, marker in [(4, "."), (3, "x")]:
        points = [(t - origin_s, s - origin_step) for t, s, w in timeline if w == world]
        if points:
            axes.plot(*zip(*points, strict=True), marker, ms=4, color=color, ls="none")


def plot_kill(axes: Any, runs: dict[str, dict | None]) -> None:
    right_end = 1.0
    for side, run in runs.items():
        if run is None:
            continue
        label, color = LABELS[side]
        kill_step = run["first_step_after_kill"] + run["committed_steps_lost"]
        plot_steps(axes, run["timeline"], 0.0, kill_step, color)
        axes.plot([], [], "-", color=color, label=f"{label}: state from {run['state_source']}, {run['steps_redone']} "
                                                  f"redone, back at step K after {run['back_at_step_k_s']:.2f} s "
                                                  f"({run['time_lost_s']:.2f} s lost)")
        right_end = max(right_end, run["back_at_step_k_s"] + 1.0)
    axes.axvline(0, color="black", ls="--", lw=1, label="rank 1 SIGKILLed before step K")
    axes.axhline(0, color="gray", lw=0.5)
    axes.set_xlim(-0.5, right_end)
    axes.set_ylim(-45, 25)
    axes.set(xlabel="seconds since the kill (median round)", ylabel="committed step - K",
             title="The kill: dots at world size 4, crosses at 3 (the survivors)")
    axes.legend(fontsize=8, loc="lower right")


def plot_rejoin(axes: Any, runs: dict[str, dict | None]) -> None:
    for side, run in runs.items():
        if run is None or "rejoin_time_lost_s" not in run["rejoin"]:
            continue
        label, color = LABELS[side]
        rejoin = run["rejoin"]
        last_at_three = rejoin["joined_after_kill_s"] - rejoin["step_boundary_s"]
        plot_steps(axes, run["timeline"], last_at_three, rejoin["at_step"], color)
        axes.plot([], [], "-", color=color, label=f"{label}: {rejoin['joined_after_kill_s']:.1f} s after the kill, "
                                                  f"{rejoin['rejoin_pause_s']:.2f} s pause (state from "
                                                  f"{rejoin['state_source']}, formed in "
                                                  f"{rejoin['generation_formed_s']:.2f} s)")
    axes.axvline(0, color="black", ls="--", lw=1, label="last commit at world size 3")
    axes.set_xlim(-1, 2)
    axes.set_ylim(-40, 40)
    axes.set(xlabel="seconds since the last commit at world size 3 (median round)",
             ylabel="committed step - first step at world size 4",
             title="The replacement rejoins: world size 3 -> 4")
    axes.legend(fontsize=8, loc="lower right")


def plot_throughput(axes: Any, rounds: list[dict], summary: dict) -> None:
    medians = summary["medians"]
    for x, side in enumerate(LABELS):
        label, color = LABELS[side]
        values = [r[f"steady_{side}"]["samples_per_s"] for r in rounds
                  if "samples_per_s" in r.get(f"steady_{side}", {})]
        if values:
            axes.bar(x, medians[f"steady_{side}"]["samples_per_s"], color=color, alpha=0.4, width=0.6)
            axes.plot([x] * len(values), values, "o", color=color, ms=4)
    axes.set_xticks(range(len(LABELS)), ["replicas 2", "replicas 1"])
    ratio = summary["r2_over_r1_samples_per_s"]["samples_per_s"]
    axes.set(ylabel="samples/s (steady runs; bar: median, dots: rounds)",
             title=f"Steady state at 4 workers: R=2 / R=1 = {ratio}")


def plot_bytes(axes: Any, measured: dict) -> None:
    parameters = measured["parameters"]
    for x, side in enumerate(LABELS):
        if side not in measured:
            continue
        worst = max(measured[side]["ranks"], key=lambda rank: rank["total"])
        bottom = 0.0
        for part, shade in [("parameters", 0.9), ("gradients", 0.6), ("optimizer", 0.35)]:
            value = worst[part] / parameters
            axes.bar(x, value, bottom=bottom, color=LABELS[side][1], alpha=shade, width=0.6,
                     label=part if x == 0 else None)
            bottom += value
        formula = measured[side]["formula_bytes_per_parameter"]
        axes.hlines(formula, x - 0.4, x + 0.4, color="black", lw=2, label="formula 16R/N" if x == 0 else None)
        axes.annotate(f"{measured[side]['max_over_formula']:.2f}x formula", (x, bottom + 0.15), ha="center", fontsize=8)
    axes.set_xticks(range(len(LABELS)), ["replicas 2", "replicas 1"])
    axes.set(ylabel="bytes per parameter on the largest rank",
             title=f"Bytes per rank, N=4: R=2 / R=1 = {measured.get('r2_over_r1')}")
    axes.legend(fontsize=8, loc="upper right")
