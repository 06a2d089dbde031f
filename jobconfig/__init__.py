"""The job's configuration: one frozen, keyword-only dataclass per concern, nested in JobConfig.

A leaf package: it imports nothing from the rest of Raylastic, so the CLI, the actors, the strategies
and the sweeps all read the same definitions. Every field is checked in ``__post_init__``; a bad value
raises ValueError naming the field (as ``section.field``) and what is allowed, before any actor starts.
Names follow Ray Train's where the meaning is the same (``ScalingConfig.min_workers``,
``FailureConfig.max_failures``). ``jobconfig.naming`` names a run's actors in Ray.

Example::

    job = JobConfig(training=TrainingConfig(steps=50, global_batch_size=128),
                    scaling=ScalingConfig(min_workers=2, max_workers=2))
    job = load_job_config("job.yaml", ["training.steps=50", "optim.lr=3e-3"])   # YAML + --set overrides
"""

from raylastic.jobconfig.job import JobConfig
from raylastic.jobconfig.link import LinkConfig
from raylastic.jobconfig.loading import job_config_from_dict, load_job_config
from raylastic.jobconfig.outputs import CheckpointConfig, TrackingConfig
from raylastic.jobconfig.parallel import ParallelConfig
from raylastic.jobconfig.scaling import FAULT_ACTIONS, FailureConfig, FaultConfig, ScalingConfig
from raylastic.jobconfig.strategy import COMPRESSIONS, STRATEGIES, StrategyConfig
from raylastic.jobconfig.training import (
    OPTIMIZERS,
    PRECISIONS,
    SCHEDULES,
    DataConfig,
    EvalConfig,
    OptimConfig,
    TrainingConfig,
    WorkloadConfig,
)

__all__ = ["COMPRESSIONS", "FAULT_ACTIONS", "OPTIMIZERS", "PRECISIONS", "SCHEDULES", "STRATEGIES", "CheckpointConfig",
           "DataConfig", "EvalConfig", "FailureConfig", "FaultConfig", "JobConfig", "LinkConfig", "OptimConfig",
           "ParallelConfig", "ScalingConfig", "StrategyConfig", "TrackingConfig", "TrainingConfig", "WorkloadConfig",
           "job_config_from_dict", "load_job_config"]
