"""The Controller's side of fault injection (``faults: [{action, rank, step}]``): each fault fires once per
run; a ``throttle`` slows its rank's steps from ``step`` to ``until_step``, in every generation it spans.

The Controller keeps the faults not yet fired (``FaultPlan``) and gives each worker those aimed at its rank
when a generation starts training; the worker fires them from its step hooks (actors/faults/step_hooks.py)::

    plan = FaultPlan(job.faults)                          # Controller
    worker.train.remote(until_step, plan.for_rank(rank))
    plan.disarm(failed_ranks={1}, step=29)                # after a failure: fired faults never fire again
"""

from __future__ import annotations

from collections.abc import Sequence

from raylastic.jobconfig import FaultConfig


class FaultPlan:
    """The run's injected faults that have not fired yet; pure bookkeeping for the Controller.

        plan = FaultPlan([FaultConfig(action="kill", rank=1, step=30)])
        plan.for_rank(1)                        # (FaultConfig(action='kill', rank=1, step=30),)
        plan.disarm(failed_ranks={1}, step=29)  # rank 1 died with step 30 in flight: its fault fired
        plan.for_rank(1)                        # ()
    """

    def __init__(self, faults: Sequence[FaultConfig]) -> None:
        self.pending: list[FaultConfig] = list(faults)

    def for_rank(self, rank: int) -> tuple[FaultConfig, ...]:
        """The pending faults aimed at ``rank`` of the generation about to train."""
        return tuple(f for f in self.pending if f.rank == rank)

    def disarm(self, failed_ranks: set[int], step: int) -> None:
        """After a failure at committed step ``step``: drop the faults of steps already begun (up to
        ``step + 1``, on every rank), and the first later one of each failed rank (it may have fired
        after the last step the Controller heard of). A throttle stays until its last step is committed."""
        throttles = [f for f in self.pending if f.action == "throttle" and (f.until_step or step + 1) > step]
        fired = [min((f for f in self.pending if f.rank == rank and f.step > step and f.action != "throttle"),
                     key=lambda f: f.step, default=None) for rank in failed_ranks]
        self.pending = throttles + [f for f in self.pending
                                    if f.step > step + 1 and f not in fired and f.action != "throttle"]
