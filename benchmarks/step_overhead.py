"""Where a small model's step time goes: plain DDP, then our step's pieces added one at a time.

The digits MLP (2 ranks, global batch 64, AdamW, 1 torch thread per rank, gloo) trained by the
same 2 processes with four step functions, each on its own model, alternating every round (the
order flips every round) so that all four see the same machine:

- ``ddp``: plain DDP as a user writes it (the torchrun peer of benchmarks/throughput.py);
- ``+hook``: our timed, byte-counting uncompressed comm hook (strategies.compression "none");
- ``+metrics``: and the step's [loss, samples, stop vote] summed over ranks, carried in bucket 0;
- ``steprunner``: our whole step (actors.step_loop.StepRunner): data slicing, loss scaling,
  metrics, optimizer step, the StepResult.

``--ray`` runs the same four inside two Ray actors (in a thread, as TrainWorker runs its loop),
to tell what Ray's worker process adds from what our step adds. What the whole system adds on
top (Controller, polls, driver) is benchmarks/throughput.py's ours/torchrun. Run from the
repository root (about 2 minutes on 2 cores)::

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

VARIANTS = ("ddp", "+hook", "+metrics", "steprunner")
GLOBAL_BATCH = 64


def make_step(variant: str) -> Callable[[int], None]:
    """A function that trains step k of the digits job on the current 2-rank group."""
    from actors.data_order import GlobalSampleOrder
    from actors.step_loop import StepRunner
    from strategies.compression import make_comm_hook
    from strategies.ddp import DDPStrategy
    from strategies.overlap import CommTimer
    from strategies.step_metrics import BucketPiggyback
    from workloads import load_workload

    torch.manual_seed(0)
    workload = load_workload("digits")
    dataset = workload.train_dataset()
    order = GlobalSampleOrder(len(dataset), GLOBAL_BATCH, seed=0)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    def build_optimizer(parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(parameters, lr=1e-3, weight_decay=0.0)

    if variant == "steprunner":
        state = DDPStrategy().setup(workload.build_model, build_optimizer, torch.device("cpu"), None)
        runner = StepRunner(workload, dataset, order, DDPStrategy(), None, torch.device("cpu"))
        return lambda k: runner.run(state, k, stop_vote=False)

    model = torch.nn.parallel.DistributedDataParallel(workload.build_model(), bucket_cap_mb=25.0)
    optimizer = build_optimizer(list(model.parameters()))
    metrics = BucketPiggyback() if variant == "+metrics" else None
    if variant != "ddp":
        hook = make_comm_hook("none")
        model.register_comm_hook(hook.state, CommTimer().wrap(metrics.wrap(hook.hook) if metrics else hook.hook))
    inputs, targets = dataset.tensors
    scale = world_size / GLOBAL_BATCH

    def step(k: int) -> None:
        indices = order.rank_indices(k, rank, world_size)
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss_sum(model(inputs[indices]), targets[indices])
        if metrics:
            metrics.start(torch.stack([loss.detach().double(), loss.new_tensor(len(indices), dtype=torch.float64),
                                       loss.new_tensor(0.0, dtype=torch.float64)]))
        (loss * scale).backward()
        if metrics:
            metrics.finish()
        optimizer.step()
        loss.item()

    return step


def measure(steps: int, rounds: int, warmup: int = 200) -> dict[str, list[float]]:
    """Microseconds per step of every variant, per round (collective: every rank calls it)."""
    torch.set_num_threads(1)
    step_functions = {variant: make_step(variant) for variant in VARIANTS}
    for step in step_functions.values():
        for k in range(warmup):
            step(k)
    per_round: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for round_index in range(rounds):
        for variant in VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]:
            dist.barrier()
            started = time.perf_counter()
            for k in range(warmup, warmup + steps):
                step_functions[variant](k)
            per_round[variant].append(round((time.perf_counter() - started) / steps * 1e6, 1))
    return per_round


def in_processes(steps: int, rounds: int) -> dict[str, list[float]]:
    return run_distributed(measure, 2, steps, rounds, timeout_s=900.0)[0]


def in_ray_actors(steps: int, rounds: int) -> dict[str, list[float]]:
    import ray

    from cluster.connect import ray_session

    @ray.remote(num_cpus=1)
    class Rank:
        def run(self, rank: int, store_path: str) -> dict[str, list[float]]:
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
    parser.add_argument("--steps", type=int, default=1000, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--ray", action="store_true", help="run the ranks in two Ray actors")
    args = parser.parse_args(argv)
    if args.steps < 10 or args.rounds < 1:
        parser.error("need --steps >= 10 and --rounds >= 1")

    os.chdir(Path(__file__).resolve().parent.parent)  # Ray workers import the project from here
    per_round = (in_ray_actors if args.ray else in_processes)(args.steps, args.rounds)
    medians = {variant: statistics.median(values) for variant, values in per_round.items()}
    baseline = medians["ddp"]
    where = "2 Ray actors" if args.ray else "2 processes"
    print(f"\ndigits MLP, B={GLOBAL_BATCH}, {where}, medians of {args.rounds} rounds x {args.steps} steps")
    for variant in VARIANTS:
        print(f"  {variant:11s} {medians[variant]:7.0f} us/step  ({medians[variant] - baseline:+5.0f} us, "
              f"{medians[variant] / baseline:.3f}x ddp)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / ("step_overhead_ray.json" if args.ray else "step_overhead.json")
    path.write_text(json.dumps({
        "benchmark": "us per step of the digits MLP: plain DDP vs our step's pieces, same processes, alternating",
        "where": where, "machine": machine_info(), "steps": args.steps, "rounds": args.rounds,
        "us_per_step_per_round": per_round, "median_us_per_step": medians,
        "ratio_to_ddp": {variant: round(medians[variant] / baseline, 4) for variant in VARIANTS}}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
