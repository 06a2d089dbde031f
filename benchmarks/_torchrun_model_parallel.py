"""The torchrun peer of ``benchmarks/model_parallel.py``: tensor parallelism and FSDP2 as a torchtitan-style script
writes them, without our Controller, actors or step loop.

It reads the same job config as the Raylastic side (``--job``: ``JobConfig.to_dict()``-shaped JSON) and trains the
same workload with the same recipe on a ``(dp, tp)`` DeviceMesh: the workload's own ``parallelize`` over the tp
dimension (the built-in GPT's plan), then ``fully_shard`` of every block and of the root over the dp dimension
(``reshard_after_forward`` as zero3), AdamW from the workload's ``configure_optimizer``, the lr schedule,
``clip_grad_norm_`` over the DTensors, bf16 autocast, forward and backward under ``loss_parallel``, each dp rank
on its slice of the global batch of the same sample order, dropout seeded per step as ours. Rank 0 times every
step. Run by model_parallel.py as::

    python -m torch.distributed.run --nproc-per-node 4 benchmarks/_torchrun_model_parallel.py --job J --out O
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import loss_parallel

from benchmarks._torchrun_ddp import step_batches
from raylastic.actors.data.order import GlobalSampleOrder
from raylastic.actors.worker.optimizer_recipe import learning_rate
from raylastic.actors.worker.step import step_seed
from raylastic.jobconfig import job_config_from_dict
from raylastic.workloads import load_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="the job config as JSON (JobConfig.to_dict() sections)")
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    args = parser.parse_args()
    job = job_config_from_dict(json.loads(Path(args.job).read_text()))
    training, optim, tp = job.training, job.optim, job.parallel.tp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dp = dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    torch.manual_seed(training.seed)
    workload = load_workload(job.workload.name, job.workload.options)
    model = workload.build_model()
    if tp > 1:
        workload.parallelize(model, mesh["tp"])
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = workload.configure_optimizer(model)
    order = GlobalSampleOrder(len(workload.train_dataset()), training.global_batch_size, training.seed)
    batches = step_batches(workload, job, order, dp_rank, dp, training.steps)
    position = dp_rank * training.global_batch_size // dp

    step_times = []
    started, started_unix_s = time.perf_counter(), time.time()
    for step in range(training.steps):
        inputs, targets = next(batches)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, optim, training.steps)
        optimizer.zero_grad(set_to_none=True)
        torch.default_generator.manual_seed(step_seed(training.seed, step, position, tp_rank))
        with loss_parallel() if tp > 1 else nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16) if training.precision == "bf16" else nullcontext():
                loss = workload.training_step(model, (inputs, targets)).float() * len(inputs)
            (loss * (dp / training.global_batch_size)).backward()
        if optim.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip_grad_norm)
        optimizer.step()
        if dist.get_rank() == 0:
            step_times.append(time.perf_counter() - started)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"step_times_s": step_times, "started_unix_s": started_unix_s}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
