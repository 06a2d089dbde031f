"""A new generation's state from the copies the members (and the spares a layout set aside) kept in memory: who
sends which part (``plan_memory_restore``), and the restore itself (``restore_from_memory``). The Controller asks
for the plan when a generation forms and carries it out when ``choose_state_source`` picks it.

Example (the Controller, once the members joined)::

    plan = plan_memory_restore(group, reports, model_parallel=True)
    label, moved = restore_from_memory(group, plan)   # "peers", {"previous_layout": ..., "moved_bytes": ...}
"""

from __future__ import annotations

from typing import Any

from raylastic.strategies.peer_restore import PeerRestorePlan, plan_peer_restore
from raylastic.strategies.region_plan import RegionRestorePlan, plan_region_restore


def plan_memory_restore(group: Any, reports: list, *,
                        model_parallel: bool) -> PeerRestorePlan | RegionRestorePlan | None:
    """Which member sends which part of the sharded state the members kept (None: no complete copy survived).
    ``group``: the WorkerGroup; ``reports``: its members' JoinReports."""
    if model_parallel:  # the spares the layout left out, and drained members, may hold parts too
        holdings = [report.region_copies for report in reports] + group.set_aside_copies()
        return plan_region_restore(holdings, members=len(reports))
    return plan_peer_restore([report.shard_copies for report in reports])


def restore_from_memory(group: Any, plan: PeerRestorePlan | RegionRestorePlan) -> tuple[str, dict[str, Any]]:
    """Every member takes its part of ``plan``'s state from the kept copies; the state source's label, and under
    model parallelism what moved: its bytes, the ranks that sent them and the workers set aside that handed their
    parts over (through Ray's object store)."""
    label = "buddy" if plan.from_buddies else "peers"
    if isinstance(plan, RegionRestorePlan):
        traffic = group.restore_regions(plan)
        return label, {"previous_layout": plan.layout.describe(),
                       "moved_bytes": sum(t.bytes_received for t in traffic),
                       "moved_from": sorted({sender for t in traffic for sender in t.senders}),
                       "handed_over_by": group.handed_over_by(plan)}
    group.restore_from_peers(plan)
    return label, {}
