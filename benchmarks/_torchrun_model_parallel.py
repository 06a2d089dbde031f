"""The torchrun peer of ``benchmarks/model_parallel.py``: tensor, pipeline and data parallelism as a torchtitan-style
script writes them, without our Controller, actors or step loop.

It reads the same job config as the Raylastic side (``--job``: ``JobConfig.to_dict()``-shaped JSON) and trains the
same workload with the same recipe on a ``(pp, dp, tp)`` DeviceMesh: the model cut to the rank's stage by the
workload's ``pipeline_split``, its ``parallelize`` over the tp dimension (the built-in GPT's plan), then
``fully_shard`` of every block and of the root over the dp dimension (``reshard_after_forward`` as zero3), AdamW
from the workload's ``configure_optimizer``, the lr schedule, the gradient clip over every stage and tp shard (the
norm all-reduced over pp, as torchtitan's ``clip_grad_norm_``), bf16 autocast, forward and backward under
``loss_parallel``, through ``Schedule1F1B`` in ``parallel.pp_microbatches`` micro-batches where pp > 1, each dp
rank on its slice of the global batch of the same sample order, dropout seeded per step as ours. Rank 0 times
every step. Run by model_parallel.py as::

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
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
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
    training, optim, tp, pp = job.training, job.optim, job.parallel.tp, job.parallel.pp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dp = dist.get_world_size() // (tp * pp)
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank, tp_rank = (mesh[name].get_local_rank() for name in ("pp", "dp", "tp"))
    torch.manual_seed(training.seed)
    workload = load_workload(job.workload.name, job.workload.options)
    model = workload.build_model()
    if pp > 1:
        model = workload.pipeline_split(model, pp_rank, pp)
    if tp > 1:
        workload.parallelize(model, mesh["tp"])
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = workload.configure_optimizer(model)
    order = GlobalSampleOrder(len(workload.train_dataset()), training.global_batch_size, training.seed)
    batches = step_batches(workload, job, order, dp_rank, dp, training.steps)
    position = dp_rank * training.global_batch_size // dp
    weight = dp / training.global_batch_size
    if pp > 1:
        stage = PipelineStage(model, pp_rank, pp, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule = Schedule1F1B(stage, n_microbatches=job.parallel.microbatches, scale_grads=False,
                                loss_fn=lambda out, target: workload.pipeline_loss(out, target) * len(target) * weight)

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
                if pp > 1:
                    schedule.step(*((inputs,) if stage.is_first else ()),
                                  **({"target": targets, "losses": []} if stage.is_last else {}))
                else:
                    loss = workload.training_step(model, (inputs, targets)).float() * len(inputs)
                    (loss * weight).backward()
        if optim.clip_grad_norm > 0:
            clip(list(model.parameters()), optim.clip_grad_norm, mesh["pp"].get_group() if pp > 1 else None)
        optimizer.step()
        if dist.get_rank() == 0:
            step_times.append(time.perf_counter() - started)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"step_times_s": step_times, "started_unix_s": started_unix_s}))
    dist.destroy_process_group()


def clip(parameters: list[torch.Tensor], max_norm: float, pp_group: dist.ProcessGroup | None) -> None:
    """torchtitan's clip: the norm over this stage's gradients (DTensors made whole), all-reduced over the
    pipeline's stages, then every gradient scaled by the same factor."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if pp_group is not None:
        norm = norm**2
        dist.all_reduce(norm, group=pp_group)
        norm = norm.sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)


if __name__ == "__main__":
    main()
