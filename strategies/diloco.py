"""DiLoCo (Douillard et al. 2023) and local SGD: communicate every ``sync_every`` steps, not every step.

Between two outer steps every worker trains on its own slices of the global sample order with its
own inner optimizer (the job's ``optim``): no gradient leaves the worker. Every ``sync_every`` steps
(and at the last step of the run) the workers average their parameter change since the last outer
step - each weighted by the samples it trained on, so uneven shares count as they should - and an
outer SGD with Nesterov momentum applies that average (the pseudo-gradient) to the global
parameters, which every worker then starts from. ``sync_warmup_steps`` first averages the parameters after
every step, with no outer optimizer (post-local SGD): while the loss falls fastest, models trained apart from
one initialization drift furthest apart, and the outer momentum would carry those first large moves into
later outer steps. With ``outer_lr`` 1 and ``outer_momentum`` 0 this is local SGD; with ``sync_every`` 1
as well, and a plain SGD inner optimizer, it is synchronous DDP.
``compression`` fp16 or bf16 all-reduces the pseudo-gradient in 16 bits: half the bytes of float32.

Each rank's loss is its own mean (``averages_gradients`` is False: the step loop weights the loss by
the rank's share, not by world_size / global batch). Elastic: a new generation starts with the outer
state (global parameters, outer momentum) of its most advanced member, then an outer step merges what
every member trained since the last one, so a lost worker costs only its own inner steps since then.
Checkpoints hold the global parameters, the outer momentum and the inner optimizer state
(``checkpoint.every_steps`` is a multiple of ``sync_every``: the workers agree only after an outer step).

Example::

    strategy = DiLoCoStrategy(sync_every=50, outer_lr=0.7, outer_momentum=0.9, compression="bf16")
    state = strategy.setup(build_model, build_optimizer, device, previous=None)
    ... inner step ...
    strategy.after_step(state, step=50, samples=32, last=False)   # an outer step: collective
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from raylastic.jobconfig.strategy import DiLoCoCompression
from raylastic.strategies.base import GroupContext, ModelFactory, OptimizerFactory, TrainState
from raylastic.strategies.compression.accounting import NO_TRAFFIC, CommTraffic
from raylastic.strategies.flat_state import copy_into, model_entries, optimizer_entries
from raylastic.strategies.state_transfer import broadcast_training_state

WIRE_DTYPES: dict[DiLoCoCompression, torch.dtype] = {"none": torch.float32, "fp16": torch.float16,
                                                     "bf16": torch.bfloat16}
"""What the pseudo-gradient travels as, by ``strategy.compression`` (jobconfig.strategy.DILOCO_COMPRESSIONS)."""


class OuterState:
    """The global parameters at the last outer step, the outer optimizer over them, and this rank's samples since.

    ``wire_dtype``: what the averaged parameter change is all-reduced in (float16/bfloat16 halve the bytes; the
    outer optimizer and the global parameters stay float32).
    """

    def __init__(self, model: torch.nn.Module, lr: float, momentum: float,
                 wire_dtype: torch.dtype = torch.float32) -> None:
        self.names = [name for name, _ in model.named_parameters()]
        self.params = torch.nn.ParameterList([torch.nn.Parameter(p.detach().clone()) for p in model.parameters()])
        self.optimizer = torch.optim.SGD(self.params, lr=lr, momentum=momentum, nesterov=momentum > 0)
        if momentum > 0:  # a zero buffer steps as a missing one does, and checkpoints have its entries from step 0
            for param in self.params:
                self.optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param)
        self.wire_dtype = wire_dtype
        self.samples = 0

    def step(self, model: torch.nn.Module, *, average_only: bool = False) -> CommTraffic:
        """Collective: the outer step from every rank's change since the last one; returns the bytes sent.
        ``average_only``: the global parameters become the ranks' (sample-weighted) mean, the outer
        optimizer and its momentum untouched (the synchronous start's steps).

        The sample count is all-reduced first, so each rank scales its change by its share of the samples
        *before* the sum: what travels is a convex combination of the changes, never larger than the largest,
        so float16's range (65504) holds it however many samples were trained (summing changes times
        samples would overflow it once a large global batch runs a few hundred steps). The half-precision
        sum loses ~2^-11 (fp16) or ~2^-8 (bf16) of each entry; OpenDiLoCo all-reduced its pseudo-gradients in
        fp16 with no loss of quality (Jaghouar et al. 2024, arXiv 2407.07852). fp16 also loses precision below
        ~6e-5 and rounds entries below ~3e-8 to zero; bf16 keeps float32's range.
        """
        params = list(model.parameters())
        with torch.no_grad():
            count = torch.tensor([self.samples], dtype=torch.int64, device=params[0].device)
            dist.all_reduce(count)
            total = int(count.item())
            sent = count.numel() * count.element_size()
            uncompressed = sent
            if total > 0:  # every rank sees the same total: all take this branch or none
                share = self.samples / total
                flat = torch.cat([((g - p) * share).flatten() for g, p in zip(self.params, params, strict=True)])
                wire = flat.to(self.wire_dtype)
                dist.all_reduce(wire)
                sent += wire.numel() * wire.element_size()
                uncompressed += flat.numel() * flat.element_size()
                mean = wire.to(flat.dtype)
                offset = 0
                for g in self.params:
                    g.grad = mean[offset:offset + g.numel()].view_as(g)
                    offset += g.numel()
                if average_only:
                    for g in self.params:
                        g.sub_(g.grad)
                else:
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            for g, p in zip(self.params, params, strict=True):
                p.copy_(g)
        self.samples = 0
        return CommTraffic(bytes_sent=sent, uncompressed_bytes=uncompressed)


@dataclass(frozen=True, kw_only=True)
class DiLoCoStrategy:
    sync_every: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    compression: DiLoCoCompression = "none"
    """What the averaged parameter change travels as: float32 (none), float16 or bfloat16."""
    sync_warmup_steps: int = 0
    """Steps 1 to this one each end in a plain average of the parameters (outer optimizer and momentum
    untouched): post-local SGD's synchronous start (Lin et al. 2020)."""
    name: str = "diloco"
    replicated: bool = True
    averages_gradients: bool = False

    def setup(self, build_model: ModelFactory, build_optimizer: OptimizerFactory, device: torch.device,
              previous: TrainState | None, context: GroupContext | None = None) -> TrainState:
        """Keeps the previous generation's model, inner optimizer and outer state (no wrapper: nothing syncs
        gradients)."""
        if previous is not None:
            return TrainState(model=previous.model, wrapped=previous.model, optimizer=previous.optimizer,
                              outer=previous.outer)
        model = build_model()
        return TrainState(model=model, wrapped=model, optimizer=build_optimizer(model),
                          outer=OuterState(model, self.outer_lr, self.outer_momentum, WIRE_DTYPES[self.compression]))

    def no_sync(self, state: TrainState) -> AbstractContextManager:
        return contextlib.nullcontext()

    def after_step(self, state: TrainState, step: int, samples: int, last: bool) -> CommTraffic:
        """After the inner optimizer's step ``step`` on ``samples`` samples: the outer step when one is due."""
        state.outer.samples += samples
        warming_up = step <= self.sync_warmup_steps
        if step % self.sync_every and not last and not warming_up:
            return NO_TRAFFIC
        return state.outer.step(state.model, average_only=warming_up)

    def hand_over(self, state: TrainState, step: int, *, source_rank: int, device: torch.device,
                  scaler: torch.amp.GradScaler | None = None) -> int:
        """A new generation: every rank takes the source's outer state and inner optimizer, keeps its own inner
        progress (a newcomer has none), and an outer step merges it; returns the step."""
        outer = state.outer
        own = [p.detach().clone() for p in state.model.parameters()] if outer.samples else None
        broadcast_training_state(outer.params, outer.optimizer, step, source_rank=source_rank, device=device)
        samples = outer.samples
        step = broadcast_training_state(state.model, state.optimizer, step, source_rank=source_rank, device=device,
                                        scaler=scaler)
        with torch.no_grad():
            for param, start in zip(state.model.parameters(), own or outer.params, strict=True):
                param.copy_(start)
        outer.samples = samples
        outer.step(state.model, average_only=step <= self.sync_warmup_steps)
        return step

    def state_dict(self, state: TrainState) -> dict[str, Any]:
        """The global parameters (as ``model.<name>``), the model's buffers, and both optimizers' state."""
        outer = state.outer
        flat = model_entries(state.model)
        flat |= {f"model.{name}": param for name, param in zip(outer.names, outer.params, strict=True)}
        flat |= optimizer_entries(state.optimizer.state, {p: n for n, p in state.model.named_parameters()})
        outer_names = dict(zip(outer.params, outer.names, strict=True))
        flat |= {f"outer.{key}": value for key, value in optimizer_entries(outer.optimizer.state, outer_names).items()}
        return flat

    def load_state_dict(self, state: TrainState, flat: dict[str, Any]) -> None:
        copy_into(self.state_dict(state), flat)
        with torch.no_grad():
            for param, shared in zip(state.model.parameters(), state.outer.params, strict=True):
                param.copy_(shared)
        state.outer.samples = 0
