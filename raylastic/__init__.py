"""Raylastic: elastic, fault-tolerant distributed PyTorch training on Ray.

    from raylastic import JobConfig, TrainingConfig, train, sweep
    result = train(JobConfig(training=TrainingConfig(steps=50)))

The subpackages are the repository's top-level folders: ``raylastic.cluster`` (the driver, the CLI),
``raylastic.actors`` (the Controller and the workers), ``raylastic.strategies``, ``raylastic.tuning``,
``raylastic.workloads`` and ``raylastic.jobconfig``. Installed, they sit inside this package; run from a
checkout (``ray job submit --working-dir .``, ``python -m raylastic`` in the repository) they are found
beside it.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

_CHECKOUT = os.path.dirname(__path__[0])
if not os.path.isdir(os.path.join(__path__[0], "actors")) and os.path.isdir(os.path.join(_CHECKOUT, "actors")):
    __path__.append(_CHECKOUT)  # a checkout: the subpackages are the folders beside this one

_EXPORTS = {
    **dict.fromkeys(["CheckpointConfig", "DataConfig", "EvalConfig", "FailureConfig", "JobConfig", "LinkConfig",
                     "OptimConfig", "ScalingConfig", "StrategyConfig", "TrackingConfig", "TrainingConfig",
                     "WorkloadConfig", "load_job_config"], "raylastic.jobconfig"),
    "train": "raylastic.cluster.job", "job_runtime_env": "raylastic.cluster.connect",
    **dict.fromkeys(["RunResult", "RunFailed"], "raylastic.actors.status.run"),
    **dict.fromkeys(["sweep", "SweepResult", "SearchSpace"], "raylastic.tuning"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # Imported on first use: the CLI imports this package for every command, and torch, Ray and the actors take
    # seconds to import, which only a running job should pay.
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raylastic' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
