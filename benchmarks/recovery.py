"""Recovery from a SIGKILLed worker, ours against Ray Train's TorchTrainer; and our scale-up time.

The same job on both sides: digits MLP (hidden=512), 2 CPU workers (1 torch thread each), global
batch 64, AdamW(lr=1e-3), the same sample order, a checkpoint every 10 steps, max_failures=1. Rank 1
SIGKILLs its own process just before step K (default 25) starts - ours with the ``kill`` fault, Ray
Train's inside its train loop (benchmarks/_recovery_helpers.py). Definitions (also in the JSON):

- kill time: the commit of step K-1, the last step before the kill (the killed rank commits it and
  kills itself before any work on step K; Ray Train's kill marker, written just before the SIGKILL,
  checks this);
- recovery_s: the first step committed after the kill time, minus the kill time;
- steps_redone: committed steps lost (K-1 minus the step resumed from) + 1, the in-flight step K;
- scale-up: from ``ray.kill`` of a blocker actor holding the second worker's CPU (min 1, max 2
  workers) to the commit of the first step at world size 2.

Ours runs two ways: min_workers=1 (the survivor goes on alone) and min=max=2 (the run waits for a
replacement worker, which costs a new process's start-up). One local Ray instance (2 CPUs) per side
per round; the side that goes first alternates; medians over rounds.
Run from the repository root (3-4 minutes a round on 2 busy cores)::

    .venv/bin/python -m benchmarks.recovery                 # 3 rounds
    .venv/bin/python -m benchmarks.recovery --rounds 5 --kill-step 30

Writes benchmarks/results/recovery.json and recovery.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import ray
import torch

import cluster.job
from actors.controller import RunFailed
from actors.run_status import Event, RunStatus
from benchmarks import _recovery_helpers as helpers
from jobconfig import load_job_config
from jobconfig.naming import NAMESPACE, controller_name, worker_name

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results"
NUM_WORKERS, GLOBAL_BATCH, HIDDEN, CHECKPOINT_EVERY, LR, SEED = 2, 64, 512, 10, 1e-3, 0
GOALS = {"recovery_s_below": 1.5, "speedup_at_least": 5.0, "steps_redone_at_most": 1, "scale_up_s_below": 3.0}


def job_overrides(name: str, steps: int, min_workers: int, kill_step: int | None) -> list[str]:
    """The failure runs checkpoint as Ray Train's side does; the scale-up run (no kill) does not."""
    overrides = [f"name={name}", f"workload.options={{hidden: {HIDDEN}}}", f"training.steps={steps}",
                 f"training.global_batch_size={GLOBAL_BATCH}", f"training.seed={SEED}", f"optim.lr={LR}",
                 f"scaling.min_workers={min_workers}", f"scaling.max_workers={NUM_WORKERS}",
                 "scaling.cpus_per_worker=1", "failure.max_failures=1", "checkpoint.resume=never"]
    if kill_step is None:
        return [*overrides, "checkpoint.every_steps=0"]
    return [*overrides, f"checkpoint.every_steps={CHECKPOINT_EVERY}",
            f"faults=[{{action: kill, rank: 1, step: {kill_step}}}]"]


class Follower:
    """train()'s on_progress: learns the Controller's clock origin; kills the blocker at a step."""

    def __init__(self, name: str, blocker: Any, release_at_step: int) -> None:
        self.name, self.blocker, self.release_at_step = name, blocker, release_at_step
        self.origin: float | None = None
        self.released_at: float | None = None

    def __call__(self, progress: RunStatus) -> None:
        if self.origin is None:  # RunLog.started: the time_s of history and events count from it
            controller = ray.get_actor(controller_name(self.name))
            self.origin = ray.get(controller.__ray_call__.remote(lambda c: c.log.started))
        if self.released_at is None and progress.step >= self.release_at_step:
            self.released_at = time.time()
            ray.kill(self.blocker)


