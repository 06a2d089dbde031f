"""Slow links (issue 20): time to a target loss and bytes per sample over an emulated 1 Gbit/s link, for DDP,
DDP + PowerSGD, DiLoCo at H = 10 and 50, and DDP and async PS with one worker throttled 2x.

One job for every side: digits with a wide MLP (hidden=HIDDEN, 4.3M parameters: 17 MB of float32 gradients
per rank and step, 0.14 s at 1 Gbit/s against ~0.04 s of compute and optimizer step at 16 samples per rank:
on CPUs a small batch is what makes the gradient large against the compute, as a GPU's speed does), global
batch GLOBAL_BATCH over WORKERS workers, AdamW(lr=1e-3) (DiLoCo's inner optimizer; its outer one is the
default Nesterov SGD, lr 0.7, momentum 0.9), the same seed, sample order and number of steps, 1 CPU and 1
torch thread per rank, equal batch shares (``scaling.balance: off``), no checkpoint but the final one. The
link is the job's ``link:`` section (strategies/emulated_link.py): after its communication a step sleeps the
bytes its rank sent x 8 / bandwidth, plus the latency once; not overlapped with backward, so DDP's figure is
an upper bound on its exposed communication. Sides (``SIDES``: each is one entry, a strategy section and
whether a rank is throttled, compared with its baseline; an asynchronous side is one more):

- ``ddp``: torch DDP, a 17 MB all-reduce every step;
- ``ddp_powersgd``: the best compressor of benchmarks/communication.py: PowerSGD rank 4 sent 39x fewer bytes
  within 1-3% of uncompressed DDP's loss (top-k and 1-bit sent as much or less and missed their loss goals),
  and it all-reduces, so the link's per-rank bytes are its payload at any world size (top-k, 1-bit and int8
  all-gather: N-1 payloads per rank). Two uncompressed steps first (``powersgd_start_iter`` 2);
- ``diloco_h10``, ``diloco_h50``: one all-reduce of the parameters' change every 10 / 50 steps;
- ``ddp_throttled``: ddp with the last rank throttled 2x from step 1 (faults ``throttle``: it sleeps its
  previous step's compute before each step), the baseline of the asynchronous side;
- ``async_ps_throttled``: async_ps with two parameter servers, the same throttle: each worker pulls the 17 MB
  of parameters, computes a whole step (32 samples) and pushes 17 MB of gradients; the link is full duplex, as
  for the synchronous sides (a push goes out while the worker pulls and computes its next step); its bytes per
  sample count the pushed gradients (``bytes_received_per_sample``: the pulled parameters).

Time to target: the target is ddp's training loss, smoothed over SMOOTHING_STEPS steps, at TARGET_FRACTION of
the run; a side's time to it is the time from the commit of its step 1 to the commit of the first step whose
smoothed loss is at or below it. The training loss is the history's: each step's loss over the global batch,
before the step's update, of the models the ranks train (for DiLoCo, between outer steps, their own inner
models); the held-out eval loss and accuracy after the last step (DiLoCo: after its final outer step) are
reported beside it. Each round runs every side, in reverse order every other round, after one unmeasured
short run; the math is deterministic, so only the times change between rounds; ratios are of medians over
rounds. Run from the repository root (about 6 minutes a round on 2 cores at the defaults)::

    .venv/bin/python -m benchmarks.slow_links --rounds 1
    .venv/bin/python -m benchmarks.slow_links --rounds 3 --bandwidth-gbit-s 0.1 --latency-ms 20

Writes benchmarks/results/slow_links.json and slow_links.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, alternated, code_version, machine_info
from raylastic.cluster.connect import ray_session
from raylastic.cluster.job import train
from raylastic.jobconfig import job_config_from_dict

HIDDEN, GLOBAL_BATCH, WORKERS, LR, FACTOR = 2048, 32, 2, 1e-3, 2.0
SERVERS, SERVER_CPUS = 2, 0.5
"""async_ps: two parameter servers of half a CPU: they share the 2 cores with the two workers (which the
synchronous sides use alone) and run the AdamW step each DDP rank runs for itself. The link is emulated on the
workers only: two servers each carry half of every update's bytes, within what one worker's link carries."""
DEFAULT_STEPS = 300
WARMUP_RUN_STEPS = 20
SMOOTHING_STEPS = 20
TARGET_FRACTION = 0.5
GOALS = {"diloco_h50_time_over_ddp_at_most": 0.3, "diloco_h50_bytes_fewer_than_ddp_at_least": 40.0,
         "async_ps_throttled_time_over_ddp_throttled_below": 0.95}
"""Issue 20's goals at an emulated 1 Gbit/s. "Async PS beats DDP's time" is read as at least 5% faster: the times
move by a few percent between rounds on a quiet machine."""


@dataclass(frozen=True)
class Side:
    """One way to train the job: its strategy section, whether the last rank is throttled, its baseline."""

    name: str
    strategy: dict[str, Any] = field(default_factory=dict)
    throttled: bool = False
    baseline: str = "ddp"
    """The side its time and bytes are compared with."""


SIDES = (Side("ddp", {"name": "ddp"}),
         Side("ddp_powersgd", {"name": "ddp", "compression": "powersgd", "powersgd_start_iter": 2}),
         Side("diloco_h10", {"name": "diloco", "sync_every": 10}),
         Side("diloco_h50", {"name": "diloco", "sync_every": 50}),
         Side("ddp_throttled", {"name": "ddp"}, throttled=True),
         Side("async_ps_throttled", {"name": "async_ps", "num_servers": SERVERS, "server_cpus": SERVER_CPUS},
              throttled=True,
              baseline="ddp_throttled"))


@dataclass(frozen=True)
class Link:
    bandwidth_gbit_s: float
    latency_ms: float


def job_sections(side: Side, steps: int, link: Link) -> dict:
    sections = {"workload": {"name": "digits", "options": {"hidden": HIDDEN}},
                "training": {"steps": steps, "global_batch_size": GLOBAL_BATCH},
                "optim": {"name": "adamw", "lr": LR}, "strategy": dict(side.strategy),
                "scaling": {"min_workers": WORKERS, "max_workers": WORKERS, "cpus_per_worker": 1, "balance": "off"},
                "checkpoint": {"every_steps": 0, "resume": "never"},
                "link": {"bandwidth_gbit_s": link.bandwidth_gbit_s, "latency_ms": link.latency_ms}}
    if side.throttled:
        sections["faults"] = [{"action": "throttle", "rank": WORKERS - 1, "step": 1, "factor": FACTOR}]
    job_config_from_dict(sections)  # a bad section fails here, before any run starts
    return sections


def run_side(side: Side, steps: int, link: Link, run_dir: Path) -> dict[str, Any]:
    """One run of ``side``: its per-step curve, traffic and final metrics."""
    load = os.getloadavg()[0]
    started = time.perf_counter()
    result = train(job_config_from_dict({**job_sections(side, steps, link), "name": f"slow-links-{run_dir.name}"}),
                   run_dir=run_dir)
    wall_s = time.perf_counter() - started
    rows = result.history
    assert [row["step"] for row in rows] == list(range(1, steps + 1)), "a step was redone or lost"
    origin = rows[0]["time_s"]
    samples = sum(row["samples"] for row in rows)
    return {"wall_s": round(wall_s, 2), "load_average_at_start": round(load, 2),
            "bytes_per_sample": round(sum(row["bytes_sent"] for row in rows) / samples, 1),
            "bytes_received_per_sample": round(sum(row.get("bytes_received", 0) for row in rows) / samples, 1),
            "median_step_s": round(statistics.median(row["step_s"] for row in rows), 4),
            "link_delay_s_per_step": round(sum(row.get("link_delay_s", 0.0) for row in rows) / len(rows), 4),
            "eval_loss": round(result.metrics["eval_loss"], 4), "accuracy": round(result.metrics["accuracy"], 4),
            "curve": [[row["step"], round(row["time_s"] - origin, 3), round(row["loss"], 5), row["bytes_sent"]]
                      for row in rows]}


def smoothed(losses: list[float], window: int = SMOOTHING_STEPS) -> list[float | None]:
    """Trailing means over ``window`` steps; None for the first window - 1 steps."""
    return [None if k + 1 < window else sum(losses[k + 1 - window:k + 1]) / window for k in range(len(losses))]


def time_to_target(curve: list[list], target: float) -> dict[str, Any]:
    """When a run's smoothed loss first reaches ``target``: seconds after step 1's commit, its step and the bytes
    sent until then (all ranks); None where it never does."""
    losses = smoothed([loss for _, _, loss, _ in curve])
    hit = next((k for k, loss in enumerate(losses) if loss is not None and loss <= target), None)
    if hit is None:
        return {"time_to_target_s": None, "steps_to_target": None, "bytes_to_target": None}
    return {"time_to_target_s": curve[hit][1], "steps_to_target": curve[hit][0],
            "bytes_to_target": sum(row[3] for row in curve[:hit + 1])}


def target_loss(ddp_curve: list[list], steps: int) -> float:
    """ddp's smoothed loss at TARGET_FRACTION of the run."""
    return smoothed([loss for _, _, loss, _ in ddp_curve])[round(TARGET_FRACTION * steps) - 1]


