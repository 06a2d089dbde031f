"""Who is in the run: members of the current generation, workers starting up to join, and drains.

New workers are started (actor created, model built) while the current generation keeps
training; only once they are ready does the Controller stop the group at a step boundary to
let them in, so a scale-up costs the group one re-formation, not the start-up time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError

from raylastic.actors.processes.setup_hook import TRAINS, Warmth
from raylastic.actors.processes.warm_processes import WarmProcesses
from raylastic.actors.status.peer_loss import plain_error
from raylastic.actors.worker.actor import TrainWorkerActor, WorkerSpec
from raylastic.actors.worker_group.placement import ReservedSlots, WorkerSlots
from raylastic.jobconfig.naming import worker_name


@dataclass(frozen=True)
class StartFailure:
    """A new worker whose actor could not be constructed (its workload, CUDA, an import failed where it was
    placed)."""

    worker: str
    node_id: str
    error: str


class WorkersCannotStart(RuntimeError):
    """failure.max_start_failures new workers in a row could not be constructed: the run cannot grow back."""


@dataclass
class Member:
    actor: Any
    slot: Any
    name: str
    node_id: str = ""
    ready: Any = field(default=None, repr=False)
    """ObjectRef that resolves once the actor is constructed (to its ProcessStart)."""
    requested_at: float = 0.0
    constructed: bool = False
    warmth: Warmth = field(default_factory=Warmth)
    """How far its process had come when it was asked for: started ahead, the training modules imported."""


class Membership:
    def __init__(self, *, run_name: str, spec: WorkerSpec, slots: WorkerSlots | ReservedSlots, cpus: float, gpus: int,
                 resources: dict[str, float], warm: WarmProcesses | None = None, max_start_failures: int = 3,
                 runtime_env: dict[str, Any] = TRAINS) -> None:
        """``runtime_env``: the workers' (setup_hook.worker_runtime_env), one for all of them."""
        self.run_name = run_name
        self.max_start_failures = max_start_failures
        self.start_failures: list[StartFailure] = []
        """New workers that could not be constructed, not yet reported (``take_start_failures``)."""
        self._failed_starts_in_a_row = 0
        self.spec = spec
        self.slots = slots
        self.warm = warm
        self._actor_options = dict(num_cpus=cpus, num_gpus=gpus, resources=resources or None, max_restarts=0,
                                   max_concurrency=2, runtime_env=runtime_env)
        self.members: list[Member] = []
        self.joining: list[Member] = []
        self.spares: list[Member] = []
        """Workers started and held idle (scaling.spare_workers), to join at once when one is needed."""
        self.draining: dict[str, bool] = {}
        """Members asked to leave at the next step boundary -> whether a replacement is asked for."""
        self.departing: list[tuple[Member, bool]] = []
        """Drained members out of the group whose processes stay until the next formation took their parts of the
        state (``remove_drained(hand_over=True)``), each with whether a replacement is asked for."""
        self._spawned = 0

    @property
    def size(self) -> int:
        return len(self.members)

    def changes_pending(self) -> bool:
        """Slots asked for and not placed yet, workers starting up, or drains: something to check soon."""
        return bool(self.joining or self.draining or self.slots.waiting)

    def spawn(self, slots: list) -> list[Member]:
        started = []
        for slot in slots:
            self._spawned += 1
            name = worker_name(self.run_name, self._spawned)
            actor = TrainWorkerActor.options(
                name=name, scheduling_strategy=self.slots.scheduling(slot), **self._actor_options).remote(self.spec)
            started.append(Member(actor=actor, slot=slot, name=name, ready=actor.process_start.remote(),
                                  requested_at=time.time()))
        return started

    def top_up(self, constructed: list[Member]) -> None:
        """Workers were constructed: start a process ahead on each of their nodes, for the next worker there.
        Not at spawn: a process started then may serve the spawn itself, and the one Ray started for it,
        which Ray keeps idle only while the node has fewer processes than CPUs, be left instead."""
        if self.warm is not None and constructed:
            process = ray.get(constructed[0].ready)  # all of the run's workers share one runtime environment
            self.warm.top_up({self.slots.node_of(member.slot) for member in constructed}, process.runtime_env)

    def add_joiners(self, count: int, *, timeout_s: float = 0.0) -> int:
        """Start up to ``count`` new workers on slots that are ready (waiting up to ``timeout_s`` for
        all of them); returns how many started."""
        joiners = self.spawn(self.slots.take_ready(count, at_least=count, timeout_s=timeout_s))
        self.joining += joiners
        return len(joiners)

    def add_spares(self, count: int) -> int:
        """Start up to ``count`` spares on slots that are ready now; returns how many started."""
        spares = self.spawn(self.slots.take_ready(count))
        self.spares += spares
        return len(spares)

    def ready_spares(self) -> list[Member]:
        """Spares whose actor is constructed; a spare that died is dropped and its slot asked for again."""
        return self._constructed(self.spares)

    def promote_spares(self, count: int) -> list[Member]:
        """Up to ``count`` constructed spares become joiners, ready to come in at once."""
        promoted = self.ready_spares()[:count]
        self.spares = [m for m in self.spares if m not in promoted]
        self.joining += promoted
        return promoted

    def ready_joiners(self) -> list[Member]:
        """Joiners whose actor is constructed; a joiner that died starting is dropped and replaced."""
        return self._constructed(self.joining)

    def _constructed(self, starting: list[Member]) -> list[Member]:
        """Of ``starting`` (joiners or spares), those constructed; one that died is dropped from the list and
        its slot asked for again. Raises WorkersCannotStart when failure.max_start_failures in a row could not
        be constructed."""
        if not starting:
            return []
        ready, _ = ray.wait([m.ready for m in starting], num_returns=len(starting), timeout=0)
        constructed = []
        for member in [m for m in starting if m.ready in ready]:
            try:
                member.warmth = ray.get(member.ready).warmth(member.requested_at)
                constructed.append(member)
                self._failed_starts_in_a_row = 0
            except RayActorError as error:
                starting.remove(member)
                if error.actor_init_failed:
                    self._start_failed(member, error)
                self.remove(member, replace=True)
        self.top_up([m for m in constructed if not m.constructed])
        for member in constructed:
            member.constructed = True
        return constructed

    def _start_failed(self, member: Member, error: RayActorError) -> None:
        failure = StartFailure(member.name, self.slots.node_of(member.slot), plain_error(error))
        self.start_failures.append(failure)
        self._failed_starts_in_a_row += 1
        if self._failed_starts_in_a_row >= self.max_start_failures:
            raise WorkersCannotStart(f"{self._failed_starts_in_a_row} new workers in a row could not start "
                                     f"(failure.max_start_failures={self.max_start_failures}); the last, "
                                     f"{failure.worker} on node {failure.node_id}: {failure.error}")

    def take_start_failures(self) -> list[StartFailure]:
        """The start failures since the last call."""
        taken, self.start_failures = self.start_failures, []
        return taken

    def wait_for_joiners(self, timeout_s: float) -> list[Member]:
        if self.joining:
            ray.wait([m.ready for m in self.joining], num_returns=len(self.joining), timeout=timeout_s)
        return self.ready_joiners()

    def admit(self, joiners: list[Member]) -> None:
        self.joining = [m for m in self.joining if m not in joiners]
        self.members += joiners

    def rank(self, ranked: list[Member]) -> None:
        """The members become ``ranked`` (a reordering of them, or of some); the others wait as spares."""
        self.spares += [m for m in self.members if m not in ranked]
        self.members = list(ranked)

    def drain(self, names: set[str], *, replace: bool = False) -> None:
        """``names`` leave at the next step boundary; with ``replace``, a slot is asked for each (a node
        being taken away: the run should grow back elsewhere)."""
        self.draining |= dict.fromkeys(names & {m.name for m in self.members}, replace)

    def undrain(self, names: set[str]) -> None:
        """A drain called off before the boundary: those members stay."""
        for name in names:
            self.draining.pop(name, None)

    def remove_drained(self, *, hand_over: bool = False) -> list[Member]:
        """Members asked to leave: out of the group now, at a step boundary (replaced if the drain asked for it).
        With ``hand_over``, their processes stay until ``release_departed``."""
        leaving = [m for m in self.members if m.name in self.draining]
        for member in leaving:
            self.members.remove(member)
            if hand_over:
                self.departing.append((member, self.draining[member.name]))
            else:
                self.remove(member, replace=self.draining[member.name])
        self.draining.clear()
        return leaving

    def release_departed(self) -> None:
        """The drained members kept for a hand-over go now."""
        for member, replace in self.departing:
            self.remove(member, replace=replace)
        self.departing = []

    def drop(self, member: Member) -> None:
        """A member that failed: removed, and a slot requested for its replacement."""
        if member in self.members:
            self.members.remove(member)
        self.remove(member, replace=True)

    def remove(self, member: Member, *, replace: bool) -> None:
        ray.kill(member.actor, no_restart=True)
        self.slots.release(member.slot)
        if replace:
            self.slots.request(1)

    def shutdown(self) -> None:
        for member in self.members + self.joining + self.spares + [member for member, _ in self.departing]:
            self.remove(member, replace=False)
        self.departing = []
        self.members, self.joining, self.spares = [], [], []
        self.slots.release_pending()
