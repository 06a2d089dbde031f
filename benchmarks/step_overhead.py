"""Where a small model's step time goes: plain DDP, then our step's pieces added one at a time.

The digits MLP (2 ranks, global batch 64, AdamW, 1 torch thread per rank, gloo) trained by the
same 2 processes with four step functions, each on its own model, alternating every round (the
order flips every round) so that all four see the same machine:

- ``ddp``: plain DDP as a user writes it (the torchrun peer of benchmarks/throughput.py);
- ``+hook``: our timed, byte-counting uncompressed comm hook (strategies.compression "none"), which
  ``strategy.comm_timing`` turns on (the default runs DDP's own all-reduce, like ``ddp``);
- ``steprunner``: our whole step, default strategy (actors.step_loop.StepRunner): data slicing, loss scaling,
  optimizer step, this rank's loss, the StepResult;
- ``+vote``: and the stop vote (actors.stop_vote), as TrainWorker's loop runs them.

Per step it reports wall time and the CPU time of the training thread and of the whole process
(gloo's threads included): on a shared 2-core VM wall time swings by tens of percent from round to
round, CPU time much less, and on 2 busy cores CPU spent is wall time lost. ``--ray`` runs the same
four inside two Ray actors (in a thread, as TrainWorker runs its loop), to tell what Ray's worker
process adds from what our step adds. What the whole system adds on top (Controller, polls,
driver) is benchmarks/throughput.py's ours/torchrun. Run from the repository root (about 2
minutes on 2 cores)::

    python -m benchmarks.step_overhead               # in 2 plain processes
    python -m benchmarks.step_overhead --ray         # in 2 Ray actors

Writes benchmarks/results/step_overhead.json (step_overhead_ray.json with --ray).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.throughput import RESULTS, machine_info
from tests.distributed_harness import run_distributed

VARIANTS = ("ddp", "+hook", "steprunner", "+vote")
MEASURES = ("wall", "thread_cpu", "process_cpu")
GLOBAL_BATCH = 64
WARMUP_STEPS = 200


def make_step(variant: str) -> Callable[[int], None]:
    """A function that trains step k of the digits job on the current 2-rank group."""
    from actors.data_order import GlobalSampleOrder
    from actors.step_loop import StepRunner
    from actors.stop_vote import StopVote
    from cluster.config import OptimConfig
    from strategies.compression import make_comm_hook
    from strategies.ddp import DDPStrategy
    from strategies.overlap import CommTimer
    from workloads import load_workload

    torch.manual_seed(0)
    workload = load_workload("digits")
    dataset = workload.train_dataset()
    order = GlobalSampleOrder(len(dataset), GLOBAL_BATCH, seed=0)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    def build_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)

    if variant in ("steprunner", "+vote"):
        device = torch.device("cpu")
        state = DDPStrategy().setup(workload.build_model, build_optimizer, device, None)
        runner = StepRunner(workload=workload, order=order, strategy=DDPStrategy(), micro_batch_size=None,
                            device=device, optim=OptimConfig(name="adamw", lr=1e-3), total_steps=10**7)
        # As the worker does: one DataLoader over the coming steps' batches. Rounds repeat step numbers,
        # so a batch's samples need not be step k's: only the time matters here.
        batches = runner.batches(dataset, 0, 10**7)
        if variant == "steprunner":
            return lambda k: runner.run(state, k, batches)
        vote = StopVote(first_step=0, device=device)

        def voting_step(k: int) -> None:  # TrainWorker._steps without its bookkeeping
            voting = vote.due(k)
            if voting:
                vote.open(k, stop=False)
            runner.run(state, k, batches)
            if voting:
                vote.close(k)

        return voting_step

    model = torch.nn.parallel.DistributedDataParallel(workload.build_model(), bucket_cap_mb=25.0)
    optimizer = build_optimizer(model)
    if variant == "+hook":
        hook = make_comm_hook("none")
        model.register_comm_hook(hook.state, CommTimer().wrap(hook.hook))
    inputs, targets = dataset.tensors
    scale = world_size / GLOBAL_BATCH

    def step(k: int) -> None:
        indices = order.rank_indices(k, rank, world_size)
        optimizer.zero_grad(set_to_none=True)
        loss = workload.training_step(model, (inputs[indices], targets[indices])) * len(indices)
        (loss * scale).backward()
        optimizer.step()
        loss.item()

    return step


def measure(steps: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per variant and measure ("wall", "thread_cpu", "process_cpu"), microseconds per step in every
    round (collective: every rank calls it)."""
    torch.set_num_threads(1)
    step_functions = {variant: make_step(variant) for variant in VARIANTS}
    for step in step_functions.values():
        for k in range(WARMUP_STEPS):
            step(k)
    per_round: dict[str, dict[str, list[float]]] = {v: {m: [] for m in MEASURES} for v in VARIANTS}
    for round_index in range(rounds):
        for variant in VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]:
            dist.barrier()
            started = (time.perf_counter(), time.thread_time(), time.process_time())
            for k in range(WARMUP_STEPS, WARMUP_STEPS + steps):
                step_functions[variant](k)
            ended = (time.perf_counter(), time.thread_time(), time.process_time())
            for measure_name, begin, end in zip(MEASURES, started, ended, strict=True):
                per_round[variant][measure_name].append(round((end - begin) / steps * 1e6, 1))
    return per_round


