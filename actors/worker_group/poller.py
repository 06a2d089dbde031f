"""Polling one training generation: a long poll in flight per member, answers taken in as they come.

A worker's poll answers at once on news (a phase change, an error, an event) and at least every
``wait_s`` otherwise; a worker's death fails its poll at once. What the answers say is handed on as
``MemberStatus`` and ``RankNews``; judging them is ``actors.controller.policies.GenerationJudge``'s job.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from raylastic.actors.status.group import DONE_PHASES, MemberStatus, RankNews
from raylastic.actors.worker_group.membership import Member


@dataclass
class _View:
    last_answer: float
    phase: str = "training"
    error: str | None = None
    error_cause: str | None = None
    step_running_s: float | None = None
    dead: str | None = None
    seen: int = -1
    """The version of the worker's news last heard (its long poll answers when there is newer)."""


class GenerationPoller:
    def __init__(self, members: list[Member], wait_s: float) -> None:
        self.members = members
        self.wait_s = wait_s
        now = time.monotonic()
        self.views = {m.name: _View(last_answer=now) for m in members}
        self.polls = {m.name: self._poll(m) for m in members}
        self.first_error_at: float | None = None

    def poll(self, timeout_s: float) -> tuple[tuple[MemberStatus, ...], tuple[RankNews, ...]]:
        """Wait up to ``timeout_s`` for answers; the members' statuses and the news since the last call."""
        answered, news = set(self._answered(timeout_s)), []
        for rank, member in enumerate(self.members):
            if member.name in self.polls and self.polls[member.name] in answered:
                news += self._take(member, rank, self.polls.pop(member.name))
                if self.views[member.name].phase not in DONE_PHASES:  # a done worker has nothing more to say
                    self.polls[member.name] = self._poll(member)
        if self.first_error_at is None and any(v.error for v in self.views.values()):
            self.first_error_at = time.monotonic()
        return self.statuses(), tuple(news)

    def finish(self) -> tuple[RankNews, ...]:
        """Polls still in flight carry step results: take them in before the generation's end is acted on. Each
        live member is asked to answer at once (a survivor blocked in a collective with a lost peer has no news
        that would end its poll), and waited for within one poll's wait."""
        live = {name: ref for name, ref in self.polls.items() if not self.views[name].dead}
        for member in self.members:
            if member.name in live:
                member.actor.answer_now.remote()
        if live:
            ray.wait(list(live.values()), num_returns=len(live), timeout=self.wait_s + 1.0)
        news = []
        for rank, member in enumerate(self.members):
            if member.name in live:
                news += self._take(member, rank, live[member.name])
        self.polls = {}
        return tuple(news)

    def statuses(self) -> tuple[MemberStatus, ...]:
        now = time.monotonic()
        return tuple(MemberStatus(name=m.name, phase=v.phase, node_id=m.node_id, silent_s=now - v.last_answer,
                                  step_running_s=v.step_running_s, error=v.error, error_cause=v.error_cause,
                                  dead=v.dead)
                     for m in self.members for v in [self.views[m.name]])

    def errors_for_s(self) -> float | None:
        return None if self.first_error_at is None else time.monotonic() - self.first_error_at

    def _answered(self, timeout_s: float) -> list[ray.ObjectRef]:
        """The polls answered within ``timeout_s`` (all that are, once one is)."""
        if not self.polls:
            time.sleep(timeout_s)
            return []
        refs = list(self.polls.values())
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout_s)
        return ray.wait(refs, num_returns=len(refs), timeout=0)[0] if ready else []

    def _poll(self, member: Member) -> ray.ObjectRef:
        return member.actor.poll.remote(self.wait_s, self.views[member.name].seen)

    def _take(self, member: Member, rank: int, ref: ray.ObjectRef) -> list[RankNews]:
        """Take in a finished poll: its news, or the member's death."""
        view = self.views[member.name]
        try:
            status = ray.get(ref, timeout=0)
        except RayActorError as error:
            view.dead = death_reason(error)
            return []
        except GetTimeoutError:
            return []
        view.last_answer, view.phase, view.error, view.seen = time.monotonic(), status.phase, status.error, \
            status.version
        view.error_cause, view.step_running_s = status.error_cause, status.step_running_s
        return [RankNews(rank, status)]


def death_reason(error: RayActorError) -> str:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"actor died: {first_line[:200]}"
