"""The Controller's cost as the group grows (issue 34): a run of 1,024 fake workers (tests/support/fake_group.py: no
Ray, no processes) takes a failure, a scale-up and a drain through the real state machine, policies and run log. The
Controller's CPU time (the thread's, less what the fake members spent making their news) per poll, decisions and
generations included, is what this bounds: ~6 ms here, where one pass over the 1M member pairs per poll adds 30-50 ms
(measured with a nested loop over the members, and with a member list rebuilt for each member, in the drain notices'
reading). CPU time, not wall time: a loaded machine slows it less. The objects alive before the run are frozen out of
the garbage collector's passes: a full pass over the heap that the suite's earlier tests left in this process is not
the Controller's cost (it more than doubled the run's CPU after a few other test modules), while a pass over what
the Controller makes and keeps still counts."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest

from raylastic.actors.controller.states import Forming, Running
from tests.support.fake_group import advance, controller, events, states_until_end, with_member

WORKERS = 1024
STEPS = 12
CPU_PER_POLL_BOUND_S = 0.025
"""4x the Controller's ~6 ms a poll at 1,024 workers; half the issue's goal at 4,096 (50 ms)."""


@pytest.fixture
def heap_frozen() -> Iterator[None]:
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def test_a_controller_of_1024_workers_takes_a_failure_a_scale_up_and_a_drain(tmp_path, heap_frozen):
    run, group = controller(tmp_path, f"scaling.min_workers={WORKERS // 2}", f"scaling.max_workers={WORKERS}",
                            f"training.global_batch_size={4 * WORKERS}", f"training.steps={STEPS}",
                            workers=WORKERS, free_slots=1)
    started = time.thread_time()
    group.on_poll(lambda status: with_member(status, "w7", dead="actor died: killed"))
    states = []
    while not (len(events(run, "worker_joined")) == 1 and isinstance(run.state, Running)):
        states.append(advance(run).name)  # the failure, the re-formation without w7, the replacement's scale-up
    assert run.drain(rank=5) == ["w5"]
    states += states_until_end(run)
    controller_cpu_s = time.thread_time() - started - group.cpu_s
    polls = group.calls.count("poll")

    assert run.state.result.final_step == STEPS, states
    sizes = [e["world_size"] for e in events(run, "generation_formed")]
    assert sizes == [WORKERS, WORKERS - 1, WORKERS, WORKERS - 1], (sizes, states)
    assert [e["worker"] for e in events(run, "worker_failed")] == ["w7"]
    assert [e["reason"] for e in events(run, "worker_left")] == ["drained"]
    assert "recovering" in states and states.count("resizing") == 2 and Forming().name in states
    assert controller_cpu_s / polls < CPU_PER_POLL_BOUND_S, (
        f"{WORKERS} workers: the Controller's CPU {controller_cpu_s:.2f} s over {polls} polls")
