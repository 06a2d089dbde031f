"""The pure parts of in-memory redundancy for sharded state (issue 18): how many copies a generation keeps,
which rank holds which rows, and which survivor sends which shard. No torch.distributed, no Ray.

    python -m pytest tests/test_peer_restore_plan.py -q     # about 2 s
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from raylastic.strategies.peer_restore import PeerRestorePlan, ShardCopy, plan_peer_restore
from raylastic.strategies.shard_copy import keep_shards
from raylastic.strategies.shard_layout import ShardLayout, effective_replicas, row_bounds


@pytest.mark.parametrize(("replicas", "world_size", "expected"), [
    (1, 1, 1), (1, 4, 1), (2, 4, 2), (2, 3, 1), (2, 1, 1), (3, 4, 2), (4, 2, 2), (2, 2, 2), (3, 6, 3), (4, 6, 3),
    (8, 7, 7), (2, 7, 1), (4, 8, 4),
])
def test_effective_replicas_is_the_largest_divisor_of_the_world_size_up_to_the_setting(replicas, world_size,
                                                                                      expected):
    assert effective_replicas(replicas, world_size) == expected


@pytest.mark.parametrize(("replicas", "world_size"), [(0, 4), (2, 0)])
def test_effective_replicas_refuses_non_positive_counts(replicas, world_size):
    with pytest.raises(ValueError, match="positive"):
        effective_replicas(replicas, world_size)


def test_replica_groups_are_contiguous_and_copies_lie_num_shards_apart():
    layouts = [ShardLayout(world_size=6, replicas=2, rank=rank) for rank in range(6)]
    assert [(layout.replica, layout.shard) for layout in layouts] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


@pytest.mark.parametrize(("rows", "num_shards"), list(itertools.product([0, 1, 2, 5, 7, 10, 64], [1, 2, 3, 4, 7])))
def test_row_bounds_split_as_torch_chunk_does(rows, num_shards):
    chunks = torch.chunk(torch.arange(rows), num_shards)
    for shard in range(num_shards):
        start, stop = row_bounds(rows, num_shards, shard)
        expected = chunks[shard].tolist() if shard < len(chunks) else []
        assert list(range(start, stop)) == expected


def copies_of(generation: int, world_size: int, replicas: int, ranks: list[int], step: int
              ) -> list[tuple[ShardCopy]]:
    """What each new rank holds: the old rank's own copy, one per new rank."""
    return [(ShardCopy(generation=generation, world_size=world_size, replicas=replicas, rank=rank, step=step),)
            for rank in ranks]


def test_the_docstring_example():
    copies = copies_of(0, 4, 2, [0, 2, 3], 7)
    assert plan_peer_restore(copies) == PeerRestorePlan(generation=0, world_size=4, replicas=2, step=7, senders=(0, 2))
    assert plan_peer_restore([copies[0], copies[1], ()]) is None


def _oracle(world_size: int, replicas: int, new_order: list[int | None]) -> tuple[int, ...] | None:
    """For each shard, the lowest new rank whose old rank holds it; None if a shard has no holder."""
    num_shards = world_size // replicas
    holders = [[new for new, old in enumerate(new_order) if old is not None and old % num_shards == shard]
               for shard in range(num_shards)]
    return tuple(h[0] for h in holders) if all(holders) else None


@pytest.mark.parametrize("world_size", range(1, 9))
def test_every_loss_of_every_layout_against_an_oracle(world_size):
    """Every replica count that divides the world size, every set of survivors, in a shuffled new-rank order
    with new workers among them: a plan exactly when each shard kept a holder, from its lowest new rank."""
    shuffle = random.Random(world_size)
    for replicas in [r for r in range(1, world_size + 1) if world_size % r == 0]:
        for survivors in itertools.chain.from_iterable(itertools.combinations(range(world_size), count)
                                                       for count in range(world_size + 1)):
            new_order: list[int | None] = [*survivors, *[None] * shuffle.randint(0, 2)]
            shuffle.shuffle(new_order)
            copies = [() if old is None else (ShardCopy(3, world_size, replicas, old, 11),) for old in new_order]
            plan = plan_peer_restore(copies)
            expected = _oracle(world_size, replicas, new_order)
            assert (plan.senders if plan else None) == expected, (replicas, new_order)
            if world_size - len(survivors) < replicas:  # up to R - 1 lost, whichever: always a plan
                assert plan is not None
            if plan is not None:
                assert (plan.generation, plan.world_size, plan.replicas, plan.step) == (3, world_size, replicas, 11)


