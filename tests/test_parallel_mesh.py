"""A generation's mesh for its layout (strategies/parallel_mesh.py), on 4 gloo ranks: each view holds exactly the
ranks that ParallelLayout's grid puts beside this one, and its group sums over them."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from raylastic.strategies.hierarchical import make_hierarchical_hook
from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.strategies.parallel_mesh import parallel_mesh
from tests.support.distributed_harness import run_distributed

COLLECTIVE_TIMEOUT_S = 3
SLACK_S = 20
"""Beyond the collective timeout, for a loaded machine; torch's default (30 min) is far beyond either."""

LAYOUTS = [ParallelLayout(pp=2, tp=2), ParallelLayout(dp_replicate=2, dp_shard=2), ParallelLayout(dp_shard=2, tp=2),
           ParallelLayout(pp=2, dp_shard=2), ParallelLayout(dp_shard=4)]


def _views(layouts: list[ParallelLayout]) -> list[dict[str, object]]:
    seen = []
    for layout in layouts:
        mesh = parallel_mesh(torch.device("cpu"), layout)
        views = {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp}
        ranks = {name: None if view is None else sorted(view.mesh.flatten().tolist()) for name, view in views.items()}
        if mesh.tp is not None:
            total = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(total, group=mesh.tp.get_group())
            ranks["tp_sum"] = total.item()
        seen.append(ranks)
    return seen


def _beside(layout: ParallelLayout, rank: int, *varying: str) -> list[int]:
    """The ranks whose coordinates equal ``rank``'s but in the ``varying`` dimensions."""
    at = layout.coordinates(rank)
    return [other for other in range(layout.world_size)
            if all(getattr(layout.coordinates(other), d) == getattr(at, d)
                   for d in ("pp", "dp_replicate", "dp_shard", "tp") if d not in varying)]


@pytest.mark.processes
def test_each_view_of_a_generation_mesh_holds_the_ranks_its_layout_puts_together():
    by_rank = run_distributed(_views, 4, LAYOUTS, timeout_s=120)
    for index, layout in enumerate(LAYOUTS):
        for rank, seen in enumerate(views[index] for views in by_rank):
            assert seen["dp"] == _beside(layout, rank, "dp_replicate", "dp_shard"), (layout, rank)
            assert seen["tp"] == (_beside(layout, rank, "tp") if layout.tp > 1 else None), (layout, rank)
            assert seen["pp"] == (_beside(layout, rank, "pp") if layout.pp > 1 else None), (layout, rank)
            if layout.tp > 1:
                assert seen["tp_sum"] == sum(_beside(layout, rank, "tp"))


def _sub_group_collectives_without_rank_1(released: str) -> list[tuple[float, str]]:
    """Rank 1 makes the groups, then joins none of their collectives until rank 0 is done (or a minute went by):
    how long each of this rank's collectives with rank 1 took, and how it ended."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=COLLECTIVE_TIMEOUT_S))  # join_group's, in a run
    mesh = parallel_mesh(torch.device("cpu"), ParallelLayout(dp_shard=2, tp=2))  # tp groups {0, 1} and {2, 3}
    node_group = make_hierarchical_hook(["a", "a", "b", "b"]).state.node_group  # {0, 1} and {2, 3}
    if dist.get_rank() == 1:
        deadline = time.monotonic() + 60
        while not Path(released).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return []
    ended = []
    for group in (mesh.tp.get_group(), node_group):
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=group)
            outcome = "completed"
        except RuntimeError as error:
            outcome = str(error)
        ended.append((time.monotonic() - started, outcome))
    if dist.get_rank() == 0:
        Path(released).touch()
    return ended


@pytest.mark.processes
def test_a_sub_group_collective_with_a_stopped_peer_ends_within_the_collective_timeout(tmp_path):
    by_rank = run_distributed(_sub_group_collectives_without_rank_1, 4, str(tmp_path / "released"), timeout_s=180)
    for waited_s, outcome in by_rank[0]:  # the mesh's tensor-parallel group, then the node group of the hook
        assert "Timed out" in outcome and waited_s < COLLECTIVE_TIMEOUT_S + SLACK_S, (waited_s, outcome)
    assert [outcome for _, outcome in by_rank[2] + by_rank[3]] == ["completed"] * 4