def benchmark(sides: tuple[Side, ...], steps: int, rounds: int, link: Link, scratch: Path) -> dict[str, list[dict]]:
    """Every side ``rounds`` times, after one unmeasured short run; each run with its round's target figures."""
    run_side(sides[0], WARMUP_RUN_STEPS, link, scratch / "warmup")
    runs: dict[str, list[dict]] = {side.name: [] for side in sides}
    for index in range(rounds):
        for side in alternated(sides, index):
            run = run_side(side, steps, link, scratch / f"{side.name}-{index}")
            runs[side.name].append(run)
            print(f"  round {index + 1}/{rounds} {side.name:14s} step {run['median_step_s'] * 1000:6.1f} ms (link "
                  f"{run['link_delay_s_per_step'] * 1000:5.1f}), {run['bytes_per_sample'] / 1e3:8.1f} kB/sample, "
                  f"eval loss {run['eval_loss']:.3f} (load {run['load_average_at_start']:.1f})", flush=True)
        target = target_loss(runs["ddp"][index]["curve"], steps)
        for side in sides:
            runs[side.name][index].update(target_loss=round(target, 5),
                                          **time_to_target(runs[side.name][index]["curve"], target))
    return runs


def summarize(sides: tuple[Side, ...], runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Per side: medians over rounds, and ratios to its baseline (time: side / baseline; bytes: baseline / side)."""
    def median(name: str, key: str) -> float | None:
        values = [run[key] for run in runs[name]]
        return None if None in values else round(statistics.median(values), 4)

    measured = ("time_to_target_s", "steps_to_target", "bytes_per_sample", "median_step_s", "link_delay_s_per_step",
                "eval_loss", "accuracy")
    summary = {}
    for side in sides:
        medians = {key: median(side.name, key) for key in measured}
        time_s, base_time_s = medians["time_to_target_s"], median(side.baseline, "time_to_target_s")
        summary[side.name] = {
            "baseline": side.baseline, **medians,
            "time_over_baseline": None if time_s is None or not base_time_s else round(time_s / base_time_s, 4),
            "bytes_fewer_than_baseline": round(median(side.baseline, "bytes_per_sample")
                                               / medians["bytes_per_sample"], 2),
            "paired_time_over_baseline": [None if a["time_to_target_s"] is None or not b["time_to_target_s"] else
                                          round(a["time_to_target_s"] / b["time_to_target_s"], 4)
                                          for a, b in zip(runs[side.name], runs[side.baseline], strict=True)]}
    return summary


def goals_met(summary: dict[str, dict]) -> dict[str, bool | None]:
    """Each goal: met, not met, or None where its side was not measured (or never reached the target)."""
    diloco, async_ps = summary.get("diloco_h50", {}), summary.get("async_ps_throttled", {})
    time_ratio, async_ratio = diloco.get("time_over_baseline"), async_ps.get("time_over_baseline")
    return {"diloco_h50_time_over_ddp_at_most": None if time_ratio is None
            else time_ratio <= GOALS["diloco_h50_time_over_ddp_at_most"],
            "diloco_h50_bytes_fewer_than_ddp_at_least": None if not diloco
            else diloco["bytes_fewer_than_baseline"] >= GOALS["diloco_h50_bytes_fewer_than_ddp_at_least"],
            "async_ps_throttled_time_over_ddp_throttled_below": None if async_ratio is None
            else async_ratio < GOALS["async_ps_throttled_time_over_ddp_throttled_below"]}


def plot(sides: tuple[Side, ...], runs: dict[str, list[dict]], summary: dict[str, dict], link: Link,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves_ax, time_ax, bytes_ax) = plt.subplots(1, 3, figsize=(15, 4.2), width_ratios=(2, 1, 1))
    for side in sides:
        run = sorted(runs[side.name], key=lambda r: r["wall_s"])[len(runs[side.name]) // 2]  # the median round's
        curve = run["curve"]
        losses = smoothed([loss for _, _, loss, _ in curve])
        points = [(t, loss) for (_, t, _, _), loss in zip(curve, losses, strict=True) if loss is not None]
        curves_ax.plot(*zip(*points, strict=True), label=side.name, linestyle="--" if side.throttled else "-")
    target = runs["ddp"][0]["target_loss"]
    curves_ax.axhline(target, color="0.4", linestyle=":", label=f"target {target:.3g}")
    curves_ax.set_yscale("log")
    curves_ax.set_xlabel("seconds after step 1")
    curves_ax.set_ylabel(f"training loss, mean of {SMOOTHING_STEPS} steps")
    curves_ax.set_title(f"emulated link {link.bandwidth_gbit_s:g} Gbit/s, {link.latency_ms:g} ms (median round)",
                        fontsize=10)
    curves_ax.legend(fontsize=8)
    names = [side.name for side in sides]
    times = [summary[name]["time_to_target_s"] or 0.0 for name in names]
    time_ax.bar(range(len(names)), times, color="tab:blue", alpha=0.8)
    for x, name in enumerate(names):
        ratio = summary[name]["time_over_baseline"]
        time_ax.annotate("never" if ratio is None else f"{ratio:.2f}x", (x, times[x]), ha="center", va="bottom",
                         fontsize=8)
    time_ax.set_xticks(range(len(names)), [n.replace("_", "\n", 1) for n in names], fontsize=7)
    time_ax.set_ylabel("time to target, s (median)")
    time_ax.set_title("time to target (x its baseline)", fontsize=10)
    per_sample = [summary[name]["bytes_per_sample"] / 1e3 for name in names]
    bytes_ax.bar(range(len(names)), per_sample, color="tab:orange", alpha=0.8)
    for x, name in enumerate(names):
        bytes_ax.annotate(f"{summary[name]['bytes_fewer_than_baseline']:.0f}x fewer", (x, per_sample[x]),
                          ha="center", va="bottom", fontsize=8)
    bytes_ax.set_yscale("log")
    bytes_ax.set_xticks(range(len(names)), [n.replace("_", "\n", 1) for n in names], fontsize=7)
    bytes_ax.set_ylabel("kB sent per sample (all ranks)")
    bytes_ax.set_title("bytes per sample", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def describe(steps: int, link: Link) -> dict[str, Any]:
    """The JSON's "job" and "definitions"."""
    job = {"workload": f"digits(hidden={HIDDEN})", "workers": WORKERS, "global_batch_size": GLOBAL_BATCH,
           "steps": steps, "optimizer": f"AdamW(lr={LR:g})", "cpus_per_worker": 1, "balance": "off",
           "link": f"{link.bandwidth_gbit_s:g} Gbit/s, {link.latency_ms:g} ms",
           "sides": {side.name: {"strategy": side.strategy, "throttled": side.throttled, "baseline": side.baseline}
                     for side in SIDES},
           "throttle": f"rank {WORKERS - 1} from step 1, factor {FACTOR:g}"}
    definitions = {
        "target_loss": f"ddp's training loss, a trailing mean over {SMOOTHING_STEPS} steps, at step "
                       f"{round(TARGET_FRACTION * steps)} ({TARGET_FRACTION:.0%} of the run)",
        "time_to_target_s": "from the commit of step 1 to the commit of the first step whose smoothed training "
                            "loss is at or below the target (rank 0's clock; start-up not counted); "
                            "None: never reached",
        "training_loss": "the history's loss: the global batch's mean, before the step's update, of the models the "
                         "ranks train (DiLoCo between outer steps: each rank's inner model on its own samples)",
        "eval_loss, accuracy": "held-out digits after the last step (DiLoCo: after the final outer step)",
        "bytes_per_sample": "bytes sent by all ranks over the run (their payloads to the collectives: the gradient "
                            "all-reduces, PowerSGD's factors, DiLoCo's outer all-reduces; async PS: the gradients "
                            "pushed) / samples trained",
        "bytes_received_per_sample": "async PS: the parameters pulled / samples trained",
        "time_over_baseline": "median time to target / its baseline's (ddp; async_ps_throttled: ddp_throttled); "
                              "paired: the same per round",
        "bytes_fewer_than_baseline": "the baseline's bytes per sample / the side's",
        "link_delay_s_per_step": "the emulated link's sleep per step on rank 0 (async PS: per update, the pull "
                                 "and any wait for the last push to go out), mean over the run",
        "emulation": "strategies/emulated_link.py: after a step's communication the rank sleeps its bytes x 8 / "
                     "bandwidth + the latency once; on top of the real local gloo transport; not overlapped "
                     "with backward (an upper bound on DDP's exposed communication); exact per-rank bytes for a "
                     "ring all-reduce at 2 ranks"}
    return {"job": job, "definitions": definitions}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every side (order flipped every round)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps per run (a multiple of 50)")
    parser.add_argument("--bandwidth-gbit-s", type=float, default=1.0, help="the emulated link's bandwidth")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="the emulated link's latency per step")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 2 * SMOOTHING_STEPS or args.steps % 50:
        parser.error(f"need --rounds >= 1 and --steps a multiple of 50, at least {2 * SMOOTHING_STEPS}")
    link = Link(args.bandwidth_gbit_s, args.latency_ms)

    os.chdir(Path(__file__).resolve().parent.parent)  # Ray workers import the workloads from here
    load_before = os.getloadavg()
    with (tempfile.TemporaryDirectory(prefix="raylastic-slow-links-") as scratch,
          ray_session(min_cpus=WORKERS + SERVERS * SERVER_CPUS)):
        runs = benchmark(SIDES, args.steps, args.rounds, link, Path(scratch))
    summary = summarize(SIDES, runs)
    machine = {**machine_info(), "load_average_1_5_15_before": [round(v, 2) for v in load_before],
               "load_average_at_end": [round(v, 2) for v in os.getloadavg()]}
    report = {"benchmark": f"slow links: time to a target loss and bytes per sample at an emulated "
                           f"{link.bandwidth_gbit_s:g} Gbit/s: DDP, DDP + PowerSGD, DiLoCo H=10/50; DDP and async PS "
                           "with a rank throttled 2x",
              "command": machine["command"], "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "code": code_version(), "machine": machine, **describe(args.steps, link), "goals": GOALS,
              "goals_met": goals_met(summary), "target_loss": runs["ddp"][0]["target_loss"], "summary": summary,
              "runs": runs}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "slow_links.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(SIDES, runs, summary, link, RESULTS / "slow_links.png")
    print(f"target loss {report['target_loss']}")
    for name, s in summary.items():
        print(f"  {name:14s} time to target {s['time_to_target_s']} s ({s['time_over_baseline']}x {s['baseline']}), "
              f"{s['bytes_per_sample'] / 1e3:.1f} kB/sample ({s['bytes_fewer_than_baseline']}x fewer), eval loss "
              f"{s['eval_loss']}, accuracy {s['accuracy']}")
    print(f"goals met: {report['goals_met']}\nwrote {RESULTS / 'slow_links.json'} and slow_links.png")


if __name__ == "__main__":
    main()