@pytest.mark.parametrize(("lost", "has_plan"), [
    ((), True), ((1,), True), ((1, 3), True), ((0, 4, 2), True),
    ((3, 4, 5), True),  # a whole replica group (one node's ranks)
    ((1, 4), False), ((0, 3), False), ((0, 1, 5, 2), False),
])
def test_six_ranks_with_two_copies_lose_a_shard_only_with_both_its_holders(lost, has_plan):
    """Shard s is held by ranks s and s + 3."""
    survivors = [rank for rank in range(6) if rank not in lost]
    assert (plan_peer_restore(copies_of(0, 6, 2, survivors, 5)) is not None) == has_plan


def test_the_newest_complete_state_is_restored_when_ranks_ended_a_step_apart():
    # old ranks 0 and 1 (one copy of both shards) committed step 9; ranks 2 and 3 only step 8
    copies = copies_of(2, 4, 2, [0, 1], 9) + copies_of(2, 4, 2, [2, 3], 8)
    plan = plan_peer_restore(copies)
    assert (plan.step, plan.senders) == (9, (0, 1))
    # only shard 0 of step 9 survives: step 8 is the newest state complete
    copies = copies_of(2, 4, 2, [0], 9) + copies_of(2, 4, 2, [2, 3], 8)
    plan = plan_peer_restore(copies)
    assert (plan.step, plan.senders) == (8, (1, 2))
    assert plan_peer_restore(copies_of(2, 4, 2, [0], 9) + copies_of(2, 4, 2, [3], 8)) is None


def test_of_two_complete_states_at_one_step_the_newer_generation_is_taken():
    copies = [*copies_of(4, 2, 1, [0, 1], 6), *copies_of(5, 1, 1, [0], 6)]
    assert plan_peer_restore(copies) == PeerRestorePlan(generation=5, world_size=1, replicas=1, step=6, senders=(2,))


def test_no_copies_no_plan():
    assert plan_peer_restore([]) is None
    assert plan_peer_restore([(), ()]) is None


def test_two_new_ranks_reporting_the_same_old_rank_is_a_bug():
    with pytest.raises(AssertionError, match="both report rank 1"):
        plan_peer_restore(copies_of(0, 2, 1, [1, 1], 3))


def test_a_rank_keeps_its_rows_of_each_entry_and_shard_0_the_scalars():
    flat = {"model.w": torch.arange(10.0).view(5, 2), "model.b": torch.ones(2), "optim.state.w.step": torch.tensor(3.0)}
    strategy = SimpleNamespace(name="zero1", state_dict=lambda state: flat)
    kept = [keep_shards(strategy, SimpleNamespace(layout=ShardLayout(world_size=4, replicas=1, rank=rank),
                                                  optimizer=SimpleNamespace()), None, generation=2, step=7)
            for rank in range(4)]
    assert kept[3].copy == ShardCopy(generation=2, world_size=4, replicas=1, rank=3, step=7)
    assert [k.rows["model.w"].shape[0] for k in kept] == [2, 2, 1, 0]  # torch.chunk's split: the last is empty
    assert [k.rows["model.b"].shape[0] for k in kept] == [1, 1, 0, 0]
    assert ["optim.state.w.step" in k.rows for k in kept] == [True, False, False, False]
    assert torch.equal(torch.cat([k.rows["model.w"] for k in kept]), flat["model.w"])
    assert kept[0].entries["model.w"].shape == (5, 2)


def test_nothing_is_kept_at_step_0_or_from_a_zero1_update_cut_short():
    state = SimpleNamespace(layout=ShardLayout(world_size=2, replicas=1, rank=0), optimizer=SimpleNamespace())
    strategy = SimpleNamespace(name="zero1", state_dict=lambda state: {"model.w": torch.ones(4)})
    assert keep_shards(strategy, state, None, generation=0, step=0) is None
    assert keep_shards(strategy, state, None, generation=0, step=1).rows["model.w"].tolist() == [1.0, 1.0]
    state.optimizer.stepping = True  # its chunks updated, the gathering of the others failed
    assert keep_shards(strategy, state, None, generation=0, step=1) is None
