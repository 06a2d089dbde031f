"""In-memory copies of the sharded state: HSDP (strategy.replicas 2), the buddy copy (replicas 1, the default),
and one copy with a checkpoint every 50 steps; and the buddy copy's steady-state cost on the GPT recipe.

Issues 18 and 29. The digits job on every side: digits MLP (hidden=512), zero3, 4 CPU workers of 0.5 CPU (1 torch
thread each), global batch 64, AdamW(lr=1e-3), the same sample order, min_workers=3, max_workers=4,
max_failures=1; the sides differ only in (benchmarks/_redundancy_runs.py ``SIDES``):

- ``r2``: strategy.replicas 2, a checkpoint every 50 steps (at 3 ranks two copies cannot split the ranks evenly,
  so that generation keeps one, and the buddy copy, on by default, covers it: strategies/shard_layout.py);
- ``buddy``: strategy.replicas 1 with the buddy copy, no periodic checkpoint: the defaults a user gets;
- ``r1``: strategy.replicas 1, strategy.buddy_copy false, a checkpoint every 50 steps: the baseline;
- ``timed``: ``buddy`` with the time-based checkpoint's period shortened (checkpoint.every_minutes 0.03), a steady
  run only: what each save costs the steps trained meanwhile, and so what the default (a save every 10 minutes,
  issue 52) costs a run (benchmarks/_redundancy_timed.py). The alternative, a second buddy copy, would cost another
  copy's transfer every step: about the GPT pair's buddy cost again.

Per side and round:

- a kill run: rank 1 SIGKILLs its own process just before step K (default 90, mid-interval: r1 goes back to the
  step-50 checkpoint) with the ``kill`` fault; the 3 survivors carry on, a replacement worker starts on the
  freed slot and joins at a later step boundary (world size 4 again). The run is stopped 3 s after the driver
  sees world size 4 again. Its recovery_s, back_at_step_k_s and steps_redone are benchmarks/recovery.py's
  (``summarize_failure``); steps_lost_event is the generation_formed event's ``steps_lost`` (committed steps
  lost); time_lost_s = back_at_step_k_s - step_s (the median step before the kill); state_source: the event's
  'peers' (every shard had a surviving copy), 'buddy' (a lost shard came from its buddy's copy) or 'checkpoint';
  the replacement's rejoin is timed too (further definitions in the JSON);
- a steady run: the same job without the kill, ``--steady-steps`` steps at 4 workers; samples/s over steps
  11..end (the checkpoints' saves included, as the user pays them); bytes per rank: ``TrainWorker.memory()`` at
  the run's end, parameters + gradients + optimizer state against fp32 AdamW's 16 bytes per parameter (zero3 at
  N ranks 16/N, HSDP with R copies 16R/N), and the buddy copies' host bytes beside them;
- a GPT pair (benchmarks/_buddy_cost.py): benchmarks/throughput.py's GPT recipe, zero3 at 4 workers of 0.5 CPU,
  replicas 1, no periodic checkpoint, buddy copy on against off, ``--gpt-steps`` steps each; samples/s over the
  steady part (the first 20% of the steps left out), the ratio per round, and the copies' host bytes per rank
  against the rank's shard (parameters + optimizer state).

Goals: r2 (issue 18): steps_redone <= 1 in every round, median time_lost_s < 2 s; buddy (issue 29):
steps_lost_event <= 1 in every round, median time_lost_s < 2 s; GPT: median per-round samples/s buddy / none
>= 0.98 (issue 53; issue 29 asked 0.95; benchmarks/copy_cost.py measures it in the same processes, which a
loaded machine allows better); timed (issue 52): the default period's cost below 1% of a run's time, and below
a second copy's. One local Ray instance (2 CPUs) per round; the side that goes first alternates; medians over
rounds. Run from the repository root (~10 minutes a round on 2 cores, 6 of them the GPT pair)::

    .venv/bin/python -m benchmarks.redundancy --rounds 3
    .venv/bin/python -m benchmarks.redundancy --rounds 5 --kill-step 80 --gpt-steps 400

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

from benchmarks import _buddy_cost, _redundancy_plot
from benchmarks import _recovery_changes as changes
from benchmarks import _redundancy_runs as runs
from benchmarks import _redundancy_timed as _timed
from benchmarks._recovery_helpers import HIDDEN
from benchmarks.common import RESULTS, alternated, code_version, guarded, local_ray, numbers
from raylastic.workloads.digits import Digits

GOALS = {"r2": {"steps_redone_at_most": 1, "time_lost_s_below": 2.0},
         "buddy": {"steps_lost_at_most": 1, "time_lost_s_below": 2.0},
         "gpt": {"buddy_over_none_samples_per_s_at_least": _buddy_cost.GOAL_RATIO},
         "timed": {"default_cost_fraction_below": 0.01, "below_a_second_copy": True}}
NUM_PARAMETERS = sum(p.numel() for p in Digits(hidden=HIDDEN).build_model().parameters())
BYTES_PER_PARAMETER = 16  # fp32 AdamW: 4 parameter + 4 gradient + 8 optimizer state (ZeRO paper, section 5)


def run_round(index: int, scratch: Path, args: argparse.Namespace) -> dict:
    order = alternated(runs.SIDES, index)
    record: dict[str, Any] = {"round": index, "order": order, "load_average_at_start": os.getloadavg()}
    local_ray(int(runs.NUM_WORKERS * runs.CPUS_PER_WORKER))
    try:
        for side in (side for side in order if runs.SIDES[side].killed):
            record[f"kill_{side}"] = guarded(runs.run_kill, f"kill-{side}-{index}", scratch, runs.SIDES[side],
                                             args.kill_step)
        for side in order:
            record[f"steady_{side}"] = guarded(runs.run_steady, f"steady-{side}-{index}", scratch, runs.SIDES[side],
                                               args.steady_steps)
        record.update(_buddy_cost.run_pair(index, scratch, args.gpt_steps, guarded))
    finally:
        ray.shutdown()
    print(f"round {index}: " + ", ".join(f"{key} {headline(run)}" for key, run in record.items()
                                         if isinstance(run, dict)), flush=True)
    return record


def headline(run: dict) -> Any:
    for field in ("time_lost_s", "samples_per_s", "error"):
        if field in run:
            return run[field]
    return None


def summarize(rounds: list[dict]) -> dict:
    keys = [f"{kind}_{side}" for kind in ("kill", "steady") for side in runs.SIDES]
    ok = {key: [r[key] for r in rounds if r.get(key, {}).get("status") == "finished"] for key in keys}
    medians = {}
    for key, finished in ok.items():
        flat = [numbers({**run, **{k if k.startswith("rejoin_") else f"rejoin_{k}": v
                                   for k, v in run.get("rejoin", {}).items()}}) for run in finished]
        fields = sorted({f for run in flat for f in run})
        medians[key] = {f: round(statistics.median(run[f] for run in flat if f in run), 4) for f in fields}
    worst = {side: {"steps_redone": max((run["steps_redone"] for run in ok[f"kill_{side}"]), default=None),
                    "steps_lost": max((run["steps_lost_event"] for run in ok[f"kill_{side}"]), default=None)}
             for side in runs.KILLED_SIDES}
    gpt = _buddy_cost.summarize(rounds)
    timed = _timed.summarize(rounds, second_copy_cost=None if gpt.get("paired_ratio_median") is None
                             else round(1 - gpt["paired_ratio_median"], 4))
    goals_met = {
        "r2": {"steps_redone_at_most": _at_most(worst["r2"]["steps_redone"], GOALS["r2"]["steps_redone_at_most"]),
               "time_lost_s_below": _below(medians["kill_r2"].get("time_lost_s"), GOALS["r2"]["time_lost_s_below"])},
        "buddy": {"steps_lost_at_most": _at_most(worst["buddy"]["steps_lost"], GOALS["buddy"]["steps_lost_at_most"]),
                  "time_lost_s_below": _below(medians["kill_buddy"].get("time_lost_s"),
                                              GOALS["buddy"]["time_lost_s_below"])},
        "gpt": {"buddy_over_none_samples_per_s_at_least": _buddy_cost.goal_met(gpt)},
        "timed": {"default_cost_fraction_below": _below(timed["default_cost_fraction"],
                                                        GOALS["timed"]["default_cost_fraction_below"]),
                  "below_a_second_copy": timed["below_a_second_copy"]}}
    return {"medians": medians, "over_r1_samples_per_s": {side: ratios_over_r1(rounds, medians, side)
                                                          for side in runs.SIDES if side != "r1"},
            "bytes_per_rank": bytes_per_rank(ok),
            "state_sources": {side: [run["state_source"] for run in ok[f"kill_{side}"]] for side in runs.KILLED_SIDES},
            "worst_round": worst, "buddy_cost": gpt, "timed_checkpoint": timed,
            "outcomes": {key: [r.get(key, {}).get("status") for r in rounds] for key in keys}, "goals_met": goals_met}


def ratios_over_r1(rounds: list[dict], medians: dict, side: str) -> dict[str, float | None]:
    """``side``'s samples/s against r1's: of the medians, per-round pairs, and the kill runs' pre-kill steps."""
    ratios = {f"{kind}{field}": _ratio(medians[f"{kind_key}_{side}"].get(f"{prefix}{field}"),
                                       medians[f"{kind_key}_r1"].get(f"{prefix}{field}"))
              for kind, kind_key, prefix in [("", "steady", ""), ("pre_kill_", "kill", "pre_kill_")]
              for field in ("samples_per_s", "samples_per_s_median_step")}
    paired = [r[f"steady_{side}"]["samples_per_s"] / r["steady_r1"]["samples_per_s"] for r in rounds
              if r.get(f"steady_{side}", {}).get("status") == r.get("steady_r1", {}).get("status") == "finished"]
    ratios["samples_per_s_paired_median"] = round(statistics.median(paired), 3) if paired else None
    return ratios


