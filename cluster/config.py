"""The job's configuration: one frozen, keyword-only dataclass per concern, nested in JobConfig.

Every field is checked in ``__post_init__``; a bad value raises ValueError naming the field
(as ``section.field``) and what is allowed, before any actor starts. Names follow Ray
Train's where the meaning is the same (``ScalingConfig.min_workers``, ``FailureConfig.max_failures``).

Example::

    job = JobConfig(training=TrainingConfig(steps=50, global_batch_size=128),
                    scaling=ScalingConfig(min_workers=2, max_workers=2))
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("constant", "linear", "cosine")
FAULT_ACTIONS = ("kill", "ray_kill", "stall", "raise", "remove_node")
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "topk", "onebit", "int8")
PRECISIONS = ("fp32", "bf16", "fp16")
A_DAY_S = 86_400.0
"""Upper bound of every timeout: a longer one is a typo (or a unit mix-up), and a run would hang for it."""


def _require(condition: bool, field_name: str, allowed: str, value: Any) -> None:
    if not condition:
        raise ValueError(f"{field_name} must be {allowed}, got {value!r}")


def _positive_int(value: Any) -> bool:
    return _non_negative_int(value) and value > 0


def _non_negative_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _require_seconds(value: Any, field_name: str, low: float) -> None:
    _require(_number(value) and low <= value <= A_DAY_S, field_name,
             f"a number of seconds in [{low:g}, {A_DAY_S:g}] (a day)", value)


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    name: str = "digits"
    """A built-in workload ("digits", "chargpt") or a user's class as "pkg.module:ClassName"."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the workload's constructor (e.g. {"n_layer": 4} for chargpt)."""

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and bool(self.name), "workload.name", "a non-empty string",
                 self.name)
        _require(isinstance(self.options, dict), "workload.options", "a mapping", self.options)


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    steps: int = 300
    """Optimizer steps to run; the run ends at this step whatever failures happen on the way."""
    global_batch_size: int = 64
    """Samples per step across all workers (B); fixed for the whole run, whatever the world size."""
    micro_batch_size: int | None = None
    """Largest slice one forward/backward handles; a rank's slice is accumulated in micro-batches of
    this size. None: the whole slice at once."""
    seed: int = 0
    """Seeds the model's initialisation and the per-epoch sample permutation."""
    record_samples: bool = False
    """Record which samples every step consumed, each time a generation committed it: result.json's "ledger",
    ``{step: [{"generation", "samples", "kept"}, ...]}`` (kept: part of the final state; see RunLog.ledger)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """bf16: autocast on CPU and GPU; fp16: autocast with dynamic loss scaling, GPU only."""
    compile: bool = False
    """torch.compile the model (kernel fusion); the first step then includes the compile time."""
    profile_steps: int = 0
    """Trace this many steps (from step 3) with the torch profiler on rank 0, for TensorBoard."""
    on_nonfinite: Literal["fail", "skip"] = "fail"
    """A step whose loss or gradient norm is inf/NaN: "fail" ends the run with an error naming the step;
    "skip" discards the step's update on every rank (the step still counts) and marks its row skipped."""

    def __post_init__(self) -> None:
        _require(_positive_int(self.steps), "training.steps", "a positive integer", self.steps)
        _require(_positive_int(self.global_batch_size), "training.global_batch_size", "a positive integer",
                 self.global_batch_size)
        _require(self.micro_batch_size is None or _positive_int(self.micro_batch_size),
                 "training.micro_batch_size", "a positive integer or null", self.micro_batch_size)
        _require(_non_negative_int(self.seed) and self.seed < 2**32, "training.seed", "an integer in [0, 2**32)",
                 self.seed)
        _require(isinstance(self.record_samples, bool), "training.record_samples", "true or false",
                 self.record_samples)
        _require(self.precision in PRECISIONS, "training.precision", f"one of {', '.join(PRECISIONS)}",
                 self.precision)
        _require(isinstance(self.compile, bool), "training.compile", "true or false", self.compile)
        _require(_non_negative_int(self.profile_steps), "training.profile_steps", "a non-negative integer",
                 self.profile_steps)
        _require(self.on_nonfinite in ("fail", "skip"), "training.on_nonfinite", "one of fail, skip",
                 self.on_nonfinite)


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer when the workload has no ``configure_optimizer``: "adamw" (torch.optim.AdamW) or "sgd"
    (with momentum)."""
    lr: float = 1e-3
    """Peak learning rate. It sets every param group's lr, also of a workload's own optimizer (a group's
    ``lr_scale``, default 1, multiplies it)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (adamw) or L2 penalty (sgd)."""
    momentum: float = 0.9
    """Momentum for sgd; ignored by adamw."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """How lr decays after the warm-up, to ``min_lr`` at the last step: constant, linear or cosine."""
    warmup_steps: int = 0
    """Steps of linear warm-up from lr/warmup_steps to lr."""
    min_lr: float = 0.0
    """The learning rate linear and cosine decay reach at training.steps."""
    clip_grad_norm: float = 0.0
    """Clip the global gradient norm (over all parameters, all ranks) to this; 0: no clipping. The norm
    before clipping is the history's grad_norm either way."""

    def __post_init__(self) -> None:
        _require(self.name in OPTIMIZERS, "optim.name", f"one of {', '.join(OPTIMIZERS)}", self.name)
        _require(_number(self.lr) and 0 < self.lr <= 10, "optim.lr", "a number in (0, 10]", self.lr)
        _require(_number(self.weight_decay) and self.weight_decay >= 0, "optim.weight_decay",
                 "a non-negative number", self.weight_decay)
        _require(_number(self.momentum) and 0 <= self.momentum < 1, "optim.momentum", "a number in [0, 1)",
                 self.momentum)
        _require(self.schedule in SCHEDULES, "optim.schedule", f"one of {', '.join(SCHEDULES)}", self.schedule)
        _require(_non_negative_int(self.warmup_steps), "optim.warmup_steps", "a non-negative integer",
                 self.warmup_steps)
        _require(_number(self.min_lr) and 0 <= self.min_lr <= self.lr, "optim.min_lr",
                 f"a number in [0, optim.lr={self.lr}]", self.min_lr)
        _require(_number(self.clip_grad_norm) and self.clip_grad_norm >= 0, "optim.clip_grad_norm",
                 "a non-negative number (0: no clipping)", self.clip_grad_norm)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    num_workers: int = 0
    """DataLoader worker processes per training worker that fetch and collate the coming steps' batches
    (0: on the training thread, the fastest for data already in memory)."""
    prefetch_factor: int = 2
    """Batches each DataLoader worker process prepares ahead (with num_workers > 0)."""

    def __post_init__(self) -> None:
        _require(_non_negative_int(self.num_workers), "data.num_workers", "a non-negative integer", self.num_workers)
        _require(_positive_int(self.prefetch_factor), "data.prefetch_factor", "a positive integer",
                 self.prefetch_factor)


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    every_steps: int = 0
    """Evaluate every this many steps during training (0: only at the end); the metrics become the
    history's eval rows."""
    batch_size: int = 64
    """Samples per forward pass of the distributed evaluation over ``eval_dataset`` (per rank)."""

    def __post_init__(self) -> None:
        _require(_non_negative_int(self.every_steps), "eval.every_steps", "a non-negative integer",
                 self.every_steps)
        _require(_positive_int(self.batch_size), "eval.batch_size", "a positive integer", self.batch_size)


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    mlflow_uri: str | None = None
    """MLflow tracking URI (a local directory such as ``mlruns``, ``file:///...`` or ``http://host:5000``);
    None: no MLflow logging. Needs ``pip install 'raylastic[mlflow]'``."""
    mlflow_experiment: str = "raylastic"
    """The MLflow experiment the run is logged under (created if missing)."""

    def __post_init__(self) -> None:
        _require(self.mlflow_uri is None or (isinstance(self.mlflow_uri, str) and bool(self.mlflow_uri)),
                 "tracking.mlflow_uri", "a tracking URI or null", self.mlflow_uri)
        _require(isinstance(self.mlflow_experiment, str) and bool(self.mlflow_experiment),
                 "tracking.mlflow_experiment", "a non-empty string", self.mlflow_experiment)


