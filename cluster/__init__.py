"""How a job reaches Ray: configuration, connection, the driver-side run and the CLI."""

from cluster.config import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    FailureConfig,
    JobConfig,
    OptimConfig,
    ScalingConfig,
    StrategyConfig,
    TrackingConfig,
    TrainingConfig,
    WorkloadConfig,
)
from cluster.loading import load_job_config

__all__ = ["CheckpointConfig", "DataConfig", "EvalConfig", "FailureConfig", "JobConfig", "OptimConfig", "ScalingConfig",
           "StrategyConfig", "TrackingConfig", "TrainingConfig", "WorkloadConfig", "load_job_config", "train"]


def __getattr__(name: str):
    # Imported lazily: the actors import cluster.config, and cluster.job imports the actors.
    if name == "train":
        from cluster.job import train

        return train
    raise AttributeError(name)
