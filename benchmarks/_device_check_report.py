"""The device check's outcomes and table (benchmarks/device_check.py): pure functions over what its pytest plugin
(benchmarks/_device_check_plugin.py) writes, one JSON object a line::

    {"event": "collected", "tests": ["tests/test_gpu.py::test_x", ...]}
    {"event": "test", "test": "tests/test_gpu.py::test_x", "outcome": "passed", "seconds": 12.5, "ranks": 2}
    {"event": "not collected", "test": "tests/test_x.py", "detail": "ModuleNotFoundError: No module named 'ray'"}

    rows = rows_of("torch", events, ended_early=False)
    print(format_table(rows)); print(format_summary(rows))
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Outcome = Literal["passed", "failed", "error", "skipped", "not run", "not collected"]
FAILING: frozenset[str] = frozenset({"failed", "error", "not collected"})
OUT_OF_TIME = "the check's time budget ran out"
RAY_MISSING = "Ray is not importable here"
DETAIL_CHARS = 120
"""The table's cut of a row's detail (the JSON keeps it whole, the group's pytest log has the traceback)."""


@dataclass(frozen=True)
class Row:
    """One test of the check (or a module it could not collect)."""

    group: str
    """"torch" (torch.distributed only, Ray hidden) or "ray"."""
    test: str
    """pytest's node id."""
    outcome: Outcome
    ranks: int | None = None
    """The processes (one GPU each) the test ran on, where it says (``record_property("ranks", n)``)."""
    seconds: float | None = None
    detail: str = ""
    """Why it was skipped or not run, or the failure's message."""


def phase_outcome(phases: Sequence[tuple[str, str]]) -> Outcome:
    """A test's outcome from its phases' (when, outcome) as pytest reports them: a failed setup or teardown is an
    error, a failed call a failure, a skip in any phase a skip."""
    for when, outcome in phases:
        if outcome == "failed":
            return "failed" if when == "call" else "error"
    if any(outcome == "skipped" for _, outcome in phases):
        return "skipped"
    return "passed"


def rows_of(group: str, events: Iterable[dict], *, ended_early: bool, not_collected_reason: str | None = None
            ) -> list[Row]:
    """The rows of one group's events, in the order the tests were collected. A collected test with no result
    is "not run" (``ended_early``: its pytest was stopped at the check's time limit); a module that failed to
    collect is "not run" for ``not_collected_reason`` (Ray missing), else "not collected"."""
    collected: list[str] = []
    finished: dict[str, Row] = {}
    broken: list[Row] = []
    for event in events:
        kind = event.get("event")
        if kind == "collected":
            collected.extend(event["tests"])
        elif kind == "test":
            finished[event["test"]] = Row(group, event["test"], event["outcome"], event.get("ranks"),
                                          event.get("seconds"), event.get("detail", ""))
        elif kind == "not collected":
            outcome, detail = (("not run", not_collected_reason) if not_collected_reason
                               else ("not collected", event.get("detail", "")))
            broken.append(Row(group, event["test"], outcome, detail=detail))
    rows = [finished.pop(test, None) or Row(group, test, "not run",
                                            detail=OUT_OF_TIME if ended_early else "pytest ended before it ran")
            for test in collected]
    return broken + rows + list(finished.values())


def exit_code(rows: Sequence[Row]) -> int:
    """0: nothing failed and every test ran or was skipped; 1: a failure, an error or a module not collected;
    2: none of those, but some tests did not run (the time budget, or pytest ended early)."""
    if any(row.outcome in FAILING for row in rows):
        return 1
    if any(row.outcome == "not run" and row.detail != RAY_MISSING for row in rows):
        return 2
    return 0



def _cell(row: Row) -> str:
    detail = row.detail if len(row.detail) <= DETAIL_CHARS else row.detail[:DETAIL_CHARS - 3] + "..."
    return row.outcome + (f": {detail}" if detail else "")


def format_table(rows: Sequence[Row]) -> str:
    """A fixed-width table: group, test, ranks, seconds, outcome (and why, cut at DETAIL_CHARS), one row a test."""
    header = ("group", "test", "ranks", "seconds", "outcome")
    cells = [(row.group, row.test.removeprefix("tests/"), "-" if row.ranks is None else str(row.ranks),
              "-" if row.seconds is None else f"{row.seconds:.1f}", _cell(row)) for row in rows]
    widths = [max(len(header[i]), *(len(cell[i]) for cell in cells)) if cells else len(header[i])
              for i in range(4)]
    return "\n".join("  ".join([cell[0].ljust(widths[0]), cell[1].ljust(widths[1]), cell[2].rjust(widths[2]),
                                 cell[3].rjust(widths[3]), cell[4]]).rstrip() for cell in [header, *cells])


def format_summary(rows: Sequence[Row]) -> str:
    """One line of counts by outcome, then the reasons tests were skipped or not run, most frequent first."""
    counts = Counter(row.outcome for row in rows)
    order = ("passed", "failed", "error", "not collected", "skipped", "not run")
    line = ", ".join(f"{counts[outcome]} {outcome}" for outcome in order if counts[outcome]) or "no tests"
    reasons = Counter(f"{row.outcome}: {row.detail}" for row in rows if row.outcome in ("skipped", "not run"))
    return "\n".join([line, *(f"  {reason} ({count})" for reason, count in reasons.most_common())])
