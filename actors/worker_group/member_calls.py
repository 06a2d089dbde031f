"""One call on every member of the group, waited for with a bound on every way it can hang.

While the call runs, each member whose call has not ended is pinged (``alive``, which a worker answers from
another thread) every ``PING_S``: a member that answers nothing for failure.step_timeout_s - a stopped
process, a frozen VM - is hung, whatever it was doing. A call that runs longer than failure.max_step_s (a
deadlock in a live process) is hung too. Once one member failed, the others may still wait for it inside the
collective for up to failure.collective_timeout_s per rendezvous the call holds: they must have ended
before the next generation's calls run beside them in the same processes, and one that has not by then is
hung. The outcome: the results, or ``MembersFailed`` naming the dead and hung (those whose collective merely
lost a peer are survivors), or ``MemberRaised`` for an error of the job itself. A hung member is killed the
moment it is found, so that its peers' waits for it end too.

Example (``WorkerGroup._call_all``)::

    results = call_members(members, "save_checkpoint", None, bounds=CallBounds(collective_timeout_s=30,
                                                                            step_timeout_s=10, max_call_s=600))
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from raylastic.actors.status.group import JobError, LostWorker, WorkersLost
from raylastic.actors.status.peer_loss import is_peer_loss, plain_error
from raylastic.actors.worker.actor import TrainingThreadHung
from raylastic.actors.worker_group.poller import death_reason

COLLECTIVE_GRACE_S = 5.0
"""Beyond failure.collective_timeout_s: how long members may take to give up on a dead peer."""
PING_S = 1.0
"""How often a member whose call runs is asked whether it is alive."""


class MembersFailed(Exception):
    """Members were found dead or hung (``lost``; empty when every member's collective lost a peer that is
    nonetheless still there: the group re-forms as it is). ``verdict`` is what the Controller acts on."""

    def __init__(self, lost: list[LostWorker]) -> None:
        super().__init__("; ".join(worker.describe() for worker in lost))
        self.lost = tuple(lost)
        self.verdict = WorkersLost(self.lost)


class MemberRaised(Exception):
    """A member raised an error of the job itself in a call, or could not even be built (``where``: "in
    evaluate", "while starting"). ``verdict`` is what the Controller acts on."""

    def __init__(self, member: str, error: str, *, where: str) -> None:
        self.verdict = JobError(((member, error),), where=where)
        super().__init__(self.verdict.reason(step=0))


@dataclass(frozen=True, kw_only=True)
class CallBounds:
    collective_timeout_s: float
    step_timeout_s: float
    """A member that answers no ping for this long is hung."""
    max_call_s: float
    """A call that runs this long (plus its rendezvous) is hung."""


def call_members(members: list[Any], method: str, args: list[tuple] | None, *, bounds: CallBounds,
                 rendezvous: int = 1, on_failure: Callable[[], Any] | None = None) -> list[Any]:
    """``method`` on every member (``args[rank]``), in rank order; the results (see the module's docstring).
    ``on_failure`` is called once, as soon as a member is found lost or a collective lost a peer (a join calls
    its generation's rendezvous off, so the others' waits on the store end too)."""
    calls = {getattr(m.actor, method).remote(*(args[rank] if args else ())): rank for rank, m in enumerate(members)}
    results: list[Any] = [None] * len(members)
    lost: list[LostWorker] = []
    pings: dict[Any, int] = {}
    heard = dict.fromkeys(range(len(members)), time.monotonic())
    next_ping = dict.fromkeys(range(len(members)), 0.0)
    survivors_saw_a_loss, failed_at = False, None
    collective_s = rendezvous * bounds.collective_timeout_s + COLLECTIVE_GRACE_S
    give_up_at = time.monotonic() + bounds.max_call_s + collective_s
    while calls:
        for rank in set(calls.values()) - set(pings.values()):
            if time.monotonic() >= next_ping[rank]:
                pings[members[rank].actor.alive.remote()] = rank
                next_ping[rank] = time.monotonic() + PING_S
        limit = min(give_up_at, failed_at + collective_s if failed_at is not None else give_up_at)
        ready, _ = ray.wait([*calls, *pings], num_returns=1, timeout=max(0.0, min(PING_S, limit - time.monotonic())))
        ready = ray.wait([*calls, *pings], num_returns=len(calls) + len(pings), timeout=0)[0] if ready else []
        for ref in ready:
            if ref in pings:
                rank = pings.pop(ref)
                heard[rank] = time.monotonic()
                continue
            member = members[rank := calls.pop(ref)]
            try:
                results[rank] = ray.get(ref)
                continue
            except ray.exceptions.RayActorError as error:
                lost.append(LostWorker(member.name, death_reason(error), rank))
            except ray.exceptions.RayTaskError as error:
                if isinstance(error.cause, TrainingThreadHung):
                    lost.append(_killed(member, f"hung: {error.cause}", rank))
                elif is_peer_loss(error.cause):
                    survivors_saw_a_loss = True
                else:
                    raise MemberRaised(member.name, plain_error(error), where=f"in {method}") from None
            failed_at = failed_at or time.monotonic()
        now = time.monotonic()
        for ref, rank in [(ref, rank) for ref, rank in calls.items() if now - heard[rank] > bounds.step_timeout_s]:
            del calls[ref]
            lost.append(_killed(members[rank], f"hung: no answer for {now - heard[rank]:.0f}s during its {method} "
                                f"call (failure.step_timeout_s={bounds.step_timeout_s})", rank))
            failed_at = failed_at or now
        if failed_at is not None and on_failure is not None:
            on_failure()
            on_failure = None
        if now >= limit:
            break
    why = (f"did not end within {rendezvous} collective timeout(s) of the failure" if failed_at is not None else
           f"did not end within failure.max_step_s={bounds.max_call_s} and its collective timeouts")
    lost += [_killed(members[rank], f"hung: its {method} call {why}", rank) for rank in calls.values()]
    if lost or survivors_saw_a_loss:
        raise MembersFailed(lost)
    return results


def _killed(member: Any, reason: str, rank: int) -> LostWorker:
    """A hung member, killed at once: until its process is gone its peers wait for it inside a collective (or for
    its answer while their group connects), so they could not end their own calls."""
    ray.kill(member.actor, no_restart=True)
    return LostWorker(member.name, reason, rank)
