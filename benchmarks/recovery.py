"""Recovery from a SIGKILLed worker, ours against Ray Train's TorchTrainer; our scale-up and drain times.

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
  workers) to the commit of the first step at world size 2; again with ``scaling.spare_workers=1``
  and a CPU more for the spare ("no scale-up" when the run is at world size 2 before the release);
- drain: a two-node ``ray.cluster_utils.Cluster``, a worker on each node; the driver drains the second
  node through the GCS as a preemption notice (60 s deadline); from that call to the first step
  committed without the node (world size 1), and the steps lost.

Ours runs the kill four ways: min_workers=1 (the survivor goes on alone), min=max=2 (the run waits for
a replacement worker; at K=25 the warm process started after the workers' construction is still
importing), the same killed at a later step (the replacement is constructed in the warm process) and
min=max=2 with a warm spare (``scaling.spare_workers=1``; killed at that later step, once the spare is
built). Ours runs with the job's runtime environment as ``raylastic train`` sets it (the setup hook of
actors/processes/setup_hook.py), Ray Train with a plain one. One local Ray instance
per side per round (Ray Train's 2 CPUs; ours 3, the third held by a blocker except for the spare's
runs); the side that goes first alternates; then the drain on its own cluster; medians over rounds.
Run from the repository root (3 minutes a round on 2 quiet cores, 5 on busy ones)::

    .venv/bin/python -m benchmarks.recovery                 # 3 rounds
    .venv/bin/python -m benchmarks.recovery --rounds 5 --kill-step 30

Writes benchmarks/results/recovery.json and recovery.png.
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
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import ray
import torch

from benchmarks import _recovery_changes as changes
from benchmarks import _recovery_helpers as helpers
from benchmarks._recovery_helpers import HIDDEN, summarize_failure
from benchmarks.common import RESULTS, alternated, code_version, guarded, local_ray, numbers
from raylastic.actors.processes.warm_processes import WarmProcesses
from raylastic.actors.rendezvous.keys import RendezvousKeys, beside_this_process
from raylastic.actors.status.run import Event, RunFailed
from raylastic.jobconfig import load_job_config
from raylastic.jobconfig.naming import worker_name

NUM_WORKERS, GLOBAL_BATCH, CHECKPOINT_EVERY, LR, SEED = 2, 64, 10, 1e-3, 0
GOALS = {"recovery_s_below": 1.5, "speedup_at_least": 5.0, "steps_redone_at_most": 1, "scale_up_s_below": 3.0,
         "spare_recovery_s_below": 1.0, "spare_scale_up_s_below": 1.0, "drain_steps_lost_at_most": 0}
MEASURED = ("ours_min1", "ours_min2", "ours_min2_late", "ours_spare", "ray_train", "scale_up", "scale_up_spare",
            "drain", "startup", "startup_warm")
WARM_PROCESS_GRACE_S = 5.0  # a process started ahead imports torch and the worker's modules in ~2.5 s
DRAIN_STEPS = 100_000  # a cap: the run is stopped a few seconds after the node left


def job_overrides(name: str, steps: int, min_workers: int, kill_step: int | None, spare_workers: int = 0) -> list[str]:
    """The failure runs checkpoint as Ray Train's side does; the scale-up and drain runs (no kill) do not."""
    overrides = [f"name={name}", f"workload.options={{hidden: {HIDDEN}}}", f"training.steps={steps}",
                 f"training.global_batch_size={GLOBAL_BATCH}", f"training.seed={SEED}", f"optim.lr={LR}",
                 f"scaling.min_workers={min_workers}", f"scaling.max_workers={NUM_WORKERS}",
                 f"scaling.spare_workers={spare_workers}", "scaling.cpus_per_worker=1", "failure.max_failures=1",
                 "checkpoint.resume=never"]
    if kill_step is None:
        return [*overrides, "checkpoint.every_steps=0"]
    return [*overrides, f"checkpoint.every_steps={CHECKPOINT_EVERY}",
            f"faults=[{{action: kill, rank: 1, step: {kill_step}}}]"]