def bytes_per_rank(ok: dict[str, list[dict]]) -> dict:
    """Measured against the formula, from the first finished steady run of each side (bytes repeat exactly)."""
    out: dict[str, Any] = {"parameters": NUM_PARAMETERS}
    for side, settings in runs.SIDES.items():
        if not ok[f"steady_{side}"]:
            continue
        ranks = ok[f"steady_{side}"][0]["bytes_per_rank"]
        formula = BYTES_PER_PARAMETER * settings.replicas / runs.NUM_WORKERS
        worst = max(ranks, key=lambda m: m["total"])
        copies = max(ranks, key=lambda m: m.get("buddy_copies", 0))
        shard = copies["parameters"] + copies["optimizer"]
        out[side] = {"formula_bytes_per_parameter": formula, "formula_bytes": round(formula * NUM_PARAMETERS),
                     "max_bytes": worst["total"], "max_bytes_per_parameter": round(worst["total"] / NUM_PARAMETERS, 4),
                     "max_over_formula": round(worst["total"] / (formula * NUM_PARAMETERS), 4),
                     "max_buddy_copies_bytes": copies.get("buddy_copies", 0),
                     "buddy_copies_over_shard": round(copies.get("buddy_copies", 0) / shard, 3), "ranks": ranks}
    for side in ("r2", "buddy"):
        if side in out and "r1" in out:
            out[f"{side}_over_r1"] = round(out[side]["max_bytes"] / out["r1"]["max_bytes"], 4)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _below(value: float | None, limit: float) -> bool | None:
    return None if value is None else value < limit


