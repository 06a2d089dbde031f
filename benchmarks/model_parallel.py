"""Steady-state samples/s of our model-parallel layouts against a torchtitan-style torchrun script, and the memory
each rank holds against the formula.

The GPT recipe (benchmarks/sides.py: the gpt workload with dropout, AdamW, warm-up + cosine, clipping, bf16) on
4 workers as zero3 over 4 data-parallel ranks (dp4) and as zero3 over 2 with tensor parallelism 2 (dp2 x tp2).
The peer (benchmarks/_torchrun_model_parallel.py) applies the same torch APIs to the same job on a (dp, tp)
DeviceMesh: the workload's tp plan, ``fully_shard`` over dp, ``loss_parallel``. Rounds alternate the sides (the
order flips every round) after one unmeasured run of each; steady state as in benchmarks/throughput.py. Memory:
the parameter, gradient and optimizer bytes each of our ranks reports at the end (``result.json``'s
``memory``) against the formula: the model's fp32 parameters / (tp x dp) for parameters and gradients, twice
that for AdamW's state. Parameters that tensor parallelism replicates (LayerNorms, biases of the row-split
layers, the position table) make it slightly more. Run from the repository root (about 10 minutes on 2 cores)::

    python -m benchmarks.model_parallel --rounds 2

Writes benchmarks/results/model_parallel.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path

from benchmarks._cpu_meter import Measurement
from benchmarks.common import REPO_ROOT, alternated, machine_info, write_json
from benchmarks.sides import GPT_MODEL, job_sections, measure_ours, run_torchrun
from raylastic.cluster.connect import ray_session
from raylastic.jobconfig import job_config_from_dict
from raylastic.workloads.chargpt import CharGPT

PEER = REPO_ROOT / "benchmarks" / "_torchrun_model_parallel.py"
NUM_WORKERS = 4
LAYOUTS = {"dp4": 1, "dp2 x tp2": 2}
"""Layout name -> parallel.tp, on NUM_WORKERS workers under zero3."""
GOAL_RATIO = 0.98


def sections_for(tp: int, steps: int, global_batch_size: int, scratch: Path) -> dict:
    sections = job_sections("gpt", steps, global_batch_size, scratch)
    sections["scaling"] = {"min_workers": NUM_WORKERS, "max_workers": NUM_WORKERS, "cpus_per_worker": 0.5}
    sections["strategy"] = {"name": "zero3"}
    sections["parallel"] = {"tp": tp}
    job_config_from_dict(sections)
    return sections


def formula_bytes(tp: int) -> dict[str, float]:
    """What each rank holds by the formula: fp32 parameters split over tp x dp; gradients alike; AdamW 2x."""
    model = GPT_MODEL
    parameters = CharGPT.num_parameters(model["n_layer"], model["n_head"], model["n_embd"], model["block_size"])
    per_rank = 4 * parameters / NUM_WORKERS  # tp x dp = NUM_WORKERS in every layout
    return {"parameters": per_rank, "gradients": per_rank, "optimizer": 2 * per_rank}


def benchmark(name: str, tp: int, steps: int, global_batch_size: int, rounds: int, scratch: Path) -> dict:
    sections = sections_for(tp, steps, global_batch_size, scratch)
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
    formula = formula_bytes(tp)
    memory_ratios = {kind: round(max(rank[kind] for rank in memory) / formula[kind], 3) for kind in formula}
    return {"layout": name, "tp": tp, "steps": steps, "global_batch_size": global_batch_size,
            "ours": [asdict(m) for m in ours], "torchrun": [asdict(m) for m in peer],
            "ratio_ours_over_torchrun": round(ratio, 4), "meets_goal": ratio >= GOAL_RATIO,
            "memory_per_rank_bytes": memory, "formula_bytes": formula,
            "memory_over_formula": memory_ratios}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternating ours/torchrun rounds per layout")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--global-batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 5:
        parser.error("need --rounds >= 1 and --steps >= 5")
    os.chdir(REPO_ROOT)
    results = []
    with tempfile.TemporaryDirectory(prefix="raylastic-model-parallel-") as scratch, \
            ray_session(min_cpus=NUM_WORKERS // 2):
        for name, tp in LAYOUTS.items():
            results.append(benchmark(name, tp, args.steps, args.global_batch_size, args.rounds, Path(scratch)))
    payload = {"benchmark": "model-parallel layouts: Raylastic vs a torchrun script of the same torch APIs",
               "machine": machine_info(), "goal_ratio": GOAL_RATIO, "num_workers": NUM_WORKERS, "results": results}
    path = write_json("model_parallel", payload)
    print(f"\n{'layout':11s} {'ours/torchrun':>14s}  memory/formula (parameters, gradients, optimizer)")
    for result in results:
        ratios = result["memory_over_formula"]
        print(f"{result['layout']:11s} {result['ratio_ours_over_torchrun']:14.3f}  "
              f"{ratios['parameters']:.3f}, {ratios['gradients']:.3f}, {ratios['optimizer']:.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
