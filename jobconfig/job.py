"""JobConfig: the sections of a job nested in one frozen dataclass, and the checks that span sections."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from raylastic.jobconfig.checks import is_number, require
from raylastic.jobconfig.link import LinkConfig
from raylastic.jobconfig.naming import RUN_NAME_CHARACTERS, is_run_name
from raylastic.jobconfig.outputs import CheckpointConfig, TrackingConfig
from raylastic.jobconfig.parallel import ParallelConfig
from raylastic.jobconfig.scaling import FailureConfig, FaultConfig, ScalingConfig
from raylastic.jobconfig.strategy import StrategyConfig
from raylastic.jobconfig.training import DataConfig, EvalConfig, OptimConfig, TrainingConfig, WorkloadConfig

MODEL_PARALLEL_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
"""The strategies that apply over the data-parallel ranks of a model-parallel run (all through FSDP2)."""


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    name: str = "digits"
    """The run's name: its default run directory is runs/<name>, its actors are named after it."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Model parallelism (tensor parallel); ``strategy`` applies over the data-parallel ranks left."""
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    link: LinkConfig = field(default_factory=LinkConfig)
    """An emulated slow link between the workers (tests and demos); off by default."""
    faults: tuple[FaultConfig, ...] = ()
    """Faults to inject (tests and demos); empty for real runs."""

    def __post_init__(self) -> None:
        require(is_run_name(self.name), "name", RUN_NAME_CHARACTERS, self.name)
        require(not (self.training.precision == "fp16" and self.strategy.name == "async_ps"), "training.precision",
                "fp32 or bf16 with strategy.name=async_ps (its workers push gradients without fp16's loss scaler)",
                self.training.precision)
        if self.strategy.offload and not self.scaling.use_gpu:
            raise ValueError("strategy.offload=true needs scaling.use_gpu=true: FSDP2's CPU offload moves parameters "
                             "between host and GPU memory; CPU workers hold them in host memory already")
        batch = self.training.global_batch_size
        if self.parallel.model_parallel > 1:
            self._check_model_parallel()
        elif batch < self.scaling.max_workers:
            raise ValueError(f"training.global_batch_size ({batch}) cannot be split across "
                             f"scaling.max_workers ({self.scaling.max_workers}): every worker needs at "
                             "least one sample per step")
        every, sync_every = self.checkpoint.every_steps, self.strategy.sync_every
        if self.strategy.name == "diloco" and every % sync_every:
            raise ValueError(f"checkpoint.every_steps ({every}) must be a multiple of strategy.sync_every "
                             f"({sync_every}) under diloco: only after an outer step do the workers hold the same "
                             f"parameters")
        if self.strategy.name == "async_ps":
            self._check_async_ps()
        for index, fault in enumerate(self.faults):  # a fault that can never fire would be ignored silently
            if fault.action == "kill_server":
                require(self.strategy.name == "async_ps", f"faults[{index}].action",
                        "kill_server only with strategy.name=async_ps", fault.action)
                require(fault.rank < self.strategy.num_servers, f"faults[{index}].rank",
                        f"below strategy.num_servers ({self.strategy.num_servers})", fault.rank)
            else:
                require(fault.rank < self.scaling.max_workers, f"faults[{index}].rank",
                        f"below scaling.max_workers ({self.scaling.max_workers})", fault.rank)
            require(fault.step <= self.training.steps, f"faults[{index}].step",
                    f"at most training.steps ({self.training.steps})", fault.step)
            require(fault.microbatch is None or (self.parallel.pp > 1
                                                 and fault.microbatch < self.parallel.microbatches),
                    f"faults[{index}].microbatch",
                    f"null without parallel.pp > 1, else below parallel.pp_microbatches ({self.parallel.microbatches})",
                    fault.microbatch)

    def _check_model_parallel(self) -> None:
        """What tensor and pipeline parallelism compose with (each refusal names the field and why)."""
        parallel, strategy, scaling, training = self.parallel, self.strategy, self.scaling, self.training
        when = "with parallel.tp or parallel.pp > 1"
        require(strategy.name in MODEL_PARALLEL_STRATEGIES, "strategy.name",
                f"{', '.join(MODEL_PARALLEL_STRATEGIES)} {when} (diloco and async_ps step each worker's whole "
                "model)", strategy.name)
        for name, value in (("compression", strategy.compression != "none"), ("hierarchical", strategy.hierarchical),
                            ("comm_timing", strategy.comm_timing)):
            require(not value, f"strategy.{name}", f"left at its default {when} (it is a hook of torch DDP; "
                    "under model parallelism FSDP2 reduces the gradients)", getattr(strategy, name))
        require(not training.compile, "training.compile", f"false {when} (not supported yet)", training.compile)
        unit = parallel.model_parallel
        require(scaling.max_workers % unit == 0, "scaling.max_workers",
                f"a multiple of parallel.tp x parallel.pp ({unit}): every copy of the model takes that many "
                "workers", scaling.max_workers)
        require(scaling.min_workers % unit == 0 or unit % scaling.min_workers == 0, "scaling.min_workers",
                f"a multiple or a divisor of parallel.tp x parallel.pp ({unit}): with fewer workers the model "
                "splits over a divisor of it", scaling.min_workers)
        batch, data_parallel = training.global_batch_size, scaling.max_workers // unit
        if batch < data_parallel:
            raise ValueError(f"training.global_batch_size ({batch}) cannot be split across the {data_parallel} "
                             f"data-parallel ranks of scaling.max_workers ({scaling.max_workers}) / parallel.tp x "
                             f"parallel.pp ({unit}): every data-parallel rank needs at least one sample per step")
        if parallel.pp > 1:
            require(not (strategy.name == "zero3" and parallel.pp_schedule == "zbv"), "strategy.name",
                    "ddp, zero1 or zero2 with parallel.pp_schedule=zbv (zero3 frees each stage's gathered parameters "
                    "after its forward, and ZBV's separate weight-gradient pass of the last stage then loses its "
                    "gradients; 1f1b and interleaved_1f1b take zero3)", strategy.name)
            require(training.micro_batch_size is None, "training.micro_batch_size",
                    "null with parallel.pp > 1 (a pipeline's micro-batches are parallel.pp_microbatches)",
                    training.micro_batch_size)
            share = data_parallel * parallel.microbatches
            require(batch % share == 0, "training.global_batch_size",
                    f"a multiple of {share} with parallel.pp > 1: each of the {data_parallel} data-parallel ranks "
                    f"cuts its share into parallel.pp_microbatches ({parallel.microbatches}) equal micro-batches",
                    batch)

    @property
    def balances_shares(self) -> bool:
        """Whether each step's batch shares follow the ranks' speeds (scaling.balance=auto; not under model
        parallelism, whose data-parallel ranks take even shares)."""
        return self.scaling.balance == "auto" and self.parallel.model_parallel == 1

    @property
    def replicated(self) -> bool:
        """Whether every worker holds the whole model and optimizer state (a survivor can hand it over)."""
        return self.strategy.replicated and self.parallel.model_parallel == 1

    def _check_async_ps(self) -> None:
        """What asynchronous training does not do (each names the field to change)."""
        unsupported = {"scaling.spare_workers": self.scaling.spare_workers != 0,
                       "training.compile": self.training.compile,
                       "training.activation_checkpointing": self.training.activation_checkpointing != "none",
                       "training.profile_steps": self.training.profile_steps != 0}
        for name, set_ in unsupported.items():
            if set_:
                raise ValueError(f"{name} is not supported with strategy.name=async_ps; leave it at its default")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def math_hash(self) -> str:
        """A hash of what decides the trained parameters; a checkpoint resumes only a run with the same."""
        optim = {k: float(v) if is_number(v) else v for k, v in asdict(self.optim).items()}  # 1 == 1.0
        relevant = {"workload": asdict(self.workload), "optim": optim,
                    "global_batch_size": self.training.global_batch_size, "seed": self.training.seed}
        if self.optim.schedule != "constant":  # a decaying schedule's length is part of its math
            relevant["steps"] = self.training.steps
        if self.strategy.name == "diloco":  # other updates altogether: its checkpoints resume only diloco runs
            strategy = self.strategy
            relevant["diloco"] = [strategy.sync_every, float(strategy.outer_lr), float(strategy.outer_momentum)]
            if strategy.sync_warmup_steps:  # appended only when set: older diloco checkpoints keep their hash
                relevant["diloco"].append(strategy.sync_warmup_steps)
        if self.strategy.name == "async_ps":  # applied as they come: its checkpoints resume only async_ps runs
            relevant["async_ps"] = True
        return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]