def run_ours(name: str, scratch: Path, steps: int, kill_step: int, min_workers: int, spare_workers: int = 0) -> dict:
    job = load_job_config(None, job_overrides(name, steps, min_workers, kill_step, spare_workers))
    follow = changes.Follower(name)
    spare = worker_name(name, NUM_WORKERS + 1) if spare_workers else None  # started right after the members
    try:
        result, spare_marks = changes.follow_run(job, scratch / name, follow, watched=spare)
    except RunFailed as error:
        events = [Event.from_dict(e) for e in json.loads((scratch / name / "result.json").read_text())["events"]]
        return {"status": "failed", "error": str(error)[:300], "events": changes.membership_events(events)}
    commits = sorted(((r["step"], r["time_s"]) for r in result.history), key=lambda c: c[1])
    summary = summarize_failure(commits, kill_step)
    kill_at = next(t for s, t in commits if s == kill_step - 1)
    failed = next(e for e in result.events if e.type == "worker_failed")
    formed = next(e for e in result.events if e.type == "generation_formed" and e.details["generation"] == 1)
    formed_from = formed.time_s - formed.details["duration_s"]
    breakdown = {"detected_s": failed.time_s - kill_at, "recover_s": formed_from - failed.time_s,
                 "generation_formed_s": formed.details["duration_s"],
                 "first_step_s": kill_at + summary["recovery_s"] - formed.time_s}
    spare_facts = {}
    if spare_workers:
        spare_facts = {"spare_built_before_kill_s": round(kill_at - (spare_marks["constructed"] - follow.origin), 4)}
        taken = [e.details.get("reason") for e in result.events if e.type == "spares_taken" and e.time_s >= kill_at]
        if taken[:1] != ["failure"] or any(e.type == "waiting_for_resources" for e in result.events):
            raise RuntimeError(f"the spare was not taken at once after the kill (spares_taken {taken}; built "
                               f"{spare_facts['spare_built_before_kill_s']} s before it): raise --spare-kill-step")
    joined = [e.details["warm_process"] for e in result.events if e.type == "worker_joined"]
    replacement = {"replacement_warm_process": joined[0]} if joined else {}
    return {"status": "finished", **summary, "steps_lost_event": formed.details["steps_lost"], **spare_facts,
            **replacement,
            "breakdown": {k: round(v, 4) for k, v in breakdown.items()},
            "events": changes.membership_events(result.events)}


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


def run_scale_up(scratch: Path, steps: int, release_at_step: int, spare_workers: int = 0) -> dict:
    name = f"scaleup{'-spare' if spare_workers else ''}-{scratch.name}"
    job = load_job_config(None, job_overrides(name, steps, 1, None, spare_workers))
    return changes.run_scale_up(job, scratch / name, release_at_step)


def run_drain(scratch: Path, steps: int, notice_at_step: int) -> dict:
    name = f"drain-{scratch.name}"
    return changes.run_drain(load_job_config(None, job_overrides(name, steps, 1, None)), scratch / name, notice_at_step)


def measure_startup(*, warm: bool) -> dict:
    """On the idle instance: where a new worker's time goes until it can train (StartupProbe's marks), for the
    job of the scale-up runs. Cold: a runtime environment of its own, so Ray starts a process for it. Warm: a
    process started ahead (WarmProcesses, as after a worker starts), given time to import."""
    environment = {}
    if warm:
        WarmProcesses().top_up({ray.get_runtime_context().get_node_id()})
        time.sleep(WARM_PROCESS_GRACE_S)
    else:
        environment = {"runtime_env": {"env_vars": {"RAYLASTIC_STARTUP_PROBE": f"cold-{time.time()}"}}}
    store = RendezvousKeys.options(**beside_this_process()).remote()
    ray.get(store.num_keys.remote())  # started, as the run's is long before a worker joins
    requested = time.time()
    probe = ray.remote(num_cpus=1)(helpers.StartupProbe).options(**environment).remote(
        job_overrides("startup-probe", 1, 1, None), store)
    marks, imported = ray.get(probe.timings.remote())
    ray.kill(probe)
    ray.kill(store)
    phases = {"total_s": marks["first_join"] - requested}
    if imported is not None and imported.began_at > requested:  # imported for this probe: a cold start
        phases |= {"process_start_s": imported.began_at - requested,
                   "setup_hook_imports_s": imported.done_at - imported.began_at,
                   "to_constructor_s": marks["constructor"] - imported.done_at}
    else:
        phases |= {"to_constructor_s": marks["constructor"] - requested}
    names = list(marks)
    phases |= {f"{later}_s": marks[later] - marks[earlier] for earlier, later in zip(names, names[1:], strict=False)}
    return {"warm_process": imported is not None and imported.done_at < requested} | {
        k: round(v, 4) for k, v in phases.items()}


