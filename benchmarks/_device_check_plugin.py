"""The device check's pytest plugin (``-p benchmarks._device_check_plugin``): writes what was collected and each
test's outcome, one JSON line each, to the file named by DEVICE_CHECK_EVENTS, as they come (a pytest stopped at
the check's time limit leaves what it finished); skips every test that would start after DEVICE_CHECK_DEADLINE
(seconds since the epoch). The line format is benchmarks/_device_check_report.py's."""

from __future__ import annotations

import json
import os
import time

import pytest

from benchmarks._device_check_report import OUT_OF_TIME, phase_outcome

EVENTS = "DEVICE_CHECK_EVENTS"
DEADLINE = "DEVICE_CHECK_DEADLINE"
DETAIL_CHARS = 300
_phases: dict[str, list[tuple[str, str]]] = {}
_seconds: dict[str, float] = {}
_details: dict[str, str] = {}


def _write(event: dict) -> None:
    path = os.environ.get(EVENTS)
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps(event) + "\n")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        detail = crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1]
        detail = detail.removeprefix("E").strip()  # pytest's mark of an error line
        _write({"event": "not collected", "test": report.nodeid, "detail": detail[:DETAIL_CHARS]})


def pytest_collection_finish(session: pytest.Session) -> None:
    _write({"event": "collected", "tests": [item.nodeid for item in session.items]})


def pytest_runtest_setup(item: pytest.Item) -> None:
    deadline = os.environ.get(DEADLINE)
    if deadline and time.time() > float(deadline):
        pytest.skip(OUT_OF_TIME)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _phases.setdefault(report.nodeid, []).append((report.when, report.outcome))
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration
    if report.skipped and isinstance(report.longrepr, tuple):
        _details[report.nodeid] = report.longrepr[2].removeprefix("Skipped: ")
    elif report.failed and report.nodeid not in _details:
        crash = getattr(report.longrepr, "reprcrash", None)
        _details[report.nodeid] = (crash.message if crash is not None else str(report.longrepr)).splitlines()[0]
    if report.when == "teardown":
        outcome = phase_outcome(_phases.pop(report.nodeid))
        ranks = dict(report.user_properties).get("ranks")
        detail = _details.pop(report.nodeid, "")
        if outcome == "skipped" and detail == OUT_OF_TIME:
            outcome, ranks = "not run", None
        _write({"event": "test", "test": report.nodeid, "outcome": outcome, "ranks": ranks,
                "seconds": round(_seconds.pop(report.nodeid), 2),
                "detail": detail[:DETAIL_CHARS] if outcome != "passed" else ""})
