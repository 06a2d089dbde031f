"""``raylastic plot``'s figure from a result.json, drawn without Ray."""

from __future__ import annotations

import math
from pathlib import Path

from raylastic.cluster.plot_command import _smoothed, plot_losses


def test_a_run_with_skipped_non_finite_steps_plots_with_gaps(tmp_path: Path) -> None:
    """training.on_nonfinite=skip: result.json writes a skipped step's NaN loss (and a diverged evaluation's) as null,
    which the smoothing multiplied (TypeError) and the CLI printed as a traceback."""
    history = [{"step": s, "loss": None if s in (3, 7) else 1.0 / s, "world_size": 2, "skipped": s in (3, 7)}
               for s in range(1, 11)]
    result = {"name": "skips", "history": history, "events": [],
              "eval_history": [{"step": 5, "eval_loss": 0.5}, {"step": 10, "eval_loss": None}]}
    plot_losses(result, tmp_path / "losses.png")
    assert (tmp_path / "losses.png").stat().st_size > 0
    smoothed = _smoothed([None, 2.0, None, 4.0])
    assert math.isnan(smoothed[0]) and smoothed[1] == 2.0 and smoothed[2] == 2.0 and 2.0 < smoothed[3] < 4.0
