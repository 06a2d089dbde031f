"""What the Controller hands a worker for one generation of the process group (strategies/process_group.py
joins it). Imports no torch."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from raylastic.strategies.parallel_layout import ParallelLayout


@dataclass(frozen=True, kw_only=True)
class GroupAssignment:
    """What the Controller hands a worker for one generation."""

    generation: int
    rank: int
    world_size: int
    store: Any
    """The run's rendezvous keys (a ``RendezvousKeys`` actor handle); a rank reaches them with a ``RayStore``."""
    store_prefix: str
    """The run's random key prefix in the store (``new_store_prefix()``, made once per run)."""
    timeout_s: float
    run_step: int = 0
    """Steps the run had committed when this generation was formed (the same on every rank)."""
    layout: ParallelLayout | None = None
    """The generation's model-parallel layout (parallel.tp > 1); None: every rank a data-parallel one."""


def generation_prefix(store_prefix: str, generation: int) -> str:
    """The keys of ``generation``'s group (and of the groups made from it) are ``<this>/...`` in the store."""
    return f"{store_prefix}/generation/{generation}"


def new_store_prefix() -> str:
    """A run's store key prefix: 128 random bits."""
    return secrets.token_hex(16)
