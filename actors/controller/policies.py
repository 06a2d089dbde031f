"""Pure policies the Controller asks; they decide from observed state and never call Ray.

Every decision of a run is taken here, from a snapshot:

- ``ScalingPolicy``: how many workers to have (``ScalingState``);
- ``FailurePolicy``: recover from one more failure, or give up;
- ``GenerationJudge``: from a ``GroupStatus`` poll, whether the generation trains on, finished, stopped
  at a boundary, lost workers (dead, silent, hung, blamed for their peers' errors) or hit a job error;
- ``choose_state_source``: where a new generation's state comes from (a checkpoint, the most advanced
  member, the shards kept in the members' memory, the seed at step 0), or that it is lost;
- ``workers_missing``: whether the run must wait for workers before it can form again;
- ``read_drain_notices``: which draining nodes' workers leave at the next step boundary, and which drains
  were called off.
- ``LayoutPolicy`` (actors/controller/layout_policy.py): each generation's layout under model parallelism.

``RunPolicies`` holds the three a Controller is built with (``RunPolicies.for_job``, or a test's own).

Example::

    ScalingPolicy(min_workers=2, max_workers=4).decide(ScalingState(num_workers=2, num_placeable=1))  # Resize(3)
    FailurePolicy(max_failures=1).decide(failures_so_far=2)                                          # Raise(...)
"""

from __future__ import annotations

from dataclasses import dataclass

from raylastic.actors.controller.layout_policy import LayoutPolicy, divisors
from raylastic.actors.status.group import DONE_PHASES, GroupStatus, JobError, LostWorker, WorkersLost
from raylastic.jobconfig import CheckpointConfig, JobConfig, StrategyConfig
from raylastic.strategies.checkpoint_catalogue import Checkpoint
from raylastic.strategies.parallel_layout import ParallelLayout
from raylastic.strategies.peer_restore import PeerRestorePlan
from raylastic.strategies.region_plan import RegionRestorePlan

# -- scaling --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Noop:
    """Keep the current workers."""


@dataclass(frozen=True)
class Resize:
    num_workers: int
    from_spares: int = 0
    """Of the new workers, how many are spares taken (the others start on slots that are ready)."""


@dataclass(frozen=True)
class ScalingState:
    num_workers: int
    """Workers in the current generation (and joining it)."""
    num_placeable: int
    """Further workers whose resources are reserved and ready now."""
    num_spares_ready: int = 0
    """Spares constructed and idle."""
    num_spares: int = 0
    """Spares started, constructed or not."""


@dataclass(frozen=True, kw_only=True)
class ScalingPolicy:
    """Ask for as many workers as allowed, as soon as resources for them are ready, and keep ``spare_workers``
    spares started besides. Spares hold their own slots: they fill new resources at once (a new spare then
    starts on the new slot), not slots the run was given for them."""

    min_workers: int
    max_workers: int
    spare_workers: int = 0
    unit: int = 1
    """The ranks a layer is split over (parallel.tp): a generation takes whole groups of them (``trained_workers``),
    and the spares that complete one join."""

    def decide(self, state: ScalingState) -> Noop | Resize:
        available = state.num_workers + state.num_placeable + (state.num_spares_ready if self.unit > 1 else 0)
        target = trained_workers(min(self.max_workers, available), self.unit)
        if target != state.num_workers and target >= self.min_workers:
            return Resize(target, from_spares=min(state.num_spares_ready, target - state.num_workers))
        return Noop()

    def spares_to_start(self, state: ScalingState, decision: Noop | Resize) -> int:
        """New spares to start on the slots ``decision`` leaves free."""
        grown, taken = ((decision.num_workers - state.num_workers, decision.from_spares)
                        if isinstance(decision, Resize) else (0, 0))
        slots_left = state.num_placeable - (grown - taken)
        return max(0, min(slots_left, self.spare_workers - (state.num_spares - taken)))

    def grows_at_a_boundary(self, *, world_size: int, ready: int) -> bool:
        """Whether ``ready`` workers (joiners built, spares taken) joining a generation of ``world_size`` would train
        more of them: not when they complete no tp x pp group (they would only wait as spares)."""
        return ready > 0 and trained_workers(world_size + ready, self.unit) > trained_workers(world_size, self.unit)

    def spares_to_take(self, *, num_workers: int, num_spares_ready: int) -> int:
        """After a failure: ready spares that bring the group back towards max_workers at once."""
        return max(0, min(num_spares_ready, self.max_workers - num_workers))


def trained_workers(num_workers: int, unit: int) -> int:
    """How many of ``num_workers`` a generation trains with when its layers split over ``unit`` ranks (parallel.tp):
    whole tp groups, or with fewer workers than ``unit`` the largest divisor of it (``choose_layout``)."""
    if num_workers >= unit:
        return num_workers - num_workers % unit
    return max(d for d in divisors(unit) if d <= num_workers) if num_workers else 0


def workers_missing(*, min_workers: int, num_workers: int) -> int:
    """How many workers the run must wait for before it may form a generation (0: none)."""
    return max(0, min_workers - num_workers)


