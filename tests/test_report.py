"""A sweep's results table, best config and plots, from Tune-like results (no Ray)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from raylastic.jobconfig import JobConfig
from raylastic.tuning.report import SweepResult
from raylastic.tuning.search_space import DEFAULT_SEARCH_SPACE


def tune_result(trial_id: str, started: float, config: dict | None, error: Exception | None = None, **metrics):
    if metrics:
        metrics = {"timestamp": started + metrics.get("time_total_s", 0.0), **metrics}
    return SimpleNamespace(path=f"/sweeps/s/trial_{trial_id}", config=config, error=error, metrics=metrics)


def config(lr: float, batch: int, bucket: int) -> dict:
    return {"optim.lr": lr, "training.global_batch_size": batch, "strategy.bucket_cap_mb": bucket}


GRID = [
    tune_result("c", 30.0, config(3e-3, 128, 5), final_step=60, loss=0.2, accuracy=0.95, completed=True, done=True,
                time_total_s=9.0, failures=1),
    tune_result("a", 10.0, config(1e-5, 32, 1), final_step=60, loss=2.3, accuracy=0.1, completed=True, done=True,
                time_total_s=8.0, failures=0),
    tune_result("b", 20.0, config(2e-5, 64, 25), step=15, loss=2.29, accuracy=None, completed=False, done=True,
                time_total_s=3.0),
    tune_result("d", 40.0, None, error=RuntimeError("run failed")),
    tune_result("e", 50.0, config(1e-2, 32, 5), step=3, loss=1.9, completed=False, done=False, time_total_s=1.0),
]


@pytest.fixture
def result() -> SweepResult:
    return SweepResult.from_result_grid(GRID, space=DEFAULT_SEARCH_SPACE, base_job=JobConfig(), metric="accuracy",
                                        mode="max", path=Path("/sweeps/s"), num_samples=5)


def test_one_row_per_trial_in_start_order_with_status(result):
    frame = result.dataframe
    assert list(frame["trial_id"]) == ["a", "b", "c", "e", "d"]  # d never reported: last
    assert list(frame["trial"]) == [0, 1, 2, 3, 4]
    assert list(frame["status"]) == ["completed", "early_stopped", "completed", "unfinished", "error"]
    assert list(frame["steps"]) == [60, 15, 60, 3, 0] and list(frame["failures"]) == [0, 0, 1, 0, 0]
    assert frame.loc[1, "accuracy"] != frame.loc[1, "accuracy"]  # NaN: stopped trials have no objective
    assert str(frame["training.global_batch_size"].dtype) == "Int64"
    assert frame.loc[0, "run_dir"] == "/sweeps/s/jobs/a"
    assert result.interrupted  # e is unfinished


def test_best_config_is_a_job_with_the_best_values(result):
    best = result.best_config
    assert (best.name, best.optim.lr, best.training.global_batch_size, best.strategy.bucket_cap_mb) == (
        "s-best", 3e-3, 128, 5.0)
    assert type(best.training.global_batch_size) is int
    assert "best accuracy 0.9500 (trial 2" in result.summary()


def test_minimizing_ranks_the_other_way():
    low = SweepResult.from_result_grid(GRID, space=DEFAULT_SEARCH_SPACE, base_job=JobConfig(), metric="loss",
                                       mode="min", path=Path("/sweeps/s"), num_samples=5)
    assert low.best["trial_id"] == "c"


def test_no_completed_trial_is_a_clear_error():
    none = SweepResult.from_result_grid(GRID[2:], space=DEFAULT_SEARCH_SPACE, base_job=JobConfig(),
                                        metric="accuracy", mode="max", path=Path("/sweeps/s"), num_samples=3)
    with pytest.raises(ValueError, match="no trial of sweep 's' completed with a 'accuracy' value"):
        _ = none.best_config


def test_plots_are_written_and_shown_inline(result, tmp_path):
    paths = result.plots(tmp_path)
    assert [p.name for p in paths] == ["accuracy_vs_optim.lr.png", "accuracy_vs_training.global_batch_size.png",
                                       "accuracy_vs_strategy.bucket_cap_mb.png", "optimization_history.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    page = result._repr_html_()
    assert page.count("<img") == 4 and "<table" in page and "run_dir" not in page
