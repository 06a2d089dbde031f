"""Steady-state samples/s of our model-parallel layouts against a torchtitan-style torchrun script, and the memory
each rank holds against the formula.

The GPT recipe (benchmarks/sides.py: the gpt workload with dropout, AdamW, warm-up + cosine, clipping, bf16; its
head untied from the embedding, which a pipeline puts on another stage) on 4 workers under zero3, as dp4, dp2 x tp2,
pp2 x dp2 and pp2 x tp2 (1f1b, 2 micro-batches). The peer (benchmarks/_torchrun_model_parallel.py) applies the same
torch APIs to the same job on a (pp, dp, tp) DeviceMesh: the workload's stages and tp plan, ``fully_shard`` over
dp, ``loss_parallel``, ``Schedule1F1B``. Rounds alternate the sides (the order flips every round) after one
unmeasured run of each; steady state as in benchmarks/throughput.py. Memory: the parameter, gradient and optimizer
bytes each of our ranks reports at the end (``result.json``'s ``memory``) against the formula: the model's fp32
parameters / (pp x tp x dp) for parameters and gradients, twice that for AdamW's state; for the largest rank and
for the mean. Parameters that tensor parallelism replicates (LayerNorms, biases of the row-split layers, the
position table) make it slightly more, and pipeline stages hold unequal shares (the embeddings on the first, the
head on the last). ``--part recovery``: one of the 4 workers killed at pp2 x dp2 and at dp2 x tp2, ours against a
checkpoint restart and a replica-group restart (benchmarks/_model_parallel_recovery.py). Run from the repository
root (about 20 minutes on 2 cores for the layouts, 10 for a round of recovery)::

    python -m benchmarks.model_parallel --rounds 2 --part throughput
    python -m benchmarks.model_parallel --rounds 1 --part recovery

Writes benchmarks/results/model_parallel.json and model_parallel_recovery.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path

from benchmarks import _model_parallel_recovery as recovery_ways
from benchmarks._cpu_meter import Measurement
from benchmarks._recovery_helpers import RECOVERY_BREAKDOWN
from benchmarks.common import REPO_ROOT, alternated, machine_info, write_json
from benchmarks.sides import job_sections, measure_ours, run_torchrun
from raylastic.cluster.connect import ray_session
from raylastic.jobconfig import job_config_from_dict
from raylastic.workloads import load_workload

PEER = REPO_ROOT / "benchmarks" / "_torchrun_model_parallel.py"
NUM_WORKERS = 4
LAYOUTS = {"dp4": {}, "dp2 x tp2": {"tp": 2}, "pp2 x dp2": {"pp": 2}, "pp2 x tp2": {"pp": 2, "tp": 2}}
"""Layout name -> the parallel section, on NUM_WORKERS workers under zero3."""
GOAL_RATIO = 0.98
RECOVERY_LAYOUTS = ("pp2 x dp2", "dp2 x tp2")


def sections_for(parallel: dict, steps: int, global_batch_size: int, scratch: Path) -> dict:
    sections = job_sections("gpt", steps, global_batch_size, scratch)
    sections["workload"]["options"]["tie_embeddings"] = False  # a pipeline's first and last stages differ
    sections["scaling"] = {"min_workers": NUM_WORKERS, "max_workers": NUM_WORKERS, "cpus_per_worker": 0.5}
    sections["strategy"] = {"name": "zero3"}
    sections["parallel"] = dict(parallel)
    job_config_from_dict(sections)
    return sections


def formula_bytes(sections: dict) -> dict[str, float]:
    """What each rank holds by the formula: fp32 parameters split over pp x tp x dp; gradients alike; AdamW 2x."""
    model = load_workload("gpt", sections["workload"]["options"]).build_model()
    per_rank = 4 * sum(p.numel() for p in model.parameters()) / NUM_WORKERS  # pp x tp x dp = NUM_WORKERS
    return {"parameters": per_rank, "gradients": per_rank, "optimizer": 2 * per_rank}


def benchmark(name: str, parallel: dict, steps: int, global_batch_size: int, rounds: int, scratch: Path) -> dict:
    sections = sections_for(parallel, steps, global_batch_size, scratch)
    ours: list[Measurement] = []
    peer: list[Measurement] = []
    memory: list[dict[str, int]] = []

    def run_ours(run_dir: Path) -> Measurement:
        run = measure_ours(job_config_from_dict({**sections, "name": f"mp-{run_dir.name}"}), run_dir)
        memory[:] = run.result.memory
        return run.measurement

    def run_peer(run_dir: Path) -> Measurement:
        return run_torchrun(sections, run_dir, num_workers=NUM_WORKERS, script=PEER)

    slug = name.replace(" ", "")
    for side, run in (("ours", run_ours), ("torchrun", run_peer)):  # warm-up: not measured
        run_dir = scratch / f"{slug}-{side}-warmup"
        run_dir.mkdir(parents=True)
        run(run_dir)
    for round_index in range(rounds):
        sides = [("ours", run_ours), ("torchrun", run_peer)]
        for side, run in alternated(sides, round_index):
            run_dir = scratch / f"{slug}-{side}-{round_index}"
            run_dir.mkdir(parents=True)
            measurement = run(run_dir)
            (ours if side == "ours" else peer).append(measurement)
            print(f"  {name} round {round_index + 1}/{rounds} {side:9s} {measurement.samples_per_s:8.1f} samples/s",
                  flush=True)
    ratio = statistics.median(m.samples_per_s for m in ours) / statistics.median(m.samples_per_s for m in peer)
    formula = formula_bytes(sections)
    return {"layout": name, "parallel": parallel, "steps": steps, "global_batch_size": global_batch_size,
            "ours": [asdict(m) for m in ours], "torchrun": [asdict(m) for m in peer],
            "ratio_ours_over_torchrun": round(ratio, 4), "meets_goal": ratio >= GOAL_RATIO,
            "memory_per_rank_bytes": memory, "formula_bytes": formula,
            "memory_over_formula": {kind: round(max(rank[kind] for rank in memory) / formula[kind], 3)
                                    for kind in formula},
            "mean_memory_over_formula": {kind: round(statistics.mean(rank[kind] for rank in memory) / formula[kind], 3)
                                         for kind in formula}}


def recovery(name: str, parallel: dict, args: argparse.Namespace, scratch: Path) -> dict:
    """One worker of 4 killed at step ``args.kill_step`` of the layout, each way of _model_parallel_recovery.WAYS,
    ``args.rounds`` times (the ways' order flips every round); medians over the rounds."""
    sections = sections_for(parallel, args.recovery_steps, args.global_batch_size, scratch)
    runs: dict[str, list[dict]] = {way: [] for way in recovery_ways.WAYS}
    for round_index in range(args.rounds):
        for way in alternated(list(recovery_ways.WAYS), round_index):
            run_dir = scratch / f"{name.replace(' ', '')}-{way.replace(' ', '-')}-{round_index}"
            measured = recovery_ways.measure(way, sections, run_dir, kill_step=args.kill_step,
                                             num_workers=NUM_WORKERS)
            runs[way].append(measured)
            print(f"  {name} round {round_index + 1}/{args.rounds} {way:22s} kill -> next step "
                  f"{measured['recovery_s']:6.2f} s, {measured['steps_redone']} redone, samples/s after/before "
                  f"{measured['after_over_before']}", flush=True)
    summary = {way: {key: statistics.median(run[key] for run in done if run.get(key) is not None)
                     for key in ("recovery_s", "steps_redone", "after_over_before", *RECOVERY_BREAKDOWN)
                     if any(run.get(key) is not None for run in done)} for way, done in runs.items()}
    return {"layout": name, "parallel": parallel, "kill_step": args.kill_step, "steps": args.recovery_steps,
            "killed_rank": recovery_ways.KILLED_RANK, "summary": summary, "runs": runs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "throughput", "recovery"), default="all")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per layout")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--recovery-steps", type=int, default=30, help="steps of each recovery run")
    parser.add_argument("--kill-step", type=int, default=15, help="the step the killed worker does not finish")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 5 or not 5 <= args.kill_step < args.recovery_steps - 5:
        parser.error("need --rounds >= 1, --steps >= 5 and 5 <= --kill-step < --recovery-steps - 5")
    os.chdir(REPO_ROOT)
    with tempfile.TemporaryDirectory(prefix="raylastic-model-parallel-") as scratch, \
            ray_session(min_cpus=NUM_WORKERS // 2):
        if args.part in ("all", "throughput"):
            throughput(args, Path(scratch))
        if args.part in ("all", "recovery"):
            recoveries = [recovery(name, LAYOUTS[name], args, Path(scratch)) for name in RECOVERY_LAYOUTS]
            path = write_json("model_parallel_recovery", {
                "benchmark": "model-parallel recovery: one of 4 workers killed, three ways",
                "machine": machine_info(), "num_workers": NUM_WORKERS, "results": recoveries})
            print(f"wrote {path}")


def throughput(args: argparse.Namespace, scratch: Path) -> None:
    results = [benchmark(name, parallel, args.steps, args.global_batch_size, args.rounds, scratch)
               for name, parallel in LAYOUTS.items()]
    payload = {"benchmark": "model-parallel layouts: Raylastic vs a torchrun script of the same torch APIs",
               "machine": machine_info(), "goal_ratio": GOAL_RATIO, "num_workers": NUM_WORKERS, "results": results}
    path = write_json("model_parallel", payload)
    print(f"\n{'layout':11s} {'ours/torchrun':>14s}  memory/formula of the largest rank, of the mean "
          "(parameters, gradients, optimizer)")
    for result in results:
        largest, mean = result["memory_over_formula"], result["mean_memory_over_formula"]
        print(f"{result['layout']:11s} {result['ratio_ours_over_torchrun']:14.3f}  "
              f"{largest['parameters']:.3f}, {largest['gradients']:.3f}, {largest['optimizer']:.3f}; "
              f"{mean['parameters']:.3f}, {mean['gradients']:.3f}, {mean['optimizer']:.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
