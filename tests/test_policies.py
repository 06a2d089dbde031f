"""The Controller's pure decisions: ScalingPolicy (how many workers) and FailurePolicy (recover or give up).

    python -m pytest tests/test_policies.py -q
"""

from __future__ import annotations

import itertools

import pytest

from actors.policies import FailurePolicy, Noop, Raise, Recover, Resize, ScalingPolicy, ScalingState

# -- ScalingPolicy ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_workers", "num_placeable"), [(2, 0), (2, 1), (2, 10), (0, 5)])
def test_fixed_size_never_resizes_once_formed(num_workers, num_placeable):
    policy = ScalingPolicy(min_workers=2, max_workers=2)
    decision = policy.decide(ScalingState(num_workers=num_workers, num_placeable=num_placeable))
    assert decision == (Noop() if num_workers == 2 else Resize(2))


@pytest.mark.parametrize(("num_workers", "num_placeable", "expected"), [
    (2, 2, Resize(4)),   # grows to max when the resources are ready
    (2, 1, Resize(3)),   # grows as far as the ready resources allow
    (2, 50, Resize(4)),  # never above max
    (3, 1, Resize(4)),
    (0, 2, Resize(2)),   # a fresh start with just enough
    (4, 0, Noop()),      # already at max
    (4, 3, Noop()),
    (3, 0, Noop()),      # nothing ready to grow onto
    (0, 1, Noop()),      # never a Resize below min
    (1, 0, Noop()),
])
def test_elastic_decisions(num_workers, num_placeable, expected):
    policy = ScalingPolicy(min_workers=2, max_workers=4)
    assert policy.decide(ScalingState(num_workers=num_workers, num_placeable=num_placeable)) == expected


def test_resize_always_within_bounds_and_to_the_target():
    for min_workers, max_workers in itertools.combinations_with_replacement(range(1, 6), 2):
        policy = ScalingPolicy(min_workers=min_workers, max_workers=max_workers)
        for num_workers, num_placeable in itertools.product(range(7), range(6)):
            decision = policy.decide(ScalingState(num_workers=num_workers, num_placeable=num_placeable))
            target = min(max_workers, num_workers + num_placeable)
            case = (min_workers, max_workers, num_workers, num_placeable, decision)
            if isinstance(decision, Resize):
                assert min_workers <= decision.num_workers <= max_workers, case
                assert decision.num_workers == target != num_workers, case
            else:
                assert decision == Noop(), case
                assert target == num_workers or target < min_workers, case


# -- FailurePolicy ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_failures", [0, 1, 3])
def test_recovers_up_to_max_failures_then_raises(max_failures):
    policy = FailurePolicy(max_failures=max_failures)
    for failures in range(1, max_failures + 1):
        assert isinstance(policy.decide(failures_so_far=failures), Recover), failures
    decision = policy.decide(failures_so_far=max_failures + 1)
    assert isinstance(decision, Raise)
    assert f"failure.max_failures={max_failures}" in decision.reason
    assert isinstance(policy.decide(failures_so_far=max_failures + 5), Raise)


def test_max_failures_zero_raises_on_the_first():
    assert isinstance(FailurePolicy(max_failures=0).decide(failures_so_far=1), Raise)


def test_no_backoff_by_default():
    assert FailurePolicy(max_failures=5).decide(failures_so_far=3) == Recover(backoff_s=0.0)


def test_backoff_doubles_then_caps():
    policy = FailurePolicy(max_failures=10, backoff_s=0.5, max_backoff_s=3.0)
    delays = [policy.decide(failures_so_far=n).backoff_s for n in range(1, 8)]
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0, 3.0]


def test_backoff_stays_capped_after_many_failures():
    policy = FailurePolicy(max_failures=10_000, backoff_s=1.0, max_backoff_s=30.0)
    assert policy.decide(failures_so_far=2_000) == Recover(backoff_s=30.0)