def run_round(index: int, scratch: Path, args: argparse.Namespace) -> dict:
    sides = alternated(["ours", "ray_train"], index)
    record: dict[str, Any] = {"round": index, "order": sides, "load_average_at_start": os.getloadavg()}
    for side in sides:
        local_ray(NUM_WORKERS if side == "ray_train" else NUM_WORKERS + 1, ours=side == "ours")
        try:
            if side == "ray_train":
                (scratch / f"rt{index}").mkdir()
                record["ray_train"] = guarded(run_ray_train, scratch / f"rt{index}", args.steps, args.kill_step)
            else:
                record |= run_ours_side(index, scratch, args)
        finally:
            ray.shutdown()
    record["drain"] = guarded(run_drain, scratch / f"d{index}", DRAIN_STEPS, args.release_at_step)
    print(f"round {index}: " + ", ".join(f"{k} {headline(v)}" for k, v in record.items() if isinstance(v, dict)),
          flush=True)
    return record


def run_ours_side(index: int, scratch: Path, args: argparse.Namespace) -> dict[str, dict]:
    """On a 3-CPU instance: the runs without a spare while a blocker holds the third CPU, then the spare's."""
    record: dict[str, dict] = {}
    third_cpu = ray.remote(num_cpus=1)(helpers.Blocker).remote()
    ray.get(third_cpu.ready.remote())
    for key, min_workers in [("ours_min1", 1), ("ours_min2", 2)]:
        record[key] = guarded(run_ours, f"{key.replace('_', '-')}-{index}", scratch, args.steps,
                              args.kill_step, min_workers)
    spare_steps = args.spare_kill_step + args.steps - args.kill_step  # as many steps after the kill as the others
    record["ours_min2_late"] = guarded(run_ours, f"ours-min2-late-{index}", scratch, spare_steps,
                                       args.spare_kill_step, NUM_WORKERS)
    record["scale_up"] = guarded(run_scale_up, scratch / f"s{index}", args.scale_up_steps, args.release_at_step)
    record["startup"] = guarded(measure_startup, warm=False)
    record["startup_warm"] = guarded(measure_startup, warm=True)
    ray.kill(third_cpu)
    wait_for_free_cpus(NUM_WORKERS + 1)
    record["ours_spare"] = guarded(run_ours, f"ours-spare-{index}", scratch, spare_steps, args.spare_kill_step,
                                   NUM_WORKERS, spare_workers=1)
    record["scale_up_spare"] = guarded(run_scale_up, scratch / f"ss{index}", args.scale_up_steps,
                                       args.release_at_step, spare_workers=1)
    return record


def headline(run: dict) -> Any:
    for field in ("recovery_s", "scale_up_s", "notice_to_step_without_node_s", "total_s", "status"):
        if field in run:
            return run[field]
    return None