@dataclass(frozen=True, kw_only=True)
class StrategyConfig:
    name: Literal["ddp", "zero1", "zero2", "zero3"] = "ddp"
    """ddp: replicated state; zero1: optimizer state sharded; zero2: + gradients (FSDP2, parameters
    kept gathered from forward to backward); zero3: + parameters (FSDP2, resharded after forward)."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB, for ddp and zero1 (DDP's first bucket is 1 MiB whatever this says)."""
    offload: bool = False
    """zero2/zero3: keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2's
    CPUOffloadPolicy); meaningful on GPUs only."""
    compression: Literal["none", "fp16", "bf16", "powersgd", "topk", "onebit", "int8"] = "none"
    """ddp gradient compression (a DDP comm hook): 16-bit, PowerSGD, top-k or 1-bit with error
    feedback, or 8-bit with a per-bucket scale."""
    powersgd_rank: int = 4
    """PowerSGD's approximation rank."""
    powersgd_start_iter: int = 10
    """Uncompressed iterations before PowerSGD starts, per generation (>= 2)."""
    topk_fraction: float = 0.05
    """Fraction of each bucket's entries top-k sends, in (0, 1]. 5% (10x fewer bytes) trains digits to
    within a point of uncompressed accuracy in 600 AdamW steps; 1% (50x) lagged ~3 points
    (tests/test_communication.py)."""
    onebit_warmup_steps: int = 50
    """Full-precision steps before 1-bit compression starts (within a point of uncompressed accuracy on
    digits after 600 steps, tests/test_communication.py)."""
    hierarchical: bool = False
    """ddp: reduce inside each node, all-reduce among one leader per node, broadcast back (node
    membership from Ray's node ids, re-derived at every generation). Not combinable with compression."""
    comm_timing: bool = False
    """ddp: time every gradient bucket's communication (the history's comm_s and exposed_comm_s) with a
    Python hook on each bucket. Off, uncompressed DDP runs its own C++ all-reduce with no Python on the
    gradients' path (the hook's GIL hand-offs made a ~4 ms step ~20% slower on 2 CPU cores)."""

    def __post_init__(self) -> None:
        _require(self.name in STRATEGIES, "strategy.name", f"one of {', '.join(STRATEGIES)}", self.name)
        _require(_number(self.bucket_cap_mb) and self.bucket_cap_mb > 0, "strategy.bucket_cap_mb",
                 "a positive number of MiB", self.bucket_cap_mb)
        _require(isinstance(self.offload, bool), "strategy.offload", "true or false", self.offload)
        _require(self.compression in COMPRESSIONS, "strategy.compression", f"one of {', '.join(COMPRESSIONS)}",
                 self.compression)
        _require(isinstance(self.hierarchical, bool), "strategy.hierarchical", "true or false", self.hierarchical)
        _require(isinstance(self.comm_timing, bool), "strategy.comm_timing", "true or false", self.comm_timing)
        for name, value in (("compression", self.compression != "none"), ("hierarchical", self.hierarchical),
                            ("comm_timing", self.comm_timing)):
            if value and self.name != "ddp":
                raise ValueError(f"strategy.{name} works with strategy.name=ddp only, got {self.name!r}")
        if self.hierarchical and self.compression != "none":
            raise ValueError("strategy.hierarchical and strategy.compression cannot be combined (DDP takes one "
                             f"communication hook), got compression={self.compression!r}")
        _require(_positive_int(self.powersgd_rank), "strategy.powersgd_rank", "a positive integer", self.powersgd_rank)
        _require(_non_negative_int(self.powersgd_start_iter) and self.powersgd_start_iter >= 2,
                 "strategy.powersgd_start_iter", "an integer >= 2", self.powersgd_start_iter)
        _require(_number(self.topk_fraction) and 0 < self.topk_fraction <= 1, "strategy.topk_fraction",
                 "a number in (0, 1]", self.topk_fraction)
        _require(_non_negative_int(self.onebit_warmup_steps), "strategy.onebit_warmup_steps",
                 "a non-negative integer", self.onebit_warmup_steps)
        if self.offload and self.name not in ("zero2", "zero3"):
            raise ValueError(f"strategy.offload needs strategy.name zero2 or zero3, got {self.name!r}")


