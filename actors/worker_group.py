"""WorkerGroup: the run's workers as one group - placement, membership, generations, calls on every
member, and polling while they train.

The Controller decides; the group executes and reports::

    lost = group.place(max_workers=4, min_workers=2, timeout_s=60)   # workers that could not start
    reports = group.form(run_step=0)                 # generation g+1: every member joins (JoinReports)
    group.call_all("sync_state", [(0,)] * group.size)
    group.start_training(until_step=100, faults=[(), ()])
    status = group.poll()                            # a GroupStatus, judged by actors.policies
    group.end_generation()                           # the news still in flight
    group.shutdown()

A call that finds members dead or hung raises ``MembersFailed``; one where a member raised an error of
the job itself raises ``MemberRaised``.
"""

from __future__ import annotations

import re
import time
from typing import Any

import ray

from actors.failures import is_peer_loss
from actors.group_status import GroupStatus, LostWorker
from actors.membership import Member, Membership
from actors.placement import ReservedBundles, ReservedSlots, SlotShape, WorkerSlots, draining_nodes
from actors.poller import GenerationPoller, death_reason
from actors.warm_start import WarmProcesses
from actors.worker import JoinReport, TrainingThreadHung, WorkerSpec
from jobconfig import FaultConfig, JobConfig
from strategies.checkpoint import Checkpointer
from strategies.process_group import GroupAssignment, host_store, new_store_prefix

START_GRACE_S = 1.0
"""After min_workers are placed, how long the start waits for the rest of max_workers."""
COLLECTIVE_GRACE_S = 5.0
"""Beyond failure.collective_timeout_s: how long members may take to give up on a dead peer."""
JOIN_RENDEZVOUS = 3
"""Rendezvous a join holds (the group, the checkpoint group, the node ids): each may wait one collective timeout."""
LONG_POLL_S = 1.0
"""Longest a worker's poll waits for news: how fresh step results are when nothing else happens.
Each poll costs the Controller, the worker and Ray's services CPU that a small model's steps,
on a machine with no core to spare, would otherwise have had."""
NOTICE_POLL_S = 1.0
"""How often the GCS is asked which nodes are draining (a spot notice gives 30-120 s)."""
BUSY_POLL_S = 0.1
"""How often the group is polled while something is under way (slots or joiners awaited, a drain,
an error's grace period); otherwise the polls' answers set the pace."""


class MembersFailed(Exception):
    """Members were found dead or hung (``lost``; empty when every member's collective lost a peer that is
    nonetheless still there: the group re-forms as it is)."""

    def __init__(self, lost: list[LostWorker]) -> None:
        super().__init__("; ".join(worker.describe() for worker in lost))
        self.lost = tuple(lost)


class MemberRaised(Exception):
    """A member raised an error of the job itself in a call (or could not even be built)."""


