"""The narrow contract every strategy keeps, and the canonical state-dict layout they share.

A strategy builds, for each process-group generation, the objects a worker trains with
(``TrainState``), says how to skip gradient communication during accumulation, and converts
that state to and from one canonical, flat state dict:

    "model.<fqn>"                 parameters and buffers
    "optim.state.<fqn>.<name>"    optimizer state per parameter (Adam's exp_avg, step, ...)
    "scaler.scale"                fp16 only: the loss scaler's scale and growth tracker, saved
    "scaler.growth_tracker"       beside the strategy's entries (``scaler_entries``)

Sharded tensors are DTensors sharded on dim 0 over all ranks, replicated ones plain tensors;
both describe the same logical tensor, so torch.distributed.checkpoint can save with one
strategy and world size and load with another (zero3 at 4 ranks -> ddp at 2 ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from raylastic.strategies.checkpoint import load_into
from raylastic.strategies.compression.accounting import CommTraffic
from raylastic.strategies.parallel_mesh import ParallelMesh
from raylastic.strategies.shard_layout import ShardLayout

ModelFactory = Callable[[], torch.nn.Module]
OptimizerFactory = Callable[[torch.nn.Module], torch.optim.Optimizer]
"""Builds the optimizer over a model's (possibly sharded) parameters."""

ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
                          torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam,
                          torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop)
"""Optimizers whose update of an entry depends on that entry alone, so they can run on row shards."""


def require_elementwise(optimizer: torch.optim.Optimizer, strategy: str) -> None:
    """Refuse an optimizer a sharding strategy cannot run on row shards (L-BFGS, Adafactor, ...)."""
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        allowed = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(f"strategy.name={strategy} shards optimizer state by rows, which needs an element-wise "
                         f"optimizer ({allowed}); the workload's configure_optimizer returned "
                         f"{type(optimizer).__module__}.{type(optimizer).__name__}: use strategy.name=ddp for it")


@dataclass(frozen=True)
class GroupContext:
    """What a strategy may need to know about the generation it is set up for (same on every rank)."""

    node_ids: tuple[str, ...]
    """The Ray node id of every rank, indexed by rank."""
    completed_steps: int
    """Optimizer steps the run has committed (e.g. whether 1-bit compression is past its warm-up)."""
    mesh: ParallelMesh | None = None
    """The generation's model-parallel mesh (parallel.tp > 1), whose ``dp`` view a strategy shards over; None: the
    strategy spans the whole group."""


@dataclass
class CommInstruments:
    """What counts a DDP's bytes sent (a hook's state) and, when timed, its bucket timer (overlap)."""

    state: Any
    timer: Any = None


@dataclass
class TrainState:
    """What one worker trains with in the current generation."""

    model: torch.nn.Module
    """The module itself (sharded in place by FSDP2 for zero2/zero3)."""
    wrapped: torch.nn.Module
    """What forward is called on: a DDP wrapper for ddp/zero1, the module itself otherwise."""
    optimizer: torch.optim.Optimizer
    comm: CommInstruments | None = None
    """Set for a DDP at world size > 1; its timer only with strategy.comm_timing."""
    layout: ShardLayout | None = None
    """Sharded strategies: which shard of the state this rank holds, and how many copies there are."""
    outer: Any = None
    """diloco: the global parameters and the outer optimizer (strategies/diloco.py OuterState)."""

    def kept_across_groups(self) -> TrainState:
        """The model and optimizer alone: what a replicated strategy carries into the next group.

        The wrapper (DDP's reducer) and the hook state hold the current process group. They must be
        freed before the group is destroyed: if one of them drops the group's last reference, the
        group's destructor joins gloo's worker threads while holding the GIL, and a worker thread
        finishing a collective left in flight by a failed step needs the GIL to free its tensors (a
        deadlock; tests/test_group_handover.py reproduces it).
        """
        return TrainState(model=self.model, wrapped=self.model, optimizer=self.optimizer, outer=self.outer)


