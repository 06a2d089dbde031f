"""What is trained and how: the workload, the step loop, the optimizer recipe, data loading, evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from raylastic.jobconfig.checks import is_non_negative_int, is_number, is_positive_int, one_of, require

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
OnNonfinite = Literal["fail", "skip"]
ActivationCheckpointing = Literal["none", "full", "selective"]
ACTIVATION_CHECKPOINTING: tuple[str, ...] = get_args(ActivationCheckpointing)
OptimizerName = Literal["adamw", "sgd"]
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)
Schedule = Literal["constant", "linear", "cosine"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    name: str = "digits"
    """A built-in workload ("digits", "chargpt") or a user's class as "pkg.module:ClassName"."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the workload's constructor (e.g. {"n_layer": 4} for chargpt)."""

    def __post_init__(self) -> None:
        require(isinstance(self.name, str) and bool(self.name), "workload.name", "a non-empty string", self.name)
        require(isinstance(self.options, dict), "workload.options", "a mapping", self.options)


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
    precision: Precision = "fp32"
    """bf16: autocast on CPU and GPU; fp16: autocast with dynamic loss scaling (strategies/loss_scaling.py), CPU and
    GPU, every strategy but async_ps."""
    compile: bool = False
    """torch.compile the model (kernel fusion); the first step then includes the compile time."""
    activation_checkpointing: ActivationCheckpointing = "none"
    """Recompute activations in backward instead of keeping them, block by block (the model's repeated blocks):
    "full" keeps only each block's input; "selective" keeps the outputs of its matmuls and attention and
    recomputes the cheap operations between them. Less memory for more compute; the math is unchanged."""
    profile_steps: int = 0
    """Trace this many steps (from step 3) with the torch profiler on rank 0, for TensorBoard."""
    on_nonfinite: OnNonfinite = "fail"
    """A step whose loss or gradient norm is inf/NaN: "fail" ends the run with an error naming the step;
    "skip" discards the step's update on every rank (the step still counts) and marks its row skipped."""
    log_every_steps: int = 100
    """The most steps between two reads of the steps' losses and gradient norms from the device. Between reads a
    step makes no host synchronisation (on a GPU the next steps' kernels queue behind it); each read takes every
    step since the last one in one transfer, so the history keeps a row per step. Reads also come at every stop
    vote (about every 50 ms, actors/worker/stop_vote.py), save, evaluation and the last step, and every step with
    record_samples; the Controller takes results once a second. An inf/NaN step under on_nonfinite=fail fails the
    run at the next read, naming the step, before any save. 1: read every step."""

    def __post_init__(self) -> None:
        require(is_positive_int(self.steps), "training.steps", "a positive integer", self.steps)
        require(is_positive_int(self.global_batch_size), "training.global_batch_size", "a positive integer",
                self.global_batch_size)
        require(self.micro_batch_size is None or is_positive_int(self.micro_batch_size),
                "training.micro_batch_size", "a positive integer or null", self.micro_batch_size)
        require(is_non_negative_int(self.seed) and self.seed < 2**32, "training.seed", "an integer in [0, 2**32)",
                self.seed)
        require(isinstance(self.record_samples, bool), "training.record_samples", "true or false",
                self.record_samples)
        require(self.precision in PRECISIONS, "training.precision", one_of(PRECISIONS), self.precision)
        require(isinstance(self.compile, bool), "training.compile", "true or false", self.compile)
        require(self.activation_checkpointing in ACTIVATION_CHECKPOINTING, "training.activation_checkpointing",
                one_of(ACTIVATION_CHECKPOINTING), self.activation_checkpointing)
        require(is_non_negative_int(self.profile_steps), "training.profile_steps", "a non-negative integer",
                self.profile_steps)
        require(is_positive_int(self.log_every_steps), "training.log_every_steps", "a positive integer",
                self.log_every_steps)
        require(self.on_nonfinite in get_args(OnNonfinite), "training.on_nonfinite", one_of(get_args(OnNonfinite)),
                self.on_nonfinite)


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    name: OptimizerName = "adamw"
    """Optimizer when the workload has no ``configure_optimizer``: "adamw" (torch.optim.AdamW) or "sgd"
    (with momentum)."""
    lr: float = 1e-3
    """Peak learning rate. It sets every param group's lr, also of a workload's own optimizer (a group's
    ``lr_scale``, default 1, multiplies it)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (adamw) or L2 penalty (sgd)."""
    momentum: float = 0.9
    """Momentum for sgd; ignored by adamw."""
    schedule: Schedule = "constant"
    """How lr decays after the warm-up, to ``min_lr`` at the last step: constant, linear or cosine."""
    warmup_steps: int = 0
    """Steps of linear warm-up from lr/warmup_steps to lr."""
    min_lr: float = 0.0
    """The learning rate linear and cosine decay reach at training.steps."""
    clip_grad_norm: float = 0.0
    """Clip the global gradient norm (over all parameters, all ranks) to this; 0: no clipping. The norm
    before clipping is the history's grad_norm either way."""

    def __post_init__(self) -> None:
        require(self.name in OPTIMIZERS, "optim.name", one_of(OPTIMIZERS), self.name)
        require(is_number(self.lr) and 0 < self.lr <= 10, "optim.lr", "a number in (0, 10]", self.lr)
        require(is_number(self.weight_decay) and self.weight_decay >= 0, "optim.weight_decay",
                "a non-negative number", self.weight_decay)
        require(is_number(self.momentum) and 0 <= self.momentum < 1, "optim.momentum", "a number in [0, 1)",
                self.momentum)
        require(self.schedule in SCHEDULES, "optim.schedule", one_of(SCHEDULES), self.schedule)
        require(is_non_negative_int(self.warmup_steps), "optim.warmup_steps", "a non-negative integer",
                self.warmup_steps)
        require(is_number(self.min_lr) and 0 <= self.min_lr <= self.lr, "optim.min_lr",
                f"a number in [0, optim.lr={self.lr}]", self.min_lr)
        require(is_number(self.clip_grad_norm) and self.clip_grad_norm >= 0, "optim.clip_grad_norm",
                "a non-negative number (0: no clipping)", self.clip_grad_norm)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    num_workers: int = 0
    """DataLoader worker processes per training worker that fetch and collate the coming steps' batches
    (0: on the training thread, the fastest for data already in memory)."""
    prefetch_factor: int = 2
    """Batches each DataLoader worker process prepares ahead (with num_workers > 0)."""

    def __post_init__(self) -> None:
        require(is_non_negative_int(self.num_workers), "data.num_workers", "a non-negative integer",
                self.num_workers)
        require(is_positive_int(self.prefetch_factor), "data.prefetch_factor", "a positive integer",
                self.prefetch_factor)


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    every_steps: int = 0
    """Evaluate every this many steps during training (0: only at the end); the metrics become the
    history's eval rows."""
    batch_size: int = 64
    """Samples per forward pass of the distributed evaluation over ``eval_dataset`` (per rank)."""

    def __post_init__(self) -> None:
        require(is_non_negative_int(self.every_steps), "eval.every_steps", "a non-negative integer",
                self.every_steps)
        require(is_positive_int(self.batch_size), "eval.batch_size", "a positive integer", self.batch_size)
