"""Worker slots: one single-bundle placement group per worker, so each can come and go alone.

The Controller asks for up to max_workers slots at once. It starts with those that are ready;
the rest stay pending in Ray's scheduler and become ready when resources appear (a node joins,
another job ends) - which is how the Controller learns it can scale up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from ray import PlacementGroupID
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raylastic.jobconfig.naming import slot_name

WAIT_INTERVAL_S = 0.05


@dataclass(frozen=True)
class ReservedBundles:
    """Bundles of a placement group reserved for this run's workers (e.g. by a Ray Tune trial)."""

    placement_group: PlacementGroup
    bundle_indices: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class SlotShape:
    cpus: float
    gpus: int
    custom: dict[str, float]

    def bundle(self) -> dict[str, float]:
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {}), **self.custom}


def draining_nodes() -> dict[str, float | None]:
    """Nodes Ray is draining (a preemption notice, ``ray drain-node``, SIGTERM to ``ray start --block``):
    node id -> when the node goes (``time.time()`` seconds; None: no deadline). Ray places nothing new on
    them."""
    deadlines_ms = ray._private.state.state.get_draining_nodes()  # the GCS's view; no public API yet
    return {node_id: (deadline / 1000 if deadline else None) for node_id, deadline in deadlines_ms.items()}


def remove_run_slots(run_name: str) -> list[str]:
    """Remove the placement groups of run ``run_name`` that Ray still holds; their names.

    The Controller releases its slots when it ends, but a killed one cannot, and Ray removes a placement group
    only once both its creator actor and its job are gone: under a long-lived driver (a notebook) they would
    stay. The driver calls this after its Controller has ended, however it ended."""
    head = slot_name(run_name, 0).removesuffix("0")
    removed = []
    for group_id, info in placement_group_table().items():
        name = info["name"]
        if name.startswith(head) and name[len(head):].isdigit() and info["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(group_id))))
            removed.append(name)
    return removed


class WorkerSlots:
    def __init__(self, shape: SlotShape, run_name: str) -> None:
        self.shape = shape
        self.run_name = run_name
        self._pending: list[PlacementGroup] = []
        self._created = 0

    def request(self, count: int) -> None:
        """Ask Ray for ``count`` more slots; they become ready when resources allow."""
        for _ in range(count):
            self._created += 1
            name = slot_name(self.run_name, self._created)
            self._pending.append(placement_group([self.shape.bundle()], name=name))

    def take_ready(self, at_most: int, *, at_least: int = 0, timeout_s: float = 0.0) -> list[PlacementGroup]:
        """Up to ``at_most`` ready slots, waiting up to ``timeout_s`` for ``at_least`` of them."""
        deadline = time.monotonic() + timeout_s
        ready = self._ready()
        while len(ready) < min(at_least, len(self._pending)) and time.monotonic() < deadline:
            time.sleep(WAIT_INTERVAL_S)
            ready = self._ready()
        taken = ready[:at_most]
        self._pending = [pg for pg in self._pending if pg not in taken]
        return taken

    @property
    def waiting(self) -> bool:
        """Whether slots were asked for that Ray has not placed yet."""
        return bool(self._pending)

    def count_ready(self) -> int:
        return len(self._ready())

    def release(self, slot: PlacementGroup) -> None:
        remove_placement_group(slot)

    def release_pending(self) -> None:
        for slot in self._pending:
            remove_placement_group(slot)
        self._pending = []

    def scheduling(self, slot: PlacementGroup) -> PlacementGroupSchedulingStrategy:
        """How an actor is placed in ``slot``."""
        return PlacementGroupSchedulingStrategy(placement_group=slot)

    def node_of(self, slot: PlacementGroup) -> str:
        """The node a ready slot is on."""
        return placement_group_table(slot)["bundles_to_node_id"][0]

    def _ready(self) -> list[PlacementGroup]:
        # A state query to the GCS; pg.ready() would leave a GCS wait pending for each call.
        return [pg for pg in self._pending if placement_group_table(pg)["state"] == "CREATED"]


class ReservedSlots:
    """Slots from bundles someone else reserved, e.g. a Ray Tune trial's placement group.

    Same interface as WorkerSlots; a slot is a bundle index. Capacity is fixed: a released
    bundle is free again for a replacement, and nothing is asked of Ray's scheduler.
    """

    def __init__(self, group: PlacementGroup, bundle_indices: list[int], shape: SlotShape) -> None:
        self.group = group
        self.shape = shape
        self._free = list(bundle_indices)
        self._wanted = 0

    def request(self, count: int) -> None:
        self._wanted += count

    def take_ready(self, at_most: int, *, at_least: int = 0, timeout_s: float = 0.0) -> list[int]:
        count = min(at_most, self._wanted, len(self._free))
        taken, self._free = self._free[:count], self._free[count:]
        self._wanted -= count
        return taken

    @property
    def waiting(self) -> bool:
        return self._wanted > 0

    def count_ready(self) -> int:
        return min(self._wanted, len(self._free))

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def release_pending(self) -> None:
        self._wanted = 0

    def scheduling(self, slot: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=slot,
                                                placement_group_capture_child_tasks=False)

    def node_of(self, slot: int) -> str:
        return placement_group_table(self.group)["bundles_to_node_id"][slot]
