"""The buddy copy of the sharded state (strategies/buddy_copy.py) on local gloo groups, no Ray: a rank's shard
packed into one byte buffer reads back exactly; after a rank is lost, the survivors plan a restore from
their own copies and the lost rank's buddy's, and rebuild exactly the state of the step planned.

    python -m pytest tests/test_buddy_copy.py -q     # about 30 s on 2 cores
"""

from __future__ import annotations

import gc
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from raylastic.strategies.buddy_copy import BuddyCopies
from raylastic.strategies.peer_restore import ShardCopy, plan_peer_restore
from raylastic.strategies.process_group import leave_group
from raylastic.strategies.shard_copy import (
    entries_of,
    gather_shards,
    keep_shards,
    load_full_state,
    pack_shard,
    packed_size,
    unpack_shard,
)
from raylastic.strategies.shard_layout import ShardLayout
from tests.support.distributed_harness import run_distributed
from tests.support.strategy_runs import setup

STEPS = 3
LOST_RANK = 1


def test_a_packed_shard_reads_back_as_its_rows_of_every_entry():
    flat = {"model.w": torch.arange(21.0).view(7, 3), "model.half": torch.arange(5, dtype=torch.bfloat16),
            "optim.state.w.step": torch.tensor(4.0), "scaler.growth_tracker": torch.tensor(3, dtype=torch.int64),
            "model.empty": torch.zeros(0, 2)}
    entries = entries_of(flat)
    for rank in range(3):
        layout = ShardLayout(world_size=3, replicas=1, rank=rank)
        buffer = torch.empty(packed_size(entries, 3, rank), dtype=torch.uint8)
        pack_shard(flat, layout, entries, buffer)
        rows = unpack_shard(entries, buffer, layout)
        expected = keep_shards(_Named(flat), _Laid(layout), None, generation=0, step=1).rows
        assert rows.keys() == expected.keys()
        for key in expected:
            assert rows[key].dtype == expected[key].dtype and torch.equal(rows[key], expected[key]), (rank, key)
    assert "optim.state.w.step" not in unpack_shard(entries, torch.empty(packed_size(entries, 3, 1), dtype=torch.uint8),
                                                    ShardLayout(world_size=3, replicas=1, rank=1))


class _Named:
    name = "zero1"

    def __init__(self, flat):
        self.flat = flat

    def state_dict(self, state):
        return self.flat


class _Laid:
    def __init__(self, layout):
        self.layout, self.optimizer = layout, object()


def test_a_lost_ranks_shard_is_planned_from_its_buddy_and_a_rank_lost_with_its_buddy_leaves_no_plan():
    def held(rank: int, step: int) -> tuple[ShardCopy, ...]:  # own snapshots at step - 1 and step, left's at step
        own = [ShardCopy(7, 4, 1, rank, s) for s in (step - 1, step)]
        return (*own, ShardCopy(7, 4, 1, (rank - 1) % 4, step, holder="buddy"))

    survivors = [held(rank, 9) for rank in (0, 2, 3)]  # rank 1 lost: rank 2 holds its shard
    plan = plan_peer_restore(survivors)
    assert (plan.step, plan.senders, plan.from_buddies) == (9, (0, 1, 1, 2), (1,))
    # rank 2 (rank 1's buddy) had received only step 8 when rank 1 was lost; the others committed step 9
    late = [held(0, 9), (*held(2, 9)[:2], ShardCopy(7, 4, 1, 1, 8, holder="buddy")), held(3, 9)]
    plan = plan_peer_restore(late)
    assert (plan.step, plan.from_buddies) == (8, (1,))
    assert plan_peer_restore([held(0, 9), held(3, 9)]) is None  # rank 1 and its buddy, rank 2


def _train_lose_one_and_restore(store_dir: str, strategy_name: str, finish_before_leaving: bool):
    """Every rank trains STEPS steps with buddy copies; LOST_RANK then leaves (its last exchange completed or
    not), the others fail in the next step, re-form without it, plan and restore. Returns, on the survivors,
    (the plan, the whole state at every step, the restored whole state)."""
    strategy, state, runner = setup(strategy_name, "adamw")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    copies = BuddyCopies(group=dist.new_group(backend="gloo"), layout=state.layout, generation=0, timeout_s=30)
    whole = {0: None}
    for step in range(STEPS):
        runner.run(state, step, before_reduction=copies.finish)
        copies.start(strategy, state, None, step + 1)
        whole[step + 1] = _whole(strategy, state)
    if rank == LOST_RANK:
        if finish_before_leaving:
            copies.finish()
        return None
    with pytest.raises(RuntimeError):
        runner.run(state, STEPS, before_reduction=copies.finish)
    copies.close()
    kept = copies.kept()
    del state, runner, copies
    gc.collect()
    leave_group()
    survivors = [r for r in range(world_size) if r != LOST_RANK]
    dist.init_process_group("gloo", store=dist.FileStore(f"{store_dir}/generation1", len(survivors)),
                            rank=survivors.index(rank), world_size=len(survivors), timeout=timedelta(seconds=60))
    holdings = [None] * len(survivors)
    dist.all_gather_object(holdings, tuple(k.copy for k in kept))  # what the Controller reads from JoinReports
    plan = plan_peer_restore(holdings)
    strategy, state, _ = setup(strategy_name, "adamw")
    load_full_state(strategy, state, None, gather_shards(kept, plan))
    return plan, whole, _whole(strategy, state)


def _whole(strategy, state) -> dict[str, torch.Tensor]:
    return {key: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
            for key, value in strategy.state_dict(state).items()}


@pytest.mark.parametrize(("strategy_name", "finish_before_leaving"), [
    ("zero3", True), ("zero1", True), ("zero2", False)])
def test_survivors_rebuild_the_lost_ranks_shard_from_its_buddys_copy(tmp_path, strategy_name, finish_before_leaving):
    results = run_distributed(_train_lose_one_and_restore, 4, str(tmp_path), strategy_name, finish_before_leaving,
                              timeout_s=120)
    for rank in (0, 2, 3):
        plan, whole, restored = results[rank]
        assert plan.from_buddies == (LOST_RANK,) and plan.senders[LOST_RANK] == 1  # new rank 1: old rank 2
        assert plan.step == STEPS if finish_before_leaving else plan.step in (STEPS - 1, STEPS)
        expected = whole[plan.step]
        assert restored.keys() == expected.keys() and any(key.startswith("optim.state.") for key in expected)
        for key in expected:
            assert torch.equal(restored[key], expected[key]), f"rank {rank}: {key}"
