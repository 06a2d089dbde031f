"""Gradient compression as DDP communication hooks, each with a state that counts its bytes.

Every hook returns the mean over ranks of the bucket (exactly, or approximately for the lossy
ones), like torch's ``allreduce_hook``: the step loop's loss scaling relies on DDP averaging.

===========  ==========================================  ================  ===================
kind         what travels per bucket and rank            bytes vs float32  paper
===========  ==========================================  ================  ===================
none         float32 all-reduce (DDP's own result)       1x                -
fp16/bf16    16-bit all-reduce                           2x less           Micikevicius 2018
powersgd     rank-r P and Q per matrix, error feedback   ~(nm)/(r(n+m))    Vogels et al. 2019
topk         k values + int32 indices, error feedback    10x at 5%         Stich 2018, Lin 2018
onebit       packed signs + 1 scale, error feedback      ~32x              Seide 2014, Tang 2021
int8         int8 values + 1 scale                       ~4x               Dettmers 2016
===========  ==========================================  ================  ===================

topk, onebit and int8 all-gather their payloads (sums of sparse or quantized values would not
fit the same format): a rank receives N-1 payloads, while a ring all-reduce moves about twice
its own. Their wire advantage therefore shrinks with the world size N, to nothing near
N = 2 x the ratio above (e.g. ~100 ranks for top-k at 1%). The counters report payloads.

Elasticity: build a fresh hook (``make_comm_hook``) for every new DDP, i.e. every process-group
generation. Error-feedback buffers then start at zero on every rank, which keeps the ranks
deterministic and consistent whatever happened to the old group (a new member has no residual,
a lost one took its residual with it). This is the conservative choice DeepSpeed's 1-bit
Adam/LAMB make when loading a checkpoint: the compression errors are reset, since they are
per-rank and tied to the world size. ``completed_steps`` lets 1-bit skip its warm-up when the
run is already past it; PowerSGD always runs ``powersgd_start_iter`` uncompressed iterations
after a new DDP is built (torch keys its buffers by bucket index, and DDP rebuilds its buckets
after the first iteration).

Example::

    from raylastic.strategies.compression import CompressionOptions, make_comm_hook

    state, hook = make_comm_hook("topk", options=CompressionOptions(topk_fraction=0.01))
    ddp_model.register_comm_hook(state, hook)
    ...                                  # after each optimizer step:
    sent = state.take_bytes_sent()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from raylastic.jobconfig.strategy import COMPRESSIONS as COMPRESSION_KINDS
from raylastic.jobconfig.strategy import Compression as CompressionKind
from raylastic.strategies.compression.accounting import CommTraffic, HookState
from raylastic.strategies.compression.int8 import Int8State, int8_hook
from raylastic.strategies.compression.lowp import LowPrecisionState, low_precision_hook
from raylastic.strategies.compression.onebit import OneBitState, onebit_hook
from raylastic.strategies.compression.powersgd import PowerSGDHookState, powersgd_hook
from raylastic.strategies.compression.topk import TopKState, topk_hook

CommHookFn = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass(frozen=True, kw_only=True)
class CompressionOptions:
    """The compression fields of StrategyConfig (``jobconfig.strategy``), where they are documented and
    validated; a hook trusts them."""

    powersgd_rank: int = 4
    powersgd_start_iter: int = 10
    topk_fraction: float = 0.05
    onebit_warmup_steps: int = 50


class CommHook(NamedTuple):
    """A hook and its state; unpacks as ``state, hook = make_comm_hook(...)``."""

    state: HookState
    hook: CommHookFn


def make_comm_hook(kind: CompressionKind, *, process_group: dist.ProcessGroup | None = None,
                   options: CompressionOptions | None = None, completed_steps: int = 0) -> CommHook:
    """A fresh (state, hook) of ``kind`` for one DDP on ``process_group`` (None: the default group).

    ``completed_steps``: optimizer steps the run has already committed; only 1-bit uses it (its
    warm-up counts run steps, so a new generation past the warm-up compresses at once).
    """
    options = CompressionOptions() if options is None else options
    if not (isinstance(completed_steps, int) and not isinstance(completed_steps, bool) and completed_steps >= 0):
        raise ValueError(f"completed_steps must be an integer >= 0, got {completed_steps!r}")
    if kind == "none":
        return CommHook(LowPrecisionState(process_group), low_precision_hook)
    if kind == "fp16":
        return CommHook(LowPrecisionState(process_group, torch.float16), low_precision_hook)
    if kind == "bf16":
        return CommHook(LowPrecisionState(process_group, torch.bfloat16), low_precision_hook)
    if kind == "powersgd":
        state = PowerSGDHookState(process_group, rank=options.powersgd_rank, start_iter=options.powersgd_start_iter)
        return CommHook(state, powersgd_hook)
    if kind == "topk":
        return CommHook(TopKState(process_group, fraction=options.topk_fraction), topk_hook)
    if kind == "onebit":
        state = OneBitState(process_group, warmup_steps=options.onebit_warmup_steps, completed_steps=completed_steps)
        return CommHook(state, onebit_hook)
    if kind == "int8":
        return CommHook(Int8State(process_group), int8_hook)
    raise ValueError(f"compression must be one of {', '.join(COMPRESSION_KINDS)}; got {kind!r}")


__all__ = ["COMPRESSION_KINDS", "CommHook", "CommTraffic", "CompressionKind", "CompressionOptions", "HookState",
           "make_comm_hook"]
