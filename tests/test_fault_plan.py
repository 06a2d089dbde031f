"""Injected faults fire once per run: the Controller's FaultPlan, and the worker's step hooks (installed only
when the job configures faults or a link).

    python -m pytest tests/test_fault_plan.py -q
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from raylastic.actors.faults.plan import FaultPlan
from raylastic.actors.faults.step_hooks import (
    FaultInjector,
    InjectedFault,
    SlowLink,
    Throttle,
    step_hooks,
    throttle_factor,
)
from raylastic.actors.status.worker import StepResult
from raylastic.jobconfig import FaultConfig, LinkConfig
from raylastic.strategies.emulated_link import EmulatedLink

REPO = Path(__file__).resolve().parents[1]


def fault(rank: int, step: int, action: str = "kill") -> FaultConfig:
    return FaultConfig(action=action, rank=rank, step=step)


def test_each_rank_gets_its_own_faults_in_order():
    plan = FaultPlan([fault(1, 30), fault(0, 10), fault(1, 20, "raise")])
    assert plan.for_rank(1) == (fault(1, 30), fault(1, 20, "raise"))
    assert plan.for_rank(0) == (fault(0, 10),)
    assert plan.for_rank(2) == ()


def test_a_failed_rank_loses_the_fault_it_was_given_first():
    plan = FaultPlan([fault(1, 30), fault(1, 40), fault(0, 35)])
    plan.disarm(failed_ranks={1}, step=25)  # the Controller heard of step 25; rank 1's kill at 30 may have fired
    assert plan.pending == [fault(1, 40), fault(0, 35)]


def test_faults_of_steps_already_begun_are_dropped_on_every_rank():
    plan = FaultPlan([fault(0, 5), fault(0, 11), fault(1, 12), fault(1, 20)])
    plan.disarm(failed_ranks=set(), step=10)  # step 11 was in flight: begun on every rank
    assert plan.pending == [fault(1, 12), fault(1, 20)]


def test_a_failed_rank_without_later_faults_drops_nothing_else():
    plan = FaultPlan([fault(0, 30)])
    plan.disarm(failed_ranks={1}, step=10)
    assert plan.for_rank(0) == (fault(0, 30),)


def test_disarming_leaves_the_faults_it_was_built_from_alone():
    faults = [fault(0, 1)]
    FaultPlan(faults).disarm(failed_ranks={0}, step=0)
    assert faults == [fault(0, 1)]


def test_the_injector_fires_a_fault_before_its_step_only():
    injector = FaultInjector([fault(0, 3, "raise")])
    injector.before_step(2)
    with pytest.raises(InjectedFault, match="step 3 on rank 0"):
        injector.before_step(3)
    injector.before_step(4)


def test_a_step_has_hooks_only_for_what_the_job_configures():
    assert step_hooks((), EmulatedLink.of(LinkConfig())) == ()  # the defaults: no faults, no link
    hooks = step_hooks((fault(0, 3), throttle(0, 1, 2.0)), EmulatedLink(latency_ms=1.0))
    assert [type(hook) for hook in hooks] == [FaultInjector, Throttle, SlowLink]


def throttle(rank: int, step: int, factor: float, until_step: int | None = None) -> FaultConfig:
    return FaultConfig(action="throttle", rank=rank, step=step, factor=factor, until_step=until_step)


def test_a_throttle_slows_its_steps_and_no_others():
    faults = [throttle(1, 10, 3.0, until_step=20)]
    assert [throttle_factor(faults, step) for step in (9, 10, 20, 21)] == [1.0, 3.0, 3.0, 1.0]
    assert throttle_factor([throttle(0, 5, 2.0)], 10**6) == 2.0
    FaultInjector(faults).before_step(10)  # fires nothing: a throttle is the Throttle hook's


def result_of(step: int, *, compute_s: float = 0.0, bytes_sent: int = 0) -> StepResult:
    return StepResult(step=step, loss_sum=1.0, samples=4, duration_s=compute_s, finished_at=time.time(),
                      compute_s=compute_s, bytes_sent=bytes_sent)


def test_a_throttled_step_computes_factor_times_as_long_as_the_step_before_it():
    hook = Throttle([throttle(0, 2, 3.0)])
    hook.before_compute(1)
    hook.after_step(result_of(1, compute_s=0.05))  # unthrottled
    started = time.perf_counter()
    hook.before_compute(2)
    assert time.perf_counter() - started >= 2 * 0.05
    hook.after_step(result_of(2, compute_s=0.05 + time.perf_counter() - started))
    started = time.perf_counter()
    hook.before_compute(3)  # still 3x what the step took less its throttle, not 3x of 3x
    assert 2 * 0.05 <= time.perf_counter() - started < 9 * 0.05


def test_a_slow_link_adds_its_delay_to_a_step_that_sent_bytes_only():
    hook = SlowLink(EmulatedLink(bandwidth_gbit_s=0.08, latency_ms=10.0))  # 1e6 bytes: 0.1 s + 0.01 s
    unsent = result_of(1)
    assert hook.after_step(unsent) is unsent
    sent = result_of(2, compute_s=0.5, bytes_sent=1_000_000)
    delayed = hook.after_step(sent)
    assert delayed.link_delay_s == pytest.approx(0.11) and delayed.duration_s == pytest.approx(0.61)


def test_a_throttle_outlives_failures_until_its_last_step():
    plan = FaultPlan([throttle(1, 1, 2.0, until_step=50), throttle(2, 1, 2.0), fault(1, 30)])
    plan.disarm(failed_ranks={1}, step=40)
    assert plan.pending == [throttle(1, 1, 2.0, until_step=50), throttle(2, 1, 2.0)]
    plan.disarm(failed_ranks=set(), step=50)
    assert plan.pending == [throttle(2, 1, 2.0)]


STALL_FROM_A_THREAD = """
import sys, threading
from raylastic.actors.faults.step_hooks import fire
from raylastic.jobconfig import FaultConfig

def step():
    fire(FaultConfig(action="stall", rank=0, step=1))
    open(sys.argv[1], "w").write("went on")  # what a stalled step must never reach

threading.Thread(target=step).start()  # a worker's steps run off the main thread, as in a Ray actor
threading.Event().wait()
"""


@pytest.mark.processes
def test_a_stall_fired_off_the_main_thread_stops_that_thread_before_it_goes_on(tmp_path):
    """A SIGSTOP sent to the process is taken by its main thread: the thread that sent it ran on for a while,
    long enough for an async_ps worker to have its stalled step admitted. Five processes, none may go on."""
    markers = [tmp_path / f"went_on_{index}" for index in range(5)]
    processes = [subprocess.Popen([sys.executable, "-c", STALL_FROM_A_THREAD, str(marker)], cwd=REPO)
                 for marker in markers]
    try:
        deadline = time.monotonic() + 60
        while not all(_stopped(p.pid) for p in processes) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_stopped(p.pid) for p in processes)
        time.sleep(0.5)
        assert [m.name for m in markers if m.exists()] == []
    finally:
        for process in processes:
            process.kill()
            process.wait()


def _stopped(pid: int) -> bool:
    """The process is stopped by a signal (state T in /proc)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
