"""Model-parallel layouts (issue 32), the pure parts: the ``parallel:`` settings and their refusals, a layout's
rank grid, the rank order that keeps tp groups on one node, and the layout a generation of N workers takes."""

from __future__ import annotations

import pytest

from raylastic.actors.controller.layout_policy import LayoutPolicy, choose_layout
from raylastic.jobconfig.parallel import ParallelConfig
from raylastic.strategies.parallel_layout import Coordinates, ParallelLayout, in_place_order, rank_order


@pytest.mark.parametrize(("settings", "message"), [
    ({"tp": 0}, "parallel.tp must be a positive integer, got 0"),
    ({"pp": 1.5}, "parallel.pp must be a positive integer, got 1.5"),
    ({"pp": 2, "pp_schedule": "dualpipe"}, "parallel.pp_schedule must be one of gpipe, 1f1b, interleaved_1f1b, zbv"),
    ({"pp_schedule": "gpipe"}, r"parallel.pp_schedule must be left at its default \(1f1b\) unless parallel.pp > 1"),
    ({"pp_microbatches": 4}, "parallel.pp_microbatches must be left unset unless parallel.pp > 1"),
    ({"pp": 2, "pp_microbatches": 0}, "parallel.pp_microbatches must be a positive integer or null, got 0"),
    ({"pp": 4, "pp_microbatches": 3}, r"parallel.pp_microbatches must be at least parallel.pp \(4\) with the 1f1b"),
    ({"pp": 2, "pp_schedule": "zbv", "stages_per_rank": 3}, "parallel.stages_per_rank must be 2 with parallel.pp_"),
    ({"pp": 2, "pp_schedule": "interleaved_1f1b", "stages_per_rank": 1}, "stages_per_rank must be at least 2"),
    ({"pp": 2, "stages_per_rank": 2}, r"stages_per_rank must be 1 with parallel.pp_schedule=1f1b \(one stage"),
    ({"pp": 4, "pp_schedule": "interleaved_1f1b", "pp_microbatches": 9},
     r"pp_microbatches must be a multiple of its rounds with interleaved_1f1b \(pp_microbatches // pp = 2\)"),
])
def test_impossible_parallel_settings_are_refused_naming_the_field(settings, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**settings)


def test_the_schedules_defaults():
    assert ParallelConfig().model_parallel == 1
    assert (ParallelConfig(pp=2).stages_on_each_rank, ParallelConfig(pp=2).microbatches) == (1, 2)
    interleaved = ParallelConfig(pp=2, pp_schedule="interleaved_1f1b")
    assert (interleaved.stages_on_each_rank, interleaved.microbatches) == (2, 4)
    assert ParallelConfig(pp=3, pp_schedule="zbv", pp_microbatches=1).microbatches == 1  # zbv pads to 2 pp - 1
    assert ParallelConfig(tp=2, pp=2, pp_microbatches=8).model_parallel == 4


def test_a_layout_numbers_its_ranks_tp_innermost_and_pp_outermost():
    layout = ParallelLayout(pp=2, dp_replicate=2, dp_shard=1, tp=2)
    assert (layout.world_size, layout.dp) == (8, 2)
    grid = [layout.coordinates(rank) for rank in range(8)]
    assert [c.tp for c in grid] == [0, 1] * 4                      # a tp group: two consecutive ranks
    assert [c.pp for c in grid] == [0] * 4 + [1] * 4                # a stage: four consecutive ranks
    assert [c.dp_replicate for c in grid] == [0, 0, 1, 1] * 2
    assert [layout.rank(c) for c in grid] == list(range(8))
    assert layout.coordinates(5) == Coordinates(pp=1, dp_replicate=0, dp_shard=0, tp=1)
    assert layout.describe() == "pp2 x dp2 (2 copies) x tp2"
    assert ParallelLayout().describe() == "dp1"
    with pytest.raises(ValueError, match="rank 8 is not in a layout of 8 ranks"):
        layout.coordinates(8)


def test_several_stages_on_a_rank_loop_or_mirror_and_the_rank_holding_the_last_reports():
    looped = ParallelLayout(pp=2, stages_per_rank=3)
    assert (looped.num_stages, looped.stages(0), looped.stages(1)) == (6, (0, 2, 4), (1, 3, 5))
    assert [looped.reports(rank) for rank in range(2)] == [False, True]
    v = ParallelLayout(pp=3, dp_shard=2, stages_per_rank=2, v_shape=True)
    assert [v.stages(p) for p in range(3)] == [(0, 5), (1, 4), (2, 3)]
    assert [v.reports(rank) for rank in range(6)] == [True, True, False, False, False, False]  # stage 5 on pp 0
    assert v.describe() == "pp3 (2 stages each, V) x dp2"
    with pytest.raises(ValueError, match="a V places 2 stages on each pipeline rank"):
        ParallelLayout(pp=2, stages_per_rank=3, v_shape=True)