@dataclass(frozen=True)
class DrainNotices:
    new: dict[str, float | None]
    """Draining nodes that host members -> their deadlines: those members leave at the next step boundary."""
    called_off: tuple[str, ...]
    """Nodes whose drain was acted on and that are no longer draining: their members stay."""


def read_drain_notices(status: GroupStatus, pending: set[str]) -> DrainNotices:
    """What Ray's draining nodes mean for the run, given the nodes whose members are already ``pending`` to
    leave at the next boundary."""
    hosting = {member.node_id for member in status.members if member.node_id}
    new = {node: deadline for node, deadline in status.draining_nodes.items() if node in hosting - pending}
    return DrainNotices(new, tuple(sorted(pending - status.draining_nodes.keys())))


def stragglers_to_drain(status: GroupStatus, *, min_workers: int, num_leaving: int) -> list[int]:
    """Ranks that reported themselves stragglers in ``status`` and may leave: as many as keep the group, less
    those already leaving, at ``min_workers`` or more (the slowest first)."""
    reported = sorted((event.details.get("speed_vs_median", 0.0), news.rank) for news in status.news
                      for event in news.status.events if event.type == "straggler")
    room = max(0, len(status.members) - num_leaving - min_workers)
    return [rank for _, rank in reported[:room]]


# -- failures -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recover:
    """Form the next generation with the workers left."""


@dataclass(frozen=True)
class Raise:
    reason: str


@dataclass(frozen=True, kw_only=True)
class FailurePolicy:
    """Survive up to ``max_failures`` failures per run; workers lost together count once."""

    max_failures: int

    def decide(self, failures_so_far: int) -> Recover | Raise:
        """``failures_so_far`` counts the failure being decided on."""
        if failures_so_far > self.max_failures:
            return Raise(f"{failures_so_far} failures, more than failure.max_failures={self.max_failures}")
        return Recover()


# -- verdicts on a training generation ------------------------------------------------------------------------


@dataclass(frozen=True)
class KeepTraining:
    pass


@dataclass(frozen=True)
class GenerationFinished:
    """Every member trained to the run's last step."""


@dataclass(frozen=True)
class AllStopped:
    """Every member stopped after the same step (a stop or a membership change was asked for)."""


Verdict = KeepTraining | GenerationFinished | AllStopped | WorkersLost | JobError

EVERY_RANK_FAILED = ("in a collective that failed on every rank at once with no worker lost: the ranks' collectives "
                     "do not match")
"""Where a JobError of collectives failed everywhere was raised (JobError.reason's first line)."""


@dataclass(frozen=True, kw_only=True)
class GenerationJudge:
    """Judges a training generation from each poll.

    A worker whose process is gone, that stops answering for ``step_timeout_s`` or whose step runs for
    ``max_step_s`` is lost. A worker whose collective lost its peer is a survivor; if no death explains
    such errors within ``error_grace_s``, the members still training (the ones their peers' collectives
    gave up waiting for) are hung; when none is, every member's collective failed with nobody lost: the
    collectives the job calls do not match between ranks (a root, an order), which a new generation would
    only meet again. That and an error of the job itself end the run.
    """

    step_timeout_s: float
    max_step_s: float
    collective_timeout_s: float
    error_grace_s: float = 2.0
    """How long a collective error may precede the report of the death that caused it."""

    def decide(self, status: GroupStatus) -> Verdict:
        lost = self.lost_workers(status)
        if lost:
            return WorkersLost(lost)
        job_errors = tuple((m.name, m.error) for m in status.members if m.error_cause == "job")
        if job_errors:
            return JobError(job_errors)
        if status.errors_for_s is not None and status.errors_for_s > self.error_grace_s:
            if all(m.phase == "failed" for m in status.members):
                return JobError(tuple((m.name, m.error) for m in status.members), where=EVERY_RANK_FAILED)
            return WorkersLost(tuple(
                LostWorker(m.name, "hung: its peers' collectives gave up waiting for it "
                                   f"(failure.collective_timeout_s={self.collective_timeout_s})", rank)
                for rank, m in enumerate(status.members) if m.phase == "training" and not m.error))
        phases = {m.phase for m in status.members}
        if phases == {"finished"}:
            return GenerationFinished()
        if phases <= {"finished", "stopped"}:
            return AllStopped()
        return KeepTraining()

    def lost_workers(self, status: GroupStatus) -> tuple[LostWorker, ...]:
        """Members dead, silent for step_timeout_s, or with a step running for max_step_s."""
        lost = []
        for rank, member in enumerate(status.members):
            if member.dead:
                reason = member.dead
            elif member.phase not in DONE_PHASES and member.silent_s > self.step_timeout_s:
                reason = f"no answer for {member.silent_s:.1f}s (failure.step_timeout_s={self.step_timeout_s})"
            elif member.step_running_s is not None and member.step_running_s > self.max_step_s:
                reason = f"hung: its step has run {member.step_running_s:.0f}s (failure.max_step_s={self.max_step_s})"
            else:
                continue
            lost.append(LostWorker(member.name, reason, rank))
        return tuple(lost)


# -- where a new generation's state comes from ----------------------------------------------------------------


@dataclass(frozen=True)
class FromCheckpoint:
    checkpoint: Checkpoint


