"""Sharded state with strategy.replicas copies (HSDP, issue 18) on local gloo groups, no Ray.

The math at R = 2 is one process's (gradients averaged over every rank); a checkpoint saved with
two copies loads at another layout; and the shards the ranks keep when they leave a generation rebuild
the whole state in a smaller or equal group, at any stage and replica count, without a file.

    python -m pytest tests/test_hsdp.py -q     # about 35 s on 2 cores
"""

from __future__ import annotations

import gc
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from raylastic.strategies.base import memory_breakdown
from raylastic.strategies.checkpoint_catalogue import complete_checkpoints
from raylastic.strategies.peer_restore import plan_peer_restore
from raylastic.strategies.process_group import leave_group
from raylastic.strategies.shard_copy import gather_shards, keep_shards, load_full_state
from tests.support.distributed_harness import run_distributed
from tests.support.strategy_runs import restore_and_report, setup, train_and_report, train_each_and_report

STEPS = 3


TWO_COPIES = ("zero1", "zero2", "zero3")


HELD_SETTINGS = [("zero1", 1), ("zero1", 2), ("zero3", 1), ("zero3", 2)]
"""(strategy, replicas) whose state held per rank the two-copy test compares."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[dict, dict[str, dict], str, list]:
    """One process training the job alone; 4 ranks training it with two copies under each of TWO_COPIES in
    turn (zero3's run saves a checkpoint), then holding one step of each of HELD_SETTINGS; the checkpoint's path."""
    root = str(tmp_path_factory.mktemp("two-copies"))
    alone = run_distributed(train_and_report, 1, "ddp", STEPS, timeout_s=120)[0]
    runs = [{"strategy_name": name, "steps": STEPS, "replicas": 2, "checkpoint_root": root if name == "zero3" else None}
            for name in TWO_COPIES]
    two, held = run_distributed(_train_each_then_held, 4, runs, HELD_SETTINGS, timeout_s=300)[0]
    return alone, dict(zip(TWO_COPIES, two, strict=True)), complete_checkpoints(root)[-1].path, held


def _train_each_then_held(runs: list[dict], settings: list[tuple[str, int]]) -> tuple[list[dict], list]:
    """``train_each_and_report(runs)``, then ``_held(settings)``, on the same ranks."""
    return train_each_and_report(runs), _held(settings)


@pytest.mark.parametrize("strategy", TWO_COPIES)
def test_two_copies_train_as_one_process(trained, strategy):
    alone, two, _, _ = trained
    assert alone.keys() == two[strategy].keys() and any(key.startswith("optim.state.") for key in alone)
    for key in alone:  # Adam's noise on near-zero gradients: see tests/test_zero.py's ABSOLUTE_TOLERANCE
        torch.testing.assert_close(two[strategy][key], alone[key], rtol=1e-4, atol=1e-4, msg=key)


def _held(settings: list[tuple[str, int]]) -> list[tuple[int, dict[str, int]]]:
    """For each (strategy, replicas): this rank's shard count and bytes held after one step."""
    held = []
    for name, replicas in settings:
        strategy, state, runner = setup(name, "adamw", replicas)
        runner.run(state, 0)
        held.append((state.layout.num_shards, memory_breakdown(state)))
        del strategy, state, runner
        gc.collect()
    return held


def test_two_copies_hold_twice_the_sharded_state_per_rank(trained):
    (zero1_one, zero1_two, zero3_one, zero3_two) = trained[3]
    assert [zero1_one[0], zero1_two[0], zero3_one[0], zero3_two[0]] == [4, 2, 4, 2]
    assert zero1_two[1]["optimizer"] > 1.5 * zero1_one[1]["optimizer"]
    assert zero1_two[1]["parameters"] == zero1_one[1]["parameters"]  # zero1: every rank holds the whole model
    for kind in ("parameters", "optimizer"):
        assert zero3_two[1][kind] > 1.5 * zero3_one[1][kind], kind


def test_a_checkpoint_saved_with_two_copies_loads_exactly_at_three_ranks(trained):
    _, two, path, _ = trained
    saved = two["zero3"]
    loaded = run_distributed(restore_and_report, 3, "zero2", path)[0]
    assert loaded.keys() == saved.keys()
    for key in saved:
        assert torch.equal(loaded[key], saved[key]), key


SURVIVOR_CASES = {  # before and after (strategy, replicas), the ranks lost, the plan's senders (None: no plan)
    "zero3-4to3": (("zero3", 2), ("zero3", 2), (1,), (0, 2)),  # 3 ranks: one copy left
    "zero2-4to2": (("zero2", 2), ("zero2", 2), (1, 2), (0, 1)),  # 2 copies of 1 shard: whole
    "zero1-4to3": (("zero1", 2), ("zero1", 2), (0,), (1, 0)),
    "zero3-to-zero1-at-4": (("zero3", 1), ("zero1", 1), (), (0, 1, 2, 3)),  # nobody lost
    "zero3-to-zero2-4to3": (("zero3", 2), ("zero2", 1), (0,), (1, 0)),
    "both-copies-of-shard-0-lost": (("zero3", 2), ("zero3", 1), (0, 2), None),  # ranks 0 and 2 held shard 0
}


@pytest.fixture(scope="module")
def survivors(tmp_path_factory) -> dict[str, list]:
    """Every case of SURVIVOR_CASES, one after the other on the same 4 ranks: by case, each rank's result."""
    store_dir = str(tmp_path_factory.mktemp("survivors"))
    cases = [case[:3] for case in SURVIVOR_CASES.values()]
    by_rank = run_distributed(_restore_each_in_survivors, 4, store_dir, cases, timeout_s=300)
    return {name: [results[index] for results in by_rank] for index, name in enumerate(SURVIVOR_CASES)}


def _restore_each_in_survivors(store_dir: str, cases: list[tuple]) -> list:
    """``_restore_in_survivors`` for each of ``cases`` (before, after, lost) in turn, every case starting from a
    group of all the ranks."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = []
    for index, case in enumerate(cases):
        if index > 0:
            leave_group()
            dist.init_process_group("gloo", store=dist.FileStore(f"{store_dir}/case{index}-all", world_size),
                                    rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        results.append(_restore_in_survivors(f"{store_dir}/case{index}-", *case))
        gc.collect()
    return results


def _restore_in_survivors(store_prefix: str, before: tuple[str, int], after: tuple[str, int], lost: tuple[int, ...]):
    """Train ``before`` (strategy, replicas) on every rank and keep the shards, as TrainWorker.join does; the
    ranks not ``lost`` form a new group (its FileStore at ``store_prefix`` + "generation1"), plan, and restore into
    ``after``. Returns (whole state before, whole state after, plan) on the survivors."""
    strategy, state, runner = setup(before[0], "adamw", before[1])
    for step in range(STEPS):
        runner.run(state, step)
    before_state = _whole(strategy, state)
    kept = keep_shards(strategy, state, None, generation=0, step=STEPS)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    del state, runner
    gc.collect()
    leave_group()
    survivors = [r for r in range(world_size) if r not in lost]
    if rank in lost:
        return None
    dist.init_process_group("gloo", store=dist.FileStore(f"{store_prefix}generation1", len(survivors)),
                            rank=survivors.index(rank), world_size=len(survivors), timeout=timedelta(seconds=60))
    copies = [None] * len(survivors)
    dist.all_gather_object(copies, (kept.copy,))  # what the Controller reads from the JoinReports
    plan = plan_peer_restore(copies)
    if plan is None:
        return before_state, None, None
    strategy, state, _ = setup(after[0], "adamw", after[1])
    load_full_state(strategy, state, None, gather_shards([kept], plan))
    return before_state, _whole(strategy, state), plan


def _whole(strategy, state) -> dict[str, torch.Tensor]:
    """The whole canonical state, on every rank (collective)."""
    return {key: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
            for key, value in strategy.state_dict(state).items()}


@pytest.mark.parametrize("case", [name for name, case in SURVIVOR_CASES.items() if case[3] is not None])
def test_kept_shards_rebuild_the_state_in_the_survivors(survivors, case):
    lost, senders = SURVIVOR_CASES[case][2:]
    for rank in sorted(set(range(4)) - set(lost)):
        expected, restored, plan = survivors[case][rank]
        assert plan is not None and plan.senders == senders and plan.step == STEPS
        assert restored.keys() == expected.keys() and any(key.startswith("optim.state.") for key in expected)
        for key in expected:
            assert torch.equal(restored[key], expected[key]), f"rank {rank}: {key}"


def test_no_plan_when_both_copies_of_a_shard_are_lost(survivors):
    results = survivors["both-copies-of-shard-0-lost"]
    assert results[1] == (results[1][0], None, None)  # ranks 0 and 2 held shard 0
