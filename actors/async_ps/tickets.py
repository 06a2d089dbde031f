"""The books of an asynchronous run: which steps of the sample order are leased, which are applied, in what order.

A ticket is a step of the global sample order (its ``global_batch_size`` samples). A worker leases the
lowest ticket nobody holds or has applied, computes its gradient, and asks for admission with the
update number (version) of the parameters it read from each server. Admission gives the next update
number, unless the gradient would be applied more than ``max_staleness`` updates after the oldest
parameters it read; a refused ticket goes back in the queue. A ticket's samples therefore reach the
parameters exactly once: a lost worker's leases go back, a server restore takes back every update after
its checkpoint. Pure bookkeeping, no Ray::

    book = TicketBook(total_steps=100, max_staleness=4)
    ticket = book.lease("w0")                        # 0
    book.admit(ticket, "w0", read_versions=[0, 0])   # Admission(update=1, staleness=0)
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Admission:
    update: int | None
    """The update number the gradient is applied as (1-based); None: refused as too stale."""
    staleness: int
    """Updates applied between the oldest parameters the gradient was computed on and its own."""


@dataclass
class TicketBook:
    total_steps: int
    max_staleness: int
    _returned: list[int] = field(default_factory=list)
    _next_fresh: int = 0
    leases: dict[int, str] = field(default_factory=dict)
    """Ticket -> the worker computing it."""
    applied: list[int] = field(default_factory=list)
    """The ticket of every admitted update, in update order (update u is applied[u - 1])."""
    refused: int = 0
    withdrawn: int = 0

    @property
    def version(self) -> int:
        """Updates admitted so far."""
        return len(self.applied)

    @property
    def steps_applied(self) -> int:
        """Tickets whose gradient is admitted (a withdrawn update's number is used, its ticket is not)."""
        return sum(1 for ticket in self.applied if ticket >= 0)

    @property
    def done(self) -> bool:
        return self.steps_applied == self.total_steps

    def lease(self, worker: str) -> int | None:
        """The next ticket for ``worker``; None when every remaining one is leased."""
        if self._returned:
            ticket = heapq.heappop(self._returned)
        elif self._next_fresh < self.total_steps:
            ticket, self._next_fresh = self._next_fresh, self._next_fresh + 1
        else:
            return None
        self.leases[ticket] = worker
        return ticket

    def admit(self, ticket: int, worker: str, read_versions: list[int]) -> Admission:
        """Admit ``worker``'s gradient of ``ticket``, computed on parameters at ``read_versions`` (one per server)."""
        if self.leases.get(ticket) != worker:
            raise ValueError(f"ticket {ticket} is not leased to {worker} (it is {self.leases.get(ticket)!r}'s)")
        staleness = self.version - min(read_versions)
        del self.leases[ticket]
        if staleness > self.max_staleness:
            self.refused += 1
            heapq.heappush(self._returned, ticket)
            return Admission(None, staleness)
        self.applied.append(ticket)
        return Admission(self.version, staleness)

    def give_back(self, ticket: int, worker: str) -> None:
        """``worker`` will not finish ``ticket`` (its pull failed): someone computes it again."""
        if self.leases.get(ticket) == worker:
            del self.leases[ticket]
            heapq.heappush(self._returned, ticket)

    def worker_lost(self, worker: str) -> list[int]:
        """A worker died: its leased tickets go back in the queue; returns them."""
        lost = sorted(t for t, holder in self.leases.items() if holder == worker)
        for ticket in lost:
            self.give_back(ticket, worker)
        return lost

    def withdraw(self, update: int) -> None:
        """Update ``update`` reached no server (its worker died before pushing it): its ticket is computed
        again, and the update number stays used (the servers skip it)."""
        ticket = self.applied[update - 1]
        self.applied[update - 1] = -1
        heapq.heappush(self._returned, ticket)
        self.withdrawn += 1

    def rewind(self, version: int, applied: list[int]) -> None:
        """The servers went back to update ``version`` (a checkpoint whose tickets are ``applied``): every later
        update's ticket, and every lease, is computed again. A book that starts from a checkpoint (a resumed run)
        leases none of its tickets again."""
        self.applied = list(applied[:version])
        done = {t for t in self.applied if t >= 0}
        self.leases.clear()
        self._next_fresh = max(self._next_fresh, max(done, default=-1) + 1)
        self._returned = [t for t in range(self._next_fresh) if t not in done]
        heapq.heapify(self._returned)
