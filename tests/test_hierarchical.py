"""Hierarchical all-reduce at world size 4 with simulated nodes, against the flat mean.

One spawned group of 4 ranks builds the hook for every node layout in turn (``dist.new_group``
is collective, so all ranks build the same groups in the same order) and also trains a small
DDP model with and without the hook. Run: ``pytest tests/test_hierarchical.py``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from raylastic.strategies.compression.accounting import CommTraffic
from raylastic.strategies.hierarchical import make_hierarchical_hook, ranks_by_node, reference_hierarchical_mean
from tests.support.distributed_harness import FakeBucket, run_distributed

WORLD_SIZE = 4
LAYOUTS = {
    "two nodes of two": ["a", "a", "b", "b"],
    "uneven": ["a", "a", "a", "b"],
    "interleaved": ["x", "y", "x", "y"],
    "one node": ["a", "a", "a", "a"],
    "one rank per node": ["a", "b", "c", "d"],
}
BUCKET_NUMELS = [1000, 37]
STEPS = 2
DDP_STEPS = 3


def gradient(rank: int, step: int, bucket: int, numel: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10_000 * step + 100 * bucket + rank)
    return torch.randn(numel, generator=generator) * (1 + rank)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _train(node_ids: list[str] | None) -> torch.Tensor:
    """DDP_STEPS steps of two micro-batches (no_sync on the first), with the hook when node_ids is given."""
    generator = torch.Generator().manual_seed(dist.get_rank())
    model = _model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001, init_sync=False)
    if node_ids is not None:
        ddp.register_comm_hook(*make_hierarchical_hook(node_ids))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(DDP_STEPS):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(2):
            with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                inputs, targets = torch.randn(5, 8, generator=generator), torch.randn(5, 4, generator=generator)
                F.mse_loss(ddp(inputs), targets).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _hierarchical_checks() -> dict:
    rank = dist.get_rank()
    results: dict = {}
    for name, node_ids in LAYOUTS.items():
        state, hook = make_hierarchical_hook(node_ids)
        parameters = [[torch.zeros(numel)] for numel in BUCKET_NUMELS]
        outputs = {}
        for step in range(STEPS):
            for index, numel in enumerate(BUCKET_NUMELS):
                bucket = FakeBucket(index, parameters[index], gradient(rank, step, index, numel),
                                    bucket_count=len(BUCKET_NUMELS))
                outputs[step, index] = hook(state, bucket).wait().clone()
        results[name] = {"outputs": outputs, "flat": state.flat, "is_leader": state.is_leader,
                         "traffic": CommTraffic(state.bytes_sent, state.uncompressed_bytes), "steps": state.steps}
    results["ddp"] = {"flat": _train(None), "hierarchical": _train(LAYOUTS["two nodes of two"])}
    try:
        make_hierarchical_hook(["a"])
    except ValueError as error:
        results["wrong length"] = str(error)
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_hierarchical_checks, WORLD_SIZE, timeout_s=120)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hierarchical_mean_equals_the_flat_mean(runs, layout):
    for step in range(STEPS):
        for index, numel in enumerate(BUCKET_NUMELS):
            grads = [gradient(rank, step, index, numel) for rank in range(WORLD_SIZE)]
            for rank in range(WORLD_SIZE):
                output = runs[rank][layout]["outputs"][step, index]
                torch.testing.assert_close(output, sum(grads) / WORLD_SIZE)
                torch.testing.assert_close(output, reference_hierarchical_mean(grads, LAYOUTS[layout]))
                assert torch.equal(output, runs[0][layout]["outputs"][step, index]), f"rank {rank} differs"
    assert runs[0][layout]["steps"] == STEPS


def test_falls_back_to_flat_when_there_is_no_hierarchy(runs):
    flat = {layout for layout in LAYOUTS if runs[0][layout]["flat"]}
    assert flat == {"one node", "one rank per node"}


def test_only_node_leaders_send_across_nodes(runs):
    bucket_bytes = 4 * sum(BUCKET_NUMELS) * STEPS
    for layout, node_ids in LAYOUTS.items():
        leaders = {ranks[0] for ranks in ranks_by_node(node_ids)}
        for rank in range(WORLD_SIZE):
            result = runs[rank][layout]
            assert result["traffic"].uncompressed_bytes == bucket_bytes
            expected = bucket_bytes if result["flat"] or rank in leaders else 0
            assert result["traffic"].bytes_sent == expected, (layout, rank)
            assert result["flat"] or result["is_leader"] == (rank in leaders)


def test_ddp_with_the_hierarchical_hook_trains_like_flat_ddp(runs):
    for rank in range(WORLD_SIZE):
        torch.testing.assert_close(runs[rank]["ddp"]["hierarchical"], runs[rank]["ddp"]["flat"])
        assert torch.equal(runs[rank]["ddp"]["hierarchical"], runs[0]["ddp"]["hierarchical"])


def test_ranks_by_node_orders_nodes_by_their_lowest_rank():
    assert ranks_by_node(["y", "x", "y", "x", "z"]) == [[0, 2], [1, 3], [4]]


def test_node_ids_must_cover_the_world(runs):
    assert "node_ids" in runs[0]["wrong length"]
