"""How far a workload's model splits: the most pipeline stages it cuts into (its blocks) and the tensor-parallel
degrees its ``parallelize`` takes. Pure, no torch: the Controller's layout policy (actors/controller/layout_policy.py)
re-plans within them.

A workload tells them through the optional hook ``model_limits(model) -> dict`` (workloads/protocol.py), called by
each worker once on its model built on the meta device; the built-in GPTs' is workloads/gpt_splits.py's.

Example::

    ModelLimits.reported({"blocks": 6, "tp_degrees": [1, 2, 4]}, workload="chargpt")
    # ModelLimits(blocks=6, tp_degrees=(1, 2, 4))
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelLimits:
    blocks: int
    """The model's blocks: a pipeline cuts it into at most this many stages, each a run of consecutive blocks (the
    first stages one more where they do not divide evenly)."""
    tp_degrees: tuple[int, ...]
    """The tensor-parallel degrees its ``parallelize`` takes (1 always)."""

    @classmethod
    def reported(cls, reported: object, *, workload: str) -> ModelLimits:
        """The limits of ``workload``'s ``model_limits`` hook's answer, a ValueError naming what is wrong with it."""
        where = f"workload {workload!r}: model_limits(model) must return {{'blocks': int >= 1, 'tp_degrees': [int]}}"
        if not isinstance(reported, dict) or set(reported) != {"blocks", "tp_degrees"}:
            raise ValueError(f"{where}, not {reported!r}")
        blocks, degrees = reported["blocks"], reported["tp_degrees"]
        if not _positive_int(blocks):
            raise ValueError(f"{where}: its 'blocks' is {blocks!r}")
        if not isinstance(degrees, list | tuple) or not all(_positive_int(degree) for degree in degrees):
            raise ValueError(f"{where}: its 'tp_degrees' is {degrees!r}")
        return cls(blocks=blocks, tp_degrees=tuple(sorted({1, *degrees})))


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
