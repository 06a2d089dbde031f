"""The digits runs of benchmarks/redundancy.py, one side each: a kill run (rank 1 SIGKILLs itself before step K,
followed until the replacement is back at world size 4) and a steady run (no kill, to the end)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

import raylastic.cluster.job
from benchmarks import _recovery_changes as changes
from benchmarks import _redundancy_timed as _timed
from benchmarks._recovery_helpers import HIDDEN, summarize_failure
from raylastic.jobconfig import load_job_config

NUM_WORKERS, MIN_WORKERS, CPUS_PER_WORKER, GLOBAL_BATCH, LR, SEED = 4, 3, 0.5, 64, 1e-3, 0
WARMUP_STEPS, STEPS_CAP = 10, 100_000  # the kill runs are stopped once measured


@dataclass(frozen=True)
class Side:
    """What one side of the digits runs sets; everything else is the same job."""

    replicas: int
    """strategy.replicas: in-memory copies of the sharded state (HSDP with 2)."""
    buddy_copy: bool
    """strategy.buddy_copy: each rank's shard also in the next rank's CPU memory while one copy is kept."""
    checkpoint_every: int
    """checkpoint.every_steps (0: no periodic checkpoint)."""
    label: str
    every_minutes: float = 0.0
    """checkpoint.every_minutes (0: no time-based checkpoint)."""
    killed: bool = True
    """Whether the side has a kill run (the timed side measures its saves' cost in the steady run only)."""

    def overrides(self) -> list[str]:
        return [f"strategy.replicas={self.replicas}", f"strategy.buddy_copy={str(self.buddy_copy).lower()}",
                f"checkpoint.every_steps={self.checkpoint_every}", f"checkpoint.every_minutes={self.every_minutes}"]


SIDES = {
    "r2": Side(replicas=2, buddy_copy=True, checkpoint_every=50, label="replicas 2, checkpoint every 50"),
    "buddy": Side(replicas=1, buddy_copy=True, checkpoint_every=0, every_minutes=_timed.DEFAULT_MINUTES,
                  label=f"replicas 1 + buddy copy, a checkpoint every {_timed.DEFAULT_MINUTES:g} min (none in a run "
                        "this short): the defaults"),
    "r1": Side(replicas=1, buddy_copy=False, checkpoint_every=50, label="replicas 1, no copy, checkpoint every 50"),
    "timed": Side(replicas=1, buddy_copy=True, checkpoint_every=0, every_minutes=_timed.MEASURED_MINUTES,
                  killed=False, label=f"the defaults with a checkpoint every {_timed.MEASURED_MINUTES * 60:g} s "
                                      "(steady run only: each save's cost)"),
}
"""r2: issue 18's HSDP (the buddy copy at its default, on: it covers the 3-rank generation, which keeps one copy);
buddy: the defaults a user gets (issue 29); r1: the baseline both replace; timed: the defaults' time-based
checkpoint, its period shortened so that its saves can be measured (benchmarks/_redundancy_timed.py)."""
KILLED_SIDES = tuple(side for side, settings in SIDES.items() if settings.killed)


def job_overrides(name: str, side: Side, steps: int, kill_step: int | None) -> list[str]:
    overrides = [f"name={name}", f"workload.options={{hidden: {HIDDEN}}}", f"training.steps={steps}",
                 f"training.global_batch_size={GLOBAL_BATCH}", f"training.seed={SEED}", "optim.name=adamw",
                 f"optim.lr={LR}", "strategy.name=zero3", *side.overrides(),
                 f"scaling.min_workers={MIN_WORKERS}", f"scaling.max_workers={NUM_WORKERS}",
                 f"scaling.cpus_per_worker={CPUS_PER_WORKER}", "failure.max_failures=1", "checkpoint.resume=never"]
    return overrides if kill_step is None else [*overrides, f"faults=[{{action: kill, rank: 1, step: {kill_step}}}]"]


class RejoinFollower(changes.Follower):
    """Stops the run LINGER_S after world size 4 is back, and then keeps the Controller's own history: the
    driver hears each step once, so a step redone after the kill reaches it only from there."""

    def __init__(self, name: str) -> None:
        super().__init__(name, act=lambda: None, ready=lambda progress: progress.failures >= 1,
                         changed=lambda progress: progress.generation >= 2 and progress.world_size == NUM_WORKERS)
        self.controller_history: list[dict] = []

    def __call__(self, progress: Any) -> None:
        running = not self.stopped
        super().__call__(progress)
        if running and self.stopped:
            self.controller_history = ray.get(self.controller.__ray_call__.remote(lambda c: c.log.history()))


def run_kill(name: str, scratch: Path, side: Side, kill_step: int) -> dict:
    job = load_job_config(None, job_overrides(name, side, STEPS_CAP, kill_step))
    follow = RejoinFollower(name)
    run, _ = changes.follow_run(job, scratch / name, follow)
    rows = {(r["step"], r["time_s"]): r for r in [*run.history, *follow.controller_history]}  # every attempt
    commits = sorted(rows.values(), key=lambda r: r["time_s"])
    summary = summarize_failure([(r["step"], r["time_s"]) for r in commits], kill_step)
    kill_at = next(r["time_s"] for r in run.history if r["step"] == kill_step - 1)  # the driver heard it first
    step_s = statistics.median(interval for step, interval in intervals(run.history) if WARMUP_STEPS < step < kill_step)
    failed = changes.first(run.events, "worker_failed", after_s=kill_at)
    formed = [e for e in run.events if e.type == "generation_formed"]
    after_kill = next(e for e in formed if e.details["generation"] == 1)
    breakdown = {"detected_s": failed.time_s - kill_at,
                 "recover_s": after_kill.time_s - after_kill.details["duration_s"] - failed.time_s,
                 "generation_formed_s": after_kill.details["duration_s"],
                 "first_step_s": kill_at + summary["recovery_s"] - after_kill.time_s,
                 "redo_s": summary["back_at_step_k_s"] - summary["recovery_s"]}
    source = after_kill.details["state_source"]
    record = {"status": "finished", **summary, "step_s": round(step_s, 4),
              "time_lost_s": round(summary["back_at_step_k_s"] - step_s, 4), "state_source": source,
              "checkpoint_read": source == "checkpoint", "resumed_from_step": after_kill.step,
              "steps_lost_event": after_kill.details["steps_lost"],
              "world_size_after_kill": after_kill.details["world_size"],
              "breakdown": {k: round(v, 4) for k, v in breakdown.items()},
              **throughput(run.history, WARMUP_STEPS, kill_step - 1, prefix="pre_kill_"),
              "rejoin": summarize_rejoin(commits, run.events, kill_at, step_s),
              "timeline": [[round(r["time_s"] - kill_at, 4), r["step"], r["world_size"]] for r in commits
                           if r["time_s"] >= kill_at - 1]}
    if (lost := record["rejoin"].get("rejoin_time_lost_s")) is not None:
        record["time_lost_with_rejoin_s"] = round(record["time_lost_s"] + lost, 4)
    record["events"] = changes.membership_events(run.events)
    return record


def summarize_rejoin(commits: list[dict], events: list, kill_at: float, step_s: float) -> dict:
    """The replacement's way back: from the last commit at world size 3 to the first at world size 4."""
    back = next((i for i, r in enumerate(commits) if r["time_s"] > kill_at and r["world_size"] == NUM_WORKERS), None)
    joined = next((e for e in events if e.type == "worker_joined" and e.time_s > kill_at), None)
    formed = next((e for e in events if e.type == "generation_formed" and e.details["generation"] >= 2
                   and e.details["world_size"] == NUM_WORKERS), None)
    if back is None or joined is None or formed is None:
        return {"status": f"no step at world size {NUM_WORKERS} within {changes.GIVE_UP_S} s of the kill"}
    before, first = commits[back - 1], commits[back]
    return {"joined_after_kill_s": round(joined.time_s - kill_at, 4), "at_step": first["step"],
            "rejoin_pause_s": round(first["time_s"] - before["time_s"], 4),
            "rejoin_time_lost_s": round(first["time_s"] - before["time_s"] - step_s, 4),
            "state_source": formed.details["state_source"], "steps_lost_event": formed.details["steps_lost"],
            "step_boundary_s": round(joined.time_s - before["time_s"], 4),
            "generation_formed_s": formed.details["duration_s"],
            "first_step_s": round(first["time_s"] - formed.time_s, 4)}


def run_steady(name: str, scratch: Path, side: Side, steps: int) -> dict:
    job = load_job_config(None, job_overrides(name, side, steps, None))
    result = raylastic.cluster.job.train(job, run_dir=scratch / name)
    if {r["world_size"] for r in result.history} != {NUM_WORKERS}:
        raise RuntimeError(f"the steady run left world size {NUM_WORKERS}: {result.events}")
    step_s = statistics.median(interval for step, interval in intervals(result.history) if step > WARMUP_STEPS)
    # the buddy copies are host memory, not the state the formula counts: kept beside the total, not in it
    memory = [{**m, "total": m["parameters"] + m["gradients"] + m["optimizer"]} for m in result.memory]
    return {"status": "finished", **throughput(result.history, WARMUP_STEPS, steps), "step_s": round(step_s, 5),
            "bytes_per_rank": memory, "max_bytes_per_rank": max(m["total"] for m in memory),
            "max_buddy_copies_bytes": max(m.get("buddy_copies", 0) for m in memory),
            **(_timed.save_costs(result.history, result.events, step_s) if side.every_minutes else {})}


def intervals(history: list[dict]) -> list[tuple[int, float]]:
    """(step, its commit time minus the previous step's) for each step of ``history`` that follows another."""
    times = {r["step"]: r["time_s"] for r in history}
    return [(step, times[step] - times[step - 1]) for step in sorted(times) if step - 1 in times]


def throughput(history: list[dict], after_step: int, last_step: int, prefix: str = "") -> dict[str, float]:
    times = {r["step"]: r["time_s"] for r in history}
    window = [s for s in range(after_step + 1, last_step + 1) if s - 1 in times and s in times]
    median_s = statistics.median(times[s] - times[s - 1] for s in window)
    return {f"{prefix}samples_per_s": round(GLOBAL_BATCH * len(window) / (times[last_step] - times[after_step]), 1),
            f"{prefix}samples_per_s_median_step": round(GLOBAL_BATCH / median_s, 1)}
