"""HSDP's in-memory copies (strategy.replicas R = 2) against one copy and a checkpoint every 50 steps (R = 1).

Issue 18. The same job on both sides: digits MLP (hidden=512), zero3, 4 CPU workers of 0.5 CPU (1 torch
thread each), global batch 64, AdamW(lr=1e-3), the same sample order, a checkpoint every 50 steps,
min_workers=3, max_workers=4, max_failures=1; only ``strategy.replicas`` differs. Per side and round:

- a kill run: rank 1 SIGKILLs its own process just before step K (default 90, mid-interval: R = 1 goes
  back to the step-50 checkpoint) with the ``kill`` fault; the 3 survivors carry on (at 3 ranks two copies
  cannot split the ranks evenly, so the generation keeps one: strategies/shard_layout.py), a replacement
  worker starts on the freed slot and joins at a later step boundary (world size 4 again, R = 2 again).
  The run is stopped 3 s after the driver sees world size 4 again. Its recovery_s, back_at_step_k_s and
  steps_redone are benchmarks/recovery.py's (``summarize_failure``); further definitions (also in the JSON):
  - step_s: the median interval between the commits of consecutive steps 11..K-1 (world size 4, no kill yet);
  - time_lost_s: back_at_step_k_s - step_s, the delay of step K against an undisturbed run;
  - rejoin_pause_s: from the last commit at world size 3 to the first at world size 4; rejoin_time_lost_s:
    that minus step_s; time_lost_with_rejoin_s: time_lost_s + rejoin_time_lost_s;
  - state_source: the generation_formed event of the generation after the kill: 'peers' (every shard had a
    surviving copy) or 'checkpoint' (a file was read);
- a steady run: the same job without the kill, ``--steady-steps`` steps at 4 workers, to the end; samples/s
  over steps 11..end (the checkpoints' saves included, as the user pays them) and 64 / the median step
  interval; the pre-kill steps 11..K-1 of the kill runs give the same figures a second time; bytes per rank:
  ``TrainWorker.memory()`` (strategies.base.memory_breakdown: parameters, gradients, optimizer state) at the
  run's end, against fp32 AdamW's 16 bytes per parameter: zero3 at N ranks 16/N, HSDP with R copies 16R/N.

Goals (issue 18), for R = 2: steps_redone <= 1 (every round) and time_lost_s < 2 s (median). One local Ray
instance (2 CPUs) per round; the side that goes first alternates; medians over rounds. Run from the
repository root (2-4 minutes a round on 2 busy cores)::

    .venv/bin/python -m benchmarks.redundancy                # 3 rounds
    .venv/bin/python -m benchmarks.redundancy --rounds 5 --kill-step 80

Writes benchmarks/results/redundancy.json and redundancy.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import ray
import torch

import cluster.job
from benchmarks import _recovery_changes as changes
from benchmarks import _redundancy_plot
from benchmarks.recovery import HIDDEN, code_version, guarded, local_ray, numbers, summarize_failure
from jobconfig import load_job_config
from workloads.digits import Digits

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results"
NUM_WORKERS, MIN_WORKERS, CPUS_PER_WORKER, GLOBAL_BATCH, LR, SEED = 4, 3, 0.5, 64, 1e-3, 0
CHECKPOINT_EVERY, WARMUP_STEPS, STEPS_CAP = 50, 10, 100_000  # the kill runs are stopped once measured
SIDES = {"r2": 2, "r1": 1}  # strategy.replicas
GOALS = {"steps_redone_at_most": 1, "time_lost_s_below": 2.0}
NUM_PARAMETERS = sum(p.numel() for p in Digits(hidden=HIDDEN).build_model().parameters())
BYTES_PER_PARAMETER = 16  # fp32 AdamW: 4 parameter + 4 gradient + 8 optimizer state (ZeRO paper, section 5)


def job_overrides(name: str, replicas: int, steps: int, kill_step: int | None) -> list[str]:
    overrides = [f"name={name}", f"workload.options={{hidden: {HIDDEN}}}", f"training.steps={steps}",
                 f"training.global_batch_size={GLOBAL_BATCH}", f"training.seed={SEED}", "optim.name=adamw",
                 f"optim.lr={LR}", "strategy.name=zero3", f"strategy.replicas={replicas}",
                 f"scaling.min_workers={MIN_WORKERS}", f"scaling.max_workers={NUM_WORKERS}",
                 f"scaling.cpus_per_worker={CPUS_PER_WORKER}", "failure.max_failures=1",
                 f"checkpoint.every_steps={CHECKPOINT_EVERY}", "checkpoint.resume=never"]
    return overrides if kill_step is None else [*overrides, f"faults=[{{action: kill, rank: 1, step: {kill_step}}}]"]


class RejoinFollower(changes.Follower):
    """Stops the run LINGER_S after world size 4 is back, and then keeps the Controller's own history: the
    driver hears each step once, so a step redone after the kill (R = 1) reaches it only from there."""

    def __init__(self, name: str) -> None:
        super().__init__(name, act=lambda: None, ready=lambda progress: progress.failures >= 1,
                         changed=lambda progress: progress.generation >= 2 and progress.world_size == NUM_WORKERS)
        self.controller_history: list[dict] = []

    def __call__(self, progress: Any) -> None:
        running = not self.stopped
        super().__call__(progress)
        if running and self.stopped:
            self.controller_history = ray.get(self.controller.__ray_call__.remote(lambda c: c.log.history()))


def run_kill(name: str, scratch: Path, replicas: int, kill_step: int) -> dict:
    job = load_job_config(None, job_overrides(name, replicas, STEPS_CAP, kill_step))
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
    record = {"status": "finished", **summary, "step_s": round(step_s, 4),
              "time_lost_s": round(summary["back_at_step_k_s"] - step_s, 4),
              "state_source": after_kill.details["state_source"], "checkpoint_read": after_kill.details[
                  "state_source"] == "checkpoint", "resumed_from_step": after_kill.step,
              "steps_lost_event": after_kill.details["steps_lost"], "world_size_after_kill":
                  after_kill.details["world_size"], "breakdown": {k: round(v, 4) for k, v in breakdown.items()},
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


def run_steady(name: str, scratch: Path, replicas: int, steps: int) -> dict:
    job = load_job_config(None, job_overrides(name, replicas, steps, None))
    result = cluster.job.train(job, run_dir=scratch / name)
    if {r["world_size"] for r in result.history} != {NUM_WORKERS}:
        raise RuntimeError(f"the steady run left world size {NUM_WORKERS}: {result.events}")
    step_s = statistics.median(interval for step, interval in intervals(result.history) if step > WARMUP_STEPS)
    memory = [{**m, "total": sum(m.values())} for m in result.memory]
    return {"status": "finished", **throughput(result.history, WARMUP_STEPS, steps), "step_s": round(step_s, 5),
            "bytes_per_rank": memory, "max_bytes_per_rank": max(m["total"] for m in memory)}


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


def run_round(index: int, scratch: Path, args: argparse.Namespace) -> dict:
    order = list(SIDES) if index % 2 == 0 else list(reversed(SIDES))
    record: dict[str, Any] = {"round": index, "order": order, "load_average_at_start": os.getloadavg()}
    local_ray(int(NUM_WORKERS * CPUS_PER_WORKER))
    try:
        for side in order:
            record[f"kill_{side}"] = guarded(run_kill, f"kill-{side}-{index}", scratch, SIDES[side], args.kill_step)
        for side in order:
            record[f"steady_{side}"] = guarded(run_steady, f"steady-{side}-{index}", scratch, SIDES[side],
                                               args.steady_steps)
    finally:
        ray.shutdown()
    print(f"round {index}: " + ", ".join(
        f"{key} {run.get('time_lost_s', run.get('samples_per_s', run.get('error')))}" for key, run in record.items()
        if isinstance(run, dict)), flush=True)
    return record


def summarize(rounds: list[dict]) -> dict:
    keys = [f"{kind}_{side}" for kind in ("kill", "steady") for side in SIDES]
    ok = {key: [r[key] for r in rounds if r.get(key, {}).get("status") == "finished"] for key in keys}
    medians = {}
    for key, runs in ok.items():
        flat = [numbers({**run, **{k if k.startswith("rejoin_") else f"rejoin_{k}": v
                                   for k, v in run.get("rejoin", {}).items()}}) for run in runs]
        fields = sorted({f for run in flat for f in run})
        medians[key] = {f: round(statistics.median(run[f] for run in flat if f in run), 4) for f in fields}
    paired = [r["steady_r2"]["samples_per_s"] / r["steady_r1"]["samples_per_s"] for r in rounds
              if r.get("steady_r2", {}).get("status") == r.get("steady_r1", {}).get("status") == "finished"]
    ratios = {f"{kind}{field}": _ratio(medians[f"{kind_key}_r2"].get(f"{prefix}{field}"),
                                       medians[f"{kind_key}_r1"].get(f"{prefix}{field}"))
              for kind, kind_key, prefix in [("", "steady", ""), ("pre_kill_", "kill", "pre_kill_")]
              for field in ("samples_per_s", "samples_per_s_median_step")}
    ratios["samples_per_s_paired_median"] = round(statistics.median(paired), 3) if paired else None
    redone = [run["steps_redone"] for run in ok["kill_r2"]]
    goals_met = {"steps_redone_at_most": max(redone) <= GOALS["steps_redone_at_most"] if redone else None,
                 "time_lost_s_below": _below(medians["kill_r2"].get("time_lost_s"), GOALS["time_lost_s_below"])}
    return {"medians": medians, "r2_over_r1_samples_per_s": ratios, "bytes_per_rank": bytes_per_rank(ok),
            "state_sources": {key: [run["state_source"] for run in ok[key]] for key in ("kill_r2", "kill_r1")},
            "steps_redone_worst_round_r2": max(redone, default=None),
            "outcomes": {key: [r.get(key, {}).get("status") for r in rounds] for key in keys}, "goals_met": goals_met}


def bytes_per_rank(ok: dict[str, list[dict]]) -> dict:
    """Measured against the formula, from the first finished steady run of each side (bytes repeat exactly)."""
    out: dict[str, Any] = {"parameters": NUM_PARAMETERS}
    for side, replicas in SIDES.items():
        if not ok[f"steady_{side}"]:
            continue
        ranks = ok[f"steady_{side}"][0]["bytes_per_rank"]
        formula = BYTES_PER_PARAMETER * replicas / NUM_WORKERS
        worst = max(ranks, key=lambda m: m["total"])
        out[side] = {"formula_bytes_per_parameter": formula, "formula_bytes": round(formula * NUM_PARAMETERS),
                     "max_bytes": worst["total"], "max_bytes_per_parameter": round(worst["total"] / NUM_PARAMETERS, 4),
                     "max_over_formula": round(worst["total"] / (formula * NUM_PARAMETERS), 4), "ranks": ranks}
    if "r1" in out and "r2" in out:
        out["r2_over_r1"] = round(out["r2"]["max_bytes"] / out["r1"]["max_bytes"], 4)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _below(value: float | None, limit: float) -> bool | None:
    return None if value is None else value < limit


def describe(args: argparse.Namespace) -> dict[str, dict]:
    job = {"workload": f"digits(hidden={HIDDEN}), {NUM_PARAMETERS:,} parameters", "strategy": "zero3",
           "replicas": "2 (r2) or 1 (r1)", "workers": f"{NUM_WORKERS} of {CPUS_PER_WORKER} CPU, min_workers "
           f"{MIN_WORKERS}", "global_batch_size": GLOBAL_BATCH, "optimizer": f"AdamW(lr={LR})",
           "checkpoint_every_steps": CHECKPOINT_EVERY, "kill": f"rank 1 SIGKILLs itself before step {args.kill_step}",
           "kill_run": f"stopped {changes.LINGER_S:g} s after a progress at world size {NUM_WORKERS} again",
           "steady_run": f"{args.steady_steps} steps, no kill", "max_failures": 1}
    definitions = {
        "kill_time": "commit of step K-1 (the killed rank commits it, then SIGKILLs itself before step K)",
        "recovery_s": "first step committed after the kill time minus the kill time",
        "back_at_step_k_s": "commit of step K (the step in flight at the kill) minus the kill time",
        "steps_redone": "committed steps lost (K-1 minus the step resumed from) + 1 (step K, in flight)",
        "step_s": f"median interval between the commits of consecutive steps {WARMUP_STEPS + 1}..K-1 (kill runs) "
                  f"or {WARMUP_STEPS + 1}..end (steady runs), world size {NUM_WORKERS}",
        "time_lost_s": "back_at_step_k_s - step_s: how much later step K commits than in an undisturbed run",
        "rejoin": f"the replacement's way back: rejoin_pause_s from the last commit at world size {MIN_WORKERS} to "
                  f"the first at {NUM_WORKERS}; rejoin_time_lost_s = that - step_s; step_boundary_s: last commit "
                  "to worker_joined; generation_formed_s: the generation_formed event's duration_s; first_step_s: "
                  "to the first commit; joined_after_kill_s: worker_joined minus the kill time",
        "time_lost_with_rejoin_s": "time_lost_s + rejoin_time_lost_s: what the failure costs in all",
        "state_source": "generation_formed's state_source for the generation after the kill: 'peers' (in memory) "
                        "or 'checkpoint' (a file read); checkpoint_read: whether it is 'checkpoint'",
        "breakdown": "detected_s: kill to worker_failed; recover_s: to the new generation starting to form; "
                     "generation_formed_s: join + state hand-over (peers or checkpoint); first_step_s: formed to "
                     "the first commit after the kill; redo_s: from there to step K's commit (0 when only step K is "
                     "redone). They add up to back_at_step_k_s",
        "samples_per_s": f"{GLOBAL_BATCH} x steps / time, over steps {WARMUP_STEPS + 1}..end of the steady run "
                         "(checkpoint saves included); samples_per_s_median_step: 64 / step_s; pre_kill_*: the same "
                         f"over steps {WARMUP_STEPS + 1}..K-1 of the kill runs",
        "bytes_per_rank": "TrainWorker.memory() (strategies.base.memory_breakdown) at the end of the steady run: "
                          "local bytes of parameters, gradients and optimizer state; formula: fp32 AdamW 16 "
                          f"bytes/parameter, ZeRO-3 16/N, HSDP 16R/N, N={NUM_WORKERS}",
        "timeline": "[seconds since the kill, step, world size] of every commit attempt from 1 s before the kill"}
    return {"job": job, "definitions": definitions}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kill-step", type=int, default=90, help="mid-interval: R = 1 goes back to step 50")
    parser.add_argument("--steady-steps", type=int, default=200)
    args = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="redundancy-"))  # run dirs and checkpoints: kept if a run failed
    rounds = [run_round(index, scratch, args) for index in range(args.rounds)]
    if all(r[k].get("status") == "finished" for r in rounds for k in r if isinstance(r[k], dict)):
        shutil.rmtree(scratch)
    else:
        print(f"a measurement failed; its run directories are kept in {scratch}", flush=True)
    summary = summarize(rounds)
    report = {"benchmark": "redundancy",
              "command": " ".join(["python -m benchmarks.redundancy", *map(shlex.quote, sys.argv[1:])]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "code": code_version(),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__,
                          "load_average_at_end": os.getloadavg()},
              **describe(args), "goals": GOALS, **summary, "rounds": rounds}
    (RESULTS / "redundancy.json").write_text(json.dumps(report, indent=1))
    _redundancy_plot.plot(rounds, summary, RESULTS / "redundancy.png")
    print(json.dumps({k: report[k] for k in ("medians", "r2_over_r1_samples_per_s", "goals_met")}, indent=1))


if __name__ == "__main__":
    main()
