"""A generation's mesh for its layout (strategies/parallel_mesh.py), on 4 gloo ranks: each view holds exactly the
ranks that ParallelLayout's grid puts beside this one, and its group sums over them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.strategies.parallel_mesh import parallel_mesh
from tests.support.distributed_harness import run_distributed

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
