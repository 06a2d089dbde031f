"""async_ps calls each have a bound, and a server restore holds no lock the workers' calls need, on a real local Ray:
the Controller answers a lease while a stopped server holds its restore up; a worker's call that the Controller
leaves unanswered raises ControllerUnanswered within its bound."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import ray

from raylastic.actors.async_ps.controller import AsyncController
from raylastic.actors.async_ps.leases import Lease
from raylastic.actors.async_ps.server_group import ServerGroup
from raylastic.actors.async_ps.shards import assign_parameters
from raylastic.actors.async_ps.worker import ControllerUnanswered, ask_within
from raylastic.workloads import load_workload
from tests.support.helpers import StoppedProcess, job

pytestmark = pytest.mark.usefixtures("ray_local")

WAIT_S = 60
"""How long a call may take on a loaded machine; far below the restore's bound, which a stopped server waits out."""


def _in_thread(function, *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
    ended: dict[str, Any] = {}

    def run() -> None:
        try:
            ended["returned"] = function(*args)
        except Exception as error:  # noqa: BLE001 - the test looks at it
            ended["raised"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, ended


def test_a_lease_is_answered_while_a_stopped_server_holds_the_restore_up(tmp_path):
    config = job("strategy.name=async_ps", "strategy.server_cpus=0.5", "scaling.placement_timeout_s=600",
                 name="ps-restoring")
    controller = AsyncController(config, str(tmp_path))
    sizes = {name: p.numel() for name, p in load_workload("digits").build_model().named_parameters()}
    shards = tuple(tuple(shard) for shard in assign_parameters(sizes, 1))
    controller.group = ServerGroup(config, str(tmp_path), shards, prefix="raylastic:ps-restoring:",
                                   place=lambda index: None)
    server = StoppedProcess(ray.get(controller.group.servers[0].pid.remote(), timeout=WAIT_S))
    try:
        restore, restored = _in_thread(controller._restore_servers, None)
        deadline = time.monotonic() + WAIT_S
        while controller.epoch == 0:  # the restore began: the stopped server cannot end it
            assert time.monotonic() < deadline, "the restore did not begin"
            time.sleep(0.01)
        lease, leased = _in_thread(controller.lease, "raylastic:ps-restoring:worker0.0")
        lease.join(timeout=WAIT_S)
        answered_during_restore = not lease.is_alive() and restore.is_alive()
        server.resume()
        restore.join(timeout=WAIT_S)
        lease.join(timeout=WAIT_S)
    finally:
        server.end()
        controller.group.kill_all()
        controller.log.close()
    assert answered_during_restore, "the lease waited for the restore"
    assert leased == {"returned": Lease(None)}  # ask again: no step is leased from books being rewound
    assert restored == {"returned": None} and not controller.restoring


@ray.remote(num_cpus=0)
class _Silent:
    def lease(self, worker: str) -> None:
        threading.Event().wait()


def test_a_call_the_controller_leaves_unanswered_raises_within_its_bound():
    silent = _Silent.remote()
    try:
        started = time.monotonic()
        with pytest.raises(ControllerUnanswered, match="left lease unanswered for 2s"):
            ask_within(silent, "lease", "worker0.0", timeout_s=2)
        assert time.monotonic() - started < 2 + WAIT_S
    finally:
        ray.kill(silent)