def wait_for_free_cpus(count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < count and time.monotonic() < deadline:
        time.sleep(0.1)


def summarize(rounds: list[dict]) -> dict:
    medians: dict[str, Any] = {}
    for key in MEASURED:
        runs = [numbers(r[key]) for r in rounds if "error" not in r.get(key, {"error": "missing"})]
        fields = sorted({f for run in runs for f in run})
        medians[key] = {f: round(statistics.median(run[f] for run in runs if f in run), 4) for f in fields}
    outcomes = {key: [r.get(key, {}).get("status", "measured") for r in rounds] for key in MEASURED}
    drains = [r["drain"] for r in rounds if "error" not in r.get("drain", {"error": "missing"})]
    drain_lost = max((max(d["steps_lost_event"], d["steps_lost_generation"], d["steps_lost_history"],
                          d["steps_committed_twice"]) for d in drains), default=None)
    ours, theirs = medians["ours_min1"].get("recovery_s"), medians["ray_train"].get("recovery_s")
    speedup = round(theirs / ours, 1) if ours and theirs else None
    goals_met = {"recovery_s_below": _below(ours, GOALS["recovery_s_below"]),
                 "speedup_at_least": None if speedup is None else speedup >= GOALS["speedup_at_least"],
                 "steps_redone_at_most": _below(medians["ours_min1"].get("steps_redone"),
                                                GOALS["steps_redone_at_most"] + 0.5),
                 "scale_up_s_below": _below(medians["scale_up"].get("scale_up_s"), GOALS["scale_up_s_below"]),
                 "spare_recovery_s_below": _below(medians["ours_spare"].get("recovery_s"),
                                                  GOALS["spare_recovery_s_below"]),
                 "spare_scale_up_s_below": _below(medians["scale_up_spare"].get("scale_up_s"),
                                                  GOALS["spare_scale_up_s_below"]),
                 "drain_steps_lost_at_most": _below(drain_lost, GOALS["drain_steps_lost_at_most"] + 0.5)}
    return {"medians": medians, "ray_train_over_ours_recovery": speedup, "drain_steps_lost_worst_round": drain_lost,
            "outcomes": outcomes, "goals_met": goals_met}


def _below(value: float | None, limit: float) -> bool | None:
    return None if value is None else value < limit


def describe(args: argparse.Namespace) -> dict[str, dict]:
    """The JSON's "job" and "definitions"."""
    job = {"workload": f"digits(hidden={HIDDEN})", "workers": NUM_WORKERS, "global_batch_size": GLOBAL_BATCH,
           "optimizer": f"AdamW(lr={LR})", "steps": args.steps, "checkpoint_every_steps": CHECKPOINT_EVERY,
           "kill": f"rank 1 SIGKILLs itself before step {args.kill_step}", "max_failures": 1,
           "spare_run": f"min=max=2 workers, scaling.spare_workers=1, rank 1 SIGKILLs itself before step "
                        f"{args.spare_kill_step} of {args.spare_kill_step + args.steps - args.kill_step}",
           "scale_up_run": f"no checkpoints, min 1 max 2 workers (and spare_workers=1); the blocker killed at the "
                           f"first progress at step {args.release_at_step} or later; stopped {changes.LINGER_S:g} s "
                           f"after a progress at world size 2 (at most {args.scale_up_steps} steps)",
           "drain_run": f"no checkpoints, min 1 max 2 workers, a head and one more node of 1 CPU each; the notice at "
                        f"the first progress at step {args.release_at_step} or later, deadline "
                        f"{changes.DRAIN_DEADLINE_S} s; stopped {changes.LINGER_S:g} s after a progress at world size "
                        f"1 (at most {DRAIN_STEPS} steps)"}
    definitions = {
        "kill_time": "commit of step K-1 (the killed rank commits it, then SIGKILLs itself before step K)",
        "recovery_s": "first step committed after the kill time minus the kill time",
        "back_at_step_k_s": "commit of step K (the step in flight at the kill) minus the kill time",
        "steps_redone": "committed steps lost (K-1 minus the step resumed from) + 1 (step K, in flight)",
        "ours_min2_late": "the kill with min=max=2 at the spare run's K, so that the warm process started after "
                          "the workers were constructed has imported by then (replacement_warm_process: what the "
                          "worker_joined event said); at K=25 the replacement takes it while it still imports",
        "ours_spare": "the kill with min=max=2 and one warm spare (built and idle in a slot of its own, the third "
                      "CPU); K is later so that the spare is built by then (spare_built_before_kill_s: the driver "
                      "saw its constructor return that long before the kill); the run fails the measurement if "
                      "the spare is not taken at once (spares_taken, reason failure, no waiting_for_resources)",
        "scale_up_s": "first step committed at world size 2 minus the driver's ray.kill(blocker) call",
        "scale_up_spare": "the same with spare_workers=1 and a CPU more from the start (for the spare). "
                          "'no scale-up' when the run trained at world size 2 before the blocker went: the "
                          "scaling policy takes every ready spare, and places members first, while the group is "
                          "below max_workers, so no spare waits idle for resources to appear",
        "drain": "notice_to_step_without_node_s: the driver's GcsClient.drain_node call (reason "
                 "DRAIN_NODE_REASON_PREEMPTION) to the first step committed at world size 1; steps_lost_event: "
                 "the drained event's steps_lost; steps_lost_generation: the next generation_formed's; "
                 "steps_lost_history: last step committed at world size 2 + 1 - first step at world size 1; "
                 "steps_committed_twice: step numbers the history holds more than once",
        "breakdown (ours, failure)": "detected_s: kill to worker_failed; recover_s: worker_failed to the new "
                                     "generation starting to form (incl. waiting for a replacement when "
                                     "min_workers needs one, or taking the spare); generation_formed_s: join + "
                                     "state hand-over; first_step_s: formed to the commit of step K",
        "breakdown (scale-up)": "slot_and_scaling_tick_s: to the joiner's actor being created (Ray placing the "
                                "slot once the blocker's process is gone, seen at the Controller's next 0.1 s "
                                "poll); actor_construction_s: to its constructor returning; "
                                "tick_and_step_boundary_s: to worker_joined; then generation_formed_s and "
                                "first_step_s. With a spare: scaling_tick_s to spares_taken, step_boundary_s to "
                                "worker_joined, then the same",
        "breakdown (drain)": "noticed_s: the call to node_draining (the Controller's poll); step_boundary_s: to "
                             "drained (the worker left at the step boundary); generation_formed_s: to the next "
                             "generation_formed; first_step_s: to the first step at world size 1",
        "startup": "a new worker until it can train, on the idle instance, the scale-up runs' job "
                   "(benchmarks/_recovery_helpers.py StartupProbe), in a process Ray starts for it (a runtime "
                   "environment of its own): process_start_s to the job's setup hook starting; "
                   "setup_hook_imports_s (torch, torch._dynamo, actors.worker.train_worker); "
                   "to_constructor_s (Ray loading the probe's class); construct_worker_s (TrainWorker's constructor: "
                   "workload and data, strategy); "
                   "first_join_s (its first join, into a group of its own: gc, rendezvous, model and optimizer)",
        "startup_warm": "the same in a process started ahead (actors/processes/setup_hook.py WarmProcesses, given "
                        f"{WARM_PROCESS_GRACE_S:.0f} s to import): to_constructor_s from asking for the probe",
        "timeline": "[seconds since the kill (failures; steps from K-25), since resources appeared (scale-up) or "
                    "since the notice (drain), step(, world)]"}
    return {"job": job, "definitions": definitions}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--kill-step", type=int, default=25)
    parser.add_argument("--spare-kill-step", type=int, default=1000, help="the spare's run: built by then")
    parser.add_argument("--scale-up-steps", type=int, default=100_000, help="a cap: stopped once measured")
    parser.add_argument("--release-at-step", type=int, default=100, help="and the drain's notice")
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
        **describe(args),
        "goals": GOALS, **summary, "ray_train_facts": helpers.RAY_TRAIN_FACTS, "rounds": rounds}
    (RESULTS / "recovery.json").write_text(json.dumps(report, indent=1))
    helpers.plot(rounds, summary, RESULTS / "recovery.png")
    print(json.dumps({k: report[k] for k in ("medians", "ray_train_over_ours_recovery", "goals_met")}, indent=1))


if __name__ == "__main__":
    main()