def summarize_failure(commits: list[tuple[int, float]], kill_step: int) -> dict[str, Any]:
    """``commits``: (step, time) of every step commit in commit order, redone steps included."""
    kill_at = next(t for s, t in commits if s == kill_step - 1)
    after = [(s, t) for s, t in commits if t > kill_at]
    first_step, first_at = after[0]
    lost = (kill_step - 1) - (first_step - 1)
    return {"recovery_s": round(first_at - kill_at, 4), "first_step_after_kill": first_step,
            "back_at_step_k_s": round(next(t for s, t in after if s == kill_step) - kill_at, 4),
            "committed_steps_lost": lost, "steps_redone": lost + 1,
            "timeline": [[round(t - kill_at, 4), s] for s, t in commits]}


def run_ours(name: str, scratch: Path, steps: int, kill_step: int, min_workers: int) -> dict:
    job = load_job_config(None, job_overrides(name, steps, min_workers, kill_step))
    try:
        result = cluster.job.train(job, run_dir=scratch / name)
    except RunFailed as error:
        events = [Event.from_dict(e) for e in json.loads((scratch / name / "result.json").read_text())["events"]]
        return {"status": "failed", "error": str(error)[:300], "events": membership_events(events)}
    commits = sorted(((r["step"], r["time_s"]) for r in result.history), key=lambda c: c[1])
    summary = summarize_failure(commits, kill_step)
    kill_at = next(t for s, t in commits if s == kill_step - 1)
    failed = next(e for e in result.events if e.type == "worker_failed")
    formed = next(e for e in result.events if e.type == "generation_formed" and e.details["generation"] == 1)
    formed_from = formed.time_s - formed.details["duration_s"]
    breakdown = {"detected_s": failed.time_s - kill_at, "recover_s": formed_from - failed.time_s,
                 "generation_formed_s": formed.details["duration_s"],
                 "first_step_s": kill_at + summary["recovery_s"] - formed.time_s}
    return {"status": "finished", **summary, "steps_lost_event": formed.details["steps_lost"],
            "breakdown": {k: round(v, 4) for k, v in breakdown.items()}, "events": membership_events(result.events)}


def run_ray_train(scratch: Path, steps: int, kill_step: int) -> dict:
    config = {"hidden": HIDDEN, "steps": steps, "kill_step": kill_step, "global_batch_size": GLOBAL_BATCH,
              "seed": SEED, "lr": LR, "checkpoint_every": CHECKPOINT_EVERY, "max_failures": 1,
              "num_workers": NUM_WORKERS}
    run = helpers.fit_ray_train(scratch, config)
    commits = [(r["step"], r["time"] - run["started"]) for r in run["records"] if "step" in r]
    starts = [(r["resumed_from"], r["time"] - run["started"]) for r in run["records"] if "resumed_from" in r]
    kill_at = next(t for s, t in commits if s == kill_step - 1)
    return {"status": "finished", **summarize_failure(commits, kill_step), "resumed_from": starts[-1][0],
            "marker_minus_kill_time_s": round(run["killed_at"] - run["started"] - kill_at, 4),
            "train_fn_restarted_s": round(starts[-1][1] - kill_at, 4), "kill_since_fit_s": round(kill_at, 3)}


def run_scale_up(scratch: Path, steps: int, release_at_step: int) -> dict:
    name = f"scaleup-{scratch.name}"
    blocker = ray.remote(num_cpus=1)(helpers.Blocker).remote()  # holds the second worker's CPU
    ray.get(blocker.ready.remote())
    follow, joiner, done = Follower(name, blocker, release_at_step), {}, threading.Event()
    watcher = threading.Thread(target=watch_joiner, args=(worker_name(name, 2), joiner, done), daemon=True)
    watcher.start()
    try:
        result = cluster.job.train(load_job_config(None, job_overrides(name, steps, 1, None)),
                                   run_dir=scratch / name, on_progress=follow)
    finally:
        done.set()
    released = follow.released_at
    first_two = next(r for r in result.history if r["world_size"] == 2)
    joined = next(e for e in result.events if e.type == "worker_joined")
    formed = [e for e in result.events if e.type == "generation_formed"][-1]
    at = {"spawned": joiner["spawned"] - released, "constructed": joiner["constructed"] - released,
          "joined": joined.time_s + follow.origin - released, "formed": formed.time_s + follow.origin - released,
          "first_step": first_two["time_s"] + follow.origin - released}
    breakdown = {"slot_and_scaling_tick_s": at["spawned"], "actor_construction_s": at["constructed"] - at["spawned"],
                 "tick_and_step_boundary_s": at["joined"] - at["constructed"],
                 "generation_formed_s": at["formed"] - at["joined"], "first_step_s": at["first_step"] - at["formed"]}
    origin = follow.origin - released
    return {"scale_up_s": round(at["first_step"], 4), "breakdown": {k: round(v, 4) for k, v in breakdown.items()},
            "timeline": [[round(r["time_s"] + origin, 4), r["step"], r["world_size"]] for r in result.history
                         if -1 <= r["time_s"] + origin <= at["first_step"] + 3],  # what the plot shows
            "events": membership_events(result.events)}


