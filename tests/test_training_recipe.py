"""Recipes on a real local Ray: the lr schedule across a kill and a resume, dropout with a redone step (the
DataLoader path and periodic evaluation: tests/test_training.py)."""

from __future__ import annotations

import json

import pytest

from raylastic.actors.status.run import RunFailed
from raylastic.actors.worker.optimizer_recipe import learning_rate
from raylastic.cluster.cli import main
from raylastic.cluster.job import train
from tests.support.helpers import assert_states_close, job, load_model

pytestmark = pytest.mark.usefixtures("ray_local")


def _assert_scheduled(history: list[dict], config) -> None:
    for row in history:
        assert row["lr"] == pytest.approx(learning_rate(row["step"] - 1, config.optim, config.training.steps),
                                          rel=1e-12), row["step"]


def test_lr_follows_warmup_then_cosine_across_a_kill_and_a_resume(tmp_path):
    recipe = ["optim.schedule=cosine", "optim.warmup_steps=8", "optim.min_lr=1e-4", "optim.lr=3e-3",
              "optim.clip_grad_norm=0.5", "training.steps=40", "checkpoint.every_steps=10",
              "scaling.min_workers=1", "failure.max_failures=1"]
    faults = "faults=[{action: kill, rank: 1, step: 15}, {action: raise, rank: 0, step: 33}]"
    failing = job(*recipe, faults, name="sched")
    with pytest.raises(RunFailed):
        train(failing, run_dir=tmp_path / "sched")
    failed = json.loads((tmp_path / "sched" / "result.json").read_text())
    assert failed["status"] == "failed" and failed["final_step"] == 32
    assert [e["step"] for e in failed["events"] if e["type"] == "worker_failed"] == [14, 32]
    _assert_scheduled(failed["history"], failing)  # through the kill: the lr of a step is its own
    assert {row["world_size"] for row in failed["history"]} >= {1, 2}

    resumed = job(*recipe, name="sched")
    result = train(resumed, run_dir=tmp_path / "sched")
    assert [e.step for e in result.events if e.type == "resumed"] == [30]
    assert [row["step"] for row in result.history] == list(range(31, 41))
    _assert_scheduled(result.history, resumed)
    before_resume = [row for row in failed["history"] if 8 < row["step"] <= 30]
    decaying = [row["lr"] for row in before_resume + result.history]
    assert decaying == sorted(decaying, reverse=True) and 1e-4 < decaying[-1] < 1.1e-4
    assert all(row["grad_norm"] > 0 for row in result.history)


def test_dropout_run_is_reproducible_and_a_redone_step_draws_the_same_masks(tmp_path):
    """With dropout a run repeats bit for bit while its batch shares stay the same: scaling.balance=off (as the
    README says) keeps them even, also when one rank is slower (here throttled 20x in the second run; under
    ``auto`` its share would shrink, and the masks of the samples that moved would change)."""
    base = ["workload.name=tests.support.user_workload:DropoutDigits", "training.steps=30", "scaling.min_workers=2",
            "optim.lr=3e-3", "scaling.balance=off"]
    first = train(job(*base, name="drop1"), run_dir=tmp_path / "drop1")
    second = train(job(*base, "faults=[{action: throttle, rank: 1, step: 1, factor: 20.0}]", name="drop2"),
                   run_dir=tmp_path / "drop2")
    killed = train(job(*base, "faults=[{action: kill, rank: 1, step: 15}]", name="drop3"), run_dir=tmp_path / "drop3")
    other_seed = train(job(*base, "training.seed=1", name="drop4"), run_dir=tmp_path / "drop4")
    assert [e.type for e in killed.events].count("worker_failed") == 1
    assert {tuple(row["shares"]) for run in (first, second) for row in run.history} == {(24, 24)}
    assert_states_close(load_model(tmp_path / "drop1"), load_model(tmp_path / "drop2"), rtol=0, atol=0)
    assert_states_close(load_model(tmp_path / "drop1"), load_model(tmp_path / "drop3"))
    assert [r["loss"] for r in first.history] == [r["loss"] for r in second.history]
    assert [r["loss"] for r in other_seed.history] != [r["loss"] for r in first.history]

    assert main(["plot", str(tmp_path / "drop3")]) == 0  # the run's losses with its failure marked
    assert (tmp_path / "drop3" / "losses.png").stat().st_size > 10_000
    assert main(["plot", str(tmp_path / "no-such-run")]) == 2
