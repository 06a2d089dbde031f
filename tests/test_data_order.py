"""GlobalSampleOrder: which samples a step consumes, and which of them each rank takes, at any world size.

    python -m pytest tests/test_data_order.py -q
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from raylastic.actors.data.batch_split import BatchSplit, rank_slice
from raylastic.actors.data.order import GlobalSampleOrder, micro_batch_count, micro_batches
from raylastic.jobconfig import TrainingConfig
from tests.support.helpers import step_indices

WORLD_SIZES = range(1, 6)
GLOBAL_BATCHES = (7, 48, 64)
# Per batch: a data set size the batch divides, one it does not, and one smaller than the batch.
SIZES = [(batch, num_samples) for batch in GLOBAL_BATCHES for num_samples in (batch * 3, 100, 5)]


def _steps_for_epochs(order: GlobalSampleOrder, epochs: int) -> int:
    return math.ceil(epochs * order.num_samples / order.global_batch_size)


def _assert_each_epoch_is_a_permutation(stream: torch.Tensor, num_samples: int) -> None:
    full_epochs = len(stream) // num_samples
    assert full_epochs >= 1
    for epoch in range(full_epochs):
        seen = stream[epoch * num_samples:(epoch + 1) * num_samples]
        assert torch.equal(seen.sort().values, torch.arange(num_samples)), f"epoch {epoch}"


@pytest.mark.parametrize(("global_batch_size", "num_samples"), SIZES)
def test_ranks_concatenate_to_the_step_at_every_world_size(global_batch_size, num_samples):
    order = GlobalSampleOrder(num_samples=num_samples, global_batch_size=global_batch_size, seed=3)
    for step in range(_steps_for_epochs(order, 2)):
        whole = step_indices(order, step)
        assert len(whole) == global_batch_size
        for world_size in WORLD_SIZES:
            parts = [order.rank_indices(step, rank, world_size) for rank in range(world_size)]
            sizes = [len(p) for p in parts]
            assert max(sizes) - min(sizes) <= 1, (step, world_size, sizes)
            assert torch.equal(torch.cat(parts), whole), (step, world_size)


@pytest.mark.parametrize(("global_batch_size", "num_samples"), SIZES)
def test_every_sample_once_per_epoch_across_the_stream(global_batch_size, num_samples):
    order = GlobalSampleOrder(num_samples=num_samples, global_batch_size=global_batch_size, seed=0)
    stream = torch.cat([step_indices(order, step) for step in range(_steps_for_epochs(order, 3))])
    _assert_each_epoch_is_a_permutation(stream, num_samples)


@pytest.mark.parametrize(("global_batch_size", "num_samples"), SIZES)
def test_every_sample_once_per_epoch_when_the_world_size_changes_every_step(global_batch_size, num_samples):
    order = GlobalSampleOrder(num_samples=num_samples, global_batch_size=global_batch_size, seed=1)
    consumed = []
    for step in range(_steps_for_epochs(order, 3)):
        world_size = WORLD_SIZES[(step * 3) % len(WORLD_SIZES)]  # 1, 4, 2, 5, 3, 1, ...
        consumed += [order.rank_indices(step, rank, world_size) for rank in range(world_size)]
    _assert_each_epoch_is_a_permutation(torch.cat(consumed), num_samples)


def test_step_spanning_an_epoch_boundary_takes_the_next_epochs_permutation():
    order = GlobalSampleOrder(num_samples=10, global_batch_size=4, seed=0)
    assert torch.equal(step_indices(order, 2), torch.cat([order.permutation(0)[8:], order.permutation(1)[:2]]))


def test_same_seed_same_order_in_a_fresh_object_and_after_going_back():
    first = GlobalSampleOrder(num_samples=100, global_batch_size=48, seed=7)
    steps = [step_indices(first, step) for step in range(9)]  # 4+ epochs: the cache drops old ones
    second = GlobalSampleOrder(num_samples=100, global_batch_size=48, seed=7)
    for step in (8, 0, 5, 1):  # out of order, as after a resume
        assert torch.equal(step_indices(second, step), steps[step]), step
        assert torch.equal(step_indices(first, step), steps[step]), step


def test_different_seeds_and_epochs_give_different_orders():
    orders = [GlobalSampleOrder(num_samples=100, global_batch_size=48, seed=seed) for seed in (0, 1, 2)]
    permutations = [o.permutation(0) for o in orders] + [orders[0].permutation(1)]
    for i, j in ((0, 1), (0, 2), (1, 2), (0, 3)):
        assert not torch.equal(permutations[i], permutations[j]), (i, j)


def test_every_seed_the_config_accepts_gives_an_order():
    largest = 2**32 - 1
    TrainingConfig(seed=largest)
    with pytest.raises(ValueError, match=r"training\.seed must be an integer in \[0, 2\*\*32\)"):
        TrainingConfig(seed=largest + 1)
    order = GlobalSampleOrder(num_samples=10, global_batch_size=4, seed=largest)
    assert torch.equal(order.permutation(0).sort().values, torch.arange(10))
    assert torch.equal(step_indices(order, 0), order.permutation(0)[:4])


@pytest.mark.parametrize("global_batch_size", GLOBAL_BATCHES)
def test_rank_slices_tile_the_batch(global_batch_size):
    for world_size in WORLD_SIZES:
        slices = [rank_slice(global_batch_size, rank, world_size) for rank in range(world_size)]
        assert slices[0][0] == 0 and slices[-1][1] == global_batch_size
        assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(slices))


@pytest.mark.parametrize(("micro_batch_size", "expected_sizes"), [
    (None, [10]), (10, [10]), (64, [10]), (3, [3, 3, 2, 2]), (5, [5, 5]), (1, [1] * 10),
])
def test_micro_batches_split_in_order(micro_batch_size, expected_sizes):
    indices = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    chunks = micro_batches(indices, micro_batch_count(BatchSplit((10, 7)), micro_batch_size))
    assert [len(c) for c in chunks] == expected_sizes
    assert torch.equal(torch.cat(chunks), indices)


def test_every_rank_runs_as_many_micro_batches_as_the_largest_share_needs():
    split = BatchSplit((2, 9))
    assert micro_batch_count(split, 3) == 3
    small = micro_batches(torch.tensor([5, 6]), 3)  # fewer samples than micro-batches: padded with the last
    assert [c.tolist() for c in small] == [[5], [6], [6]]


def test_an_empty_data_set_is_refused_naming_its_size_and_the_batch_field():
    with pytest.raises(ValueError, match=r"train_dataset\(\) has 0 samples: nothing to train on "
                                         r"\(training.global_batch_size=48 samples a step\)"):
        GlobalSampleOrder(num_samples=0, global_batch_size=48, seed=0)


@pytest.mark.parametrize(("num_samples", "global_batch_size"), [(5, 7), (5, 48), (40, 64)])
def test_a_data_set_smaller_than_a_global_batch_warns_and_the_repeats_are_as_it_says(caplog, num_samples,
                                                                                        global_batch_size):
    with caplog.at_level("WARNING", logger="raylastic.actors.data.order"):
        order = GlobalSampleOrder(num_samples=num_samples, global_batch_size=global_batch_size, seed=0)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"has {num_samples} samples, fewer than training.global_batch_size={global_batch_size}" in warning
    repeats = global_batch_size - num_samples
    assert f"at least {repeats} of them repeat" in warning and f"at most {num_samples} for no sample" in warning
    for step in range(_steps_for_epochs(order, 3)):
        batch = step_indices(order, step)
        assert len(batch) - len(batch.unique()) >= repeats


def test_a_data_set_of_a_global_batch_or_more_does_not_warn(caplog):
    with caplog.at_level("WARNING", logger="raylastic.actors.data.order"):
        GlobalSampleOrder(num_samples=48, global_batch_size=48, seed=0)
    assert caplog.records == []