def membership_events(events: list[Event]) -> list[dict]:
    return [e.to_dict() for e in events if e.type != "checkpointed"]


def watch_joiner(name: str, marks: dict[str, float], done: threading.Event) -> None:
    """Driver-side times of the joiner: its actor created by the Controller, then constructed."""
    while not done.is_set():
        try:
            actor = ray.get_actor(name)
        except ValueError:
            time.sleep(0.01)
            continue
        marks["spawned"] = time.time()
        ray.get(actor.pid.remote())
        marks["constructed"] = time.time()
        return


def measure_startup() -> dict:
    """On the idle instance: where a new worker process's start-up time goes (StartupProbe's marks)."""
    started = time.time()
    probe = ray.remote(num_cpus=1)(helpers.StartupProbe).remote(HIDDEN)
    marks = ray.get(probe.timings.remote())
    phases = {"total_s": time.time() - started, "process_start_s": marks["process_ready"] - started}
    ray.kill(probe)
    names = list(marks)
    phases |= {f"{later}_s": marks[later] - marks[earlier] for earlier, later in zip(names, names[1:], strict=False)}
    return {k: round(v, 4) for k, v in phases.items()}


def local_ray() -> None:
    ray.init(address="local", num_cpus=NUM_WORKERS, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False,
             logging_level=logging.WARNING, runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})


def guarded(measure: Any, *args: Any, **kwargs: Any) -> dict:
    """One measurement; an error is recorded (this machine is shared, the code under test moves) and the rest go on."""
    try:
        return measure(*args, **kwargs)
    except Exception as error:  # noqa: BLE001
        return {"status": "error", "error": f"{type(error).__name__}: {str(error)[:400]}"}


def run_round(index: int, scratch: Path, args: argparse.Namespace) -> dict:
    sides = ["ours", "ray_train"] if index % 2 == 0 else ["ray_train", "ours"]
    record: dict[str, Any] = {"round": index, "order": sides, "load_average_at_start": os.getloadavg()}
    for side in sides:
        local_ray()
        try:
            if side == "ray_train":
                (scratch / f"rt{index}").mkdir()
                record["ray_train"] = guarded(run_ray_train, scratch / f"rt{index}", args.steps, args.kill_step)
                continue
            for key, min_workers in [("ours_min1", 1), ("ours_min2", 2)]:
                record[key] = guarded(run_ours, f"{key.replace('_', '-')}-{index}", scratch, args.steps,
                                      args.kill_step, min_workers)
            record["scale_up"] = guarded(run_scale_up, scratch / f"s{index}", args.scale_up_steps,
                                         args.release_at_step)
            record["startup"] = guarded(measure_startup)
        finally:
            ray.shutdown()
    print(f"round {index}: " + ", ".join(f"{k} {v.get('recovery_s', v.get('scale_up_s', v.get('status')))}"
                                         for k, v in record.items() if isinstance(v, dict)), flush=True)
    return record


