"""The buddy copy's cost on the GPT recipe, against no copy, in the same processes (issue 53: goal within 2%).

benchmarks/redundancy.py's GPT pair compares whole Ray runs, one with the copy and one without; on a shared
2-core machine whose load swings, two runs minutes apart differ by more than the copy costs (and a loaded
machine may not even place the workers in time). Here the same 4 ranks (gloo, 1 torch thread each: the
processes of zero3 at 4 workers) train benchmarks/redundancy.py's GPT job (benchmarks/_buddy_cost.py:
workloads.gpt, AdamW in two groups, warm-up + cosine lr, clipping at 1.0, bf16 autocast, global batch 64) with
StepRunner.run as TrainWorker runs it, in alternating blocks of ``--steps`` steps: ``copy`` (after every
step ``BuddyCopies.start``, before every reduction ``finish``, as actors/worker/training_loop.py calls them)
and ``none``; the block that goes first alternates. Per block: wall time per step (the ranks move in step:
rank 0's), the rank processes' CPU per step (gloo's threads and the exchange's included, summed over the 4
ranks). The cost is the ratio of samples/s copy / none of the two blocks of a round; its median over rounds
and its spread.

Run from the repository root (~6 minutes on 2 idle cores)::

    .venv/bin/python -m benchmarks.copy_cost
    .venv/bin/python -m benchmarks.copy_cost --rounds 16 --steps 8

Writes benchmarks/results/copy_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks import _buddy_cost
from benchmarks.common import RESULTS, alternated, machine_info
from raylastic.actors.data.order import GlobalSampleOrder
from raylastic.actors.worker.optimizer_recipe import optimizer_factory
from raylastic.actors.worker.step import StepRunner
from raylastic.jobconfig import job_config_from_dict
from raylastic.strategies.base import GroupContext
from raylastic.strategies.buddy_copy import BuddyCopies
from raylastic.strategies.build import build_strategy
from raylastic.workloads import load_workload
from tests.support.distributed_harness import run_distributed

SIDES = ("copy", "none")
WARMUP_STEPS = 6
GOAL_RATIO = _buddy_cost.GOAL_RATIO


def measure(sections: dict, steps: int, rounds: int) -> dict:
    """Collective (every rank): per side, each round's wall seconds per step and this process's CPU per step."""
    torch.set_num_threads(1)
    job = job_config_from_dict(sections)
    workload = load_workload(job.workload.name, job.workload.options)
    dataset = workload.train_dataset()
    strategy = build_strategy(job.strategy)
    torch.manual_seed(job.training.seed)
    state = strategy.setup(workload.build_model, optimizer_factory(job.optim, getattr(workload, "configure_optimizer",
                                                                                      None)),
                           torch.device("cpu"), None, GroupContext(node_ids=("node",) * dist.get_world_size(),
                                                                   completed_steps=0))
    order = GlobalSampleOrder(len(dataset), job.training.global_batch_size, job.training.seed)
    runner = StepRunner(workload=workload, dataset=dataset, strategy=strategy, optim=job.optim, order=order,
                        micro_batch_size=None, device=torch.device("cpu"), total_steps=10**6,
                        seed=job.training.seed, precision=job.training.precision)
    copies = BuddyCopies(group=dist.new_group(backend="gloo", timeout=timedelta(seconds=600)), layout=state.layout,
                         generation=0, timeout_s=600)
    batches = runner.batches(dataset, 0, 10**6, job.data)
    step = 0

    def block(side: str, count: int) -> tuple[float, float]:
        nonlocal step
        dist.barrier()
        started = (time.perf_counter(), time.process_time())
        for _ in range(count):
            if side == "copy":
                runner.run(state, step, batches, before_reduction=copies.finish)
                copies.start(strategy, state, None, step + 1)
            else:
                runner.run(state, step, batches)
            step += 1
        copies.finish()  # the block's last exchange is the copy's cost
        dist.barrier()
        return (time.perf_counter() - started[0]) / count, (time.process_time() - started[1]) / count

    for side in SIDES:
        block(side, WARMUP_STEPS)
    per_round: dict[str, dict[str, list[float]]] = {side: {"wall_s": [], "cpu_s": []} for side in SIDES}
    for index in range(rounds):
        for side in alternated(SIDES, index):
            wall, cpu = block(side, steps)
            per_round[side]["wall_s"].append(round(wall, 5))
            per_round[side]["cpu_s"].append(round(cpu, 5))
    copies.close()
    return {"per_round": per_round, "host_bytes": copies.host_bytes(), "shard_bytes": copies._packed_by.packer.size}


def summarize(ranks: list[dict], global_batch: int) -> dict:
    per_round = ranks[0]["per_round"]
    ratios = [round(none / copy, 4) for copy, none in zip(per_round["copy"]["wall_s"], per_round["none"]["wall_s"],
                                                           strict=True)]
    cpu = {side: [sum(rank["per_round"][side]["cpu_s"][i] for rank in ranks) for i in range(len(ratios))]
           for side in SIDES}
    median = statistics.median(ratios)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [median, median, median]
    return {"paired_ratio_median": round(median, 4), "paired_ratios": ratios,
            "paired_ratio_spread": [min(ratios), max(ratios)],
            "paired_ratio_quartiles": [round(quartiles[0], 4), round(quartiles[2], 4)],
            "samples_per_s": {side: round(global_batch / statistics.median(per_round[side]["wall_s"]), 1)
                              for side in SIDES},
            "rank_cpu_ms_per_step": {side: round(1e3 * statistics.median(cpu[side]), 1) for side in SIDES},
            "cpu_ratio_median": round(statistics.median(c / n for c, n in zip(cpu["copy"], cpu["none"],
                                                                              strict=True)), 4),
            "host_bytes_rank0": ranks[0]["host_bytes"], "shard_bytes_rank0": ranks[0]["shard_bytes"],
            "goal_met": median >= GOAL_RATIO}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=10, help="steps per side per round")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.steps < 2:
        parser.error("need --rounds >= 2 and --steps >= 2")
    load_before = machine_info()["loadavg_1_5_15"]
    with tempfile.TemporaryDirectory(prefix="raylastic-copy-cost-") as scratch:
        sections = _buddy_cost.job_sections("copy-cost", True, 10**6, Path(scratch))
        ranks = run_distributed(measure, _buddy_cost.NUM_WORKERS, sections, args.steps, args.rounds,
                                timeout_s=3600.0)
    summary = summarize(ranks, _buddy_cost.GLOBAL_BATCH)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "copy_cost.json"
    path.write_text(json.dumps({
        "benchmark": "the buddy copy's cost on the GPT recipe: copy against no copy, same processes, alternating",
        "machine": machine_info(), "load_average_1_5_15_min": {"before": load_before},
        "job": {"gpt": _buddy_cost.describe(10**6)["gpt_job"].split("; ")[0], "ranks": _buddy_cost.NUM_WORKERS,
                "torch_threads_per_rank": 1, "steps_per_block": args.steps, "rounds": args.rounds},
        "definitions": {"paired_ratio": "samples/s of the copy block / the none block of one round (none's wall "
                                        "time per step / copy's); the goal's figure is their median",
                        "rank_cpu_ms_per_step": "CPU of the 4 rank processes per step, summed (gloo's threads and "
                                                "the exchange's included), median over rounds",
                        "host_bytes_rank0": "the copies' host buffers on rank 0 at the end; shard_bytes_rank0: its "
                                            "packed shard (parameters and optimizer state)"},
        "goals": {"copy_over_none_samples_per_s_at_least": GOAL_RATIO}, **summary,
        "per_round_rank0": ranks[0]["per_round"]}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
