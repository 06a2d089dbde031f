"""WorkerGroup: the run's workers as one group - placement, membership, generations, calls on every
member, and polling while they train.

The Controller decides; the group executes and reports::

    lost = group.place(max_workers=4, min_workers=2, timeout_s=60)   # workers that could not start
    reports = group.form(run_step=0)                 # generation g+1: every member joins (JoinReports)
    group.sync_state(source_rank=0)                  # rank 0's state to every member
    group.start_training(until_step=100, faults=[(), ()])
    status = group.poll()                            # a GroupStatus, judged by actors.controller.policies
    group.end_generation()                           # the news still in flight
    group.shutdown()

A call that finds members dead or hung raises ``MembersFailed``; one where a member raised an error of
the job itself raises ``MemberRaised``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import ray

from raylastic.actors.processes.setup_hook import Warmth, worker_runtime_env
from raylastic.actors.processes.warm_processes import WarmProcesses
from raylastic.actors.rendezvous.keys import (
    RendezvousKeys,
    beside_this_process,
    call_off_generation,
    forget_generations_before,
)
from raylastic.actors.status.group import GroupStatus, LostWorker
from raylastic.actors.status.peer_loss import plain_error
from raylastic.actors.worker.actor import JoinReport, WorkerSpec
from raylastic.actors.worker_group.member_calls import (
    COLLECTIVE_GRACE_S,
    CallBounds,
    MemberRaised,
    MembersFailed,
    call_members,
)
from raylastic.actors.worker_group.membership import Member, Membership, StartFailure
from raylastic.actors.worker_group.placement import (
    ReservedBundles,
    ReservedSlots,
    SlotShape,
    WorkerSlots,
    draining_nodes,
)
from raylastic.actors.worker_group.poller import GenerationPoller, death_reason
from raylastic.jobconfig import FaultConfig, JobConfig
from raylastic.strategies.checkpoint_catalogue import CheckpointSettings
from raylastic.strategies.group_assignment import GroupAssignment, new_store_prefix
from raylastic.strategies.parallel_layout import ParallelLayout, in_place_order
from raylastic.strategies.peer_restore import PeerRestorePlan
from raylastic.strategies.region_plan import RegionCopy, RegionRestorePlan, RestoreTraffic

START_GRACE_S = 1.0
"""After min_workers are placed, how long the start waits for the rest of max_workers."""
JOIN_RENDEZVOUS = 5
"""Collective timeouts a join's survivors may wait out after a member was lost: the store's waits end when the
Controller calls the generation's rendezvous off, the collectives when the lost member's process is gone, but a
rank waiting for a peer to connect to it waits 5 of them (gloo/transport/tcp/pair.h: that wait has no other bound,
and the peer's death does not end it)."""
LONG_POLL_S = 1.0
"""Longest a worker's poll waits for news: how fresh step results are when nothing else happens.
Each poll costs the Controller, the worker and Ray's services CPU that a small model's steps,
on a machine with no core to spare, would otherwise have had."""
NOTICE_POLL_S = 1.0
"""How often the GCS is asked which nodes are draining (a spot notice gives 30-120 s)."""
BUSY_POLL_S = 0.1
"""How often the group is polled while something is under way (slots or joiners awaited, a drain,
an error's grace period); otherwise the polls' answers set the pace."""


class WorkerGroup:
    def __init__(self, membership: Membership, *, collective_timeout_s: float, step_timeout_s: float,
                 max_call_s: float) -> None:
        """``max_call_s``: the longest a call on a member may take before the member is taken as hung
        (failure.max_step_s: a save, a gather or an evaluation is bounded as a step is)."""
        self.membership = membership
        self.collective_timeout_s = collective_timeout_s
        self.bounds = CallBounds(collective_timeout_s=collective_timeout_s, step_timeout_s=step_timeout_s,
                                 max_call_s=max_call_s)
        self.poll_wait_s = min(LONG_POLL_S, step_timeout_s / 4)  # a live worker answers well within the stall timeout
        self.store = RendezvousKeys.options(**beside_this_process()).remote()
        self.store_prefix = new_store_prefix()
        self.generation = -1
        self.ranked: list[Member] = []
        """The members of the generation formed last, in rank order."""
        self.layout: ParallelLayout | None = None
        """The model-parallel layout of the generation formed last."""
        self.set_aside: list[tuple[Member, Any]] = []
        """The members that generation's layout left out, and the drained members handing their parts over, with
        their ``leave`` calls (the parts they kept)."""
        self.handing_over: list[tuple[Member, Any]] = []
        """Drained members out of the group whose parts the next formation takes (``remove_drained``)."""
        self._poller: GenerationPoller | None = None
        self._draining_nodes: dict[str, float | None] = {}
        self._notices_read_at = -NOTICE_POLL_S

    @classmethod
    def for_job(cls, job: JobConfig, checkpointer: CheckpointSettings, *, reserved: ReservedBundles | None = None,
                profile_dir: str | None = None) -> WorkerGroup:
        """The group of ``job``'s workers, in slots of their own (or in ``reserved`` bundles)."""
        scaling = job.scaling
        spec = WorkerSpec.for_job(job, checkpointer, profile_dir)
        shape = SlotShape(cpus=scaling.cpus_per_worker, gpus=int(scaling.use_gpu),
                          custom=dict(scaling.resources_per_worker))
        slots = (ReservedSlots(reserved.placement_group, list(reserved.bundle_indices), shape) if reserved
                 else WorkerSlots(shape, job.name))
        membership = Membership(run_name=job.name, spec=spec, slots=slots, cpus=shape.cpus, gpus=shape.gpus,
                                resources=shape.custom, warm=WarmProcesses() if scaling.warm_processes else None,
                                max_start_failures=job.failure.max_start_failures,
                                runtime_env=worker_runtime_env(scaling))
        return cls(membership, collective_timeout_s=job.failure.collective_timeout_s,
                   step_timeout_s=job.failure.step_timeout_s, max_call_s=job.failure.max_step_s)

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
                    raise MemberRaised(member.name, plain_error(error), where="while starting") from None
                lost.append(LostWorker(member.name, death_reason(error)))
            except ray.exceptions.GetTimeoutError:
                lost.append(LostWorker(member.name, f"not started within scaling.placement_timeout_s={timeout_s}s"))
            self.membership.drop(member)
        self.membership.top_up(constructed)
        return lost

    def capacity_note(self) -> str:
        """What one worker needs and what the cluster has, for an error saying too few could be placed."""
        return f"(each needs {self.membership.slots.shape.bundle()}); the cluster has {ray.cluster_resources()}"

    def grow(self, members: int, *, spares: int = 0, wait_s: float = 0.0) -> int:
        """``members`` more workers for the run: ready spares first, new workers on the slots ready now for the
        rest (joiners: they come in once constructed, which this waits up to ``wait_s`` for); then ``spares`` new
        spares on the slots still ready. Returns how many spares were taken."""
        taken = len(self.membership.promote_spares(members)) if members > 0 else 0
        self.membership.add_joiners(members - taken)
        if wait_s > 0:
            self.membership.wait_for_joiners(wait_s)
        self.membership.add_spares(spares)
        return taken

    @property
    def num_joining(self) -> int:
        return len(self.membership.joining)

    @property
    def num_spares_ready(self) -> int:
        return len(self.membership.ready_spares())

    def take_start_failures(self) -> list[StartFailure]:
        """New workers that could not be constructed since the last call (each replaced on a new slot)."""
        return self.membership.take_start_failures()

    def admit_ready_joiners(self) -> dict[str, Warmth]:
        """Constructed joiners become members: name -> how far each one's process had come when it was asked for."""
        joiners = self.membership.ready_joiners()
        self.membership.admit(joiners)
        return {m.name: m.warmth for m in joiners}

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

    def remove_drained(self, *, hand_over: bool = False) -> dict[str, str]:
        """The drained members leave now, at a step boundary: their names -> the nodes they were on. With
        ``hand_over`` (model parallelism), each leaves its group keeping its part of the state, which the next
        formation's restore takes as a spare's (``set_aside``); ``release_departed`` ends them after it."""
        leaving = self.membership.remove_drained(hand_over=hand_over)
        if hand_over:
            self.handing_over += [(m, m.actor.leave.remote(self.collective_timeout_s)) for m in leaving]
        return {m.name: m.node_id for m in leaving}

    def release_departed(self) -> None:
        """The drained members whose parts the last formation could take go now."""
        self.handing_over = []
        self.membership.release_departed()

    def drop(self, name: str) -> None:
        """A member (or joiner) that failed: removed, and a slot requested for its replacement."""
        for member in self.membership.members + self.membership.joining:
            if member.name == name:
                self.membership.drop(member)

    def shutdown(self) -> None:
        self.membership.shutdown()

    # -- generations ----------------------------------------------------------------------------------------
    def form(self, *, run_step: int, layout: ParallelLayout | None = None) -> list[JoinReport]:
        """Every member leaves its old group and joins generation g+1; their JoinReports, in rank order.

        With a model-parallel ``layout``, the members are ranked so that what each holds of the previous
        generation's state stays where it is and each tp group shares a node where it can (``in_place_order``),
        and those beyond the layout's ranks leave their group and wait as spares (a peer blocked in a collective
        with one of them fails at once, as with a member that left)."""
        self.generation += 1
        if layout is not None:
            members = self.membership.members
            previous = {id(member): rank for rank, member in enumerate(self.ranked)}
            previous_ranks = [previous.get(id(member)) for member in members]
            order = in_place_order(self.layout, previous_ranks, layout,
                                   [m.node_id or self.membership.slots.node_of(m.slot) for m in members])
            spares = [(members[index], members[index].actor.leave.remote(self.collective_timeout_s))
                      for index in order[layout.world_size:]]  # a spare's failure is found as a spare's
            self.set_aside = spares + self.handing_over
            self.membership.rank([members[index] for index in order[:layout.world_size]])
        else:
            self.set_aside = list(self.handing_over)
        self.ranked, self.layout = list(self.membership.members), layout
        reports = self._call_all("join", [(GroupAssignment(
            generation=self.generation, rank=rank, world_size=self.size, store=self.store,
            store_prefix=self.store_prefix, timeout_s=self.collective_timeout_s,
            run_step=run_step, layout=layout),) for rank in range(self.size)], rendezvous=JOIN_RENDEZVOUS,
            on_failure=self._call_off_rendezvous)
        for member, report in zip(self.ranked, reports, strict=True):
            member.node_id = report.node_id
        forget_generations_before(self.store, self.store_prefix, self.generation)
        return reports

    def _call_off_rendezvous(self) -> None:
        """The forming generation lost a member: its other ranks' waits on the store end now."""
        call_off_generation(self.store, self.store_prefix, self.generation)

    # -- state, checkpoints and the final model: collectives on every member ---------------------------------
    def sync_state(self, *, source_rank: int) -> None:
        """Every member takes the state of ``source_rank`` (a replicated strategy's hand-over)."""
        self._call_all("sync_state", [(source_rank,)] * self.size)

    def restore_from_peers(self, plan: PeerRestorePlan) -> None:
        """Every member takes its shards of the new layout from the copies ``plan`` names."""
        self._call_all("restore_from_peers", [(plan,)] * self.size)

    def set_aside_copies(self) -> list[tuple[RegionCopy, ...]]:
        """The parts of the state each member set aside by the last formation kept (none from one that did not
        answer within the collective timeout), in ``set_aside`` order."""
        calls = [call for _, call in self.set_aside]
        if calls:
            ray.wait(calls, num_returns=len(calls), timeout=self.collective_timeout_s + COLLECTIVE_GRACE_S)
        kept = []
        for call in calls:
            try:
                kept.append(ray.get(call, timeout=0))
            except Exception:  # noqa: BLE001 - a spare lost or slow: its parts are not used
                kept.append(())
        return kept

    def handed_over_by(self, plan: RegionRestorePlan) -> list[str]:
        """The workers set aside (spares, drained members) whose parts ``plan`` hands to members."""
        return sorted({self.set_aside[index - self.size][0].name for handed in plan.deliveries.values()
                       for index, _ in handed})

    def restore_regions(self, plan: RegionRestorePlan) -> list[RestoreTraffic]:
        """Every member lays the state of ``plan`` out in the new layout from the parts the members kept and those
        handed to it from spares (``plan.deliveries``, through Ray's object store); what each received."""
        handed = [[self.set_aside[index - self.size][0].actor.kept_part.remote(copy)
                   for index, copy in plan.deliveries.get(rank, ())] for rank in range(self.size)]
        return self._call_all("restore_regions", [(plan, *refs) for refs in handed])

    def restore(self, path: str, step: int) -> str | None:
        """Every member loads the checkpoint at ``path`` (of ``step``); why its files were refused (an altered
        file), or None when it was loaded."""
        return self._call_all("restore", [(path, step)] * self.size)[0]

    def save_checkpoint(self) -> str:
        """Every member saves its part of the state now; the checkpoint's path."""
        return self._call_all("save_checkpoint")[0]

    def full_model_file(self, *, replicated: bool) -> bytes:
        """model.pt's bytes: from rank 0 alone when every rank holds the whole model, else gathered by all."""
        if replicated:
            return self._call_one(0, "full_model_file")
        return self._call_all("full_model_file", [(rank == 0,) for rank in range(self.size)])[0]

    def evaluate(self) -> dict[str, float]:
        """The evaluation of the current state (every member takes part; rank 0's metrics)."""
        return self._call_all("evaluate")[0]

    def memory(self) -> list[dict[str, int]]:
        """Each member's memory figures, in rank order."""
        return self._call_all("memory")

    def _call_all(self, method: str, args: list[tuple] | None = None, *, rendezvous: int = 1,
                  on_failure: Callable[[], Any] | None = None) -> list[Any]:
        """Call a collective ``method`` on every member (with ``args[rank]``) and return the results, every wait
        bounded (actors/worker_group/member_calls.py); ``rendezvous``: how many collective timeouts the call may
        wait out; ``on_failure``: called once the call is known to have failed. Raises MembersFailed naming the dead and
        hung, or MemberRaised for an error of the job itself."""
        return call_members(list(self.membership.members), method, args, bounds=self.bounds, rendezvous=rendezvous,
                            on_failure=on_failure)

    def _call_one(self, rank: int, method: str, *args: Any) -> Any:
        """A call that is no collective, on the member of ``rank``, bounded as ``_call_all``'s are."""
        try:
            return call_members([self.membership.members[rank]], method, [args], bounds=self.bounds)[0]
        except MembersFailed as failure:
            raise MembersFailed([dataclasses.replace(worker, rank=rank) for worker in failure.lost]) from None

    # -- training -------------------------------------------------------------------------------------------
    def start_training(self, until_step: int, faults: list[tuple[FaultConfig, ...]],
                       shares: tuple[int, ...] | None = None) -> None:
        """Every member starts its step loop (with ``faults[rank]``, the injected faults aimed at it, and the batch
        split ``shares``: None, even). A member that does not answer within the collective timeout is hung."""
        members = list(self.membership.members)
        starts = [m.actor.train.remote(until_step, faults[rank], shares) for rank, m in enumerate(members)]
        answered, _ = ray.wait(starts, num_returns=len(starts), timeout=self.collective_timeout_s + COLLECTIVE_GRACE_S)
        try:
            ray.get(answered)
        except ray.exceptions.RayActorError as error:
            poller = GenerationPoller(members, wait_s=0.0)
            ray.wait(list(poller.polls.values()), num_returns=len(members), timeout=1.0)
            poller.poll(timeout_s=0.0)
            lost = [LostWorker(s.name, s.dead, rank) for rank, s in enumerate(poller.statuses()) if s.dead]
            raise MembersFailed(lost or [LostWorker(members[0].name, death_reason(error), 0)]) from None
        silent = [LostWorker(m.name, "hung: it did not start training within failure.collective_timeout_s="
                             f"{self.collective_timeout_s}s", rank)
                  for rank, (m, start) in enumerate(zip(members, starts, strict=True)) if start not in answered]
        if silent:
            raise MembersFailed(silent)
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

    def request_checkpoint(self, number: int) -> None:
        """Ask every member for the time-based checkpoint ``number`` (they vote; all save after the same step)."""
        for member in self.membership.members:
            member.actor.request_checkpoint.remote(number)

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
