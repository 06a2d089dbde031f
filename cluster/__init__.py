"""How a job reaches Ray: connection, the driver-side run and the CLI (the configuration is ``jobconfig``).

Example::

    from raylastic.cluster import JobConfig, TrainingConfig, train
    result = train(JobConfig(training=TrainingConfig(steps=50)))
"""

from typing import Any

from raylastic.jobconfig import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    FailureConfig,
    JobConfig,
    LinkConfig,
    OptimConfig,
    ScalingConfig,
    StrategyConfig,
    TrackingConfig,
    TrainingConfig,
    WorkloadConfig,
    load_job_config,
)

__all__ = ["CheckpointConfig", "DataConfig", "EvalConfig", "FailureConfig", "JobConfig", "LinkConfig", "OptimConfig",
           "ScalingConfig", "StrategyConfig", "TrackingConfig", "TrainingConfig", "WorkloadConfig", "load_job_config",
           "job_runtime_env", "train"]


def __getattr__(name: str) -> Any:
    # train is imported on first use: `raylastic` imports cluster.cli for every command, and torch, Ray
    # and the actors take seconds to import, which only a running job should pay.
    if name == "train":
        from raylastic.cluster.job import train

        return train
    if name == "job_runtime_env":
        from raylastic.cluster.connect import job_runtime_env

        return job_runtime_env
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
