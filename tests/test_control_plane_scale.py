"""The Controller's cost as the group grows (issue 34): a run of 1,024 fake workers (tests/support/fake_group.py: no
Ray, no processes) takes a failure, a scale-up and a drain through the real state machine, policies and run log. Its
work per poll, per decision and per generation is what this times: a step of it that grew quadratically (1M member
pairs at 1,024) would take minutes, where the whole run takes well under a second."""

from __future__ import annotations

import time

from raylastic.actors.controller.states import Forming, Running
from tests.support.fake_group import advance, controller, events, states_until_end, with_member

WORKERS = 1024
STEPS = 12
BOUND_S = 20.0
"""Far above the ~0.5 s the run takes on a loaded 2-core machine, far below what an O(N^2) step would."""


def test_a_controller_of_1024_workers_takes_a_failure_a_scale_up_and_a_drain(tmp_path):
    run, group = controller(tmp_path, f"scaling.min_workers={WORKERS // 2}", f"scaling.max_workers={WORKERS}",
                            f"training.global_batch_size={4 * WORKERS}", f"training.steps={STEPS}",
                            workers=WORKERS, free_slots=1)
    started = time.perf_counter()
    group.on_poll(lambda status: with_member(status, "w7", dead="actor died: killed"))
    states = []
    while not (len(events(run, "worker_joined")) == 1 and isinstance(run.state, Running)):
        states.append(advance(run).name)  # the failure, the re-formation without w7, the replacement's scale-up
    assert run.drain(rank=5) == ["w5"]
    states += states_until_end(run)
    elapsed_s = time.perf_counter() - started

    assert run.state.result.final_step == STEPS, states
    sizes = [e["world_size"] for e in events(run, "generation_formed")]
    assert sizes == [WORKERS, WORKERS - 1, WORKERS, WORKERS - 1], (sizes, states)
    assert [e["worker"] for e in events(run, "worker_failed")] == ["w7"]
    assert [e["reason"] for e in events(run, "worker_left")] == ["drained"]
    assert "recovering" in states and states.count("resizing") == 2 and Forming().name in states
    assert elapsed_s < BOUND_S, f"{WORKERS} workers: {elapsed_s:.1f} s"
