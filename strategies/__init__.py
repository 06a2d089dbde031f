"""How gradients and state move between workers."""

from __future__ import annotations

from cluster.config import StrategyConfig
from strategies.ddp import DDPStrategy


def build_strategy(config: StrategyConfig) -> DDPStrategy:
    """The strategy object for ``config.name``; it sees only its own config."""
    if config.name == "ddp":
        return DDPStrategy(bucket_cap_mb=config.bucket_cap_mb)
    raise ValueError(f"strategy.name={config.name!r} is not implemented")