@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    min_workers: int = 2
    """The run starts once this many workers are placed."""
    max_workers: int = 2
    """The run never uses more workers than this."""
    use_gpu: bool = False
    """One GPU per worker, NCCL between them; otherwise CPU workers on gloo."""
    cpus_per_worker: float = 1.0
    """Ray CPUs reserved per worker (fractions allowed); torch uses max(1, floor) threads."""
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    """Further Ray resources each worker reserves, e.g. {"worker_slot": 1} or {"accelerator_type:A100": 0.01}.
    Not CPU or GPU: those are cpus_per_worker and use_gpu (Ray takes them apart from custom resources)."""
    placement_timeout_s: float = 120.0
    """How long to wait for min_workers to be placed, at the start and after failures, before failing; in
    [10 s, a day]. Waiting after a failure includes starting the replacement (a process importing torch
    and building the model: seconds), so a shorter wait would fail recoveries that had the resources."""

    def __post_init__(self) -> None:
        _require(_positive_int(self.min_workers), "scaling.min_workers", "a positive integer",
                 self.min_workers)
        _require(_positive_int(self.max_workers), "scaling.max_workers", "a positive integer",
                 self.max_workers)
        if self.min_workers > self.max_workers:
            raise ValueError(f"scaling.min_workers ({self.min_workers}) must be <= scaling.max_workers "
                             f"({self.max_workers})")
        _require(isinstance(self.use_gpu, bool), "scaling.use_gpu", "true or false", self.use_gpu)
        _require(_number(self.cpus_per_worker) and self.cpus_per_worker > 0, "scaling.cpus_per_worker",
                 "a positive number", self.cpus_per_worker)
        _require(isinstance(self.resources_per_worker, dict) and all(
            isinstance(k, str) and _number(v) and v > 0 for k, v in self.resources_per_worker.items()),
            "scaling.resources_per_worker", "a mapping of resource name to a positive amount",
            self.resources_per_worker)
        for name, instead in (("CPU", "scaling.cpus_per_worker"), ("GPU", "scaling.use_gpu")):
            if name in self.resources_per_worker:
                raise ValueError(f"scaling.resources_per_worker cannot reserve {name}: use {instead} instead, got "
                                 f"{self.resources_per_worker!r}")
        _require_seconds(self.placement_timeout_s, "scaling.placement_timeout_s", low=10)


