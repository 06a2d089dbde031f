"""The run's event log and step history, shared by the Controller's threads.

Events are plain dicts ``{"type", "step", "time_s", ...}`` (time since the run started), so they
go into result.json as they are and the CLI shows them live.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class RunLog:
    def __init__(self) -> None:
        self.started = time.time()
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._history: dict[int, dict[str, Any]] = {}
        self._history_order: list[int] = []
        self._reporters: dict[int, tuple[int, dict[int, tuple[int, int]]]] = {}
        """Per step: (generation, {rank: (bytes_sent, uncompressed_bytes)}) of the ranks heard so far."""
        self._samples: dict[int, list[int]] = {}

    def event(self, type_: str, step: int, **fields: Any) -> dict[str, Any]:
        record = {"type": type_, "step": step, "time_s": round(time.time() - self.started, 4), **fields}
        with self._lock:
            self._events.append(record)
        return record

    def add_step(self, step: int, finished_at: float, *, generation: int, rank: int, bytes_sent: int,
                 uncompressed_bytes: int, **fields: Any) -> None:
        """Record ``rank``'s report of step ``step``. The row keeps the lowest rank's timings and the
        bytes summed over every rank heard (the step's traffic); a step redone in a later generation
        replaces the discarded attempt."""
        with self._lock:
            if step not in self._history:
                self._history_order.append(step)
            known_generation, traffic = self._reporters.get(step, (None, {}))
            if known_generation != generation:
                traffic = {}
            lowest = not traffic or rank < min(traffic)
            traffic[rank] = (bytes_sent, uncompressed_bytes)
            self._reporters[step] = (generation, traffic)
            row = self._history[step] if not lowest and known_generation == generation else \
                {"step": step, "time_s": round(finished_at - self.started, 4), **fields}
            row["bytes_sent"] = sum(sent for sent, _ in traffic.values())
            row["uncompressed_bytes"] = sum(full for _, full in traffic.values())
            self._history[step] = row

    def add_samples(self, step: int, sample_ids: tuple[int, ...]) -> None:
        """Ledger entry: the samples all ranks consumed in ``step`` (a redone step replaces its entry)."""
        with self._lock:
            self._samples[step] = list(sample_ids)

    def ledger(self) -> dict[int, list[int]]:
        """For each committed step, the samples consumed, in rank order."""
        with self._lock:
            return dict(sorted(self._samples.items()))

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events[since:])

    def history(self, since: int = 0) -> list[dict[str, Any]]:
        """Step records in the order steps were first committed, from position ``since`` on."""
        with self._lock:
            return [self._history[s] for s in self._history_order[since:]]

    def count(self, type_: str) -> int:
        with self._lock:
            return sum(1 for e in self._events if e["type"] == type_)
