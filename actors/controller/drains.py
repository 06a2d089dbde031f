"""Planned departures while a generation trains: members on a node Ray drains (a preemption notice) and
ranks that report themselves stragglers leave at the next step boundary; a drain called off before it keeps
them. The Controller's decisions are ``actors.controller.policies``' (``read_drain_notices``, ``stragglers_to_drain``);
this carries them out on the WorkerGroup and logs them. A drain asked from another thread (``Controller.drain``: the
actor is threaded) and a boundary's leaving take turns, so one asked while members leave is taken at the next
boundary, never cleared unseen.

Example (the Controller, every poll, and at the boundary)::

    drains = Drains(group, log, min_workers=2)
    drains.observe(status, step=120)  # acts on drain notices, drains stragglers min_workers can spare
    drains.ask(rank=1)             # any thread: the member of rank 1 leaves at the next boundary
    with drains.boundary():        # the boundary: no drain is asked meanwhile
        drains.left(step=121)      # "worker_left" and "drained" events
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from raylastic.actors.controller.policies import read_drain_notices, stragglers_to_drain
from raylastic.actors.controller.run_log import RunLog
from raylastic.actors.status.group import GroupStatus


class Drains:
    def __init__(self, group: Any, log: RunLog, *, min_workers: int) -> None:
        """``group``: the WorkerGroup (or a test's fake); ``min_workers``: how few a straggler's drain may leave."""
        self.group = group
        self.log = log
        self.min_workers = min_workers
        self.pending: dict[str, list[str]] = {}
        """Draining nodes acted on -> their members, which leave at the next step boundary."""
        self._turns = threading.RLock()
        """Held while a drain is asked and while the drained leave: the group's drains are read and cleared there."""

    def ask(self, *, rank: int | None = None, node_id: str | None = None) -> list[str]:
        """From any thread: the member of ``rank`` (or every member on ``node_id``) leaves at the next step boundary
        (the one being taken, if its members have not left yet). Returns their names."""
        with self._turns:
            return self.group.drain(rank=rank, node_id=node_id)

    @contextlib.contextmanager
    def boundary(self) -> Iterator[None]:
        """While the block runs (a step boundary: who leaves is read, their state saved, they leave), no drain is
        asked: one asked meanwhile waits, and is taken at the next boundary."""
        with self._turns:
            yield

    def observe(self, status: GroupStatus, step: int) -> None:
        """Every poll: act on the drain notices, and drain the stragglers min_workers can spare."""
        with self._turns:
            self.act_on_notices(status, step=step)
            self.drain_stragglers(status, step=step)

    def act_on_notices(self, status: GroupStatus, *, step: int) -> None:
        """Members on a node Ray drains leave at the next step boundary (and are replaced elsewhere); a drain
        called off before the boundary keeps them."""
        notices = read_drain_notices(status, set(self.pending))
        for node, deadline in notices.new.items():
            workers = self.group.drain(node_id=node, replace=True)
            self.pending[node] = workers
            self.log.event("node_draining", step, node_id=node, workers=workers,
                           deadline_s=None if deadline is None else round(deadline - time.time(), 1))
        for node in notices.called_off:
            self.group.undrain(node_id=node)
            del self.pending[node]
            self.log.event("node_drain_cancelled", step, node_id=node)

    def drain_stragglers(self, status: GroupStatus, *, step: int) -> None:
        """A rank that reported itself a straggler leaves at the next step boundary, if min_workers allows."""
        for rank in stragglers_to_drain(status, min_workers=self.min_workers, num_leaving=self.group.num_leaving):
            self.log.event("worker_draining", step, workers=self.group.drain(rank=rank), reason="straggler")

    def left(self, *, step: int, hand_over: bool = False) -> None:
        """At the step boundary: the drained members leave now (with ``hand_over``, keeping their parts of the state
        for the next formation: ``WorkerGroup.remove_drained``)."""
        with self._turns:
            left = self.group.remove_drained(hand_over=hand_over)
        for name, node in left.items():
            self.log.event("worker_left", step, worker=name, node_id=node, reason="drained")
        for node, workers in self.pending.items():
            self.log.event("drained", step, node_id=node, workers=workers, steps_lost=0)
        self.pending = {}