class WorkerGroup:
    def __init__(self, membership: Membership, *, collective_timeout_s: float, step_timeout_s: float) -> None:
        self.membership = membership
        self.collective_timeout_s = collective_timeout_s
        self.poll_wait_s = min(LONG_POLL_S, step_timeout_s / 4)  # a live worker answers well within the stall timeout
        self.node_ip = ray.util.get_node_ip_address()
        self.store = host_store(self.node_ip)
        self.store_prefix = new_store_prefix()
        self.generation = -1
        self.ranked: list[Member] = []
        """The members of the generation formed last, in rank order."""
        self._poller: GenerationPoller | None = None
        self._draining_nodes: dict[str, float | None] = {}
        self._notices_read_at = -NOTICE_POLL_S

    @classmethod
    def for_job(cls, job: JobConfig, checkpointer: Checkpointer, *, reserved: ReservedBundles | None = None,
                profile_dir: str | None = None) -> WorkerGroup:
        """The group of ``job``'s workers, in slots of their own (or in ``reserved`` bundles)."""
        scaling = job.scaling
        spec = WorkerSpec.for_job(job, checkpointer, profile_dir)
        shape = SlotShape(cpus=scaling.cpus_per_worker, gpus=int(scaling.use_gpu),
                          custom=dict(scaling.resources_per_worker))
        slots = (ReservedSlots(reserved.placement_group, list(reserved.bundle_indices), shape) if reserved
                 else WorkerSlots(shape, job.name))
        membership = Membership(run_name=job.name, spec=spec, slots=slots, cpus=shape.cpus, gpus=shape.gpus,
                                resources=shape.custom, warm=WarmProcesses() if scaling.warm_processes else None)
        return cls(membership, collective_timeout_s=job.failure.collective_timeout_s,
                   step_timeout_s=job.failure.step_timeout_s)

    @property
    def size(self) -> int:
        return self.membership.size

    @property
    def member_names(self) -> list[str]:
        return [m.name for m in self.membership.members]

    # -- placement and membership ---------------------------------------------------------------------------
    def place(self, *, max_workers: int, min_workers: int, timeout_s: float,
              spare_workers: int = 0) -> list[LostWorker]:
        """Start up to ``max_workers`` (waiting up to ``timeout_s`` for ``min_workers`` slots) and up to
        ``spare_workers`` spares (others start as their slots become ready). Slots go to ``min_workers``
        members first, then to the spares the job asked for, then to growing towards ``max_workers``. Waits
        until each member has built its workload, so the first rendezvous does not time out on a slow node's
        worker. Returns those that died or did not start in time (dropped); raises MemberRaised when one
        could not build the workload."""
        slots, wanted = self.membership.slots, max_workers + spare_workers
        slots.request(wanted)
        taken = slots.take_ready(wanted, at_least=min_workers, timeout_s=timeout_s)
        if len(taken) < wanted:  # slots placed together become ready a moment apart
            taken += slots.take_ready(wanted - len(taken), at_least=wanted - len(taken), timeout_s=START_GRACE_S)
        spares_from = min(min_workers, len(taken))
        spare_slots = taken[spares_from:spares_from + spare_workers]
        members = self.membership.spawn([slot for slot in taken if slot not in spare_slots][:max_workers])
        self.membership.admit(members)
        self.membership.spares += self.membership.spawn(spare_slots)  # they build while the members do
        ray.wait([m.ready for m in members], num_returns=len(members), timeout=timeout_s)
        lost, constructed = [], []
        for member in members:
            try:
                ray.get(member.ready, timeout=0)
                constructed.append(member)
                continue
            except ray.exceptions.RayActorError as error:
                if error.actor_init_failed:
                    raise MemberRaised(f"worker {member.name} could not start: {plain(str(error))}") from None
                lost.append(LostWorker(member.name, death_reason(error)))
            except ray.exceptions.GetTimeoutError:
                lost.append(LostWorker(member.name, f"not started within scaling.placement_timeout_s={timeout_s}s"))
            self.membership.drop(member)
        self.membership.top_up(constructed)
        return lost

    def capacity_note(self) -> str:
        """What one worker needs and what the cluster has, for an error saying too few could be placed."""
        return f"(each needs {self.membership.slots.shape.bundle()}); the cluster has {ray.cluster_resources()}"

    def add_joiners(self, count: int, *, timeout_s: float = 0.0) -> None:
        """Start ``count`` new workers, waiting up to ``timeout_s`` for their slots; they come in once ready."""
        self.membership.add_joiners(count, timeout_s=timeout_s)

    @property
    def num_joining(self) -> int:
        return len(self.membership.joining)

    @property
    def num_spares_ready(self) -> int:
        return len(self.membership.ready_spares())

    def add_spares(self, count: int) -> None:
        """Start ``count`` spares on slots ready now: they build their workload and wait, idle."""
        self.membership.add_spares(count)

    def promote_spares(self, count: int) -> int:
        """Up to ``count`` constructed spares become joiners, ready to come in at once; returns how many."""
        return len(self.membership.promote_spares(count))

    def wait_for_joiners(self, timeout_s: float) -> None:
        self.membership.wait_for_joiners(timeout_s)

    def admit_ready_joiners(self) -> dict[str, bool]:
        """Constructed joiners become members: name -> whether each started in a warm process."""
        joiners = self.membership.ready_joiners()
        self.membership.admit(joiners)
        return {m.name: m.warm for m in joiners}

    def drain(self, *, rank: int | None = None, node_id: str | None = None, replace: bool = False) -> list[str]:
        """The member of ``rank`` (or every member on ``node_id``) leaves at the next step boundary; with
        ``replace``, a slot is asked for each (Ray places none on a draining node)."""
        names = {m.name for r, m in enumerate(self.membership.members)
                 if r == rank or (node_id and m.node_id == node_id)}
        self.membership.drain(names, replace=replace)
        return sorted(names)

    @property
    def num_leaving(self) -> int:
        """Members asked to leave at the next step boundary."""
        return len(self.membership.draining)

    def undrain(self, *, node_id: str) -> None:
        """The members on ``node_id`` stay after all (its drain was called off)."""
        self.membership.undrain({m.name for m in self.membership.members if m.node_id == node_id})

    def remove_drained(self) -> dict[str, str]:
        """The drained members leave now, at a step boundary: their names -> the nodes they were on."""
        return {m.name: m.node_id for m in self.membership.remove_drained()}

    def drop(self, name: str) -> None:
        """A member (or joiner) that failed: removed, and a slot requested for its replacement."""
        for member in self.membership.members + self.membership.joining:
            if member.name == name:
                self.membership.drop(member)

    def shutdown(self) -> None:
        self.membership.shutdown()

    # -- generations ----------------------------------------------------------------------------------------
    def form(self, *, run_step: int) -> list[JoinReport]:
        """Every member leaves its old group and joins generation g+1; their JoinReports, in rank order."""
        self.generation += 1
        self.ranked = list(self.membership.members)
        reports = self.call_all("join", [(GroupAssignment(
            generation=self.generation, rank=rank, world_size=self.size, store_host=self.node_ip,
            store_port=self.store.port, store_prefix=self.store_prefix, timeout_s=self.collective_timeout_s,
            run_step=run_step),) for rank in range(self.size)], rendezvous=JOIN_RENDEZVOUS)
        for member, report in zip(self.ranked, reports, strict=True):
            member.node_id = report.node_id
        return reports

    def call_all(self, method: str, args: list[tuple] | None = None, *, rendezvous: int = 1) -> list[Any]:
        """Call a collective ``method`` on every member (with ``args[rank]``) and return the results.

        When one member's call fails, the others may still wait for it inside the collective, for up to
        failure.collective_timeout_s per rendezvous the call holds: they must have ended before the next
        generation's calls run beside them in the same processes. A member whose call has not ended by
        then is hung. Raises MembersFailed naming the dead and hung (those whose collective merely lost a
        peer are survivors), or MemberRaised when a member raised an error of the job itself.
        """
        members = list(self.membership.members)
        calls = [getattr(m.actor, method).remote(*(args[rank] if args else ())) for rank, m in enumerate(members)]
        results: list[Any] = [None] * len(calls)
        pending = dict(zip(calls, range(len(calls)), strict=True))
        lost: list[LostWorker] = []
        survivors_saw_a_loss, deadline = False, None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not ready:
                break
            for ref in ray.wait(list(pending), num_returns=len(pending), timeout=0)[0]:
                member = members[rank := pending.pop(ref)]
                try:
                    results[rank] = ray.get(ref)
                    continue
                except ray.exceptions.RayActorError as error:
                    lost.append(LostWorker(member.name, death_reason(error), rank))
                except ray.exceptions.RayTaskError as error:
                    if isinstance(error.cause, TrainingThreadHung):
                        lost.append(LostWorker(member.name, f"hung: {error.cause}", rank))
                    elif is_peer_loss(error.cause):
                        survivors_saw_a_loss = True
                    else:
                        raise MemberRaised(f"{member.name} raised an error in {method}\n{plain(str(error))}") from None
                deadline = deadline or time.monotonic() + rendezvous * self.collective_timeout_s + COLLECTIVE_GRACE_S
        lost += [LostWorker(members[rank].name, f"hung: its {method} call did not end within {rendezvous} collective "
                            "timeout(s) of the failure", rank) for rank in pending.values()]
        if lost or survivors_saw_a_loss:
            raise MembersFailed(lost)
        return results

    def call_one(self, rank: int, method: str, *args: Any) -> Any:
        """A call that is no collective, on the member of ``rank``."""
        member = self.membership.members[rank]
        try:
            return ray.get(getattr(member.actor, method).remote(*args))
        except ray.exceptions.RayActorError as error:
            raise MembersFailed([LostWorker(member.name, death_reason(error), rank)]) from None

    # -- training -------------------------------------------------------------------------------------------
    def start_training(self, until_step: int, faults: list[tuple[FaultConfig, ...]],
                       shares: tuple[int, ...] | None = None) -> None:
        """Every member starts its step loop (with ``faults[rank]``, the injected faults aimed at it, and the batch
        split ``shares``: None, even)."""
        members = list(self.membership.members)
        try:
            ray.get([m.actor.train.remote(until_step, faults[rank], shares) for rank, m in enumerate(members)])
        except ray.exceptions.RayActorError as error:
            poller = GenerationPoller(members, wait_s=0.0)
            ray.wait(list(poller.polls.values()), num_returns=len(members), timeout=1.0)
            poller.poll(timeout_s=0.0)
            lost = [LostWorker(s.name, s.dead, rank) for rank, s in enumerate(poller.statuses()) if s.dead]
            raise MembersFailed(lost or [LostWorker(members[0].name, death_reason(error), 0)]) from None
        self._poller = GenerationPoller(members, self.poll_wait_s)

    def poll(self) -> GroupStatus:
        """The members' statuses and news, after waiting for answers (briefly when something is under way)."""
        busy = self._poller.first_error_at is not None or self.membership.changes_pending()
        members, news = self._poller.poll(BUSY_POLL_S if busy else self.poll_wait_s)
        return self._status(members, news)

    def end_generation(self) -> GroupStatus:
        """The training generation ended: the news still in flight, and every member's last status."""
        news = self._poller.finish()
        return self._status(self._poller.statuses(), news)

    def request_boundary(self) -> None:
        """Ask every member to stop at the next step boundary (they vote; all stop after the same step)."""
        for member in self.membership.members:
            member.actor.request_stop.remote()

    def _status(self, members: tuple, news: tuple) -> GroupStatus:
        return GroupStatus(generation=self.generation, members=members, news=news,
                           errors_for_s=self._poller.errors_for_s(), num_joining=self.num_joining,
                           num_placeable=self.membership.slots.count_ready(),
                           num_joiners_ready=len(self.membership.ready_joiners()),
                           draining=bool(self.membership.draining), draining_nodes=self._read_notices(),
                           num_spares=len(self.membership.spares),
                           num_spares_ready=len(self.membership.ready_spares()))

    def _read_notices(self) -> dict[str, float | None]:
        if time.monotonic() - self._notices_read_at >= NOTICE_POLL_S:
            self._draining_nodes, self._notices_read_at = draining_nodes(), time.monotonic()
        return self._draining_nodes


def plain(text: str) -> str:
    """``text`` without the terminal colour codes Ray puts in the errors it relays."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)
