"""The torchrun peer of ``benchmarks/throughput.py``: plain DDP as a user would write it.

Same workload class, model seed, global sample order, optimizer (AdamW) and loss scaling as a
Raylastic step, but nothing else: no metrics all-reduce, no actor, no loop thread; rank 0 logs
``loss.item()`` of its own slice and times every step. Run by throughput.py as::

    python -m torch.distributed.run --nproc-per-node 2 --master-port 29511 benchmarks/_torchrun_ddp.py \
        --workload digits --steps 300 --global-batch-size 64 --out /tmp/peer.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from actors.data_order import GlobalSampleOrder
from workloads import load_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="digits")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes (and <out>.pt: final parameters)")
    args = parser.parse_args()

    torch.set_num_threads(1)  # torchrun already sets OMP_NUM_THREADS=1; Raylastic workers use 1 thread too
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    workload = load_workload(args.workload)
    model = DistributedDataParallel(workload.build_model(), bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)  # as optim.weight_decay
    inputs, targets = workload.train_dataset().tensors
    order = GlobalSampleOrder(len(inputs), args.global_batch_size, args.seed)
    scale = world_size / args.global_batch_size

    step_times, losses = [], []
    started = time.perf_counter()
    for step in range(args.steps):
        indices = order.rank_indices(step, rank, world_size)
        optimizer.zero_grad(set_to_none=True)
        loss = workload.training_step(model, (inputs[indices], targets[indices])) * len(indices)  # summed
        (loss * scale).backward()
        optimizer.step()
        if rank == 0:
            losses.append(loss.item() / len(indices))
            step_times.append(time.perf_counter() - started)

    if rank == 0:
        state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        torch.save(state, args.out + ".pt")
        with open(args.out, "w") as f:
            json.dump({"step_times_s": step_times, "rank0_losses": losses, "world_size": world_size,
                       "torch_threads": torch.get_num_threads()}, f)
    dist.barrier()  # rank 1 tearing its group down while rank 0 still writes can abort it (seen once)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
