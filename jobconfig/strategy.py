"""How gradients and state move between workers: the strategy and its communication options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from raylastic.jobconfig.checks import is_non_negative_int, is_number, is_positive_int, one_of, require

StrategyName = Literal["ddp", "zero1", "zero2", "zero3", "diloco", "async_ps"]
STRATEGIES: tuple[str, ...] = get_args(StrategyName)
REPLICATED_STRATEGIES = ("ddp", "diloco")
"""The strategies whose every rank holds the whole state (the rest shard it); each strategy's ``replicated``."""
Compression = Literal["none", "fp16", "bf16", "powersgd", "topk", "onebit", "int8"]
COMPRESSIONS: tuple[str, ...] = get_args(Compression)
DiLoCoCompression = Literal["none", "fp16", "bf16"]
DILOCO_COMPRESSIONS: tuple[str, ...] = get_args(DiLoCoCompression)


@dataclass(frozen=True, kw_only=True)
class StrategyConfig:
    name: StrategyName = "ddp"
    """ddp: replicated state; zero1: optimizer state sharded; zero2: + gradients (FSDP2, parameters
    kept gathered from forward to backward); zero3: + parameters (FSDP2, resharded after forward);
    diloco: every worker takes ``sync_every`` optimizer steps on its own gradients, then the workers
    average their parameter change and an outer Nesterov SGD applies it (strategies/diloco.py); async_ps: the
    parameters and the optimizer live in ``num_servers`` parameter-server actors, each worker pulls them, computes
    a whole step's gradient and pushes it, and the servers apply gradients as they come (actors/async_ps/)."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB, for ddp and zero1 (DDP's first bucket is 1 MiB whatever this says)."""
    offload: bool = False
    """zero2/zero3: keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2's
    CPUOffloadPolicy); meaningful on GPUs only."""
    compression: Compression = "none"
    """ddp gradient compression (a DDP comm hook): 16-bit, PowerSGD, top-k or 1-bit with error
    feedback, or 8-bit with a per-bucket scale. diloco: fp16 or bf16 all-reduces the averaged parameter
    change (the pseudo-gradient) in 16 bits, half the bytes of float32."""
    powersgd_rank: int = 4
    """PowerSGD's matrix approximation rank r: each n x m gradient travels as (n + m) r numbers.
    1-2 is often enough for convolutions, 4+ for transformers (Vogels et al. 2019)."""
    powersgd_start_iter: int = 10
    """Uncompressed iterations before PowerSGD starts, per generation (>= 2: torch needs DDP's buckets
    rebuilt first when error feedback is on)."""
    topk_fraction: float = 0.05
    """Fraction of each bucket's entries top-k sends, in (0, 1]. The default, 5% (10x fewer bytes), keeps
    digits within a point of uncompressed accuracy; 1% (50x) falls behind (tests/test_communication.py)."""
    onebit_warmup_steps: int = 50
    """Full-precision steps before 1-bit compression starts, so the optimizer's variance estimates settle
    first (1-bit Adam's warm-up); the default keeps digits within a point of uncompressed accuracy
    (tests/test_communication.py)."""
    replicas: int = 1
    """zero1/zero2/zero3: copies of the sharded state kept in memory (HSDP: the ranks form ``replicas`` groups,
    each sharding the state over its members, and gradients are averaged over every rank). A worker's loss
    is then recovered from a surviving copy instead of a checkpoint, at the cost of ``replicas`` times the
    sharded state's memory. A generation whose world size it does not divide keeps the largest count that
    does and is at most this (world size 3 with 2: one copy; strategies/shard_layout.py)."""
    buddy_copy: bool = True
    """zero1/zero2/zero3 with one copy of the sharded state (``replicas`` 1, or a world size it does not divide):
    after every step each rank's shard is also sent to the next rank, which keeps it in CPU memory, so a lost
    worker's shard comes from there instead of a checkpoint (strategies/buddy_copy.py). Costs up to four times
    a rank's shard in host memory, and the copy's transfer, which overlaps the next step's forward."""
    hierarchical: bool = False
    """ddp: reduce inside each node, all-reduce among one leader per node, broadcast back (node
    membership from Ray's node ids, re-derived at every generation). Not combinable with compression."""
    comm_timing: bool = False
    """ddp: time every gradient bucket's communication (the history's comm_s and exposed_comm_s) with a
    Python hook on each bucket. Off, uncompressed DDP runs its own C++ all-reduce with no Python on the
    gradients' path: the hook passes the GIL between the training thread and the backend's threads for
    every bucket, which slows short steps on few cores (docs/benchmarks.md)."""

    sync_every: int = 50
    """diloco: inner steps between two outer steps (H; 1 with outer_lr 1 and outer_momentum 0 is ddp with
    plain SGD)."""
    outer_lr: float = 0.7
    """diloco: the outer SGD's learning rate on the averaged parameter change (1 with outer_momentum 0:
    local SGD, the change applied as it is)."""
    outer_momentum: float = 0.9
    """diloco: the outer SGD's Nesterov momentum, in [0, 1)."""
    sync_warmup_steps: int = 0
    """diloco: steps 1 to this one each end in a plain average of the workers' parameters (no outer optimizer):
    post-local SGD's synchronous start, one all-reduce a step while the models would drift furthest apart."""
    num_servers: int = 1
    """async_ps: parameter-server actors; the parameters are spread over them by size."""
    max_staleness: int = 4
    """async_ps: the most updates a gradient's parameters may be behind when it is applied; a staler gradient is
    refused and its step computed again on fresh parameters. Workers in flight make most gradients 0 to
    workers - 1 updates stale, so the default refuses only what a stalled or far slower worker sends."""
    server_cpus: float = 1.0
    """async_ps: the CPUs each parameter server reserves (fractional on a shared machine)."""
    predict_weights: bool = True
    """async_ps: servers serve the parameters extrapolated along their last update by the staleness recent
    gradients had (actors/async_ps/prediction.py), so that a gradient is computed about where it is applied;
    false serves the parameters as they are."""

    @property
    def replicated(self) -> bool:
        """Whether every rank holds the whole state (the built strategy's ``replicated``)."""
        return self.name in REPLICATED_STRATEGIES

    def __post_init__(self) -> None:
        require(self.name in STRATEGIES, "strategy.name", one_of(STRATEGIES), self.name)
        require(is_positive_int(self.sync_every), "strategy.sync_every", "a positive integer", self.sync_every)
        require(is_number(self.outer_lr) and self.outer_lr > 0, "strategy.outer_lr", "a positive number",
                self.outer_lr)
        require(is_number(self.outer_momentum) and 0 <= self.outer_momentum < 1, "strategy.outer_momentum",
                "a number in [0, 1)", self.outer_momentum)
        require(is_non_negative_int(self.sync_warmup_steps), "strategy.sync_warmup_steps",
                "a non-negative integer", self.sync_warmup_steps)
        require(is_number(self.bucket_cap_mb) and self.bucket_cap_mb > 0, "strategy.bucket_cap_mb",
                "a positive number of MiB", self.bucket_cap_mb)
        require(isinstance(self.offload, bool), "strategy.offload", "true or false", self.offload)
        require(self.compression in COMPRESSIONS, "strategy.compression", one_of(COMPRESSIONS), self.compression)
        require(isinstance(self.hierarchical, bool), "strategy.hierarchical", "true or false", self.hierarchical)
        require(isinstance(self.buddy_copy, bool), "strategy.buddy_copy", "true or false", self.buddy_copy)
        require(isinstance(self.comm_timing, bool), "strategy.comm_timing", "true or false", self.comm_timing)
        if self.compression != "none" and self.name not in ("ddp", "diloco"):
            raise ValueError(f"strategy.compression works with strategy.name=ddp or diloco only, got {self.name!r}")
        if self.name == "diloco" and self.compression not in DILOCO_COMPRESSIONS:
            raise ValueError(f"strategy.compression with strategy.name=diloco takes none, fp16 or bf16, got "
                             f"{self.compression!r}")
        for name, value in (("hierarchical", self.hierarchical), ("comm_timing", self.comm_timing)):
            if value and self.name != "ddp":
                raise ValueError(f"strategy.{name} works with strategy.name=ddp only, got {self.name!r}")
        if self.hierarchical and self.compression != "none":
            raise ValueError("strategy.hierarchical and strategy.compression cannot be combined (DDP takes one "
                             f"communication hook), got compression={self.compression!r}")
        require(is_positive_int(self.powersgd_rank), "strategy.powersgd_rank", "a positive integer",
                self.powersgd_rank)
        require(is_non_negative_int(self.powersgd_start_iter) and self.powersgd_start_iter >= 2,
                "strategy.powersgd_start_iter", "an integer >= 2", self.powersgd_start_iter)
        require(is_number(self.topk_fraction) and 0 < self.topk_fraction <= 1, "strategy.topk_fraction",
                "a number in (0, 1]", self.topk_fraction)
        require(is_non_negative_int(self.onebit_warmup_steps), "strategy.onebit_warmup_steps",
                "a non-negative integer", self.onebit_warmup_steps)
        require(is_positive_int(self.num_servers), "strategy.num_servers", "a positive integer", self.num_servers)
        require(is_non_negative_int(self.max_staleness), "strategy.max_staleness", "a non-negative integer",
                self.max_staleness)
        require(is_number(self.server_cpus) and self.server_cpus > 0, "strategy.server_cpus", "a positive number",
                self.server_cpus)
        require(isinstance(self.predict_weights, bool), "strategy.predict_weights", "true or false",
                self.predict_weights)
        require(is_positive_int(self.replicas), "strategy.replicas", "a positive integer", self.replicas)
        if self.replicas > 1 and self.name not in ("zero1", "zero2", "zero3"):
            raise ValueError(f"strategy.replicas > 1 needs strategy.name zero1, zero2 or zero3 (ddp's state is "
                             f"replicated on every worker already), got replicas={self.replicas} with {self.name!r}")
        if self.offload and self.name not in ("zero2", "zero3"):
            raise ValueError(f"strategy.offload needs strategy.name zero2 or zero3, got {self.name!r}")
