"""Batch shares by measured speed: the policy's decisions (pure), and uneven shares giving the same training
as even ones under every strategy (gloo process groups of local processes; the Ray runs are in
tests/test_balance_runs.py)."""

from __future__ import annotations

import statistics

import pytest
import torch

from raylastic.actors.data.balance import (
    DECISION_VOTES,
    REBALANCE_GAIN,
    STRAGGLER_DECISIONS,
    BalanceDecision,
    Balancer,
    carry_split,
    min_share,
    predicted_step_s,
    proportional_sizes,
)
from raylastic.actors.data.batch_split import BatchSplit
from raylastic.actors.data.order import GlobalSampleOrder
from tests.support.distributed_harness import run_distributed as run_on_ranks
from tests.support.strategy_runs import GLOBAL_BATCH, train_and_report


def test_proportional_sizes_follow_the_weights_and_sum_to_the_batch():
    assert proportional_sizes(64, [1, 1, 1]) == (22, 21, 21)  # remainders to the lower ranks
    assert proportional_sizes(60, [2, 2, 1]) == (24, 24, 12)
    assert proportional_sizes(64, [0, 0]) == (32, 32)  # nothing measured: even
    assert sum(proportional_sizes(97, [3.3, 1.1, 7.7, 0.2])) == 97


def test_no_share_falls_below_the_minimum():
    sizes = proportional_sizes(64, [100.0, 100.0, 1.0], min_size=5)
    assert sizes[2] == 5 and sum(sizes) == 64 and sizes[0] - sizes[1] in (0, 1)
    assert min_share(64, 3, straggler_factor=4.0) == 5  # 64/3/4 = 5.3
    assert min_share(4, 4, straggler_factor=4.0) == 1


def test_batch_split_bounds_tile_the_batch_and_the_order_follows_them():
    split = BatchSplit((5, 20, 7))
    assert [split.bounds(r) for r in range(3)] == [(0, 5), (5, 25), (25, 32)]
    order = GlobalSampleOrder(num_samples=100, global_batch_size=32, seed=3)
    uneven = torch.cat([order.split_indices(4, split, r) for r in range(3)])
    even = torch.cat([order.rank_indices(4, r, 3) for r in range(3)])
    assert torch.equal(uneven, even)  # the same samples in the same order, cut elsewhere
    assert BatchSplit.even(10, 3).sizes == (3, 3, 4)  # rank_slice: r*B//w


def decide_windows(balancer: Balancer, rates, windows: int = 1):
    """Feed ``windows`` decision windows of the same ``rates``; the decisions at their ends."""
    decisions = [balancer.decide(rates) for _ in range(windows * DECISION_VOTES)]
    assert all(d == BalanceDecision() for i, d in enumerate(decisions) if (i + 1) % DECISION_VOTES)
    return decisions[DECISION_VOTES - 1::DECISION_VOTES]


def test_shares_follow_a_slow_rank_after_the_first_window():
    balancer = Balancer(BatchSplit.even(60, 3), straggler_factor=4.0)
    first, second, third = decide_windows(balancer, (100.0, 100.0, 50.0), windows=3)
    assert first.split is None  # the generation's first window carries its start-up: not used
    assert second.split == BatchSplit((24, 24, 12))
    assert third.split is None  # settled: nothing more to gain


