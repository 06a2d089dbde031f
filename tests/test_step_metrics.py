"""The step's metrics sum: carried in DDP's bucket 0 or all-reduced on its own, the same numbers,
and carrying them changes no gradient (real gloo groups of 2 and 3 processes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from strategies.compression import make_comm_hook
from strategies.step_metrics import BucketPiggyback, SeparateAllReduce
from tests.distributed_harness import run_distributed


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.ReLU(), torch.nn.Linear(300, 4))


def _rank_steps(carry: bool, steps: int = 3) -> list[tuple[list[float], list[torch.Tensor], int, int]]:
    """``steps`` synchronising backwards of a 2-bucket DDP: per step, the rank's [loss, samples,
    vote] summed over ranks, the gradients, the bytes sent and how many steps bucket 0 carried."""
    rank = dist.get_rank()
    model = DistributedDataParallel(_model(), bucket_cap_mb=0.001, init_sync=False)
    hook = make_comm_hook("none")
    reduction = BucketPiggyback() if carry else SeparateAllReduce()
    model.register_comm_hook(hook.state, reduction.wrap(hook.hook) if carry else hook.hook)
    torch.manual_seed(100 + rank)
    per_step = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        inputs, targets = torch.randn(5, 8), torch.randint(0, 4, (5,))
        loss = torch.nn.functional.cross_entropy(model(inputs), targets, reduction="sum")
        reduction.start(torch.tensor([loss.item(), 5.0, float(rank == step % 2)], dtype=torch.float64))
        loss.backward()
        totals = reduction.finish()
        grads = [p.grad.clone() for p in model.parameters()]
        carried = reduction.carried if carry else 0
        per_step.append((totals.tolist(), grads, hook.state.take_traffic().bytes_sent, carried))
    return per_step


@pytest.mark.parametrize("world_size", [2, 3])
def test_carried_metrics_equal_a_separate_all_reduce_and_leave_gradients_alone(world_size: int) -> None:
    carried = run_distributed(_rank_steps, world_size, True)  # per rank, per step
    separate = run_distributed(_rank_steps, world_size, False)
    for rank_steps, rank_reference in zip(carried, separate, strict=True):
        for step, ((totals, grads, sent, carried_steps), (ref_totals, ref_grads, ref_sent, _)) in enumerate(
                zip(rank_steps, rank_reference, strict=True)):
            assert carried_steps == step + 1  # bucket 0 carried them every step: no all-reduce of their own
            assert totals == pytest.approx(ref_totals, rel=1e-6)
            assert totals[1:] == [5.0 * world_size, 1.0]  # samples and the stop vote (one rank's) are exact
            for grad, ref in zip(grads, ref_grads, strict=True):
                torch.testing.assert_close(grad, ref, rtol=1e-6, atol=1e-7)
            assert sent == ref_sent  # the accounting still counts every bucket once
    for step in range(len(carried[0])):  # every rank the same sums
        assert all(rank_steps[step][0] == carried[0][step][0] for rank_steps in carried)
    assert carried[0][0][0] != carried[0][1][0]  # and each step its own
