"""Worker slots: one single-bundle placement group per worker, so each can come and go alone.

The Controller asks for up to max_workers slots at once. It starts with those that are ready;
the rest stay pending in Ray's scheduler and become ready when resources appear (a node joins,
another job ends) - which is how the Controller learns it can scale up.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group


@dataclass(frozen=True, kw_only=True)
class SlotShape:
    cpus: float
    gpus: int


class WorkerSlots:
    def __init__(self, shape: SlotShape, run_name: str) -> None:
        self.shape = shape
        self.run_name = run_name
        self._pending: list[PlacementGroup] = []
        self._created = 0

    def request(self, count: int) -> None:
        """Ask Ray for ``count`` more slots; they become ready when resources allow."""
        bundle = {"CPU": self.shape.cpus, **({"GPU": self.shape.gpus} if self.shape.gpus else {})}
        for _ in range(count):
            self._created += 1
            self._pending.append(placement_group([bundle], name=f"raylastic:{self.run_name}:slot{self._created}"))

    def take_ready(self, at_most: int, *, at_least: int = 0, timeout_s: float = 0.0) -> list[PlacementGroup]:
        """Up to ``at_most`` ready slots, waiting up to ``timeout_s`` for ``at_least`` of them."""
        if not self._pending or at_most <= 0:
            return []
        refs = {pg.ready(): pg for pg in self._pending}
        ray.wait(list(refs), num_returns=max(1, min(at_least, len(refs))), timeout=timeout_s)
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        taken = [refs[r] for r in ready[:at_most]]
        self._pending = [pg for pg in self._pending if pg not in taken]
        return taken

    def count_ready(self) -> int:
        if not self._pending:
            return 0
        ready, _ = ray.wait([pg.ready() for pg in self._pending], num_returns=len(self._pending), timeout=0)
        return len(ready)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def release(self, slot: PlacementGroup) -> None:
        remove_placement_group(slot)

    def release_pending(self) -> None:
        for slot in self._pending:
            remove_placement_group(slot)
        self._pending = []