def test_a_window_averages_its_votes():
    balancer = Balancer(BatchSplit.even(60, 3), straggler_factor=4.0)
    decide_windows(balancer, (100.0, 100.0, 100.0))
    noisy = [(150.0, 100.0, 50.0), (50.0, 100.0, 150.0)] * (DECISION_VOTES // 2)  # means: all 100
    assert not any(balancer.decide(rates).split for rates in noisy)
    assert balancer.rates == (100.0, 100.0, 100.0)


def test_equal_ranks_with_noise_keep_even_shares():
    balancer = Balancer(BatchSplit.even(64, 3), straggler_factor=4.0)
    noisy = [(100.0, 104.0, 97.0), (98.0, 101.0, 103.0), (103.0, 96.0, 100.0)] * 3 * DECISION_VOTES
    assert all(balancer.decide(rates).split is None for rates in noisy)
    assert balancer.split == BatchSplit.even(64, 3)


def test_shares_move_back_when_the_slow_rank_recovers():
    balancer = Balancer(BatchSplit.even(60, 3), straggler_factor=4.0)
    decide_windows(balancer, (100.0, 100.0, 50.0), windows=2)
    assert balancer.split == BatchSplit((24, 24, 12))
    assert decide_windows(balancer, (100.0, 100.0, 100.0))[0].split == BatchSplit((20, 20, 20))


def test_a_small_share_grows_back_when_fixed_costs_dominate_its_time():
    """Each rank's compute takes a fixed 5 ms a step plus 0.1 ms a sample. Left at 6 of 48 samples by a throttle
    now lifted, the small share's rate is a quarter of the other's, so shares proportional to the rates predict
    only ~8% gain (they take its time as all per sample); but it computes 5.6 ms against 9.2 ms, and the split
    grows back until the times are within the hysteresis of their mean."""
    balancer = Balancer(BatchSplit((42, 6)), straggler_factor=8.0)
    for _ in range(12):
        times = [5.0 + 0.1 * size for size in balancer.split.sizes]
        decide_windows(balancer, tuple(size / t for size, t in zip(balancer.split.sizes, times, strict=True)))
    times = [5.0 + 0.1 * size for size in balancer.split.sizes]
    assert balancer.split.sizes[1] >= 15 and 1 - statistics.fmean(times) / max(times) < REBALANCE_GAIN


def test_a_change_must_predict_a_shorter_step_by_the_hysteresis_gain():
    current = BatchSplit((20, 20, 20))
    rates = (100.0, 100.0, 100.0 * (1 - REBALANCE_GAIN / 2))  # a target would gain ~5%: not worth it
    balancer = Balancer(current, straggler_factor=4.0)
    assert not any(d.split for d in decide_windows(balancer, rates, windows=4))
    assert predicted_step_s(current, rates) == pytest.approx(20 / rates[2])


def test_a_persistently_slow_rank_is_reported_once():
    balancer = Balancer(BatchSplit.even(64, 3), straggler_factor=4.0)
    reports = [d.stragglers for d in decide_windows(balancer, (100.0, 100.0, 10.0), windows=STRAGGLER_DECISIONS + 3)]
    assert reports == [()] * STRAGGLER_DECISIONS + [(2,), (), ()]  # the first window is not judged
    assert balancer.split.sizes[2] == min_share(64, 3, 4.0)  # held at its minimum share meanwhile


def test_a_rank_whose_rate_falls_with_its_share_is_not_a_straggler_while_its_time_keeps_up():
    """Fixed costs per step make a small share's rate low: 2x slower, at a third of the others' share, its rate
    is a quarter of theirs, yet it finishes with them."""
    balancer = Balancer(BatchSplit((28, 28, 8)), straggler_factor=4.0)
    assert not any(d.stragglers for d in decide_windows(balancer, (100.0, 100.0, 24.0), windows=6))


def test_a_rank_slow_only_for_a_while_is_not_a_straggler():
    balancer = Balancer(BatchSplit.even(64, 3), straggler_factor=4.0)
    decide_windows(balancer, (100.0, 100.0, 10.0), windows=STRAGGLER_DECISIONS)
    decisions = decide_windows(balancer, (100.0, 100.0, 100.0), windows=STRAGGLER_DECISIONS)
    assert not any(d.stragglers for d in decisions)


def test_a_resize_starts_newcomers_at_the_mean_and_spreads_a_lost_share():
    last = {"w0": 30, "w1": 30, "w2": 4}  # w2 was slow
    assert carry_split(last, ["w0", "w2", "w3"], 64, 4.0).sizes == (38, 5, 21)  # w3 new: the mean share, 64/3
    assert carry_split(last, ["w0", "w1"], 64, 4.0).sizes == (32, 32)  # w2 lost: its share spread


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(train_and_report, 1, "ddp", 3)[0]


SHARES = (1, 8, 3)
"""Of 12 samples, with micro-batches of 4: every rank runs two, rank 0's second a zero-weight padding."""


@pytest.mark.parametrize(("strategy", "options"), [
    ("ddp", None), ("zero1", None), ("zero2", None), ("zero3", None), ("ddp", {"hierarchical": True}),
])
def test_uneven_shares_train_as_the_single_process_reference(reference, strategy, options):
    assert sum(SHARES) == GLOBAL_BATCH
    state = run_on_ranks(train_and_report, 3, strategy, 3, None, "adamw", 1, SHARES, options)[0]
    assert state.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(state[key], reference[key], rtol=1e-4, atol=1e-4, msg=key)


def test_uneven_shares_under_compression_train_as_even_shares_do():
    """fp16 compression rounds each rank's part of the gradient, so the bits depend on the split: uneven and
    even shares stay as close to the uncompressed reference as each other (~5e-4 here; SGD, as Adam would
    turn the rounding of near-zero gradients into whole lr-sized moves)."""
    options = {"compression": "fp16"}
    reference = run_on_ranks(train_and_report, 1, "ddp", 3, None, "sgd")[0]
    for shares in (None, SHARES):
        state = run_on_ranks(train_and_report, 3, "ddp", 3, None, "sgd", 1, shares, options)[0]
        for key in reference:
            torch.testing.assert_close(state[key], reference[key], rtol=1e-3, atol=1e-3, msg=f"{shares}: {key}")
