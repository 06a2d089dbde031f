"""The Controller's record of each worker's share of the global batch, carried into the next generation.

Within a generation the ranks set their own shares (actors/data/balance.py). When the group changes, the
next generation starts from the shares its members last had, by worker name: a newcomer at the mean,
a lost worker's share spread over the others (``carry_split``), so a resize does not throw away what
the ranks measured::

    book = ShareBook(global_batch_size=64, straggler_factor=4.0)
    book.observe(status, step)                 # every poll: the members' last step results
    group.start_training(..., shares=book.split_for(group.member_names))
"""

from __future__ import annotations

from collections.abc import Sequence

from raylastic.actors.data.balance import carry_split
from raylastic.actors.status.group import GroupStatus


class ShareBook:
    def __init__(self, global_batch_size: int, straggler_factor: float) -> None:
        self.global_batch_size = global_batch_size
        self.straggler_factor = straggler_factor
        self.last: dict[str, int] = {}
        """Worker name -> samples it took in the last step it reported."""

    def observe(self, status: GroupStatus, step: int) -> None:
        """Every poll: the members' last step results' shares."""
        for news in status.news:
            if news.status.results and news.rank < len(status.members):
                self.last[status.members[news.rank].name] = news.status.results[-1].samples

    def split_for(self, members: Sequence[str]) -> tuple[int, ...] | None:
        """The first split of a generation of ``members`` (rank order); None (even) before any step."""
        if not self.last or len(members) < 2:
            return None
        return carry_split(self.last, members, self.global_batch_size, self.straggler_factor).sizes