@dataclass(frozen=True)
class FromRank:
    """Replicated state: the most advanced member's is broadcast to all."""

    rank: int


@dataclass(frozen=True)
class FromPeers:
    """Sharded state the members kept in memory, every shard sent by a holder and resharded to the new group (under
    model parallelism every part, re-laid out)."""

    plan: PeerRestorePlan | RegionRestorePlan


@dataclass(frozen=True)
class FromSeed:
    """A fresh start: every rank builds the state from the seed (step 0)."""


@dataclass(frozen=True)
class StateLost:
    """Sharded state of a step past 0 that no member holds whole and no checkpoint has: the run must end,
    not start over from step 0 unasked."""

    step: int
    """The step the run had committed."""

    def reason(self, strategy: StrategyConfig, checkpoint: CheckpointConfig,
               lost_layout: ParallelLayout | None = None) -> str:
        """Why the run cannot go on, naming the settings that decided it; ``lost_layout``: the model-parallel
        layout of the generation that lost it (whose data-parallel copies are a part's copies), None without one."""
        model_parallel = lost_layout is not None and lost_layout.pp * lost_layout.tp > 1
        part = "part of the model" if model_parallel else "shard"
        if model_parallel and lost_layout.dp_replicate > 1:
            copies = (f"every copy of one part of the model was lost ({lost_layout.describe()} kept "
                      f"{lost_layout.dp_replicate}, one in each data-parallel copy)")
        elif not model_parallel and strategy.replicas > 1:
            copies = f"every copy of a shard (strategy.replicas={strategy.replicas}) was lost"
        elif strategy.buddy_copy:
            copies = f"a worker and its buddy, which held the copy of its {part} (strategy.buddy_copy), were lost"
        else:
            copies = f"a worker's {part} existed nowhere else (strategy.buddy_copy=false, strategy.replicas=1)"
        every_steps, every_minutes = checkpoint.every_steps, checkpoint.every_minutes
        settings = f"checkpoint.every_steps={every_steps}, checkpoint.every_minutes={every_minutes:g}"
        return (f"the sharded state of step {self.step} is lost: {copies}, and no intact checkpoint holds it "
                f"({settings}); the run ends rather than start over from step 0")


StateSource = FromCheckpoint | FromRank | FromPeers | FromSeed | StateLost


def needs_checkpoint_lookup(*, replicated: bool, pending: Checkpoint | None, member_steps: list[int], run_step: int,
                            peer_plan: PeerRestorePlan | RegionRestorePlan | None) -> bool:
    """Whether the members may lack the run's newest state, so the newest checkpoint must be looked at: every
    replicated holder of it was lost, or some shard has no surviving copy."""
    if pending is not None:
        return False
    if replicated:
        return max(member_steps) < run_step
    return peer_plan is None and run_step > 0


def choose_state_source(*, replicated: bool, pending: Checkpoint | None, member_steps: list[int],
                        run_step: int, peer_plan: PeerRestorePlan | RegionRestorePlan | None = None,
                        newest_checkpoint: Checkpoint | None = None) -> StateSource:
    """Where generation g's state comes from.

    ``peer_plan``: sharded state every shard of which survives in the members' memory; it wins unless
    ``pending`` (the checkpoint this generation was asked to load: a resume, a sharded resize) is newer.
    Otherwise a replicated run keeps its most advanced member's state, and a sharded one loads
    ``newest_checkpoint`` (looked up when ``needs_checkpoint_lookup``; a replicated run too when it is
    newer). A sharded run past step 0 with neither has lost its state (``run_step``: the step it had
    committed).
    """
    if peer_plan is not None and (pending is None or peer_plan.step >= pending.manifest.step):
        return FromPeers(peer_plan)
    if pending is not None:
        return FromCheckpoint(pending)
    if not replicated:
        if newest_checkpoint is not None:
            return FromCheckpoint(newest_checkpoint)
        return StateLost(run_step) if run_step > 0 else FromSeed()
    best = max(range(len(member_steps)), key=lambda rank: member_steps[rank])
    if newest_checkpoint is not None and newest_checkpoint.manifest.step > member_steps[best]:
        return FromCheckpoint(newest_checkpoint)
    return FromRank(best)


# -- the set a Controller is given ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunPolicies:
    scaling: ScalingPolicy
    failure: FailurePolicy
    judge: GenerationJudge
    layout: LayoutPolicy = LayoutPolicy()

    @classmethod
    def for_job(cls, job: JobConfig) -> RunPolicies:
        """The policies the job's ``scaling:`` and ``failure:`` sections set."""
        return cls(scaling=ScalingPolicy(min_workers=job.scaling.min_workers, max_workers=job.scaling.max_workers,
                                         spare_workers=job.scaling.spare_workers, unit=job.parallel.model_parallel),
                   failure=FailurePolicy(max_failures=job.failure.max_failures),
                   judge=GenerationJudge(step_timeout_s=job.failure.step_timeout_s, max_step_s=job.failure.max_step_s,
                                         collective_timeout_s=job.failure.collective_timeout_s),
                   layout=LayoutPolicy.for_job(job))
