"""The Controller's cost as the group grows (issue 34): runs of 256 and 1,024 fake workers (tests/support/fake_group.py:
no Ray, no processes) take a failure, a scale-up and a drain through the real state machine, policies and run log.
What is bounded is the Controller's CPU time (the thread's, less what the fake members spent making their news) per
poll, decisions and generations included: at 1,024 workers (~4 ms here), and its growth from 256 to 1,024 (~2.2x
here: a fixed part and a part linear in N). A pass over the member pairs in each poll (one was tried in the drain
notices' reading) reads 21-34 ms a poll at 1,024 and grows 8-11x: the growth bound fails it whatever the machine's
speed, the absolute one on most.

CPU time, not wall time: a loaded machine slows it less; each size is run twice and the cheaper run counts, since a
burst of the other pytest-xdist worker's load seldom lands on both. The objects alive before the runs are frozen out
of the garbage collector's passes: a full pass over the heap that the suite's earlier tests left in this process is
not the Controller's cost (it more than doubled a run's CPU after a few other test modules; a CI run failed on it),
while a pass over what the Controller makes and keeps still counts."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from raylastic.actors.controller.states import Forming, Running
from tests.support.fake_group import advance, controller, events, states_until_end, with_member

WORKERS = 1024
FEWER_WORKERS = 256
STEPS = 12
CPU_PER_POLL_BOUND_S = 0.025
"""6x the Controller's ~4 ms a poll at 1,024 workers; half the issue's goal at 4,096 (50 ms)."""
GROWTH_BOUND = 5.5
"""The CPU a poll at 1,024 workers over that at 256: 2.0-2.4 here (3.1-3.5 beside three busy loops on the two cores),
8-11 with a pass over the member pairs."""


@pytest.fixture
def heap_frozen() -> Iterator[None]:
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def test_a_controller_of_1024_workers_takes_a_failure_a_scale_up_and_a_drain(tmp_path, heap_frozen):
    cpu_per_poll_s = {workers: min(failure_scale_up_and_drain(tmp_path / f"{workers}-{attempt}", workers)
                                   for attempt in range(2))
                      for workers in (FEWER_WORKERS, WORKERS)}
    measured = "the Controller's CPU a poll: " + ", ".join(f"{workers} workers {cpu_s * 1e3:.1f} ms"
                                                           for workers, cpu_s in cpu_per_poll_s.items())
    assert cpu_per_poll_s[WORKERS] < CPU_PER_POLL_BOUND_S, measured
    assert cpu_per_poll_s[WORKERS] / cpu_per_poll_s[FEWER_WORKERS] < GROWTH_BOUND, measured


def failure_scale_up_and_drain(scratch: Path, workers: int) -> float:
    """One run of ``workers``; the Controller's CPU seconds a poll."""
    scratch.mkdir()
    run, group = controller(scratch, f"scaling.min_workers={workers // 2}", f"scaling.max_workers={workers}",
                            f"training.global_batch_size={4 * workers}", f"training.steps={STEPS}",
                            workers=workers, free_slots=1)
    started = time.thread_time()
    group.on_poll(lambda status: with_member(status, "w7", dead="actor died: killed"))
    states = []
    while not (len(events(run, "worker_joined")) == 1 and isinstance(run.state, Running)):
        states.append(advance(run).name)  # the failure, the re-formation without w7, the replacement's scale-up
    assert run.drain(rank=5) == ["w5"]
    states += states_until_end(run)
    controller_cpu_s = time.thread_time() - started - group.cpu_s

    assert run.state.result.final_step == STEPS, states
    sizes = [e["world_size"] for e in events(run, "generation_formed")]
    assert sizes == [workers, workers - 1, workers, workers - 1], (sizes, states)
    assert [e["worker"] for e in events(run, "worker_failed")] == ["w7"]
    assert [e["reason"] for e in events(run, "worker_left")] == ["drained"]
    assert "recovering" in states and states.count("resizing") == 2 and Forming().name in states
    return controller_cpu_s / group.calls.count("poll")
