"""The plot of benchmarks/redundancy.py: the steps around the kill and around the replacement's rejoin on every
side (median round), the digits steady runs' samples/s per round, the bytes per rank against the formulas, and
the buddy copy's cost on the GPT recipe (samples/s with and without it, host bytes per rank)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LABELS = {"r2": ("replicas 2 + checkpoint/50", "tab:blue"), "buddy": ("replicas 1 + buddy copy", "tab:green"),
          "r1": ("replicas 1 + checkpoint/50", "tab:red")}
GPT_LABELS = {"buddy": ("buddy copy on", "tab:green"), "none": ("buddy copy off", "tab:gray")}


def plot(rounds: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((kill, rejoin, gpt_speed), (speed, held, gpt_bytes)) = plt.subplots(2, 3, figsize=(21, 9.5))
    runs = {side: median_round(rounds, f"kill_{side}", "time_lost_s") for side in LABELS}
    plot_kill(kill, runs)
    plot_rejoin(rejoin, runs)
    plot_throughput(speed, rounds, summary)
    plot_bytes(held, summary["bytes_per_rank"])
    plot_gpt_speed(gpt_speed, rounds, summary["buddy_cost"])
    plot_gpt_bytes(gpt_bytes, summary["buddy_cost"]["host_bytes"])
    loads = [r["load_average_at_start"][0] for r in rounds]
    fig.suptitle(f"zero3, 4 workers of 0.5 CPU, rank 1 SIGKILLed before step K: {len(rounds)} rounds on a 2-core "
                 f"machine (1-min load average {min(loads):.1f}-{max(loads):.1f} at round starts)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
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
             title="The kill (digits): dots at world size 4, crosses at 3 (the survivors)")
    axes.legend(fontsize=7, loc="lower right")


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
    axes.legend(fontsize=7, loc="lower right")


def bars_with_rounds(axes: Any, x: int, values: list[float], median: float | None, color: str) -> None:
    if values and median is not None:
        axes.bar(x, median, color=color, alpha=0.4, width=0.6)
        axes.plot([x] * len(values), values, "o", color=color, ms=4)


def plot_throughput(axes: Any, rounds: list[dict], summary: dict) -> None:
    medians = summary["medians"]
    for x, (side, (_, color)) in enumerate(LABELS.items()):
        values = [r[f"steady_{side}"]["samples_per_s"] for r in rounds
                  if "samples_per_s" in r.get(f"steady_{side}", {})]
        bars_with_rounds(axes, x, values, medians[f"steady_{side}"].get("samples_per_s"), color)
    axes.set_xticks(range(len(LABELS)), [label for label, _ in LABELS.values()], fontsize=8)
    ratios = summary["over_r1_samples_per_s"]
    axes.set(ylabel="samples/s (steady runs; bar: median, dots: rounds)",
             title=f"Digits steady state at 4 workers, over r1: r2 {ratios['r2']['samples_per_s']}, "
                   f"buddy {ratios['buddy']['samples_per_s']}")


def plot_bytes(axes: Any, measured: dict) -> None:
    parameters, top = measured["parameters"], 0.0
    for x, side in enumerate(LABELS):
        if side not in measured:
            continue
        worst = max(measured[side]["ranks"], key=lambda rank: rank["total"])
        bottom = 0.0
        for part, shade in [("parameters", 0.9), ("gradients", 0.6), ("optimizer", 0.35)]:
            value = worst[part] / parameters
            axes.bar(x - 0.15, value, bottom=bottom, color=LABELS[side][1], alpha=shade, width=0.3,
                     label=part if x == 0 else None)
            bottom += value
        formula = measured[side]["formula_bytes_per_parameter"]
        axes.hlines(formula, x - 0.3, x, color="black", lw=2, label="formula 16R/N" if x == 0 else None)
        copies = measured[side]["max_buddy_copies_bytes"] / parameters
        top = max(top, bottom, copies)
        if copies:
            axes.bar(x + 0.15, copies, color=LABELS[side][1], alpha=0.2, width=0.3, hatch="//",
                     label="buddy copies (host memory)")
            axes.annotate(f"{measured[side]['buddy_copies_over_shard']:.2f}x the shard", (x + 0.15, copies + 0.15),
                          ha="center", fontsize=8)
    axes.set_xticks(range(len(LABELS)), [label for label, _ in LABELS.values()], fontsize=8)
    axes.set_ylim(0, 1.25 * top)
    axes.set(ylabel="bytes per parameter on the largest rank",
             title=f"Digits bytes per rank, N=4: r2 / r1 = {measured.get('r2_over_r1')}")
    axes.legend(fontsize=7, loc="upper left")


def plot_gpt_speed(axes: Any, rounds: list[dict], cost: dict) -> None:
    pairs = [(r["gpt_buddy"]["samples_per_s"], r["gpt_none"]["samples_per_s"]) for r in rounds
             if "samples_per_s" in r.get("gpt_buddy", {}) and "samples_per_s" in r.get("gpt_none", {})]
    for x, (side, (_, color)) in enumerate(GPT_LABELS.items()):
        values = [r[f"gpt_{side}"]["samples_per_s"] for r in rounds if "samples_per_s" in r.get(f"gpt_{side}", {})]
        bars_with_rounds(axes, x, values, cost["medians"][side]["samples_per_s"], color)
    for buddy, none in pairs:
        axes.plot([0, 1], [buddy, none], "-", color="black", lw=0.5)
    axes.set_xticks(range(len(GPT_LABELS)), [label for label, _ in GPT_LABELS.values()])
    axes.set(ylabel="samples/s (steady part; lines: the same round)",
             title=f"The buddy copy's cost, GPT recipe (zero3, 4 x 0.5 CPU, replicas 1)\nbuddy / none: "
                   f"{cost['paired_ratio_median']} (median of the rounds' {cost['paired_ratios']})")


def plot_gpt_bytes(axes: Any, host: dict | None) -> None:
    if host is None:
        axes.set_title("GPT: no finished run with the buddy copy")
        return
    ranks = host["ranks"]
    xs = range(len(ranks))
    axes.bar([x - 0.2 for x in xs], [r["shard"] / 2**20 for r in ranks], width=0.4, color="tab:gray",
             label="the rank's shard: parameters + optimizer state")
    axes.bar([x + 0.2 for x in xs], [r["buddy_copies"] / 2**20 for r in ranks], width=0.4, color="tab:green",
             alpha=0.5, hatch="//", label="buddy copies (host memory)")
    for x, ratio in zip(xs, host["over_shard_per_rank"], strict=True):
        axes.annotate(f"{ratio:.2f}x", (x + 0.2, ranks[x]["buddy_copies"] / 2**20), ha="center", va="bottom",
                      fontsize=8)
    axes.set_xticks(list(xs), [f"rank {x}" for x in xs])
    axes.set_ylim(0, 1.3 * max(r["buddy_copies"] for r in ranks) / 2**20)
    axes.set(ylabel="MiB", title="GPT: the buddy copies' host bytes per rank against its shard")
    axes.legend(fontsize=7, loc="upper left")