@dataclass(frozen=True, kw_only=True)
class FailureConfig:
    max_failures: int = 3
    """Failures the run survives; one more ends it with an error (0: fail on the first). Workers lost
    together (a node with several, heard within one generation) count as one failure."""
    collective_timeout_s: float = 30.0
    """Timeout of collective operations, so a silent peer cannot block a group for long; in [1 s, a day].
    Forming a group and its first collectives take ~0.35 s on an idle machine: below a second a busy one
    would time out healthy groups."""
    step_timeout_s: float = 10.0
    """A worker that does not answer the Controller for this long is taken as hung and replaced; in [1 s, a
    day]. Polls go out every min(1 s, step_timeout_s / 4): below a second, Ray's latency on a busy machine
    would make healthy workers look hung."""
    max_step_s: float = 600.0
    """A worker whose step runs this long is taken as hung and replaced (a rank that lags its peers is
    caught sooner, when their collectives time out); raise it for steps that legitimately take longer. In
    [1 s, a day], as the other timeouts."""

    def __post_init__(self) -> None:
        _require(_non_negative_int(self.max_failures), "failure.max_failures",
                 "a non-negative integer", self.max_failures)
        _require_seconds(self.collective_timeout_s, "failure.collective_timeout_s", low=1)
        _require_seconds(self.step_timeout_s, "failure.step_timeout_s", low=1)
        _require_seconds(self.max_step_s, "failure.max_step_s", low=1)


@dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """A fault to inject, for tests and demos: ``{action: kill, rank: 1, step: 30}``; every field is required."""

    ALLOWED: ClassVar[dict[str, str]] = {"action": f"one of {', '.join(FAULT_ACTIONS)}",
                                         "rank": "a non-negative integer", "step": "a positive integer"}
    """What each field takes, for the error that names a wrong or missing one."""
    action: Literal["kill", "ray_kill", "stall", "raise", "remove_node"]
    """kill: the worker SIGKILLs itself; ray_kill: the Controller ray.kill()s it; stall: it SIGSTOPs
    itself (a hung worker); raise: its step raises; remove_node: its node's raylet is killed (the
    whole node leaves; refused on the head node)."""
    rank: int
    """The rank, in the generation running at that step, that the fault hits."""
    step: int
    """The fault hits while this step (1-based) is in flight; it fires once per run."""

    def __post_init__(self) -> None:
        _require(self.action in FAULT_ACTIONS, "faults[].action", self.ALLOWED["action"], self.action)
        _require(_non_negative_int(self.rank), "faults[].rank", self.ALLOWED["rank"], self.rank)
        _require(_positive_int(self.step), "faults[].step", self.ALLOWED["step"], self.step)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    path: str | None = None
    """Directory or fsspec URL for checkpoints; None: <run dir>/checkpoints."""
    every_steps: int = 0
    """Save every this many steps (0: only at the end of the run)."""
    num_to_keep: int = 2
    """Complete checkpoints kept; older ones are removed after a newer one is complete."""
    resume: Literal["auto", "never"] = "auto"
    """"auto": continue from the newest complete checkpoint of this run if there is one."""
    async_save: bool = False
    """Write checkpoints in the background while the next steps train (a side process group)."""

    def __post_init__(self) -> None:
        _require(self.path is None or (isinstance(self.path, str) and bool(self.path)), "checkpoint.path",
                 "a directory path or null", self.path)
        _require(_non_negative_int(self.every_steps), "checkpoint.every_steps",
                 "a non-negative integer", self.every_steps)
        _require(_positive_int(self.num_to_keep), "checkpoint.num_to_keep", "a positive integer",
                 self.num_to_keep)
        _require(self.resume in ("auto", "never"), "checkpoint.resume", "one of auto, never", self.resume)
        _require(isinstance(self.async_save, bool), "checkpoint.async_save", "true or false", self.async_save)


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
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    faults: tuple[FaultConfig, ...] = ()
    """Faults to inject (tests and demos); empty for real runs."""

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and self.name.replace("-", "").replace("_", "").isalnum(),
                 "name", "letters, digits, '-' and '_'", self.name)
        if self.training.precision == "fp16" and not self.scaling.use_gpu:
            raise ValueError("training.precision=fp16 needs scaling.use_gpu=true: fp16 with dynamic loss scaling "
                             "is for GPUs; on CPUs use training.precision=bf16")
        if self.training.precision == "fp16" and self.strategy.name != "ddp":
            raise ValueError(f"training.precision=fp16 works with strategy.name=ddp only (its loss scaler checks "
                             f"whole gradients), got {self.strategy.name!r}; use bf16")
        batch = self.training.global_batch_size
        if batch < self.scaling.max_workers:
            raise ValueError(f"training.global_batch_size ({batch}) cannot be split across "
                             f"scaling.max_workers ({self.scaling.max_workers}): every worker needs at "
                             "least one sample per step")
        for index, fault in enumerate(self.faults):  # a fault that can never fire would be ignored silently
            _require(fault.rank < self.scaling.max_workers, f"faults[{index}].rank",
                     f"below scaling.max_workers ({self.scaling.max_workers})", fault.rank)
            _require(fault.step <= self.training.steps, f"faults[{index}].step",
                     f"at most training.steps ({self.training.steps})", fault.step)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def math_hash(self) -> str:
        """A hash of what decides the trained parameters; a checkpoint resumes only a run with the same."""
        optim = {k: float(v) if _number(v) else v for k, v in asdict(self.optim).items()}  # 1 == 1.0
        relevant = {"workload": asdict(self.workload), "optim": optim,
                    "global_batch_size": self.training.global_batch_size, "seed": self.training.seed}
        if self.optim.schedule != "constant":  # a decaying schedule's length is part of its math
            relevant["steps"] = self.training.steps
        return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]
