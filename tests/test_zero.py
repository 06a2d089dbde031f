"""ZeRO-1/2/3 against the single-process reference, and checkpoints resharded across world sizes
and stages (gloo process groups of local processes; the Ray-level failure test is in test_elastic)."""

from __future__ import annotations

import pytest
import torch

from raylastic.strategies.checkpoint_catalogue import complete_checkpoints
from tests.support.distributed_harness import run_distributed as run_on_ranks
from tests.support.strategy_runs import restore_and_report, train_and_report

STEPS = 3
STRATEGIES = ("zero1", "zero2", "zero3")
ABSOLUTE_TOLERANCE = {"sgd": 1e-6, "adamw": 1e-4}
"""Adam moves an element by ~lr whatever its gradient's size, so elements whose true gradient is (near)
zero - exactly so for the attention key bias - move by float noise whose sign follows the summation
order: ~1e-5 here. 1e-4 is 1% of one step's lr (1e-2); a wrong shard would be off by whole updates."""


@pytest.fixture(scope="module")
def references():
    return {optimizer: run_on_ranks(train_and_report, 1, "ddp", STEPS, None, optimizer)[0]
            for optimizer in ABSOLUTE_TOLERANCE}


@pytest.mark.parametrize(("strategy", "world_size", "optimizer"), [
    *[(strategy, world_size, "sgd") for strategy in STRATEGIES for world_size in (2, 3)],
    *[(strategy, 3, "adamw") for strategy in STRATEGIES],  # 3 ranks: uneven shards, Adam's two moments each
])
def test_zero_matches_single_process_reference(references, strategy, world_size, optimizer):
    reference = references[optimizer]
    state = run_on_ranks(train_and_report, world_size, strategy, STEPS, None, optimizer)[0]
    assert state.keys() == reference.keys()
    assert any(key.startswith("optim.state.") for key in reference)
    for key in reference:
        torch.testing.assert_close(state[key], reference[key], rtol=1e-4, atol=ABSOLUTE_TOLERANCE[optimizer],
                                   msg=key)


@pytest.fixture(scope="module")
def saved_at_3(tmp_path_factory):
    """For each strategy: the checkpoint it saved at world size 3 and the full state it held."""
    saved = {}
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        root = tmp_path_factory.mktemp(strategy)
        state = run_on_ranks(train_and_report, 3, strategy, STEPS, str(root))[0]
        saved[strategy] = (complete_checkpoints(str(root))[-1].path, state)
    return saved


def assert_exactly_equal(loaded, saved):
    assert loaded.keys() == saved.keys()
    assert any(key.startswith("optim.state.") for key in saved)
    for key in saved:
        assert torch.equal(loaded[key], saved[key]), key


@pytest.mark.parametrize(("saved_with", "loaded_with", "world_size"), [
    ("ddp", "ddp", 2), ("zero1", "zero1", 2), ("zero2", "zero2", 2), ("zero3", "zero3", 2),
    ("ddp", "zero3", 4), ("zero1", "zero2", 4), ("zero2", "ddp", 4), ("zero3", "zero1", 4),
])
def test_checkpoint_saved_at_3_loads_exactly_at_other_sizes_and_stages(saved_at_3, saved_with, loaded_with,
                                                                        world_size):
    path, saved = saved_at_3[saved_with]
    assert_exactly_equal(run_on_ranks(restore_and_report, world_size, loaded_with, path)[0], saved)


def test_zero3_at_4_resumes_as_zero1_at_2(tmp_path):
    state = run_on_ranks(train_and_report, 4, "zero3", STEPS, str(tmp_path))[0]
    path = complete_checkpoints(str(tmp_path))[-1].path
    assert_exactly_equal(run_on_ranks(restore_and_report, 2, "zero1", path)[0], state)