def in_processes(steps: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    return run_distributed(measure, 2, steps, rounds, timeout_s=900.0)[0]


def in_ray_actors(steps: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    import ray

    from cluster.connect import ray_session

    @ray.remote(num_cpus=1)
    class Rank:
        def run(self, rank: int, store_path: str) -> dict[str, dict[str, list[float]]]:
            box: list = []

            def loop() -> None:  # TrainWorker trains in a thread of its own, too
                dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                                        timeout=timedelta(seconds=300))
                try:
                    box.append(measure(steps, rounds))
                finally:
                    dist.destroy_process_group()

            thread = threading.Thread(target=loop)
            thread.start()
            thread.join()
            return box[0]

    with ray_session(min_cpus=2), tempfile.TemporaryDirectory(prefix="raylastic-overhead-") as directory:
        ranks = [Rank.remote() for _ in range(2)]
        store = str(Path(directory) / "store")
        return ray.get([rank.run.remote(index, store) for index, rank in enumerate(ranks)])[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--ray", action="store_true", help="run the ranks in two Ray actors")
    args = parser.parse_args(argv)
    if args.steps < 10 or args.rounds < 1:
        parser.error("need --steps >= 10 and --rounds >= 1")

    os.chdir(Path(__file__).resolve().parent.parent)  # Ray workers import the project from here
    per_round = (in_ray_actors if args.ray else in_processes)(args.steps, args.rounds)
    medians = {v: {m: statistics.median(per_round[v][m]) for m in MEASURES} for v in VARIANTS}
    paired = {v: {m: round(statistics.median(ours / ddp for ours, ddp in zip(per_round[v][m], per_round["ddp"][m],
                                                                             strict=True)), 4)
                  for m in MEASURES} for v in VARIANTS}
    where = "2 Ray actors" if args.ray else "2 processes"
    print(f"\ndigits MLP, B={GLOBAL_BATCH}, {where}, rank 0, medians of {args.rounds} rounds x {args.steps} steps "
          "(x plain DDP in the same round)")
    print(f"  {'':11s} {'wall us':>15s} {'thread CPU us':>15s} {'process CPU us':>15s}")
    for variant in VARIANTS:
        cells = [f"{medians[variant][m]:6.0f} ({paired[variant][m]:.3f})" for m in MEASURES]
        print(f"  {variant:11s} " + " ".join(f"{cell:>15s}" for cell in cells))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / ("step_overhead_ray.json" if args.ray else "step_overhead.json")
    path.write_text(json.dumps({
        "benchmark": "us per step of the digits MLP: plain DDP vs our step's pieces, same processes, alternating",
        "where": where, "machine": machine_info(), "steps": args.steps, "rounds": args.rounds,
        "measures": {"wall": "perf_counter", "thread_cpu": "the training thread's CPU time (time.thread_time)",
                     "process_cpu": "the rank's whole process, gloo's threads included (time.process_time)"},
        "us_per_step_per_round": per_round, "median_us_per_step": medians,
        "paired_ratio_to_ddp": paired},
        indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