def _at_most(value: int | None, limit: int) -> bool | None:
    return None if value is None else value <= limit


def describe(args: argparse.Namespace) -> dict[str, dict]:
    job = {"workload": f"digits(hidden={HIDDEN}), {NUM_PARAMETERS:,} parameters", "strategy": "zero3",
           "sides": {side: settings.label for side, settings in runs.SIDES.items()},
           "workers": f"{runs.NUM_WORKERS} of {runs.CPUS_PER_WORKER} CPU, min_workers {runs.MIN_WORKERS}",
           "global_batch_size": runs.GLOBAL_BATCH, "optimizer": f"AdamW(lr={runs.LR})",
           "kill": f"rank 1 SIGKILLs itself before step {args.kill_step}",
           "kill_run": f"stopped {changes.LINGER_S:g} s after a progress at world size {runs.NUM_WORKERS} again",
           "steady_run": f"{args.steady_steps} steps, no kill", "max_failures": 1, "gpt_steps": args.gpt_steps}
    definitions = {
        "kill_time": "commit of step K-1 (the killed rank commits it, then SIGKILLs itself before step K)",
        "recovery_s": "first step committed after the kill time minus the kill time",
        "back_at_step_k_s": "commit of step K (the step in flight at the kill) minus the kill time",
        "steps_redone": "committed steps lost (K-1 minus the step resumed from) + 1 (step K, in flight)",
        "steps_lost_event": "the generation_formed event's steps_lost for the generation after the kill: committed "
                            "steps lost (the run's step minus the step its state came from)",
        "step_s": f"median interval between the commits of consecutive steps {runs.WARMUP_STEPS + 1}..K-1 (kill runs) "
                  f"or {runs.WARMUP_STEPS + 1}..end (steady runs), world size {runs.NUM_WORKERS}",
        "time_lost_s": "back_at_step_k_s - step_s: how much later step K commits than in an undisturbed run",
        "rejoin": "the replacement's way back: rejoin_pause_s from the last commit at world size "
                  f"{runs.MIN_WORKERS} to the first at {runs.NUM_WORKERS}; rejoin_time_lost_s = that - step_s; "
                  "step_boundary_s: last commit to worker_joined; generation_formed_s: the generation_formed "
                  "event's duration_s; first_step_s: to the first commit; joined_after_kill_s: worker_joined minus "
                  "the kill time",
        "time_lost_with_rejoin_s": "time_lost_s + rejoin_time_lost_s: what the failure costs in all",
        "state_source": "generation_formed's state_source for the generation after the kill: 'peers' (every shard "
                        "had a surviving copy), 'buddy' (a lost shard came from its buddy's copy) or 'checkpoint' "
                        "(a file read); checkpoint_read: whether it is 'checkpoint'",
        "breakdown": "detected_s: kill to worker_failed; recover_s: to the new generation starting to form; "
                     "generation_formed_s: join + state hand-over (peers, buddy or checkpoint); first_step_s: formed "
                     "to the first commit after the kill; redo_s: from there to step K's commit (0 when only step K "
                     "is redone). They add up to back_at_step_k_s",
        "samples_per_s": f"{runs.GLOBAL_BATCH} x steps / time, over steps {runs.WARMUP_STEPS + 1}..end of the "
                         "steady run (checkpoint saves included); samples_per_s_median_step: 64 / step_s; "
                         f"pre_kill_*: the same over steps {runs.WARMUP_STEPS + 1}..K-1 of the kill runs; over_r1: a "
                         "side's figure / r1's",
        "bytes_per_rank": "TrainWorker.memory() at the end of the steady run: local bytes of parameters, gradients "
                          "and optimizer state (total), against fp32 AdamW's 16 bytes/parameter, ZeRO-3 16/N, HSDP "
                          f"16R/N, N={runs.NUM_WORKERS}; buddy_copies: host bytes of the buddy copies' buffers, not in "
                          "the total; buddy_copies_over_shard: against that rank's parameters + optimizer state",
        "timeline": "[seconds since the kill, step, world size] of every commit attempt from 1 s before the kill",
        **_buddy_cost.describe(args.gpt_steps), **_timed.describe(_timed.MEASURED_MINUTES)}
    return {"job": job, "definitions": definitions}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kill-step", type=int, default=90, help="mid-interval: r1 goes back to step 50")
    parser.add_argument("--steady-steps", type=int, default=200)
    parser.add_argument("--gpt-steps", type=int, default=300,
                        help="steps of each GPT run (~0.55 s a step here: 300 keep a round under 10 minutes)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.kill_step <= runs.WARMUP_STEPS + 2 or args.steady_steps <= runs.WARMUP_STEPS + 2 \
            or args.gpt_steps < 10:
        parser.error(f"need --rounds >= 1, --kill-step and --steady-steps > {runs.WARMUP_STEPS + 2}, --gpt-steps >= 10")
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
    print(json.dumps({k: report[k] for k in ("medians", "over_r1_samples_per_s", "goals_met")}, indent=1))
    print(json.dumps({k: v for k, v in summary["buddy_cost"].items() if k != "host_bytes"}, indent=1))
    print(json.dumps(summary["timed_checkpoint"], indent=1))


if __name__ == "__main__":
    main()
