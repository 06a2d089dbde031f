"""The run log's step rows: every rank's part of the batch summed, shown only once complete; the
append-only sample ledger; and the long poll readers wait on: an event or the run's end wakes them at once."""

from __future__ import annotations

import threading
import time
import tracemalloc

import pytest

from raylastic.actors.controller.run_log import RunLog
from raylastic.actors.status.worker import StepResult


def _report(log: RunLog, step: int, rank: int, *, generation: int = 0, world_size: int = 2, loss_sum: float,
            samples: int, step_s: float = 0.01, bytes_sent: int = 100):
    return log.add_step(step, log.started + step, generation=generation, rank=rank, world_size=world_size,
                        loss_sum=loss_sum, samples=samples, step_s=step_s, bytes_sent=bytes_sent,
                        uncompressed_bytes=2 * bytes_sent, comm_s=0.001 * (rank + 1))


def test_a_row_sums_every_ranks_part_and_keeps_the_lowest_ranks_timings():
    log = RunLog()
    assert _report(log, 1, rank=1, loss_sum=6.0, samples=3, step_s=0.02) is None  # rank 0 not heard yet
    row = _report(log, 1, rank=0, loss_sum=2.0, samples=5, step_s=0.01)
    assert row["loss"] == pytest.approx(8.0 / 8) and row["samples"] == 8
    assert row["samples_per_s"] == pytest.approx(8 / 0.01) and row["step_s"] == 0.01 and row["comm_s"] == 0.001
    assert row["bytes_sent"] == 200 and row["uncompressed_bytes"] == 400 and row["world_size"] == 2
    assert row["time_s"] == pytest.approx(1.0, abs=1e-3)
    assert log.history() == [row]


def test_a_row_from_step_results_shows_the_lowest_ranks_columns_and_every_ranks_sums():
    log = RunLog()
    results = {rank: StepResult(step=1, loss_sum=float(rank + 1), samples=2 + rank, duration_s=0.02 + rank,
                                finished_at=log.started + 1 + rank, bytes_sent=10, uncompressed_bytes=40,
                                comm_s=0.0012345 * (rank + 1), exposed_comm_s=0.0004, skipped=rank == 0,
                                lr=0.1 * (rank + 1), grad_norm=1.23456789, compute_s=0.01 * (rank + 1),
                                link_delay_s=0.003 * rank)
               for rank in (0, 1)}
    assert log.add_result(results[1], generation=0, rank=1, world_size=2) is None
    row = log.add_result(results[0], generation=0, rank=0, world_size=2)
    assert row == {"step": 1, "time_s": 1.0, "loss": 3.0 / 5, "samples": 5, "samples_per_s": 250.0, "world_size": 2,
                   "step_s": 0.02, "lr": 0.1, "grad_norm": 1.234568, "comm_s": 0.00123, "exposed_comm_s": 0.0004,
                   "skipped": True, "bytes_sent": 20, "uncompressed_bytes": 80, "shares": [2, 3],
                   "compute_s": [0.01, 0.02]}


def test_a_step_one_of_several_training_workers_reports_is_complete_at_once_and_shows_them_all():
    """async_ps: one worker reports each update while three train; the row is written once, never rewritten."""
    log = RunLog()
    row = log.add_step(1, log.started + 1, generation=0, rank=0, world_size=3, reporting=1, loss_sum=4.0,
                       samples=4, step_s=0.01, bytes_sent=10, uncompressed_bytes=10)
    assert row is not None and row["world_size"] == 3 and log.history() == [row]


def test_a_complete_steps_memory_is_its_row_alone_not_every_ranks_report():
    """A long run of many workers keeps one row a step: the ranks' reports behind it go once it is complete (at
    4,096 workers they were ~2 MB a step, kept for the whole run)."""
    ranks, steps = 256, 40
    log = RunLog()
    tracemalloc.start()
    for step in range(1, steps + 1):
        for rank in range(ranks):
            _report(log, step, rank, world_size=ranks, loss_sum=1.0, samples=1)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(log.history()) == steps
    # a row's own lists of 256 shares and compute times take ~12 KB; with every rank's report kept, ~115 KB a step
    assert held / steps < 30_000, f"{held / steps:.0f} bytes held a step"


def test_history_stops_at_the_first_step_a_rank_has_yet_to_report():
    log = RunLog()
    for step in (1, 2, 3):
        _report(log, step, rank=0, loss_sum=1.0, samples=4)
    _report(log, 1, rank=1, loss_sum=3.0, samples=4)
    _report(log, 3, rank=1, loss_sum=3.0, samples=4)
    assert [row["step"] for row in log.history()] == [1]  # step 2 waits for rank 1, and step 3 behind it
    _report(log, 2, rank=1, loss_sum=3.0, samples=4)
    assert [row["step"] for row in log.history(since=1)] == [2, 3]


