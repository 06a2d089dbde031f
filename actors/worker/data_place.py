"""A rank's place among the data-parallel ranks of its group, which take each step's samples between them.

Without model parallelism every rank is a data-parallel rank. Under tensor parallelism the ranks of a tp group
split one copy of the model, so they take the same samples, and one of them (``reports``) tells the Controller
their loss and sample count; the others draw dropout masks of their own for their shards of the activations
(``stream``).

Example (a rank of a generation laid out as dp2 x tp2)::

    place = DataPlace.in_group(ParallelLayout(dp_shard=2, tp=2))   # rank 3: DataPlace(rank=1, ranks=2, ...)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from raylastic.strategies.parallel_layout import ParallelLayout


@dataclass(frozen=True)
class DataPlace:
    rank: int
    """Which share of a step's samples this rank takes."""
    ranks: int
    """How many shares there are: the data-parallel degree."""
    reports: bool = True
    """Whether this rank reports its share's loss and samples."""
    stream: int = 0
    """Which random stream this rank's forward draws from, beside the others that take the same samples."""
    tensor_parallel: bool = False

    @classmethod
    def in_group(cls, layout: ParallelLayout | None) -> DataPlace:
        """This rank's place in the current group, laid out as ``layout`` (None: every rank a data-parallel one)."""
        rank = dist.get_rank()
        if layout is None:
            return cls(rank=rank, ranks=dist.get_world_size())
        return cls(rank=layout.data_rank(rank), ranks=layout.dp, reports=layout.reports(rank),
                   stream=layout.coordinates(rank).tp, tensor_parallel=layout.tp > 1)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """What a forward and its backward run in: under tensor parallelism, torch's ``loss_parallel``, so a
        cross-entropy takes logits split by vocabulary as they are (it leaves other losses alone)."""
        return loss_parallel() if self.tensor_parallel else contextlib.nullcontext()
