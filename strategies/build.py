"""Building the strategy of a job from its config."""

from __future__ import annotations

from raylastic.jobconfig import ParallelConfig, StrategyConfig
from raylastic.strategies.base import Strategy
from raylastic.strategies.compression import CompressionOptions
from raylastic.strategies.ddp import DDPStrategy
from raylastic.strategies.diloco import DiLoCoStrategy
from raylastic.strategies.fsdp import FSDPStrategy
from raylastic.strategies.zero1 import Zero1Strategy


def build_strategy(config: StrategyConfig, parallel: ParallelConfig | None = None) -> Strategy:
    """The strategy for ``config.name``; it sees only its own config. Under model parallelism (``parallel.tp`` or
    ``parallel.pp`` > 1) every strategy is FSDP2 over the generation's data-parallel mesh, as torchtitan does it
    (torch DDP takes no tensor-parallel parameters): ddp's layout has a copy on every data-parallel rank and one
    shard; zero1 keeps the parameters gathered from forward through backward, as zero2 does (FSDP2 shards the
    gradients with the optimizer state: the same math, less memory, and a reduce-scatter plus an all-gather
    moving what DDP's all-reduce does)."""
    if parallel is not None and parallel.model_parallel > 1:
        return FSDPStrategy(name=config.name, reshard_after_forward=config.name == "zero3", offload=config.offload,
                            replicas=config.replicas)
    if config.name == "ddp":
        options = CompressionOptions(powersgd_rank=config.powersgd_rank, powersgd_start_iter=config.powersgd_start_iter,
                                     topk_fraction=config.topk_fraction, onebit_warmup_steps=config.onebit_warmup_steps)
        return DDPStrategy(bucket_cap_mb=config.bucket_cap_mb, compression=config.compression,
                           compression_options=options, hierarchical=config.hierarchical,
                           comm_timing=config.comm_timing)
    if config.name == "zero1":
        return Zero1Strategy(bucket_cap_mb=config.bucket_cap_mb, replicas=config.replicas)
    if config.name in ("zero2", "zero3"):
        return FSDPStrategy(name=config.name, reshard_after_forward=config.name == "zero3", offload=config.offload,
                            replicas=config.replicas)
    if config.name == "diloco":
        return DiLoCoStrategy(sync_every=config.sync_every, outer_lr=config.outer_lr,
                              outer_momentum=config.outer_momentum, compression=config.compression,
                              sync_warmup_steps=config.sync_warmup_steps)
    raise ValueError(f"strategy.name={config.name!r} is not implemented")