def test_a_closed_generation_shows_what_the_survivors_reported():
    log = RunLog()
    _report(log, 1, rank=0, loss_sum=1.0, samples=4)
    _report(log, 1, rank=1, loss_sum=3.0, samples=4)
    _report(log, 2, rank=0, loss_sum=2.0, samples=4)  # rank 1 died before its report of step 2 came in
    assert len(log.history()) == 1
    log.close_generation(0)
    partial = log.history()[1]
    assert partial["loss"] == pytest.approx(0.5) and partial["samples"] == 4


def test_a_step_heard_only_from_ranks_that_report_no_samples_gets_its_row_from_the_redo():
    """Model parallelism: the last pipeline stage reports a step's loss and samples, the others 0. A generation
    that lost its last stage closes with step 2 heard only from the first: no row (no loss to show), and the
    next generation's redo of step 2 makes it."""
    log = RunLog()
    _report(log, 1, rank=0, loss_sum=0.0, samples=0)
    _report(log, 1, rank=1, loss_sum=4.0, samples=4)
    _report(log, 2, rank=0, loss_sum=0.0, samples=0)
    log.close_generation(0)
    assert [row["step"] for row in log.history()] == [1]
    row = _report(log, 2, rank=0, generation=1, world_size=1, loss_sum=3.0, samples=4)
    assert log.history() == [log.history()[0], row] and row["loss"] == pytest.approx(0.75)


def test_a_step_redone_in_a_later_generation_replaces_the_discarded_attempt():
    log = RunLog()
    _report(log, 1, rank=0, loss_sum=1.0, samples=4)
    log.close_generation(0)
    row = _report(log, 1, rank=0, generation=1, world_size=1, loss_sum=8.0, samples=8)
    assert row["loss"] == 1.0 and row["world_size"] == 1
    assert [r["loss"] for r in log.history()] == [1.0]


def _commit(log: RunLog, step: int, generation: int, ranks=(0, 1)) -> None:
    for rank in ranks:  # every rank reports the step's samples (all-gathered: the same on each)
        log.add_samples(step, (2 * step, 2 * step + 1), generation=generation, rank=rank)


def _applications(log: RunLog) -> dict[int, list[tuple[int, bool]]]:
    return {step: [(a["generation"], a["kept"]) for a in applied] for step, applied in log.ledger().items()}


def test_the_ledger_keeps_a_redone_step_and_marks_the_discarded_attempt():
    log = RunLog()
    log.event("generation_formed", 0, generation=0)
    for step in (1, 2, 3):
        _commit(log, step, generation=0)
    log.event("generation_formed", 1, generation=1)  # restored from the checkpoint of step 1: 2 and 3 are redone
    for step in (2, 3):
        _commit(log, step, generation=1)
    log.event("generation_formed", 3, generation=2)  # handed over at step 3: nothing discarded
    _commit(log, 4, generation=2, ranks=(0,))
    assert _applications(log) == {1: [(0, True)], 2: [(0, False), (1, True)], 3: [(0, False), (1, True)],
                                  4: [(2, True)]}
    assert log.ledger()[2][1]["samples"] == [4, 5]


def test_a_step_a_rank_applies_twice_in_one_generation_shows_twice():
    log = RunLog()
    log.event("generation_formed", 0, generation=0)
    _commit(log, 1, generation=0)
    _commit(log, 2, generation=0)
    _commit(log, 2, generation=0, ranks=(1,))  # rank 1 trained step 2 again
    assert _applications(log) == {1: [(0, True)], 2: [(0, True), (0, True)]}


def test_a_withdrawn_update_is_not_kept_and_its_samples_applied_again_are():
    log = RunLog()
    log.event("generation_formed", 0, generation=1)
    _commit(log, 1, generation=1, ranks=(0,))  # async_ps: update 1 admitted, its worker died before pushing it
    log.withdraw(1, generation=1)
    log.add_samples(2, (2, 3), generation=1, rank=0)  # the same samples, computed again as update 2
    assert _applications(log) == {1: [(1, False)], 2: [(1, True)]}


def _waited_s(log: RunLog, events_since: int, timeout_s: float, then=None) -> float:
    """How long ``wait_for_news`` blocked while ``then`` ran 0.1 s into the wait (in another thread)."""
    started = time.monotonic()
    if then is not None:
        threading.Timer(0.1, then).start()
    log.wait_for_news(events_since, timeout_s)
    return time.monotonic() - started


LONG_WAIT_S = 30.0
"""A timeout the waits below must not run out: each asserts it returned well under it."""


def test_a_reader_waits_for_news_until_an_event_the_end_or_its_timeout():
    log = RunLog()
    log.event("generation_formed", 0)
    assert _waited_s(log, events_since=0, timeout_s=LONG_WAIT_S) < 1  # an event it has not seen: at once
    assert 1.0 <= _waited_s(log, events_since=1, timeout_s=1.0) < 10  # nothing new: its timeout
    assert 0.1 <= _waited_s(log, 1, timeout_s=LONG_WAIT_S, then=lambda: log.event("worker_failed", 3)) < 10
    assert 0.1 <= _waited_s(log, 2, timeout_s=LONG_WAIT_S, then=log.close) < 10
    assert _waited_s(log, events_since=2, timeout_s=LONG_WAIT_S) < 1  # closed: nobody waits any more