class Strategy(Protocol):
    name: str
    replicated: bool
    """True when every rank holds the full model and optimizer state, so a survivor can hand it
    over in memory; False when state is sharded and a lost shard must come from a surviving copy
    (strategy.replicas, strategies/peer_restore.py) or a checkpoint."""
    averages_gradients: bool
    """True when the ranks' gradients are averaged every step (the step loop then weights each rank's loss so
    that the average is the global batch's mean); False when each rank steps on its own mean (diloco)."""

    def setup(self, build_model: ModelFactory, build_optimizer: OptimizerFactory, device: torch.device,
              previous: TrainState | None, context: GroupContext | None = None) -> TrainState:
        """The state for the current process group; ``previous`` is the last generation's (or None)."""
        ...

    def no_sync(self, state: TrainState) -> AbstractContextManager:
        """Skip gradient communication (every micro-batch but the last of a step)."""
        ...

    def after_step(self, state: TrainState, step: int, samples: int, last: bool) -> CommTraffic:
        """After the optimizer's step ``step`` (1-based; ``last``: the run's last), on ``samples`` samples of this
        rank: any communication the strategy does between steps; returns what it sent (and what it would have
        sent uncompressed): NO_TRAFFIC for none."""
        ...

    def state_dict(self, state: TrainState) -> dict[str, Any]:
        """The canonical flat state dict (tensors shared with the live state, not copies)."""
        ...

    def load_state_dict(self, state: TrainState, flat: dict[str, Any]) -> None:
        """Load a canonical flat state dict (as filled in by a checkpoint load) into ``state``."""
        ...


def local_bytes(tensors: list[torch.Tensor | None]) -> int:
    """Bytes this rank holds for ``tensors`` (a DTensor counts only its local shard)."""
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


def memory_breakdown(state: TrainState) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds now."""
    parameters = list(state.model.parameters())
    optimizer = [v for per_param in state.optimizer.state.values() for v in per_param.values()
                 if isinstance(v, torch.Tensor)]
    return {"parameters": local_bytes(parameters), "gradients": local_bytes([p.grad for p in parameters]),
            "optimizer": local_bytes(optimizer)}


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily built state (zero gradients, a step at lr 0), so it can be loaded into."""
    optimizer = getattr(optimizer, "inner", optimizer)  # a sharded optimizer's own torch optimizer
    if optimizer.state:
        return
    parameters = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for parameter in parameters:
        parameter.grad = torch.zeros_like(parameter)
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, learning_rates, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    # Adam's step counter is now 1; a checkpoint load overwrites it, an in-memory hand-over too.


def scaler_entries(scaler: torch.amp.GradScaler | None) -> dict[str, torch.Tensor]:
    """fp16's loss-scaler state as canonical entries (none without a scaler), to save beside
    ``Strategy.state_dict``. They are copies: ``load_scaler`` puts a checkpoint's back.

    Example::

        checkpointer.save(step, {**strategy.state_dict(state), **scaler_entries(scaler)}, ...)
    """
    if scaler is None:
        return {}
    saved = scaler.state_dict()
    return {"scaler.scale": torch.tensor(saved["scale"], dtype=torch.float64),
            "scaler.growth_tracker": torch.tensor(saved["_growth_tracker"], dtype=torch.int64)}


def load_scaler(scaler: torch.amp.GradScaler | None, directory: str, group: dist.ProcessGroup | None = None
                ) -> None:
    """Collective: the loss scaler's state from checkpoint ``directory``. A checkpoint without it (saved
    at another precision, or before scalers were saved) leaves the scaler as it is."""
    if scaler is None:
        return
    entries = scaler_entries(scaler)
    load_into(entries, directory, group, partial=True)
    set_scaler(scaler, entries)


def set_scaler(scaler: torch.amp.GradScaler | None, entries: dict[str, torch.Tensor]) -> None:
    """Put ``scaler_entries`` (a checkpoint's, a peer's) back into ``scaler``; without them it stays as it is."""
    if scaler is None or "scaler.scale" not in entries:
        return
    scaler.load_state_dict({**scaler.state_dict(), "scale": entries["scaler.scale"].item(),
                            "_growth_tracker": int(entries["scaler.growth_tracker"].item())})
