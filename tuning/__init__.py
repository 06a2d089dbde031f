"""Ray Tune + Optuna sweeps over Raylastic jobs: each trial is a whole elastic job.

Example::

    from raylastic import JobConfig, sweep
    result = sweep(JobConfig(), {"optim.lr": {"loguniform": [1e-4, 1e-1]}}, num_samples=8,
                   metric="accuracy", mode="max", name="digits-lr")
    result.dataframe, result.best_config, result.plots("plots")

Names are imported on first use: ``raylastic`` imports ``tuning.cli`` for every command, and
Ray Tune, torch, pandas and matplotlib should load only when a sweep does.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    **dict.fromkeys(["sweep", "EarlyStopping"], "raylastic.tuning.tuner"), "SweepResult": "raylastic.tuning.report",
    **dict.fromkeys(["SearchSpace", "DEFAULT_SEARCH_SPACE", "LogUniform", "Uniform", "IntRange", "Choice",
                     "tunable_keys"], "raylastic.tuning.search_space"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tuning' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
