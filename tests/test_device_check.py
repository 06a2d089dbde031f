"""The device check (benchmarks/device_check.py): its outcomes, table and exit status from the events its pytest
plugin writes (pure), and the command itself on a machine without CUDA, where it exits 0 with every test skipped.

    python -m pytest tests/test_device_check.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from benchmarks._device_check_report import (
    DETAIL_CHARS,
    OUT_OF_TIME,
    RAY_MISSING,
    Row,
    exit_code,
    format_summary,
    format_table,
    phase_outcome,
    rows_of,
)
from benchmarks.device_check import Group, read_events, run_group
from tests.conftest import REPO_ROOT

A, B, C = "tests/test_gpu.py::test_a", "tests/test_gpu.py::test_b", "tests/test_gpu.py::test_c"


@pytest.mark.parametrize(("phases", "outcome"), [
    ([("setup", "passed"), ("call", "passed"), ("teardown", "passed")], "passed"),
    ([("setup", "skipped"), ("teardown", "passed")], "skipped"),
    ([("setup", "passed"), ("call", "failed"), ("teardown", "passed")], "failed"),
    ([("setup", "failed"), ("teardown", "passed")], "error"),
    ([("setup", "passed"), ("call", "passed"), ("teardown", "failed")], "error"),
    ([("setup", "passed"), ("call", "skipped"), ("teardown", "passed")], "skipped"),
])
def test_a_tests_outcome_comes_from_its_phases(phases, outcome):
    assert phase_outcome(phases) == outcome


def test_rows_follow_the_collection_and_name_the_tests_left_unrun_and_why():
    events = [{"event": "collected", "tests": [A, B, C]},
              {"event": "test", "test": B, "outcome": "failed", "ranks": 2, "seconds": 3.5, "detail": "assert 1 == 2"},
              {"event": "test", "test": A, "outcome": "passed", "ranks": 1, "seconds": 12.25, "detail": ""}]
    rows = rows_of("ray", events, ended_early=True)
    assert rows == [Row("ray", A, "passed", 1, 12.25), Row("ray", B, "failed", 2, 3.5, "assert 1 == 2"),
                    Row("ray", C, "not run", detail=OUT_OF_TIME)]
    assert rows_of("ray", events[:1], ended_early=False)[0].detail == "pytest ended before it ran"
    assert exit_code(rows) == 1 and exit_code([rows[0], rows[2]]) == 2 and exit_code(rows[:1]) == 0


def test_a_module_that_cannot_be_collected_fails_the_check_unless_ray_is_missing():
    events = [{"event": "not collected", "test": "tests/test_gpu.py", "detail": "No module named 'ray'"},
              {"event": "collected", "tests": []}]
    (broken,) = rows_of("ray", events, ended_early=False)
    assert (broken.outcome, broken.detail, exit_code([broken])) == ("not collected", "No module named 'ray'", 1)
    (missing,) = rows_of("ray", events, ended_early=False, not_collected_reason=RAY_MISSING)
    assert (missing.outcome, missing.detail, exit_code([missing])) == ("not run", RAY_MISSING, 0)


def test_the_table_has_a_row_a_test_and_the_summary_counts_outcomes_and_reasons():
    rows = [Row("torch", "tests/test_gpu_torch.py::test_x[ddp-fp32]", "passed", 1, 4.04),
            Row("torch", "tests/test_gpu_torch.py::test_y", "skipped", detail="needs 2 CUDA devices"),
            Row("ray", A, "skipped", detail="needs 2 CUDA devices")]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["group", "test", "ranks", "seconds", "outcome"]
    assert lines[1].split() == ["torch", "test_gpu_torch.py::test_x[ddp-fp32]", "1", "4.0", "passed"]
    assert lines[3].split()[:4] == ["ray", "test_gpu.py::test_a", "-", "-"]
    assert lines[3].endswith("skipped: needs 2 CUDA devices")
    assert format_summary(rows).splitlines() == ["1 passed, 2 skipped", "  skipped: needs 2 CUDA devices (2)"]
    assert format_summary([]) == "no tests"
    long = format_table([Row("ray", A, "failed", detail="x" * 500)]).splitlines()[1]
    assert long.endswith("failed: " + "x" * (DETAIL_CHARS - 3) + "...")


@pytest.mark.processes
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_the_check_runs_without_cuda_and_exits_0_with_every_test_skipped(tmp_path):
    """The ray group limited to tests/test_gpu.py (collecting every module takes a minute here); the torch group runs
    with Ray hidden, so a module of it that imported Ray would not be collected and fail the check."""
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "tests/test_gpu.py", "--out", str(out),
                           "--budget-s", "400"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    record = json.loads(out.read_text())
    assert record["versions"]["torch"] == torch.__version__ and record["versions"]["gpu_count"] == 0
    groups = {row["group"] for row in record["tests"]}
    assert groups == {"torch", "ray"} and all(group["returncode"] == 0 for group in record["groups"])
    assert {(row["outcome"], row["detail"]) for row in record["tests"]} == {("skipped", "needs a CUDA device")}
    assert "test_gpu.py::test_nccl_survivor_carries_on_when_its_peer_is_killed" in done.stdout
    assert "skipped: needs a CUDA device" in done.stdout


@pytest.mark.processes
def test_a_group_hides_ray_from_its_tests_and_skips_those_that_would_start_past_its_deadline(tmp_path):
    """A module that imports Ray is not collected in a group that hides it; a collected test whose group's deadline
    has passed is not run, for want of time."""
    table_test = "tests/test_device_check.py::test_a_tests_outcome_comes_from_its_phases[phases0-passed]"
    group = Group("torch", ("--continue-on-collection-errors", table_test, "tests/test_gpu_path.py"), hide_ray=True)
    run = run_group(group, time.time() - 1, tmp_path / "group.log", tmp_path / "events")
    rows = rows_of("torch", read_events(tmp_path / "events"), ended_early=run.returncode is None)
    assert [(row.test, row.outcome) for row in rows] == [("tests/test_gpu_path.py", "not collected"),
                                                         (table_test, "not run")], rows
    assert rows[0].detail.startswith("ImportError: Ray is hidden by the device check") and rows[1].detail == OUT_OF_TIME
