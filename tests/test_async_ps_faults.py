"""async_ps fault paths on a real local Ray (issue 29): a server whose update raises fails the run with its
traceback; a server stopped (SIGSTOP) while the Controller waits on it is replaced and the run finishes, with the
default failure timeouts; a restore after a restore applies every step once; a finished run run again finishes;
a save that fails is a checkpoint_failed event."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray
import torch

from raylastic.actors.async_ps.checkpoints import complete_checkpoints
from raylastic.actors.async_ps.heartbeats import Heartbeats
from raylastic.actors.status.run import RunFailed
from raylastic.cluster.job import train
from raylastic.workloads.digits import Digits
from tests.support.helpers import StoppedProcess, assert_states_close, job, load_model
from tests.test_async_ps import applied_tickets

ASYNC = ("strategy.name=async_ps", "strategy.server_cpus=0.5")


class _SGDThatFails(torch.optim.SGD):
    def __init__(self, params, *, lr: float, fail_at: int) -> None:
        super().__init__(params, lr=lr)
        self.fail_at, self.steps = fail_at, 0

    def step(self, closure=None):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError(f"injected optimizer failure at its step {self.fail_at}")
        return super().step(closure)


class FailingOptimizerDigits(Digits):
    """Digits whose optimizer (stepped by the parameter servers only) raises at its ``fail_at``-th step."""

    def __init__(self, *, fail_at: int, **options) -> None:
        super().__init__(**options)
        self.fail_at = fail_at

    def configure_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return _SGDThatFails(model.parameters(), lr=0.1, fail_at=self.fail_at)


class PausingDigits(Digits):
    """Digits whose first evaluation (the Controller's, at the end of the run) touches ``<signal_dir>/evaluating``
    and waits for ``<signal_dir>/go``: a test stops a server meanwhile."""

    def __init__(self, *, signal_dir: str, **options) -> None:
        super().__init__(**options)
        self.signal_dir = Path(signal_dir)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        started = self.signal_dir / "evaluating"
        if not started.exists():
            started.touch()
            deadline = time.monotonic() + 300
            while not (self.signal_dir / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return super().evaluate(model)


pytestmark = pytest.mark.usefixtures("ray_local")


def test_a_server_whose_update_raises_fails_the_run_with_its_traceback(tmp_path):
    """Issue 29: the update that raised was lost, every later one waited for it, and the run never ended."""
    config = job("training.steps=30", *ASYNC, "workload.name=tests.test_async_ps_faults:FailingOptimizerDigits",
                 "workload.options={fail_at: 5}", name="ps-raises")
    with pytest.raises(RunFailed, match="parameter server 0 failed applying update 5: RuntimeError: injected "
                                        "optimizer failure at its step 5") as failed:
        train(config, run_dir=tmp_path)
    assert "Traceback" in str(failed.value) and "in step" in str(failed.value)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "failed" and result["error"] == str(failed.value)


def test_a_server_stopped_while_the_controller_waits_on_it_is_replaced_and_the_run_finishes(tmp_path):
    """Issue 29: the Controller's calls to servers had no bound, so a server stopped while one of them waited
    hung the run for good. Server 1 is stopped during the final evaluation; the Controller's next call to it
    (the servers' stats) goes unanswered for failure.step_timeout_s, and it is replaced from the final checkpoint.
    The default failure timeouts."""
    stopped: list[StoppedProcess] = []

    def stop_server_1_while_evaluating(_progress) -> None:
        if stopped or not (tmp_path / "evaluating").exists():
            return
        stopped.append(StoppedProcess(ray.get(ray.get_actor("raylastic:ps-stopped:server1").pid.remote(), timeout=60)))
        (tmp_path / "go").touch()

    config = job("training.steps=20", *ASYNC, "strategy.num_servers=2", "failure.collective_timeout_s=30",
                 "workload.name=tests.test_async_ps_faults:PausingDigits",
                 f"workload.options={{signal_dir: {tmp_path}}}", name="ps-stopped")
    try:
        result = train(config, run_dir=tmp_path / "run", on_progress=stop_server_1_while_evaluating)
    finally:
        for process in stopped:
            process.end()
    assert stopped and result.final_step == 20
    failed = [e.details for e in result.events if e.type == "server_failed"]
    assert failed == [{"server": 1, "reason": "no answer to stats for 10s (failure.step_timeout_s)"}]
    restored = [e for e in result.events if e.type == "generation_formed"][-1]
    assert restored.step == 20 and restored.details["state_source"] == "checkpoint"
    assert result.checkpoint == restored.details["path"] and "accuracy" in result.metrics


def test_a_restore_after_a_restore_reads_whole_cuts_and_applies_every_step_once(tmp_path):
    """Server 1 dies at update 25, then server 0 at update 49 of the new epoch: each restore reads the newest whole
    cut (20 and 40, or the one before where that save was still being written when the server died: saves run
    beside the updates), the second one a cut of the new epoch, never a file left by the first; every step is
    applied once."""
    steps = 50
    result = train(job(f"training.steps={steps}", "training.global_batch_size=64", *ASYNC, "strategy.num_servers=2",
                       "checkpoint.every_steps=10", "training.record_samples=true",
                       "faults=[{action: kill_server, rank: 1, step: 25}, {action: kill_server, rank: 0, step: 49}]",
                       name="ps-twice"), run_dir=tmp_path)
    assert result.final_step == steps
    assert [e.details["server"] for e in result.events if e.type == "server_failed"] == [1, 0]
    restored = [e for e in result.events if e.type == "generation_formed" and e.details["state_source"] == "checkpoint"]
    first, second = (e.step for e in restored)
    assert first in (10, 20) and second in (30, 40) and first < second
    applied_tickets(result, steps)
    root = tmp_path / "checkpoints"
    cuts = complete_checkpoints(str(root))
    assert cuts[-1].version == steps and not [e for e in result.events if e.type == "checkpoint_failed"]
    for cut in cuts:  # nothing else is left: no torn or abandoned files
        assert sorted(str(p) for p in Path(cut.directory).iterdir()) == cut.files()
    assert sorted(p.name for p in root.glob("ps_*")) == sorted(Path(cut.directory).name for cut in cuts)


def test_a_save_that_fails_is_a_checkpoint_failed_event_the_run_goes_on_and_run_again_finishes(tmp_path):
    """Issue 29: a save's error was raised inside a push and swallowed. A file of the user's where version 5's
    directory goes makes that save fail; the user's file stays as it was. Run again, the finished run resumes at
    its last step (it applied no update there, and its final loss divided by zero)."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "ps_00000005").write_text("the user's")
    config = job("training.steps=10", *ASYNC, "checkpoint.every_steps=5", f"checkpoint.path={root}",
                 name="ps-save-fails")
    result = train(config, run_dir=tmp_path / "run")
    failed = [e for e in result.events if e.type == "checkpoint_failed"]
    assert [(e.step, e.details["server"]) for e in failed] == [(5, 0)]
    assert "ps_00000005/server_0_of_1." in failed[0].details["path"] and failed[0].details["error"]
    assert result.final_step == 10 and result.checkpoint == f"{root}/ps_00000010"
    assert (root / "ps_00000005").read_text() == "the user's"

    again = train(config, run_dir=tmp_path / "run")
    assert again.final_step == 10 and again.history == []
    assert [e.type for e in again.events if e.type in ("resumed", "worker_failed", "server_failed")] == ["resumed"]
    assert "loss" not in again.metrics and again.metrics["accuracy"] == result.metrics["accuracy"]
    assert_states_close(load_model(tmp_path / "run"), result.model_state, rtol=0, atol=0)
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "finished"
    assert (root / "ps_00000005").read_text() == "the user's"


@ray.remote(num_cpus=0)
class _AnswersLate:
    def beat(self) -> str:
        time.sleep(0.5)
        return "the saves that failed"


def test_a_ping_in_flight_when_the_run_finishes_is_heard():
    """The final checkpoint waits for the servers' pings in flight: their answers carry saves that failed, which
    the servers hand out once (a run that finished first reported no checkpoint_failed at all, the test above)."""
    heartbeats = Heartbeats(timeout_s=60)
    heartbeats.ping({"server0": _AnswersLate.remote().beat})
    assert heartbeats.check().answers == {}
    heartbeats.settle({"server0"}, timeout_s=60)
    assert heartbeats.check().answers == {"server0": "the saves that failed"}