@pytest.mark.parametrize(("nodes", "tp", "order"), [
    (["a", "b", "a", "b"], 2, [0, 2, 1, 3]),                    # members joined alternately: pairs by node
    (["a", "a", "a", "b", "b", "b"], 2, [0, 1, 3, 4, 2, 5]),    # one pair must straddle: it comes last
    (["a", "b", "c"], 1, [0, 1, 2]),                            # no tp: the order they came in
])
def test_rank_order_puts_each_tp_group_on_one_node(nodes, tp, order):
    assert rank_order(nodes, tp) == order
    groups = [[nodes[i] for i in order[g:g + tp]] for g in range(0, len(order), tp)]
    whole = sum(nodes.count(node) // tp for node in set(nodes))
    assert sum(len(set(group)) == 1 for group in groups) >= whole


@pytest.mark.parametrize(("workers", "settings", "replicas", "batch", "layout"), [
    (4, {}, 1, 64, ParallelLayout(dp_shard=4)),                                  # data parallel only
    (4, {}, 2, 64, ParallelLayout(dp_replicate=2, dp_shard=2)),                  # HSDP over dp
    (8, {"tp": 2, "pp": 2}, 1, 64, ParallelLayout(pp=2, dp_shard=2, tp=2, microbatches=2)),
    (7, {"tp": 2, "pp": 2}, 1, 64, ParallelLayout(pp=2, tp=2, microbatches=2)),  # three wait as spares
    (3, {"tp": 2, "pp": 2}, 1, 64, ParallelLayout(tp=2)),                        # pp given up before tp
    (2, {"tp": 4}, 1, 64, ParallelLayout(tp=2)),
    (6, {"pp": 2}, 1, 48, ParallelLayout(pp=2, dp_shard=3, microbatches=2)),     # 48 = 3 dp x 2 mb x 8
    (6, {"pp": 2, "pp_microbatches": 4}, 1, 40, ParallelLayout(pp=2, dp_shard=2, microbatches=4)),  # 3 x 4 no
    (3, {}, 1, 2, ParallelLayout(dp_shard=2)),                                   # a sample for every dp rank
    (4, {"pp": 2, "pp_schedule": "zbv"}, 1, 64,
     ParallelLayout(pp=2, dp_shard=2, stages_per_rank=2, v_shape=True, microbatches=4)),
    (3, {"pp": 2, "pp_schedule": "interleaved_1f1b"}, 1, 64, ParallelLayout(pp=2, stages_per_rank=2, microbatches=4)),
    (1, {"pp": 2, "pp_schedule": "interleaved_1f1b"}, 1, 64, ParallelLayout()),   # one stage without a pipeline
    (0, {}, 1, 64, None),
    (4, {"pp": 2, "pp_microbatches": 5}, 1, 48, None),                  # 5 micro-batches never divide 48: no
    (1, {"pp": 2, "pp_microbatches": 5}, 1, 48, ParallelLayout()),      # pipeline then, unless one worker is left
])
def test_a_generation_keeps_the_configured_degrees_with_the_largest_dp_the_batch_allows(workers, settings, replicas,
                                                                                      batch, layout):
    assert choose_layout(workers, ParallelConfig(**settings), replicas=replicas, global_batch_size=batch) == layout


@pytest.mark.parametrize(("settings", "max_workers", "workers", "microbatches"), [
    ({"pp": 2}, 4, [4, 3, 2], [2, 4, 4]),                         # a step's 4 micro-batches of 2 samples kept
    ({"pp": 2, "tp": 2}, 8, [8, 4], [2, 4]),
    ({"pp": 2, "pp_microbatches": 2}, 6, [6, 4, 2], [2, 3, 6]),
    ({"pp": 4, "pp_microbatches": 4}, 8, [8, 4, 3], [4, 8, 8]),   # 3 workers: pp2, one pipeline runs all 8
    ({"pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 1}, 6, [6, 4], [1, 1]),  # 3 do not split over dp2
])
def test_a_re_planned_pipeline_keeps_the_steps_micro_batch_count_where_its_dp_divides_it(settings, max_workers,
                                                                                         workers, microbatches):
    policy = LayoutPolicy(parallel=ParallelConfig(**settings), global_batch_size=48, max_workers=max_workers)
    layouts = [policy.decide(n) for n in workers]
    assert [layout.microbatches for layout in layouts] == microbatches


@pytest.mark.parametrize(("previous", "previous_ranks", "new", "order"), [
    # (pp2, 2 copies), old rank 2 (stage 1) lost: its copy (old 3) takes stage 1, old 1 waits as a spare
    (ParallelLayout(pp=2, dp_replicate=2), [0, 1, 3], ParallelLayout(pp=2), [0, 2, 1]),
    # (dp2, tp2), old rank 0 lost: the whole tp group of old ranks 2 and 3 keeps its shards
    (ParallelLayout(dp_replicate=2, tp=2), [1, 2, 3], ParallelLayout(tp=2), [1, 2, 0]),
    # a new worker (None) fills the place of the lost one
    (ParallelLayout(pp=2, dp_shard=2), [None, 0, 2, 3], ParallelLayout(pp=2, dp_shard=2), [1, 0, 2, 3]),
    # (pp2, dp2 sharded), old rank 0 lost: old rank 1 keeps its data-parallel place (its zero shard)
    (ParallelLayout(pp=2, dp_shard=2), [1, 2, 3, None], ParallelLayout(pp=2, dp_shard=2), [3, 0, 1, 2]),
    # the degrees change: nothing stays; rank_order
    (ParallelLayout(pp=2, tp=2), [0, 1, 2], ParallelLayout(tp=2), [0, 1, 2]),
])
def test_a_re_formed_generation_keeps_each_members_part_where_the_layout_allows(previous, previous_ranks, new, order):
    assert in_place_order(previous, previous_ranks, new, ["node"] * len(previous_ranks)) == order
