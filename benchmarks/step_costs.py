"""What our GPT-recipe step costs against the torchrun peer's, in the same 2 processes, and what its pieces cost.

benchmarks/throughput.py compares whole runs, whose ratio swings by +-10% from run to run on a shared
2-core VM. This script takes the run apart (Raylastic's Controller, driver and Ray services out of the
picture) in two ways:

- **pieces** (one process, 1 torch thread): microseconds per call of each thing our step does that the
  peer's step does differently or not at all: the grad-norm and clipping
  (actors.worker.optimizer_recipe.clip_gradients vs torch's clip_grad_norm_, vs not clipping), the
  per-micro-batch RNG seed (actors.worker.step.seed_rng), the lr setting, the DataLoader fetch of a batch
  (actors.data.batches.planned_batches) vs indexing the dataset, and the step's forward/backward/optimizer for scale.
- **steps** (2 ranks, gloo, 1 torch thread each, each variant its own model, variants alternating every
  round and the order flipping): the peer's step (benchmarks/_torchrun_ddp.py PlainDDP.step), our
  StepRunner.run, and StepRunner.run with the stop vote as TrainWorker runs them (a vote every step at this
  step time). Per step: wall time, the training thread's CPU and the whole process's CPU (gloo's threads
  and, with ``--ray``, Ray's), with the median per-round ratio to the peer.

Run from the repository root (about 4 minutes on 2 cores)::

    python -m benchmarks.step_costs                 # gpt, in 2 plain processes
    python -m benchmarks.step_costs --ray           # in 2 Ray actors, training in a thread as TrainWorker does
    python -m benchmarks.step_costs --workload digits --steps 300

Writes benchmarks/results/step_costs.json (step_costs_ray.json with --ray).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
import timeit
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks._torchrun_ddp import PlainDDP, step_batches
from benchmarks.common import RESULTS, alternated, machine_info
from benchmarks.sides import job_sections
from raylastic.actors.data.batch_split import BatchSplit
from raylastic.actors.data.batches import planned_batches, to_device
from raylastic.actors.data.order import GlobalSampleOrder
from raylastic.actors.worker import step as step_module
from raylastic.actors.worker.optimizer_recipe import clip_gradients, learning_rate, optimizer_factory, set_learning_rate
from raylastic.actors.worker.step import StepRunner, seed_rng, step_seed
from raylastic.actors.worker.stop_vote import StopVote
from raylastic.jobconfig import job_config_from_dict
from raylastic.strategies.ddp import DDPStrategy
from raylastic.workloads import load_workload
from tests.support.distributed_harness import run_distributed

VARIANTS = ("peer", "steprunner", "+vote", "-norm", "-seed", "-loader")
"""peer: benchmarks/_torchrun_ddp.py's step; steprunner: ours (actors.worker.step.StepRunner.run); +vote: ours
with the stop vote; -norm, -seed, -loader: ours with one piece as the peer has it: torch's clip_grad_norm_
only when clipping (no norm when not), no per-micro-batch RNG seed, the peer's batches instead of our
DataLoader (actors.data.batches.planned_batches)."""
MEASURES = ("wall", "thread_cpu", "process_cpu")
GLOBAL_BATCH = 64
WARMUP_STEPS = 10


def make_step(variant: str, sections: dict) -> Callable[[int], None]:
    """A function that trains step k of the job on the current 2-rank group, as ``variant`` does."""
    job = job_config_from_dict(sections)
    if variant == "peer":
        peer = PlainDDP.build(job, steps=10**7)

        def peer_step(k: int) -> None:
            loss, _ = peer.step(k)
            if dist.get_rank() == 0:
                loss.item()  # the peer's rank 0 logs its loss

        return peer_step

    torch.manual_seed(job.training.seed)  # as TrainWorker.join: the same initial model as the peer's
    workload = load_workload(job.workload.name, job.workload.options)
    dataset = workload.train_dataset()
    device = torch.device("cpu")
    strategy = DDPStrategy(bucket_cap_mb=job.strategy.bucket_cap_mb)
    build_optimizer = optimizer_factory(job.optim, getattr(workload, "configure_optimizer", None))
    state = strategy.setup(workload.build_model, build_optimizer, device, None)
    runner = StepRunner(workload=workload, strategy=strategy, device=device, optim=job.optim,
                        order=GlobalSampleOrder(len(dataset), job.training.global_batch_size, job.training.seed),
                        micro_batch_size=None, total_steps=job.training.steps, seed=job.training.seed,
                        precision=job.training.precision)
    # One DataLoader over the coming batches, as TrainWorker makes (StepRunner.batches); rounds repeat step
    # numbers, so a batch's samples need not be step k's: only the time matters here.
    split = BatchSplit.even(runner.order.global_batch_size, dist.get_world_size())
    batches = planned_batches(dataset, runner.order, split=split, rank=dist.get_rank(), first_step=0, until_step=10**7,
                              micro_batch_size=None,
                              collate=getattr(workload, "collate", None), data=job.data)
    if variant == "-loader":
        batches = step_batches(workload, job, runner.order, dist.get_rank(), dist.get_world_size(), 10**7)
    if variant in ("steprunner", "-loader"):
        return lambda k: runner.run(state, k, batches)
    if variant in ("-norm", "-seed"):
        return _with_step_module_globals(lambda k: runner.run(state, k, batches), ABLATIONS[variant])
    vote = StopVote(first_step=0, device=device)

    def voting_step(k: int) -> None:  # TrainingLoop._steps without its bookkeeping
        voting = vote.due(k)
        if voting:
            vote.open(k, stop=False)
        runner.run(state, k, batches)
        if voting:
            vote.close(k)

    return voting_step


def _peer_clipping(parameters: Iterable[torch.nn.Parameter], max_norm: float, across: object = None) -> torch.Tensor:
    """torch's clipping, as the peer clips (``across``: the pipeline's stages, which the benchmark has none of)."""
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return torch.zeros(())


ABLATIONS: dict[str, dict[str, Callable]] = {"-norm": {"clip_gradients": _peer_clipping},
                                              "-seed": {"seed_rng": lambda seed, device: None}}
"""What a variant replaces among the functions actors.worker.step's StepRunner.run calls."""


