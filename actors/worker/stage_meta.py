"""Pipeline stages that tell each other their tensors' shapes as JSON (strategies/plain_objects.py), not pickles.

At a schedule's first step, torch's PipelineStage infers what each stage receives and sends (shape, stride,
dtype, requires_grad of every tensor) and hands it to the neighbouring stage's rank with ``send_object_list``,
which that rank unpickles. ``PlainMetaStage`` sends the same metadata as JSON in tensors, so nothing a peer sends
reaches pickle (tests/test_plain_objects.py runs a pipeline in processes where torch's object collectives raise).
A DTensor crossing a stage boundary (its placements and mesh are torch internals) is refused by name: the
stages' modules hand on local tensors (``use_local_output=True``, torch's default).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import _DTensorMeta, _StageBackwardMeta, _StageForwardMeta, _TensorMeta

from raylastic.strategies.plain_objects import dtype_name, dtype_of, recv_plain, send_plain


class PlainMetaStage(PipelineStage):
    """A PipelineStage whose shape inference talks JSON (overrides torch's ``_send_meta``/``_recv_meta``)."""

    def _send_meta(self, meta: Any, dst_stage: int) -> None:
        send_plain(plain_stage_meta(meta), dst=self.stage_index_to_group_rank[dst_stage], group=self.group,
                   device=self.device)

    def _recv_meta(self, src_stage: int) -> Any:
        return stage_meta_from_plain(recv_plain(src=self.stage_index_to_group_rank[src_stage], group=self.group,
                                                device=self.device))


def plain_stage_meta(meta: _StageForwardMeta | _StageBackwardMeta) -> dict[str, list]:
    """A stage's forward (its outputs) or backward (its inputs' gradients, None where none) metadata as JSON."""
    if isinstance(meta, _StageForwardMeta):
        return {"forward": [_plain_tensor_meta(m) for m in meta.forward_metas]}
    if isinstance(meta, _StageBackwardMeta):
        return {"backward": [None if m is None else _plain_tensor_meta(m) for m in meta.backward_metas]}
    raise TypeError(f"a pipeline stage sent {type(meta).__name__}, which has no plain encoding")


def stage_meta_from_plain(plain: dict[str, list]) -> _StageForwardMeta | _StageBackwardMeta:
    """``plain_stage_meta``'s inverse."""
    if set(plain) == {"forward"}:
        return _StageForwardMeta(forward_metas=tuple(_tensor_meta(m) for m in plain["forward"]))
    if set(plain) == {"backward"}:
        return _StageBackwardMeta(backward_metas=tuple(None if m is None else _tensor_meta(m)
                                                       for m in plain["backward"]))
    raise ValueError(f"a pipeline stage's metadata holds {sorted(plain)}, not 'forward' or 'backward'")


def _plain_tensor_meta(meta: _TensorMeta) -> list:
    if isinstance(meta, _DTensorMeta):
        raise TypeError(f"a DTensor ({meta.placements}) crosses a pipeline stage boundary: a stage's module must "
                        "take and return local tensors (use_local_output=True in its parallelize plan)")
    return [list(meta.shape), list(meta.stride), dtype_name(meta.dtype), bool(meta.requires_grad)]


def _tensor_meta(plain: list) -> _TensorMeta:
    shape, stride, dtype, requires_grad = plain
    return _TensorMeta(shape=torch.Size(int(n) for n in shape), stride=tuple(int(n) for n in stride),
                       dtype=dtype_of(dtype), requires_grad=bool(requires_grad))