def numbers(run: dict) -> dict[str, float]:
    flat = {**run, **run.get("breakdown", {})}
    return {k: v for k, v in flat.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def summarize(rounds: list[dict]) -> dict:
    medians: dict[str, Any] = {}
    for key in ("ours_min1", "ours_min2", "ray_train", "scale_up", "startup"):
        runs = [numbers(r[key]) for r in rounds if "error" not in r.get(key, {"error": "missing"})]
        fields = sorted({f for run in runs for f in run})
        medians[key] = {f: round(statistics.median(run[f] for run in runs if f in run), 4) for f in fields}
    ours, theirs = medians["ours_min1"].get("recovery_s"), medians["ray_train"].get("recovery_s")
    speedup = round(theirs / ours, 1) if ours and theirs else None
    goals_met = {"recovery_s_below": _below(ours, GOALS["recovery_s_below"]),
                 "speedup_at_least": None if speedup is None else speedup >= GOALS["speedup_at_least"],
                 "steps_redone_at_most": _below(medians["ours_min1"].get("steps_redone"),
                                                GOALS["steps_redone_at_most"] + 0.5),
                 "scale_up_s_below": _below(medians["scale_up"].get("scale_up_s"), GOALS["scale_up_s_below"])}
    return {"medians": medians, "ray_train_over_ours_recovery": speedup, "goals_met": goals_met}


def _below(value: float | None, limit: float) -> bool | None:
    return None if value is None else value < limit


def code_version() -> str:
    """The commit measured, and whether the tree differs from it (``git status --porcelain`` lines)."""
    git = ["git", "-C", str(REPO_ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout.splitlines()
    return f"{commit or 'unknown'} + {len(changed)} changed/untracked paths: {', '.join(changed)[:300]}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--kill-step", type=int, default=25)
    parser.add_argument("--scale-up-steps", type=int, default=2000)
    parser.add_argument("--release-at-step", type=int, default=100)
    args = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="recovery-"))  # run dirs, checkpoints, logs: kept if a run failed
    rounds = [run_round(index, scratch, args) for index in range(args.rounds)]
    if all(r[k].get("status") != "error" for r in rounds for k in r if isinstance(r[k], dict)):
        shutil.rmtree(scratch)
    else:
        print(f"a measurement failed; its run directories are kept in {scratch}", flush=True)
    summary = summarize(rounds)
    from ray.train.v2._internal.constants import is_v2_enabled

    report = {
        "benchmark": "recovery",
        "command": " ".join(["python -m benchmarks.recovery", *map(shlex.quote, sys.argv[1:])]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "code": code_version(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "ray": ray.__version__, "ray_train_v2": is_v2_enabled(),
                    "load_average_at_end": os.getloadavg()},
        "job": {"workload": f"digits(hidden={HIDDEN})", "workers": NUM_WORKERS, "global_batch_size": GLOBAL_BATCH,
                "optimizer": f"AdamW(lr={LR})", "steps": args.steps, "checkpoint_every_steps": CHECKPOINT_EVERY,
                "kill": f"rank 1 SIGKILLs itself before step {args.kill_step}", "max_failures": 1,
                "scale_up_run": f"{args.scale_up_steps} steps, no checkpoints, min 1 max 2 workers"},
        "definitions": {
            "kill_time": "commit of step K-1 (the killed rank commits it, then SIGKILLs itself before step K)",
            "recovery_s": "first step committed after the kill time minus the kill time",
            "back_at_step_k_s": "commit of step K (the step in flight at the kill) minus the kill time",
            "steps_redone": "committed steps lost (K-1 minus the step resumed from) + 1 (step K, in flight)",
            "scale_up_s": "first step committed at world size 2 minus the driver's ray.kill(blocker) call",
            "breakdown (ours, failure)": "detected_s: kill to worker_failed; recover_s: worker_failed to the new "
                                         "generation starting to form (incl. waiting for a replacement when "
                                         "min_workers needs one); generation_formed_s: join + state hand-over; "
                                         "first_step_s: formed to the commit of step K",
            "breakdown (scale-up)": "slot_and_scaling_tick_s: to the joiner's actor being created (slot placed + "
                                    "the Controller's 0.5 s scaling check); actor_construction_s: to its "
                                    "constructor returning; tick_and_step_boundary_s: to worker_joined; then "
                                    "generation_formed_s and first_step_s",
            "timeline": "[seconds since the kill (failures) or since resources appeared (scale-up), step(, world)]"},
        "goals": GOALS, **summary, "ray_train_facts": helpers.RAY_TRAIN_FACTS, "rounds": rounds}
    (RESULTS / "recovery.json").write_text(json.dumps(report, indent=1))
    helpers.plot(rounds, summary, RESULTS / "recovery.png")
    print(json.dumps({k: report[k] for k in ("medians", "ray_train_over_ours_recovery", "goals_met")}, indent=1))


if __name__ == "__main__":
    main()