def _with_step_module_globals(step: Callable[[int], None], replacements: dict[str, Callable]) -> Callable[[int], None]:
    """``step`` run with some of actors.worker.step's functions replaced (only while it runs: variants alternate)."""

    def run(k: int) -> None:
        saved = {name: getattr(step_module, name) for name in replacements}
        for name, value in replacements.items():
            setattr(step_module, name, value)
        try:
            step(k)
        finally:
            for name, value in saved.items():
                setattr(step_module, name, value)

    return run


def measure(sections: dict, steps: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per variant and measure, microseconds per step in every round (collective: every rank calls it)."""
    torch.set_num_threads(1)
    step_functions = {variant: make_step(variant, sections) for variant in VARIANTS}
    for step in step_functions.values():
        for k in range(WARMUP_STEPS):
            step(k)
    per_round: dict[str, dict[str, list[float]]] = {v: {m: [] for m in MEASURES} for v in VARIANTS}
    for round_index in range(rounds):
        for variant in alternated(VARIANTS, round_index):
            dist.barrier()
            started = (time.perf_counter(), time.thread_time(), time.process_time())
            for k in range(WARMUP_STEPS, WARMUP_STEPS + steps):
                step_functions[variant](k)
            ended = (time.perf_counter(), time.thread_time(), time.process_time())
            for name, begin, end in zip(MEASURES, started, ended, strict=True):
                per_round[variant][name].append(round((end - begin) / steps * 1e6, 1))
    return per_round


def in_ray_actors(sections: dict, steps: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    import ray

    from raylastic.cluster.connect import ray_session

    @ray.remote(num_cpus=1)
    class Rank:
        def run(self, rank: int, store_path: str) -> dict[str, dict[str, list[float]]]:
            box: list = []

            def loop() -> None:  # TrainWorker trains in a thread of its own, too
                dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                                        timeout=timedelta(seconds=300))
                try:
                    box.append(measure(sections, steps, rounds))
                finally:
                    dist.destroy_process_group()

            thread = threading.Thread(target=loop)
            thread.start()
            thread.join()
            return box[0]

    with ray_session(min_cpus=2), tempfile.TemporaryDirectory(prefix="raylastic-step-costs-") as directory:
        ranks = [Rank.remote() for _ in range(2)]
        store = str(Path(directory) / "store")
        return ray.get([rank.run.remote(index, store) for index, rank in enumerate(ranks)])[0]


def piece_costs(sections: dict, repeats: int = 7) -> dict[str, float]:
    """Microseconds per call of our step's pieces and their peer counterparts, in this process (median of repeats)."""
    torch.set_num_threads(1)
    job = job_config_from_dict(sections)
    workload = load_workload(job.workload.name, job.workload.options)
    dataset = workload.train_dataset()
    torch.manual_seed(0)
    model = workload.build_model()
    optimizer = optimizer_factory(job.optim, getattr(workload, "configure_optimizer", None))(model)
    order = GlobalSampleOrder(len(dataset), GLOBAL_BATCH, seed=0)
    share = order.rank_indices(0, 0, 2).tolist()
    collate = getattr(workload, "collate", None)
    loader = planned_batches(dataset, order, split=BatchSplit.even(GLOBAL_BATCH, 2), rank=0, first_step=0,
                             until_step=10**7, micro_batch_size=None, collate=collate, data=job.data)
    batch = next(loader)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if job.training.precision == "bf16"
                else torch.autocast("cpu", enabled=False))

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = workload.training_step(model, batch)
        loss.backward()
        optimizer.step()

    train_step()  # gradients exist from here on
    parameters, cpu = list(model.parameters()), torch.device("cpu")
    fetch = (lambda: collate(dataset.__getitems__(share))) if hasattr(dataset, "__getitems__") and collate else (
        lambda: tuple(t[torch.as_tensor(share)] for t in dataset.tensors))
    pieces: dict[str, Callable[[], object]] = {
        "step: forward+backward+optimizer (for scale)": train_step,
        "clip_gradients(max_norm=1.0): ours, norm + clip": lambda: clip_gradients(parameters, 1.0),
        "clip_gradients(max_norm=0): ours without clipping, norm": lambda: clip_gradients(parameters, 0.0),
        "torch clip_grad_norm_(1.0): the peer's": lambda: torch.nn.utils.clip_grad_norm_(parameters, 1.0),
        "seed_rng(step_seed(...)): ours, per micro-batch": lambda: seed_rng(step_seed(0, 1000, 32), cpu),
        "torch.manual_seed (every backend, for comparison)": lambda: torch.manual_seed(1),
        "learning_rate + set_learning_rate: ours": lambda: set_learning_rate(optimizer,
                                                                             learning_rate(1000, job.optim, 2000)),
        "DataLoader next(planned_batches), num_workers=0: ours": lambda: next(loader),
        "to_device(batch, cpu): ours": lambda: to_device(batch, cpu),
        "dataset fetch + collate without a DataLoader": fetch,
    }
    costs = {}
    for name, call in pieces.items():
        number = 3 if name.startswith("step") else 200
        costs[name] = round(min(timeit.repeat(call, number=number, repeat=repeats)) / number * 1e6, 1)
    return costs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("gpt", "digits", "chargpt"), default="gpt")
    parser.add_argument("--steps", type=int, default=60, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--ray", action="store_true", help="run the ranks in two Ray actors")
    args = parser.parse_args(argv)
    if args.steps < 10 or args.rounds < 1:
        parser.error("need --steps >= 10 and --rounds >= 1")

    os.chdir(Path(__file__).resolve().parent.parent)  # Ray workers import the project from here
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="raylastic-step-costs-") as scratch:
        sections = job_sections(args.workload, 2000, GLOBAL_BATCH, Path(scratch))
        pieces = piece_costs(sections)
        if args.ray:
            per_round = in_ray_actors(sections, args.steps, args.rounds)
        else:
            per_round = run_distributed(measure, 2, sections, args.steps, args.rounds, timeout_s=1200.0)[0]
    medians = {v: {m: statistics.median(per_round[v][m]) for m in MEASURES} for v in VARIANTS}
    paired = {v: {m: round(statistics.median(ours / peer for ours, peer in zip(per_round[v][m],
                                                                                per_round["peer"][m], strict=True)), 4)
                  for m in MEASURES} for v in VARIANTS}
    where = "2 Ray actors" if args.ray else "2 processes"
    print(f"\n{args.workload}: pieces, us per call (1 process)")
    for name, us in pieces.items():
        print(f"  {us:10.1f}  {name}")
    print(f"\n{args.workload}, B={GLOBAL_BATCH}, {where}, rank 0, medians of {args.rounds} rounds x {args.steps} "
          "steps (x the peer's step in the same round)")
    print(f"  {'':11s} {'wall us':>17s} {'thread CPU us':>17s} {'process CPU us':>17s}")
    for variant in VARIANTS:
        cells = [f"{medians[variant][m]:7.0f} ({paired[variant][m]:.3f})" for m in MEASURES]
        print(f"  {variant:11s} " + " ".join(f"{cell:>17s}" for cell in cells))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / ("step_costs_ray.json" if args.ray else "step_costs.json")
    path.write_text(json.dumps({
        "benchmark": f"us per step of the {args.workload} recipe: the torchrun peer's step vs ours, same "
                     "processes, alternating; and our step's pieces, us per call",
        "where": where, "machine": machine_info(), "job": {k: sections[k] for k in ("workload", "training")
                                                             if k in sections} | {"optim": sections.get("optim")},
        "load_average_1_5_15_min": {"before": [round(v, 2) for v in load_before],
                                    "after": [round(v, 2) for v in os.getloadavg()]},
        "steps": args.steps, "rounds": args.rounds, "piece_us_per_call": pieces,
        "measures": {"wall": "perf_counter", "thread_cpu": "the training thread's CPU time (time.thread_time)",
                     "process_cpu": "the rank's whole process, gloo's threads included (time.process_time)"},
        "us_per_step_per_round": per_round, "median_us_per_step": medians, "paired_ratio_to_peer": paired},
        indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
