"""The torchrun peer of ``benchmarks/throughput.py``: plain DDP as a user would write it.

It reads the same job config as the Raylastic side (``--job``: ``JobConfig.to_dict()``-shaped JSON)
and trains the same workload with the same recipe: model seed, global sample order and batch split,
optimizer (the workload's ``configure_optimizer``, else AdamW), lr schedule, gradient clipping,
precision (bf16: CPU autocast) and loss scaling, with the dropout RNG seeded per step as a Raylastic
step seeds it (``actors.worker.step.step_seed``: ~3 us), so that both sides compute the same result.
Nothing else: no metrics all-reduce, no actor, no loop thread; rank 0 logs ``loss.item()`` of its own
slice and times every step. A ``TensorDataset`` is indexed in memory, one indexing per step; any other
dataset (the gpt workload's memory-mapped ``TokenBlocks``) goes through a torch DataLoader with a batch
sampler of this rank's slices. ``--throttle RANK:FACTOR`` slows one rank down as ours' ``throttle`` fault does
(actors/worker/step.py, for benchmarks/balance.py): before each of its steps, that rank sleeps (FACTOR - 1) x
its previous step's compute, timed by the same ``ComputeClock`` (from the step's start to its last local
gradient, so without the wait for its peers). Run by throughput.py as::

    python -m torch.distributed.run --nproc-per-node 2 --master-port 29511 benchmarks/_torchrun_ddp.py \
        --job /tmp/job.json --out /tmp/peer.json [--throttle 1:2.0]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Sampler, TensorDataset, default_collate

from raylastic.actors.data.compute_clock import ComputeClock
from raylastic.actors.data.order import GlobalSampleOrder
from raylastic.actors.worker.optimizer_recipe import learning_rate
from raylastic.actors.worker.step import step_seed
from raylastic.jobconfig import JobConfig, job_config_from_dict
from raylastic.workloads import load_workload


class RankSlices(Sampler[list[int]]):
    """This rank's share of every step's global batch, in step order (one batch per step)."""

    def __init__(self, order: GlobalSampleOrder, rank: int, world_size: int, steps: int) -> None:
        self.order, self.rank, self.world_size, self.steps = order, rank, world_size, steps

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.steps):
            yield self.order.rank_indices(step, self.rank, self.world_size).tolist()

    def __len__(self) -> int:
        return self.steps


def step_batches(workload: Any, job: JobConfig, order: GlobalSampleOrder, rank: int, world_size: int,
                 steps: int) -> Iterator:
    """This rank's batches of steps [0, steps): in-memory tensors indexed directly, other datasets by a DataLoader."""
    dataset = workload.train_dataset()
    if isinstance(dataset, TensorDataset):
        inputs, targets = dataset.tensors
        return ((inputs[i], targets[i]) for i in (order.rank_indices(s, rank, world_size) for s in range(steps)))
    workers = job.data.num_workers
    return iter(DataLoader(dataset, batch_sampler=RankSlices(order, rank, world_size, steps),
                           collate_fn=getattr(workload, "collate", default_collate), num_workers=workers,
                           prefetch_factor=job.data.prefetch_factor if workers else None))


@dataclass
class PlainDDP:
    """The peer's model, optimizer and batches, and its training step (also timed by benchmarks/step_costs.py)."""

    job: JobConfig
    workload: Any
    model: torch.nn.Module
    """The DDP-wrapped model; the model itself at world size 1, as ours (strategies/ddp.py ``wrap_ddp``)."""
    optimizer: torch.optim.Optimizer
    batches: Iterator
    position: int
    """Where this rank's slice starts in the global batch: the dropout seed's position."""

    @classmethod
    def build(cls, job: JobConfig, steps: int) -> PlainDDP:
        """On the current process group, from torch seed ``job.training.seed``; batches for ``steps`` steps."""
        training = job.training
        rank, world_size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(training.seed)
        workload = load_workload(job.workload.name, job.workload.options)
        model = workload.build_model()
        if hasattr(workload, "configure_optimizer"):
            optimizer = workload.configure_optimizer(model)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=job.optim.lr, weight_decay=job.optim.weight_decay)
        order = GlobalSampleOrder(len(workload.train_dataset()), training.global_batch_size, training.seed)
        wrapped = model if world_size == 1 else DistributedDataParallel(model, bucket_cap_mb=job.strategy.bucket_cap_mb)
        return cls(job, workload, wrapped, optimizer, step_batches(workload, job, order, rank, world_size, steps),
                   rank * training.global_batch_size // world_size)

    def step(self, step: int) -> tuple[torch.Tensor, int]:
        """Train step ``step`` (0-based) on this rank's next batch; its summed loss and its sample count."""
        training, optim = self.job.training, self.job.optim
        inputs, targets = next(self.batches)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(step, optim, training.steps)
        self.optimizer.zero_grad(set_to_none=True)
        torch.default_generator.manual_seed(step_seed(training.seed, step, self.position))  # the same masks
        with torch.autocast("cpu", dtype=torch.bfloat16) if training.precision == "bf16" else nullcontext():
            loss = self.workload.training_step(self.model, (inputs, targets)).float() * len(inputs)  # summed
        (loss * (dist.get_world_size() / training.global_batch_size)).backward()
        if optim.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), optim.clip_grad_norm)
        self.optimizer.step()
        return loss, len(inputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="the job config as JSON (JobConfig.to_dict() sections)")
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes (and <out>.pt: final parameters)")
    parser.add_argument("--throttle", metavar="RANK:FACTOR", default=None,
                        help="RANK sleeps (FACTOR - 1) x its previous step's compute before each step")
    args = parser.parse_args()
    job = job_config_from_dict(json.loads(Path(args.job).read_text()))

    torch.set_num_threads(1)  # torchrun already sets OMP_NUM_THREADS=1; Raylastic workers use 1 thread too
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = PlainDDP.build(job, job.training.steps)
    throttled_rank, factor = args.throttle.split(":") if args.throttle else (-1, 1.0)
    clock = ComputeClock(torch.device("cpu")) if rank == int(throttled_rank) else None
    if clock is not None:
        clock.attach(peer.model)
    compute_s = 0.0  # the throttled rank's previous step, as ours: no sleep before the first step

    step_times, losses = [], []
    started, started_unix_s = time.perf_counter(), time.time()
    for step in range(job.training.steps):
        if clock is not None:
            time.sleep((float(factor) - 1) * compute_s)
            clock.start()
        loss, samples = peer.step(step)
        if clock is not None:
            compute_s = clock.compute_s(step_s=0.0)
        if rank == 0:
            losses.append(loss.item() / samples)
            step_times.append(time.perf_counter() - started)

    if rank == 0:
        state = {k: v.detach().clone() for k, v in getattr(peer.model, "module", peer.model).state_dict().items()}
        torch.save(state, args.out + ".pt")
        with open(args.out, "w") as f:
            json.dump({"step_times_s": step_times, "started_unix_s": started_unix_s, "rank0_losses": losses,
                       "world_size": dist.get_world_size(), "torch_threads": torch.get_num_threads()}, f)
    dist.barrier()  # rank 1 tearing its group down while rank 0 still writes can abort it (seen once)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
